# Shell helpers shared by brokered.sh and metered.sh (sourced, not run): logging, the processes
# a script started (by pid, in PID[NAME]) stopped on exit, waiting for a port.
#
# Invariant: only the pids a script put in PID are ever signalled; the temporary directory TMP
# is removed only after a clean exit without KEEP_TMP=1.

declare -A PID=()
log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

stop_pid() { # stop_pid NAME: SIGTERM, then SIGKILL after 10 s
  local name=$1 pid=${PID[$1]:-}
  [[ -n $pid ]] || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
  unset "PID[$name]"
}
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for name in "${!PID[@]}"; do stop_pid "$name"; done
  if [[ $rc == 0 && ${KEEP_TMP:-0} != 1 ]]; then rm -rf "$TMP"; else log "logs and raw runs kept in $TMP"; fi
  exit "$rc"
}

wait_port() { # wait_port PORT NAME
  for _ in $(seq 300); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    kill -0 "${PID[$2]}" 2>/dev/null || die "$2 exited; see $TMP/$2.err"
    sleep 0.1
  done
  die "$2 is not listening on 127.0.0.1:$1 after 30 s; see $TMP/$2.err"
}
