#!/usr/bin/env bash
# Runs every test of hicache-existence on a fresh or a warm machine.
#
# Installs what the tests need: Debian packages (redis-server, prometheus) when
# missing, and a cached, version-keyed virtualenv outside the clone with torch
# (CPU), the real sglang wheel and this package with its test extras
# (tests/envs/ensure-env.sh).  Then lints, type-checks, proves the core imports
# without any extra, and runs pytest with skips turned into failures.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
START=$(date +%s)
log() { printf '[run-all %4ss] %s\n' "$(( $(date +%s) - START ))" "$*"; }

# 1. System packages the real-component tests use.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
# The Mooncake wheel (store client, transfer engine of the PD tests) links libibverbs.
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need_apt+=(libibverbs1)
if ((${#need_apt[@]})); then
  log "installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# 2. The cached test environment (torch, sglang, test and dev extras).  The "full"
#    flavour (torch 2.14.1 + torchvision from local disk) is the one in which sglang's
#    unified_radix_cache and scheduler modules import, which the plugin tests need.
log "preparing the test environment"
export HICACHE_EXISTENCE_ENV_FLAVOR="${HICACHE_EXISTENCE_ENV_FLAVOR:-full}"
PY="$(bash tests/envs/ensure-env.sh | tail -n 1)"
log "python: $PY"

# 3. Static checks.
log "ruff"
"$PY" -m ruff check hicache_existence tests benchmarks dashboards integrations
log "mypy"
"$PY" -m mypy hicache_existence

# 4. The core alone: no extras, no third-party package at all.
log "core import without extras"
bash tests/envs/bare-import.sh

# 5. Every test; a skip is a failure here.
export HICACHE_EXISTENCE_REQUIRE_ALL=1 HICACHE_EXISTENCE_REQUIRE_SGLANG=1
#    First the tests that reach into the cache's storage, on the pure-Python index
#    (what an install without a C compiler runs; the cache state machines run on
#    both indexes in the main pass too).
log "pytest on the pure-Python index (HICACHE_EXISTENCE_BACKEND=python)"
HICACHE_EXISTENCE_BACKEND=python "$PY" -m pytest -p no:cacheprovider -q \
  tests/test_bad_input.py tests/test_digest.py tests/test_miss_reasons.py \
  tests/test_exporter_prometheus.py tests/test_replay_mattson.py tests/test_config.py \
  tests/sglang_integration/test_sglang_launcher.py tests/test_lru_index.py \
  tests/test_advisor.py tests/test_sampler.py \
  --deselect tests/test_lru_index.py::test_compiled_index_is_in_use_where_required
log "pytest"
set +e
"$PY" -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
log "pytest exit code $rc"
exit $rc
