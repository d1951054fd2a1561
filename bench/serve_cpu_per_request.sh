#!/usr/bin/env bash
# CPU milliseconds per request spent by each process of a running `fastsched serve`
# (gateway, engines, frontends) and by the load generator, over one closed-loop
# `fastsched bench serve` run. CPU time per request is steadier than requests/s on a
# shared machine: other jobs slow a run down but add little to its processes' CPU time.
#
# usage: bench/serve_cpu_per_request.sh PORT [NUM_REQUESTS] [CONCURRENCY]
#   PORT: the gateway's --port (the server must have been started with it on the command line)
set -euo pipefail
port=$1 num=${2:-1500} conc=${3:-64}
fastsched=${FASTSCHED:-"$(dirname "$0")/../.venv/bin/fastsched"}
gateway=$(pgrep -f -- "fastsched serve.*--port $port" | head -n 1)
pids="$gateway $(pgrep -P "$gateway" | tr '\n' ' ')"
cpu_ticks() { for p in $pids; do awk -v p="$p" '{print p, $14 + $15}' "/proc/$p/stat"; done; }
before=$(cpu_ticks)
/usr/bin/time -f "load generator: %U s user + %S s system" "$fastsched" bench serve \
    --url "http://127.0.0.1:$port" --qps inf --max-concurrency "$conc" --num-requests "$num" \
    --prompt-len 32 --output-len 4 --seed 3 --no-progress 2>&1 | grep -E '^\| inf|^load generator'
after=$(cpu_ticks)
ticks=$(getconf CLK_TCK)
join <(echo "$before") <(echo "$after") | while read -r pid a b; do
    tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q resource_tracker && continue
    if ! tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q spawn_main; then role="gateway (launcher)"
    elif grep -q libtorch "/proc/$pid/maps"; then role=engine  # frontends never import torch
    else role=frontend; fi
    awk -v pid="$pid" -v role="$role" -v d=$((b - a)) -v t="$ticks" -v n="$num" \
        'BEGIN { if (d > 0) printf "pid %s %-28s %.2f ms CPU per request\n", pid, role, d * 1000 / t / n }'
done
echo "(load average: $(cut -d' ' -f1-3 /proc/loadavg))"
