# Shared settings of the PD recipes (sourced by prefill.sh, decode.sh, router.sh).
# Every value can be overridden from the environment; DRY_RUN=1 prints the command
# (one argument per line) instead of running it.  tests/real_server/test_pd.py runs
# these very scripts (tiny model on CPU), so what is written here is what runs.
: "${PYTHON:=python3}"
: "${MODEL:=meta-llama/Llama-3.1-8B-Instruct}"
: "${HOST:=0.0.0.0}"
: "${TP:=1}"
# PD transfer engine between prefill and decode (mooncake, nixl, ...).  Mooncake
# picks its transport from MOONCAKE_PROTOCOL (rdma by default; tcp where there is
# no RDMA NIC).
: "${TRANSFER_BACKEND:=mooncake}"
# HiCache L3 storage of the prefill servers (shared by all of them).
: "${L3_BACKEND:=file}"
if [ -z "${L3_EXTRA_CONFIG:-}" ]; then
  L3_EXTRA_CONFIG='{"file_storage_path": "/mnt/hicache-l3"}'
fi
# 64-token pages: what HiCache recommends (the CUDA default page size is 1).
: "${PAGE_SIZE:=64}"
# Host memory as a staging buffer only: 1.2x the device pool is upstream's default.
: "${HICACHE_RATIO:=1.2}"
: "${PREFILL_PORT:=30000}"
: "${DECODE_PORT:=30001}"
: "${ROUTER_PORT:=8000}"
# The prefill server's KV bootstrap port (decode servers connect to it; sglang's
# default is 8998).  Two prefill servers on one host need two ports.
: "${BOOTSTRAP_PORT:=8998}"
# Space-separated; a prefill entry is URL or URL,BOOTSTRAP_PORT (default BOOTSTRAP_PORT).
: "${PREFILL_URLS:=http://127.0.0.1:${PREFILL_PORT}}"
: "${DECODE_URLS:=http://127.0.0.1:${DECODE_PORT}}"
# Router policy for prefill servers: cache_aware keeps a conversation's turns on the
# server that holds its prefix; round_robin spreads them (every turn elsewhere).
: "${PREFILL_POLICY:=cache_aware}"
: "${DECODE_POLICY:=round_robin}"
# hicache-existence: how to enable it on prefill servers.
#   flag      --enable-hicache-existence on sglang's command line (sglang >= 0.5.19)
#   launcher  hicache-existence launch -- <sglang args> (launching is enabling)
#   env       HICACHE_EXISTENCE_ENABLED=1 + HICACHE_EXISTENCE_CONFIG (containers)
: "${HX_ROUTE:=flag}"
: "${HX_CONFIG:=$(dirname "${BASH_SOURCE[0]}")/hicache-existence-config.json}"
# Extra arguments, split on spaces (no quoting): SGLANG_EXTRA_ARGS go to every sglang
# server, PREFILL_EXTRA_ARGS / DECODE_EXTRA_ARGS to one role, ROUTER_EXTRA_ARGS to the
# router (e.g. "--device cpu --disable-cuda-graph" on a machine without GPUs).
read -r -a SGLANG_EXTRA <<< "${SGLANG_EXTRA_ARGS:-}"
read -r -a PREFILL_EXTRA <<< "${PREFILL_EXTRA_ARGS:-}"
read -r -a DECODE_EXTRA <<< "${DECODE_EXTRA_ARGS:-}"
read -r -a ROUTER_EXTRA <<< "${ROUTER_EXTRA_ARGS:-}"

run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%s\n' "$@"
  else
    exec "$@"
  fi
}
