#!/usr/bin/env bash
# Prefix-aware routing (--routing prefix) against least-loaded routing (--routing load) with
# two engines, side by side in one run: a multi-tenant workload (8 system prompts of 512
# tokens, short user turns; bench serve --dataset-name prefix_repetition) on SmolLM2 on CPU,
# each engine's KV pool holding KV_BLOCKS blocks of 16 tokens (default 192: six of the eight
# system prompts). Writes
# bench/out/routing_{load,prefix}.json and prints both tables, the prefix-cache hit rates
# and the routing decisions (bench/RESULTS.md).
#
#   [KV_BLOCKS=192] bench/routing_bench.sh [NUM_REQUESTS] [MAX_CONCURRENCY]
set -euo pipefail
cd "$(dirname "$0")/.."
NUM=${1:-96}
CONC=${2:-4}
PORT=${PORT:-18731}
GRPC_PORT=${GRPC_PORT:-18781}
KV_BLOCKS=${KV_BLOCKS:-192}
FS=.venv/bin/fastsched
mkdir -p bench/out
. bench/lib/serve.sh

SERVER_FLAGS=(--device cpu --dtype float32 --max-model-len 1024 --num-gpu-blocks-override "$KV_BLOCKS"
              --max-num-batched-tokens 1024 --data-parallel-size 2 --torch-num-threads 1
              --port "$PORT" --grpc-port "$GRPC_PORT" --disable-access-log)
BENCH_FLAGS=(--dataset-name prefix_repetition --prefix-repetition-num-prefixes 8
             --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 32 --output-len 16
             --random-range-ratio 0 --qps inf --max-concurrency "$CONC" --num-requests "$NUM" --seed 0 --no-progress)

run_one() {
  local name=$1; shift
  serve_start "bench/out/routing_${name}.log" "$PORT" 480 -- "${SERVER_FLAGS[@]}" "$@"
  "$FS" bench serve --url "http://127.0.0.1:$PORT" "${BENCH_FLAGS[@]}" --out "bench/out/routing_${name}.json"
  curl -s "http://127.0.0.1:$PORT/metrics" \
    | grep -E '^fastsched:(routing_decisions_total|prefix_cache_(queries|hits)_total)' || true
  serve_stop
}

echo "== --routing load"
run_one load --routing load
echo "== --routing prefix"
run_one prefix --routing prefix
