#!/usr/bin/env bash
# Runs every test of hicache-existence on a fresh or a warm machine.
#
# Installs what the tests need: Debian packages (redis-server, prometheus) when
# missing, and cached, version-keyed virtualenvs outside the clone
# (tests/envs/ensure-env.sh): torch, the real sglang wheel and this package with its
# test extras.  Then lints, type-checks, builds and installs the distribution on every
# Python of the matrix, and runs pytest with skips turned into failures:
#
#   Python 3.11  everything but the real servers and the sglang integration tests
#                (sglang 0.5.23; 3.12 runs those against 0.5.23, the seed leg on 3.11
#                against 0.5.21), plus the storage-facing tests on the pure-Python index
#   Python 3.11  the sglang integration tests against sglang 0.5.21 (the seed's flat API),
#                and real 0.5.21 servers (tests/real_server/test_server_flat*.py: buffer and cache mode)
#   Python 3.12  the sglang integration tests (sglang 0.5.23; SGLang's image runs 3.12)
#                and the real-server tests (tests/real_server), on the compiled index
#   Python 3.10, 3.13  the core tests, on both indexes (light envs: no torch, no sglang)
#
# Two lanes, one per core: the real servers then the main pass; beside them, the
# other legs one after the other (the main pass's longest tests first).
#
# The interpreters come from pyenv (~/.pyenv/versions/3.X.*) or PATH; a missing one
# fails the run (HICACHE_EXISTENCE_PYTHON_3_X=/path overrides one).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
START=$(date +%s)
# Every log line is also kept, and printed again when the run ends (or is stopped:
# CI shows only the tail of a long log, and the timeline is what says where time went).
TIMELINE="$(mktemp)"
log() { printf '[run-all %4ss] %s\n' "$(( $(date +%s) - START ))" "$*" | tee -a "$TIMELINE"; }
keep_logs() { # every leg's whole log and the timeline, kept outside the clone (the
  # newest 5 runs): CI's clone is deleted after the run, and its output shows only the tail
  local root="${HX_KEEP_LOGS:-${XDG_CACHE_HOME:-$HOME/.cache}/hicache-existence/runs}"
  local dir
  dir="$root/$(date -u +%Y%m%dT%H%M%SZ)-$$"
  mkdir -p "$dir" 2>/dev/null || return 0
  cp "$TIMELINE" "$dir/timeline.log" 2>/dev/null || true
  if [ -n "${LEGS:-}" ]; then cp "$LEGS"/*.log "$dir/" 2>/dev/null || true; fi
  ls -1dt "$root"/[0-9]*T[0-9]*Z-[0-9]*/ 2>/dev/null | tail -n +6 | xargs -r rm -rf
  printf '[run-all] the logs of every leg are kept in %s\n' "$dir"
}
on_exit() {
  local rc=$?
  set +e # nothing here may change the run's status
  printf '[run-all] timeline (exit %s after %ss):\n' "$rc" "$(( $(date +%s) - START ))"
  sed 's/^/  /' "$TIMELINE"
  # Each failed leg's failures once more, after the timeline: CI shows only the tail.
  local name
  for name in ${failed[@]+"${failed[@]}"}; do failures "$name"; done
  keep_logs
  rm -rf "$TIMELINE" "${LEGS:-}"
  exit "$rc"
}
trap on_exit EXIT
trap 'log "stopped by a signal"; exit 143' TERM INT

# 1. System packages the real-component tests use.
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)  # the Redis Cluster tests
command -v kubectl >/dev/null 2>&1 || need_apt+=(kubernetes-client)  # kubectl kustomize
# Mooncake's transfer engine and store client (mooncake_master, the L3 tests) link it.
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || [ -e /usr/lib/aarch64-linux-gnu/libibverbs.so.1 ] \
  || need_apt+=(libibverbs1)
