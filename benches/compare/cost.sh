#!/usr/bin/env bash
# Where a CONNECT tunnel's CPU goes: the harness's CONNECT → 200 → close loop through leasegate,
# then through Squid (one worker, as in run.sh), on one origin; for each, the user and system
# CPU time per tunnel of the proxy, the origin and the client (from /proc and time(1)).
#
#   benches/compare/cost.sh [LEASEGATE_BINARY]     # default: target/release/leasegate
#
# On a machine the processes saturate, tunnels/s ≈ cores ÷ (proxy + origin + client) per
# tunnel: this says how much of that sum the proxy is, and how much of the proxy is the
# kernel's loopback TCP work. Knobs (environment): ROUNDS (2), DURATION (s per run, 6),
# CONC (32). Needs squid (apt) and the compare harness (built here if missing); run as root
# (Squid drops to the proxy user). Every address is 127.0.0.1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=squid-conf.sh
. "$HERE/squid-conf.sh"
BIN=${1:-$HERE/../../target/release/leasegate}
ROUNDS=${ROUNDS:-2}
DURATION=${DURATION:-6}
CONC=${CONC:-32}
ORIGIN=18380
LG_PORT=13428
LG_ADMIN=13429
SQUID_PORT=13430

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
command -v squid >/dev/null || { log "installing squid"; apt-get install -y -qq squid >/dev/null; }
[[ -x $BIN ]] || { log "no leasegate binary at $BIN (cargo build --release)"; exit 2; }
H="$HERE/target/release/compare-harness"
if [[ ! -x $H ]]; then
  log "building the compare harness"
  CARGO_TARGET_DIR="$HERE/target" cargo build --release --quiet --manifest-path "$HERE/harness/Cargo.toml"
fi

TMP=$(mktemp -d /tmp/leasegate-cost.XXXXXX)
chmod 755 "$TMP" # squid drops to the proxy user and writes its logs here
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

wait_http() { # wait_http URL [PROXY]
  for _ in $(seq 200); do curl -sf ${2:+-x "$2"} "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "no answer from $1 (logs in $TMP)"; exit 1
}

"$H" origin --http 127.0.0.1:$ORIGIN --https 127.0.0.1:$((ORIGIN + 1)) --cert-dir "$TMP/certs" \
  --threads "$(nproc)" --backlog 4096 >"$TMP/origin.out" 2>"$TMP/origin.err" &
ORIGIN_PID=$!
PIDS+=($!)
wait_http "http://127.0.0.1:$ORIGIN/small"

"$BIN" keygen --out "$TMP/lease.key" >/dev/null
issued=$("$BIN" issue --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
  --allow-host origin.test --ttl 4h --name cost)
AUTH="Basic $(printf 'agent:%s' "${issued%%$'\n'*}" | base64 -w0)"
# The origin's ports are no defaults (443, 80): open them to tunnels and forwarded requests.
RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN-$((ORIGIN + 1)) LEASEGATE_FORWARD_PORTS=$ORIGIN \
  "$BIN" serve --listen 127.0.0.1:$LG_PORT --admin 127.0.0.1:$LG_ADMIN \
  --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
  --resolve origin.test=127.0.0.1 --allow-private 127.0.0.1/32 \
  --max-connections 100000 --max-connections-per-lease 100000 \
  --egress-log "$TMP/egress.jsonl" >"$TMP/serve.out" 2>"$TMP/serve.err" &
LG_PID=$!
PIDS+=($!)
wait_http "http://127.0.0.1:$LG_ADMIN/readyz"

echo "127.0.0.1 origin.test" >"$TMP/hosts"
squid_conf "$TMP" "$SQUID_PORT" 1 20000 >"$TMP/squid.conf"
squid -N -f "$TMP/squid.conf" >"$TMP/squid.out" 2>"$TMP/squid.err" &
SQUID_PID=$!
PIDS+=($!)
wait_http "http://origin.test:$ORIGIN/small" "http://127.0.0.1:$SQUID_PORT"

# A process's user and system CPU time so far, in clock ticks.
cpu() { awk '{ print $14, $15 }' "/proc/$1/stat"; }
TICK_US=$((1000000 / $(getconf CLK_TCK)))

run() { # run NAME PROXY_PID PROXY_ADDR AUTH
  local pu1 ps1 ou1 os1 pu2 ps2 ou2 os2 cu cs n
  read -r pu1 ps1 < <(cpu "$2")
  read -r ou1 os1 < <(cpu "$ORIGIN_PID")
  /usr/bin/time -f "%U %S" -o "$TMP/time" "$H" connect-rate --proxy "$3" \
    --target origin.test:$((ORIGIN + 1)) --auth "$4" --threads 2 --concurrency "$CONC" \
    --duration "$DURATION" >"$TMP/out"
  read -r pu2 ps2 < <(cpu "$2")
  read -r ou2 os2 < <(cpu "$ORIGIN_PID")
  read -r cu cs <"$TMP/time"
  n=$(grep -o '"tunnels":[0-9]*' "$TMP/out" | cut -d: -f2)
  awk -v name="$1" -v n="$n" -v d="$DURATION" -v t="$TICK_US" \
    -v pu=$((pu2 - pu1)) -v ps=$((ps2 - ps1)) -v ou=$((ou2 - ou1)) -v os=$((os2 - os1)) \
    -v cu="$cu" -v cs="$cs" 'BEGIN {
      f = t / n
      printf "| %s | %d | %.1f + %.1f | %.1f + %.1f | %.1f + %.1f | %.1f |\n", name, n / d,
        pu * f, ps * f, ou * f, os * f, cu * 1e6 / n, cs * 1e6 / n,
        (pu + ps + ou + os) * f + (cu + cs) * 1e6 / n }'
}

log "$ROUNDS round(s) × leasegate, Squid; ${DURATION} s each, $CONC concurrent tunnels"
echo "| proxy | tunnels/s | proxy µs (user + system) | origin µs | client µs | all µs per tunnel |"
echo "|---|---:|---:|---:|---:|---:|"
for _ in $(seq "$ROUNDS"); do
  run leasegate "$LG_PID" 127.0.0.1:$LG_PORT "$AUTH"
  run squid "$SQUID_PID" 127.0.0.1:$SQUID_PORT none
done
