#!/usr/bin/env bash
# A PD prefill server with HiCache buffer mode and hicache-existence enabled.
# Start one per prefill node (TP=<gpus> for tensor parallelism), then decode.sh and
# router.sh.  See README.md (which flags are prefill-only, and why).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SGLANG_ARGS=(
  --model-path "$MODEL" --host "$HOST" --port "$PREFILL_PORT" --tp "$TP"
  --disaggregation-mode prefill
  --disaggregation-transfer-backend "$TRANSFER_BACKEND"
  --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
  --page-size "$PAGE_SIZE"
  --enable-hierarchical-cache
  --hicache-host-memory-mode buffer_only
  --hicache-ratio "$HICACHE_RATIO"
  --hicache-storage-backend "$L3_BACKEND"
  --hicache-storage-backend-extra-config "$L3_EXTRA_CONFIG"
  --enable-metrics
  ${SGLANG_EXTRA[@]+"${SGLANG_EXTRA[@]}"}
  ${PREFILL_EXTRA[@]+"${PREFILL_EXTRA[@]}"}
)

case "$HX_ROUTE" in
  flag)
    run "$PYTHON" -m sglang.launch_server "${SGLANG_ARGS[@]}" \
      --enable-hicache-existence --hicache-existence-config "$HX_CONFIG" ;;
  launcher)
    run hicache-existence launch --hicache-existence-config "$HX_CONFIG" \
      -- "${SGLANG_ARGS[@]}" ;;
  env)
    run env HICACHE_EXISTENCE_ENABLED=1 HICACHE_EXISTENCE_CONFIG="@$HX_CONFIG" \
      "$PYTHON" -m sglang.launch_server "${SGLANG_ARGS[@]}" ;;
  *) echo "HX_ROUTE must be flag, launcher or env, not '$HX_ROUTE'" >&2; exit 2 ;;
esac
