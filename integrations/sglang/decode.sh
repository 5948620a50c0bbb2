#!/usr/bin/env bash
# A PD decode server.  No hicache-existence flag and no HiCache buffer mode here:
# sglang rejects --hicache-host-memory-mode buffer_only on decode servers, and the
# storage-existence cache exists only in buffer mode (README.md).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

run "$PYTHON" -m sglang.launch_server \
  --model-path "$MODEL" --host "$HOST" --port "$DECODE_PORT" --tp "$TP" \
  --disaggregation-mode decode \
  --disaggregation-transfer-backend "$TRANSFER_BACKEND" \
  --page-size "$PAGE_SIZE" \
  --enable-metrics \
  ${SGLANG_EXTRA[@]+"${SGLANG_EXTRA[@]}"} \
  ${DECODE_EXTRA[@]+"${DECODE_EXTRA[@]}"}
