#!/usr/bin/env bash
# Proves the core package imports and works with no third-party package:
# a throwaway venv without site-packages, the package installed without deps.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
python3 -m venv "$TMP/venv"
"$TMP/venv/bin/pip" install -q --no-deps --no-build-isolation "$REPO" 2>/dev/null \
  || "$TMP/venv/bin/pip" install -q --no-deps "$REPO"
cd "$TMP"
"$TMP/venv/bin/python" - <<'PY'
import sys
import hicache_existence as h
from hicache_existence import config, stats  # noqa: F401
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
print("core imports and runs without extras")
PY
