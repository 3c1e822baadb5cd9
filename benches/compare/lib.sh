# Shell helpers shared by brokered.sh, metered.sh and edge.sh (sourced, not run): logging, the
# processes a script started (by pid, in PID[NAME]) stopped on exit, waiting for a port, the
# builds.
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

ports_free() { # ports_free PORT...: dies naming the first one in use
  for p in "$@"; do
    ss -Hltn "( sport = :$p )" | grep -q . && die "127.0.0.1:$p is already in use"
  done
  return 0
}

build_binaries() { # build_binaries: leasegate (PROFILE) and the harness, unless SKIP_BUILD=1; sets LG and H
  if [[ ${SKIP_BUILD:-0} != 1 ]]; then
    log "cargo build --profile $PROFILE (leasegate)"
    (cd "$REPO" && cargo build --profile "$PROFILE" --quiet)
    log "cargo build --release (harness)"
    CARGO_TARGET_DIR="$HERE/target" cargo build --release --quiet --manifest-path "$HERE/harness/Cargo.toml"
  fi
  LG="${CARGO_TARGET_DIR:-$REPO/target}/$PROFILE/leasegate"
  H="$HERE/target/release/compare-harness"
  [[ -x $LG && -x $H ]] || die "missing $LG or $H (build failed?)"
}

describe_machine() { # describe_machine: sets REV (git, marked when src/ is changed), CPU and MEM
  REV=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [[ -n $(git -C "$REPO" status --porcelain --untracked-files=no -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
    REV="$REV (with uncommitted changes to src/ or Cargo.*)"
  fi
  CPU=$(awk -F': ' '/^model name/ { print $2; exit }' /proc/cpuinfo)
  MEM=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)
}
