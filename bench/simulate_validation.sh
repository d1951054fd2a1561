#!/usr/bin/env bash
# Validates `fastsched simulate` against a measured `fastsched bench serve` on the tiny
# model (CPU): serve with --step-trace, run the bench at a calibration load and at two
# validation loads, fit the step cost on the served steps, take the frontend latency
# from the calibration load, simulate the same traces, and print measured vs simulated.
#
#   bench/simulate_validation.sh [CALIBRATION_QPS] [QPS_1] [QPS_2] [NUM_REQUESTS]
# (the calibration load sends NUM_REQUESTS / 5 requests)
set -euo pipefail
cd "$(dirname "$0")/.."
CAL=${1:-5}
QPS1=${2:-25}
QPS2=${3:-50}
NUM=${4:-500}
PORT=${PORT:-18200}
GRPC_PORT=${GRPC_PORT:-18250}
FS=.venv/bin/fastsched
OUT=bench/out/simulate
mkdir -p "$OUT"
. bench/lib/serve.sh
rm -f "$OUT/steps.jsonl"
[ -d "$OUT/tiny" ] || "$FS" make-tiny-model "$OUT/tiny"

ENGINE_FLAGS=(--model "$OUT/tiny" --device cpu --dtype float32 --kv-cache-memory 67108864)
LOAD=(--prompt-len 128 --output-len 64 --seed 0)
NUM_CAL=$((NUM / 5))

serve_start "$OUT/serve.log" "$PORT" -- "${ENGINE_FLAGS[@]}" --port "$PORT" --grpc-port "$GRPC_PORT" \
    --disable-access-log --step-trace "$OUT/steps.jsonl"
"$FS" bench serve --url "http://127.0.0.1:$PORT" --qps "$CAL" --num-requests "$NUM_CAL" "${LOAD[@]}" \
    --no-progress --out "$OUT/calibration_measured.json"
"$FS" bench serve --url "http://127.0.0.1:$PORT" --qps "$QPS1" "$QPS2" --num-requests "$NUM" "${LOAD[@]}" \
    --no-progress --out "$OUT/measured.json"
serve_stop

"$FS" bench fit-step-cost "$OUT/steps.jsonl" --out "$OUT/cost.json"
"$FS" simulate "${ENGINE_FLAGS[@]}" --cost-model "$OUT/cost.json" --qps "$CAL" --num-requests "$NUM_CAL" \
    "${LOAD[@]}" --no-progress --out "$OUT/calibration.json"
FRONTEND_LATENCY=$(.venv/bin/python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
measured = json.load(open(f"{out}/calibration_measured.json"))["results"][0]["median_ttft_ms"]
simulated = json.load(open(f"{out}/calibration.json"))["results"][0]["median_ttft_ms"]
print(f"{max(0.0, measured - simulated) / 1000:.4f}")
EOF
)
echo "frontend latency from the calibration load: ${FRONTEND_LATENCY} s"
"$FS" simulate "${ENGINE_FLAGS[@]}" --cost-model "$OUT/cost.json" --qps "$QPS1" "$QPS2" --num-requests "$NUM" "${LOAD[@]}" \
    --frontend-latency "$FRONTEND_LATENCY" --no-progress --out "$OUT/simulated.json"

.venv/bin/python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
measured = {r["qps"]: r for r in json.load(open(f"{out}/measured.json"))["results"]}
simulated = {r["qps"]: r for r in json.load(open(f"{out}/simulated.json"))["results"]}
print("| QPS | TTFT p50 measured / simulated ms | diff | out tok/s measured / simulated | diff |")
print("|-----|----------------------------------|------|--------------------------------|------|")
for qps, s in simulated.items():
    m = measured[qps]
    t_m, t_s = m["median_ttft_ms"], s["median_ttft_ms"]
    o_m, o_s = m["output_throughput"], s["output_throughput"]
    print(f"| {qps:g} | {t_m:.1f} / {t_s:.1f} | {100 * (t_s - t_m) / t_m:+.0f}% "
          f"| {o_m:.0f} / {o_s:.0f} | {100 * (o_s - o_m) / o_m:+.0f}% |")
EOF
