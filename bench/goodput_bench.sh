#!/usr/bin/env bash
# The goodput valve under overload: the TTFT-SLO bench's load against SmolLM2 on CPU, three
# times in one go — no admission control, --ttft-slo, and --ttft-slo with --tpot-slo — each
# measured as goodput (requests within both targets, vLLM's request_goodput). Writes
# bench/out/goodput_{off,ttft,both}.json and prints each table (bench/RESULTS.md).
#
#   bench/goodput_bench.sh [TTFT_SECONDS] [TPOT_SECONDS] [QPS] [NUM_REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
TTFT=${1:-2}
TPOT=${2:-0.2}
QPS=${3:-4}
NUM=${4:-120}
PORT=${PORT:-18200}
GRPC_PORT=${GRPC_PORT:-18250}
FS=.venv/bin/fastsched
mkdir -p bench/out
. bench/lib/serve.sh
GOODPUT_MS=(ttft:"$(awk "BEGIN{print $TTFT*1000}")" tpot:"$(awk "BEGIN{print $TPOT*1000}")")

# As bench/ttft_slo_bench.sh: engine-bound on purpose (a 135M model on two CPU cores).
SERVER_FLAGS=(--device cpu --dtype float32 --max-model-len 2048 --kv-cache-memory 268435456
              --max-num-batched-tokens 512 --port "$PORT" --grpc-port "$GRPC_PORT" --disable-access-log)

run_one() {
  local name=$1; shift
  serve_start "bench/out/goodput_${name}.log" "$PORT" -- "${SERVER_FLAGS[@]}" "$@"
  "$FS" bench serve --url "http://127.0.0.1:$PORT" --qps "$QPS" --num-requests "$NUM" \
      --prompt-len 256 --output-len 16 --seed 0 --no-progress --goodput "${GOODPUT_MS[@]}" \
      --out "bench/out/goodput_${name}.json"
  curl -s "http://127.0.0.1:$PORT/metrics" \
      | grep -E '^fastsched:(admission_rejections_total|slo_prediction_error_seconds_(sum|count))' || true
  serve_stop
}

echo "== without admission control"
run_one off
echo "== --ttft-slo $TTFT"
run_one ttft --ttft-slo "$TTFT"
echo "== --ttft-slo $TTFT --tpot-slo $TPOT"
run_one both --ttft-slo "$TTFT" --tpot-slo "$TPOT"
