#!/usr/bin/env bash
# The PD router (pip install sglang-router): sends each request to a prefill and a
# decode server.  PREFILL_URLS / DECODE_URLS are space-separated lists.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ARGS=(--pd-disaggregation --host "$HOST" --port "$ROUTER_PORT")
for url in $PREFILL_URLS; do ARGS+=(--prefill "$url"); done
for url in $DECODE_URLS; do ARGS+=(--decode "$url"); done
run "$PYTHON" -m sglang_router.launch_router "${ARGS[@]}"