if ((${#need_apt[@]})); then
  log "installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# 2. The interpreters of the matrix: each must exist and be the version it claims.
find_python() { # X.Y -> path of a working interpreter, or fail
  local v="$1" var="HICACHE_EXISTENCE_PYTHON_${1/./_}" c
  local candidates=("${!var:-}")
  for c in "$HOME"/.pyenv/versions/"$v".*/bin/python"$v"; do candidates+=("$c"); done
  candidates+=("$(command -v "python$v" 2>/dev/null || true)")
  for c in "${candidates[@]}"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    if [ "$("$c" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$v" ]; then
      echo "$c"
      return 0
    fi
  done
  echo "[run-all] error: no Python $v (looked in ~/.pyenv/versions/$v.* and PATH; set $var)" >&2
  return 1
}
declare -A PYBASE
for v in 3.10 3.11 3.12 3.13; do PYBASE[$v]="$(find_python "$v")"; done
log "interpreters: ${PYBASE[3.10]} ${PYBASE[3.11]} ${PYBASE[3.12]} ${PYBASE[3.13]}"

# 3. The cached test environments.  The "full" flavour (torch 2.14.1 + torchvision) is
#    the one in which sglang's unified_radix_cache and scheduler modules import, which
#    the plugin tests need; "seed" is the same with sglang 0.5.21; "core" has no torch
#    and no sglang (the extra Pythons' core tests).
log "preparing the test environments"
env_for() { # flavour X.Y extras
  HICACHE_EXISTENCE_ENV_FLAVOR="$1" HICACHE_EXISTENCE_PYTHON="${PYBASE[$2]}" \
    HICACHE_EXISTENCE_ENV_EXTRAS="$3" bash tests/envs/ensure-env.sh | tail -n 1
}
# Built side by side first (a lock per environment; the repo's editable installs take
# turns), so that a fresh machine downloads and unpacks them at once; the lines after
# read each back on the warm path (a few stat()s).
ENV_SPECS=("${HICACHE_EXISTENCE_ENV_FLAVOR:-full} 3.11 test,dev" "full 3.12 test" "seed 3.11 test"
  "core 3.10 test" "core 3.13 test")
env_pids=()
for spec in "${ENV_SPECS[@]}"; do
  read -r flavour version extras <<<"$spec"
  env_for "$flavour" "$version" "$extras" >/dev/null &
  env_pids+=($!)
done
for i in "${!env_pids[@]}"; do
  wait "${env_pids[$i]}" || { log "an environment failed to build (above): ${ENV_SPECS[$i]}"; exit 1; }
  log "environment ready: ${ENV_SPECS[$i]}"
done
log "environments ready"
PY="$(env_for "${HICACHE_EXISTENCE_ENV_FLAVOR:-full}" 3.11 test,dev)"
PY312="$(env_for full 3.12 test)"
PYSEED="$(env_for seed 3.11 test)"
PY310="$(env_for core 3.10 test)"
PY313="$(env_for core 3.13 test)"
log "python: $PY (3.12: $PY312; sglang 0.5.21: $PYSEED; 3.10: $PY310; 3.13: $PY313)"

# 4. Static checks.
log "ruff (lint and format; versions pinned in pyproject's dev extra)"
"$PY" -m ruff check hicache_existence tests benchmarks dashboards integrations
"$PY" -m ruff format --check hicache_existence tests benchmarks dashboards integrations
log "mypy"
"$PY" -m mypy hicache_existence
log "static checks done"

# 5. The distribution on every Python: sdist + wheel, twine, cibuildwheel's
#    configuration, the wheel repaired to manylinux and installed (compiled index), the
#    sdist installed without a compiler (pure-Python index); no extras, no third-party
#    package at all.
log "distribution: build, check, repair, install on 3.10-3.13"
HICACHE_EXISTENCE_MATRIX="${PYBASE[3.10]} ${PYBASE[3.11]} ${PYBASE[3.12]} ${PYBASE[3.13]}" \
  bash tests/envs/bare-import.sh
log "distribution done"

# 6. Every test; a skip is a failure here.
export HICACHE_EXISTENCE_REQUIRE_ALL=1 HICACHE_EXISTENCE_REQUIRE_SGLANG=1
#    Two lanes of real servers may start at once: a server's start-up gets more time
#    than the harness's 240 s default.
export HX_SERVER_START_TIMEOUT_S="${HX_SERVER_START_TIMEOUT_S:-600}"
#    The tests that reach into the cache's storage, run again on the pure-Python index
#    (what an install without a C compiler runs; the cache state machines run on both
#    indexes in the main pass too).
STORAGE_TESTS=(tests/test_bad_input.py tests/test_digest.py tests/test_miss_reasons.py
  tests/test_exporter_prometheus.py tests/test_replay_mattson.py tests/test_config.py
  tests/test_lru_index.py tests/test_advisor.py tests/test_sampler.py tests/test_recorder.py
  --deselect tests/test_lru_index.py::test_compiled_index_is_in_use_where_required)
#    The core tests of the extra Pythons: the package's own behaviour, the main job (its
#    Redis cases against a real redis-server); nothing that needs torch or sglang (3.11
#    and 3.12 run those), and the hypothesis runs of the slow mark at their default size
#    only (3.11 runs them at full length).
CORE_TESTS=(tests/test_cache_model.py tests/test_flat_model.py tests/test_stats.py
  tests/test_lru_index.py tests/test_sampler.py tests/test_sampler_oom.py tests/test_ghosts.py
  tests/test_writes.py tests/test_miss_reasons.py tests/test_bad_input.py tests/test_digest.py
  tests/test_config.py tests/test_advisor.py tests/test_replay_mattson.py
  tests/test_replay_trace.py tests/test_replay_model.py tests/test_reconcile_unit.py
  tests/test_reconcile_inflight.py tests/test_divergence_inprocess.py
  tests/test_exporter_prometheus.py tests/test_catalog.py tests/test_doctor.py
  tests/test_logs.py tests/test_runtime.py tests/test_layering.py tests/test_demo.py
  tests/test_recorder.py tests/test_snapshot_atomic.py
  tests/upstream/test_flat_seed_differential.py
  -m "not slow and not torch and not sglang")
#    The sglang integration tests: plugin loading, hooks, construction by
#    UnifiedRadixCache, the buffer-mode pipeline, the flags.
SGLANG_TESTS=(tests/sglang_integration)
#    The main pass's longest modules (the cache and flat models' full-length hypothesis
#    runs, the advisor's accuracy on 13M page references, the demo's signals and Redis
#    deaths: 700 s of its 1,311): they run beside the real servers, and the main pass
#    leaves them out (each as --ignore=, below), so that the two lanes end together.
LONG_TESTS=(tests/test_advisor.py tests/test_cache_model.py tests/test_flat_model.py tests/test_demo.py)

LEGS="$(mktemp -d)"
failed=()
flaky=()
#: The short summary lines of a pytest log (FAILED/ERROR node ids and the counts).
summary() { grep -E '^(FAILED|ERROR) |^=+ .*(failed|error).* =+$' "$1" | tail -n 40 || true; }
failures() { # name: a failed leg's summary lines; its last 40 lines when it has none
  # (pytest killed, or exiting non-zero without a FAILED line: the tail says why).
  local f="$LEGS/$1.log" s
  [ -f "$f" ] || return 0
  s="$(summary "$f")"
  if [ -z "$s" ]; then s="$(printf 'no FAILED or ERROR line; the log ends:\n'; tail -n 40 "$f")"; fi
  printf '%s\n' "$s" | sed "s/^/[$1] /"
}
rerun() { # name status python pytest-args...: a failed run's modules, once more
  # Up to two failed modules run again, whole (their servers start again), with the
  # run's options (its -m marks, --deselect, ...).  A pass (status 0) still counts
  # as a flaky test: reported at the end with its first failure.  Only test failures
  # (pytest's status 1, not interrupted or stopped early, nothing skipped: a skip
  # fails a run only when nothing else did), and never after a hypothesis
  # counterexample: that is a bug, and other examples passing would hide it.
  local name="$1" status="$2" py="$3" mods opts=() arg takes_value=0 rc=1
  local log="$LEGS/$1.log"
  shift 3
  [ "$status" = 1 ] || return 1
  grep -qE 'Failing test case|Falsifying example' "$log" && return 1
  grep -qE 'Interrupted: |stopping after [0-9]+ failures' "$log" && return 1
  grep -E '(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | grep -q skipped && return 1
  mapfile -t mods < <(grep -E '^(FAILED|ERROR) tests/' "$log" \
    | sed -E 's/^(FAILED|ERROR) ([^: ]+).*/\2/' | sort -u)
  ((${#mods[@]} >= 1 && ${#mods[@]} <= 2)) || return 1
  for arg in "$@"; do
    if ((takes_value)) || [[ "$arg" == -* ]]; then
      opts+=("$arg")
      takes_value=0
      [[ "$arg" =~ ^(-[mkpocWn]|--(deselect|ignore|ignore-glob|tb|maxfail|basetemp|junitxml|junit-xml|rootdir|confcutdir|durations|import-mode|override-ini|log-level))$ ]] \
        && takes_value=1
    fi
  done
  log "[$name] running again: ${mods[*]}"
  # The modules first: an option left without its value then fails loudly.
  "$py" -m pytest -p no:cacheprovider -q "${mods[@]}" ${opts[@]+"${opts[@]}"} >"$LEGS/$name.rerun.log" 2>&1 && rc=0
  if [ "$rc" = 0 ]; then summary "$log" >"$LEGS/$name.flaky"; fi
  cat "$LEGS/$name.rerun.log" >>"$log"
  return "$rc"
}
leg() { # name python pytest-args...: one leg; its output is kept in $LEGS/<name>.log
  local name="$1" py="$2" t0=$SECONDS rc
  shift 2
  set +e
  "$py" -m pytest -p no:cacheprovider -q --durations="${HX_DURATIONS:-8}" "$@" >"$LEGS/$name.log" 2>&1
  rc=$?
  # The slowest steps go into the timeline too (printed again at the end).
  sed -n '/slowest .*durations/,/^$/p' "$LEGS/$name.log" | sed -n "2,$((${HX_DURATIONS:-8} + 1))p" \
    | sed "s/^/    [$name] /" >>"$TIMELINE"
  # Every leg (HX_RERUN_FAILED_MODULES=0 turns it off): the real servers, and the
  # legs beside them, whose timing bounds meet a machine the servers load.
  if [ "$rc" != 0 ] && [ "${HX_RERUN_FAILED_MODULES:-1}" = 1 ] && rerun "$name" "$rc" "$py" "$@"; then
    rc=0
  fi
  set -e
  echo "$rc $((SECONDS - t0))" >"$LEGS/$name.rc"
  log "leg [$name] finished: exit code $rc ($((SECONDS - t0))s)"
}
report() { # name: print a finished leg (its summary, or its failures in full)
  local name="$1" rc secs
  read -r rc secs <"$LEGS/$name.rc"
  if [ -s "$LEGS/$name.flaky" ]; then
    # Failed, then passed when its modules ran again: the whole log, and a note at the end.
    sed "s/^/[$name] /" "$LEGS/$name.log"
    flaky+=("$name")
  elif [ "$rc" = 0 ]; then tail -n 3 "$LEGS/$name.log" | sed "s/^/[$name] /"; else sed "s/^/[$name] /" "$LEGS/$name.log"; fi
  log "pytest [$name] exit code $rc (${secs}s)"
  if [ "$rc" != 0 ]; then failed+=("$name"); fi
}
one() { log "pytest [$1]"; leg "$@"; report "$1"; }
beside() { # NAME... LEG...: legs one after the other in the background, on the core
  # the foreground (the real servers, then the main pass) leaves idle; reported at the end
  local n=$(($# / 2)) names
  names=("${@:1:n}")
  log "pytest $(printf '[%s] ' "${names[@]}")one after the other, beside the real servers and the main pass"
  (
    for cmd in "${@:n+1}"; do eval "$cmd"; done
  ) &
  BESIDE_PID=$!
  BESIDE=("${names[@]}")
}
#    With the seed wheel, also our flat cache against its own class (the differential
#    replay the other legs run against the benchmarks' reimplementation).
SEED_WHEEL_TESTS=()
for primary in kv swa draft_kv; do
  SEED_WHEEL_TESTS+=("tests/upstream/test_flat_seed_differential.py::test_seeded_long_replay_matches_seed[$primary-seed-wheel]")
done
#    Two lanes, one per core: the real servers and then the main pass in the
#    foreground; every other leg one after the other beside them.  (The real servers
#    wait on requests and timers more than they compute, so the lanes overlap well;
#    one after the other, the legs no longer fit CI's 90 minutes.)
#    The beside lane: the main pass's longest tests; the core tests of 3.10 and 3.13 (on
#    both indexes: the index tests run each); the sglang integration tests on 0.5.23;
#    on sglang 0.5.21 those, the seed-wheel differential and real 0.5.21 servers (the
#    flat generation's write accounting against L3's files, in buffer and in cache
#    mode, dedup off and on); the storage tests on the pure-Python index (one Python:
#    the index is the same source on each, and 3.10 and 3.13 run its own tests).
beside "3.11 long" "3.10" "3.13" "3.12 sglang 0.5.23" "3.11 sglang 0.5.21" "3.11 python-index" \
  'leg "3.11 long" "$PY" "${LONG_TESTS[@]}"' \
  'leg 3.10 "$PY310" "${CORE_TESTS[@]}"' \
  'leg 3.13 "$PY313" "${CORE_TESTS[@]}"' \
  'leg "3.12 sglang 0.5.23" "$PY312" "${SGLANG_TESTS[@]}"' \
  'leg "3.11 sglang 0.5.21" "$PYSEED" "${SGLANG_TESTS[@]}" "${SEED_WHEEL_TESTS[@]}" tests/real_server/test_server_flat.py tests/real_server/test_server_flat_cache_mode.py' \
  'HICACHE_EXISTENCE_BACKEND=python leg "3.11 python-index" "$PY" "${STORAGE_TESTS[@]}" tests/sglang_integration/test_sglang_launcher.py'
#    Real sglang servers on CPU, on the Python SGLang's image runs: the flag, the write
#    accounting against the L3's own files, the reconciler, Prometheus, TP=2, PD.
#    (test_server_flat*.py are the flat generation's: they run in the 0.5.21 leg.)  Its
#    40 slowest steps go into the timeline: the server start-ups are where CI's time goes.
HX_DURATIONS=40 one "3.12 real servers" "$PY312" tests/real_server --ignore=tests/real_server/test_server_flat.py \
  --ignore=tests/real_server/test_server_flat_cache_mode.py
log "pytest [3.11]"
set +e
# Shown, and kept with the legs' logs (tee -i: a Ctrl-C is for pytest, not for the tee).
exec 3>&1 4>&2 > >(tee -i "$LEGS/3.11.log") 2>&1
TEE_PID=$!
"$PY" -m pytest -p no:cacheprovider --durations=8 --ignore=tests/real_server --ignore=tests/sglang_integration \
  "${LONG_TESTS[@]/#/--ignore=}" "$@"
rc=$?
exec 1>&3 2>&4 3>&- 4>&-
for _ in {1..100}; do # the whole log written (at most 10 s: a leftover child may hold the pipe)
  kill -0 "$TEE_PID" 2>/dev/null || break
  sleep 0.1
done
# It runs while the beside lane still loads the machine: a failed module runs once
# more, as in the legs (flaky when it then passes).
if [ "$rc" != 0 ] && rerun 3.11 "$rc" "$PY" --ignore=tests/real_server --ignore=tests/sglang_integration \
  "${LONG_TESTS[@]/#/--ignore=}" "$@"; then
  rc=0
  flaky+=(3.11)
fi
if [ "$rc" != 0 ]; then failed+=(3.11); fi
set -e
log "pytest [3.11] exit code $rc"
wait "$BESIDE_PID"
for name in "${BESIDE[@]}"; do report "$name"; done
for name in ${flaky[@]+"${flaky[@]}"}; do
  # Flaky: failed once, passed when run again (the first failure, for whoever reads CI's tail).
  sed "s/^/[$name] flaky, passed when run again: /" "$LEGS/$name.flaky"
done
if ((${#failed[@]})); then
  # (Each failed leg's failures are printed again after the timeline, by on_exit.)
  log "failed legs: ${failed[*]}"
  [ "$rc" != 0 ] || rc=1
fi
exit $rc
