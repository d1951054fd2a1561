#!/usr/bin/env bash
# The TTFT-SLO valve under overload: the same open-loop load against SmolLM2 on CPU,
# once without admission control and once with --ttft-slo. Writes
# bench/out/ttft_slo_{off,on}.json and prints both tables (bench/RESULTS.md).
#
#   bench/ttft_slo_bench.sh [SLO_SECONDS] [QPS] [NUM_REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
SLO=${1:-2}
QPS=${2:-4}
NUM=${3:-120}
PORT=${PORT:-18100}
GRPC_PORT=${GRPC_PORT:-18150}
FS=.venv/bin/fastsched
mkdir -p bench/out
. bench/lib/serve.sh

# Engine-bound on purpose: a 135M model prefills a few hundred tokens/s on two CPU cores,
# so the engine, not the Python serving path, is what overload saturates.
SERVER_FLAGS=(--device cpu --dtype float32 --max-model-len 2048 --kv-cache-memory 268435456
              --max-num-batched-tokens 512 --port "$PORT" --grpc-port "$GRPC_PORT" --disable-access-log)

run_one() {
  local name=$1; shift
  serve_start "bench/out/ttft_slo_${name}.log" "$PORT" -- "${SERVER_FLAGS[@]}" "$@"
  "$FS" bench serve --url "http://127.0.0.1:$PORT" --qps "$QPS" --num-requests "$NUM" \
      --prompt-len 256 --output-len 16 --seed 0 --no-progress --out "bench/out/ttft_slo_${name}.json"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^fastsched:(admission_queued_tokens_limit|prefill_throughput|admission_rejections_total)' || true
  serve_stop
}

echo "== without admission control"
run_one off
echo "== --ttft-slo $SLO"
run_one on --ttft-slo "$SLO"
