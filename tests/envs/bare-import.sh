#!/usr/bin/env bash
# Proves the core package imports and works with no third-party package:
# a throwaway venv without site-packages, the package installed without deps.
# Twice: as installed normally (the compiled index must be built and used), and
# with no working C compiler (the install must still succeed, on the
# pure-Python index).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# A clean copy of the sources: no build/ or in-place extension left by an
# editable install may stand in for the build under test.
mkdir "$TMP/src"
tar -C "$REPO" --exclude=.git --exclude=./build --exclude='*.so' --exclude='*.egg-info' \
  --exclude=__pycache__ -cf - . | tar -C "$TMP/src" -xf -
for mode in c python; do
  rm -rf "$TMP/venv"
  python3 -m venv "$TMP/venv"
  cc_env=()
  if [ "$mode" = python ]; then cc_env=(CC=/bin/false); fi
  env "${cc_env[@]}" "$TMP/venv/bin/pip" install -q --no-cache-dir --no-deps --no-build-isolation "$TMP/src" 2>/dev/null \
    || env "${cc_env[@]}" "$TMP/venv/bin/pip" install -q --no-cache-dir --no-deps "$TMP/src"
  rm -rf "$TMP/src/build"
  (cd "$TMP" && EXPECT="$mode" "$TMP/venv/bin/python" - <<'PY'
import os
import sys
import hicache_existence as h
from hicache_existence import config  # noqa: F401
from hicache_existence.core import stats  # noqa: F401
from hicache_existence.core import lru
assert lru.BACKEND == os.environ["EXPECT"], (lru.BACKEND, os.environ["EXPECT"])
c = h.StorageExistenceCache(2)
p = c.pool("kv")
p.add(["a", "b", "c"])
assert p.lru_keys() == ("b", "c") and p.contains_all(["b", "c"])
f = h.FlatStorageExistenceCache(2)
f.add("kv", ["a"]); f.add("swa", ["a", "b"])
assert len(f) == 2 and f.stats()["kv"].evictions == 1
third_party = sorted(
    m for m in sys.modules
    if m.split(".")[0] in {"prometheus_client", "structlog", "opentelemetry", "redis", "torch", "sglang", "numpy"}
)
assert not third_party, third_party
print(f"core imports and runs without extras (index: {lru.BACKEND})")
PY
  )
done
