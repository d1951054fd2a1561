#!/usr/bin/env bash
# `fastsched serve` against llama.cpp's `llama-server` on the embedded SmolLM2 GGUF, the same
# threads and the same closed-loop workload (random 128-token prompts as one chat message,
# 64 output tokens, EOS ignored, at most 16 in flight), rounds alternating between the two
# servers so that a shared machine's slow minutes fall on both. One server runs at a time.
#
# usage: LLAMA_SERVER=<llama.cpp build>/bin/llama-server bench/serve_vs_llamacpp.sh [ROUNDS] [REQUESTS]
#   ROUNDS (default 2) rounds of REQUESTS (default 48) requests per server; results in bench/out/.
# llama-server is not a dependency of fastsched: bench/RESULTS.md says how it was built.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2} num=${2:-48}
FS=${FS:-.venv/bin/fastsched}
PORT=${PORT:-18431} GRPC_PORT=${GRPC_PORT:-18432}
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}"
model=$(.venv/bin/python -c "from fastsched.model_loader import default_model_path; print(default_model_path())")
out=bench/out/serve_vs_llamacpp
mkdir -p "$out"
source bench/lib/serve.sh

client() {  # client NAME ROUND
  "$FS" bench serve --port "$PORT" --endpoint /v1/chat/completions --tokenizer "$model" \
      --prompt-len 128 --output-len 64 --random-range-ratio 0 --max-concurrency 16 --qps inf \
      --num-requests "$num" --seed "$2" --no-progress --out "$out/$1-$2.json" >/dev/null
}

for round in $(seq 1 "$rounds"); do
  echo "round $round: fastsched serve ($(cut -d' ' -f1 /proc/loadavg) load)"
  serve_start "$out/fastsched-$round.log" "$PORT" -- --host 127.0.0.1 --port "$PORT" --grpc-port "$GRPC_PORT" \
      --num-threads 2
  client fastsched "$round"
  serve_stop
  echo "round $round: llama-server ($(cut -d' ' -f1 /proc/loadavg) load)"
  "$LLAMA_SERVER" -m "$model" -t 2 -tb 2 --parallel 16 -c 4096 --host 127.0.0.1 --port "$PORT" \
      >"$out/llama-server-$round.log" 2>&1 &
  llama=$!
  trap 'kill $llama 2>/dev/null' EXIT
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
  client llama-server "$round"
  kill "$llama"; wait "$llama" 2>/dev/null || true
  trap - EXIT
done

.venv/bin/python - "$out" "$rounds" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def row(name, r):
    res = json.load(open(f"{out}/{name}-{r}.json"))["results"][0]
    return res
print("| round | server | output tok/s | TPOT p50 ms | TTFT p50 ms | completed |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for r in range(1, rounds + 1):
    for name in ("fastsched", "llama-server"):
        res = row(name, r)
        print(f"| {r} | {name} | {res['output_throughput']:.1f} | {res['median_tpot_ms']:.0f} | "
              f"{res['median_ttft_ms']:.0f} | {res['completed']} |")
EOF
