# Shared by the bench scripts that start `fastsched serve` themselves: start it in the
# background, wait for /health, stop it with SIGINT (a clean shutdown, every child gone)
# on the way out, including when the script fails half-way. Source it; it uses $FS.
# (A background job of a script starts with SIGINT ignored; `fastsched serve` installs its
# own handler, so SIGINT still reaches it.)
#
#   serve_start LOG PORT [TRIES] -- ARGS...   start `$FS serve ARGS...`, logging to LOG, and
#                                           wait up to TRIES × 0.5 s (default 240) for PORT
#   serve_stop                               SIGINT the server started last and wait for it

serve_start() {
  local log=$1 port=$2 tries=240
  shift 2
  if [ "$1" != "--" ]; then tries=$1; shift; fi
  shift  # the --
  if curl -s "http://127.0.0.1:$port/health" >/dev/null; then
    echo "port $port is taken by another server; set PORT and GRPC_PORT" >&2; exit 1
  fi
  "$FS" serve "$@" >"$log" 2>&1 &
  SERVER_PID=$!
  trap 'kill -INT $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null' EXIT
  for _ in $(seq 1 "$tries"); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "server exited; see $log" >&2; exit 1; }
    sleep 0.5
  done
  echo "server not ready after $((tries / 2)) s; see $log" >&2
  exit 1
}

serve_stop() {
  kill -INT "$SERVER_PID"
  wait "$SERVER_PID" || true
  trap - EXIT
}
