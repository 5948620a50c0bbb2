#!/usr/bin/env bash
# The PD router, SGLang's Model Gateway (pip install smg; sglang-router's successor):
# sends each request to a prefill and a decode server.  PREFILL_URLS / DECODE_URLS
# are space-separated lists; a prefill entry may carry its bootstrap port as
# URL,PORT (otherwise BOOTSTRAP_PORT).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ARGS=(--pd-disaggregation --host "$HOST" --port "$ROUTER_PORT"
      --prefill-policy "$PREFILL_POLICY" --decode-policy "$DECODE_POLICY")
for entry in $PREFILL_URLS; do
  url=${entry%%,*}
  port=$BOOTSTRAP_PORT
  [ "$url" != "$entry" ] && port=${entry#*,}
  ARGS+=(--prefill "$url" "$port")
done
for url in $DECODE_URLS; do ARGS+=(--decode "$url"); done
run "$PYTHON" -m smg.launch_router "${ARGS[@]}" ${ROUTER_EXTRA[@]+"${ROUTER_EXTRA[@]}"}
