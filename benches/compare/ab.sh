#!/usr/bin/env bash
# Keep-alive forwarding, one leasegate binary against another, in one run: both proxies up at
# once on the same origin, wrk runs alternating between them (A B A B ...), so drift of the
# machine hits both alike. For "did the per-request path get slower" between two commits.
#
#   benches/compare/ab.sh BASE_BINARY NEW_BINARY
#
# Each run also reports the proxy's CPU time (user + system) per request or tunnel, which
# varies less than throughput when the scheduler places the five processes differently.
# Knobs (environment): ROUNDS (5), DURATION (s per run, 10), CONC (32), LABELS ("base new"),
# MODE (keep-alive: wrk through the proxy; connect: the harness's CONNECT → 200 → close loop).
# Needs wrk (apt) and the compare harness (built here if missing). Every address is 127.0.0.1.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# == 2 ]] || { echo "usage: $0 BASE_BINARY NEW_BINARY" >&2; exit 2; }
BINS=("$1" "$2")
read -r -a LABELS <<<"${LABELS:-base new}"
ROUNDS=${ROUNDS:-5}
MODE=${MODE:-keep-alive}
[[ $MODE == keep-alive || $MODE == connect ]] || { echo "MODE: keep-alive or connect" >&2; exit 2; }
DURATION=${DURATION:-10}
CONC=${CONC:-32}
ORIGIN=18180
PORTS=(13228 13238)
ADMINS=(13229 13239)

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
command -v wrk >/dev/null || { log "installing wrk"; apt-get install -y -qq wrk >/dev/null; }
H="$HERE/target/release/compare-harness"
if [[ ! -x $H ]]; then
  log "building the compare harness"
  CARGO_TARGET_DIR="$HERE/target" cargo build --release --quiet --manifest-path "$HERE/harness/Cargo.toml"
fi

TMP=$(mktemp -d /tmp/leasegate-ab.XXXXXX)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

wait_http() { # wait_http URL
  for _ in $(seq 200); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  log "no answer from $1 (logs in $TMP)"; exit 1
}

"$H" origin --http 127.0.0.1:$ORIGIN --https 127.0.0.1:$((ORIGIN + 1)) --cert-dir "$TMP/certs" \
  --threads "$(nproc)" --backlog 4096 >"$TMP/origin.out" 2>"$TMP/origin.err" &
PIDS+=($!)
wait_http "http://127.0.0.1:$ORIGIN/small"

AUTH=()
for i in 0 1; do
  dir="$TMP/${LABELS[$i]}"
  mkdir -p "$dir"
  "${BINS[$i]}" keygen --out "$dir/lease.key" >/dev/null
  issued=$("${BINS[$i]}" issue --journal "$dir/journal.jsonl" --key-file "$dir/lease.key" \
    --allow-host origin.test --ttl 4h --name ab)
  AUTH+=("Basic $(printf 'agent:%s' "${issued%%$'\n'*}" | base64 -w0)")
  # The origin's ports, opened through the environment (a binary without the flags ignores it).
  RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN-$((ORIGIN + 1)) LEASEGATE_FORWARD_PORTS=$ORIGIN \
    "${BINS[$i]}" serve --listen 127.0.0.1:${PORTS[$i]} --admin 127.0.0.1:${ADMINS[$i]} \
    --journal "$dir/journal.jsonl" --key-file "$dir/lease.key" \
    --resolve origin.test=127.0.0.1 --allow-private 127.0.0.1/32 \
    --max-connections 100000 --max-connections-per-lease 100000 \
    --egress-log "$dir/egress.jsonl" >"$dir/serve.out" 2>"$dir/serve.err" &
  PIDS+=($!)
  PROXY_PID[i]=$!
  wait_http "http://127.0.0.1:${ADMINS[$i]}/readyz"
done

cat >"$TMP/wrk.lua" <<'EOF'
wrk.path = "http://origin.test:18180/small"
wrk.headers["Host"] = "origin.test:18180"
wrk.headers["Proxy-Authorization"] = os.getenv("WRK_AUTH")
done = function(summary, latency, requests)
  io.write(string.format("%d %f %d %f %f\n", summary.requests, summary.duration / 1e6,
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50), latency:percentile(99)))
end
EOF
sed -i "s/18180/$ORIGIN/g" "$TMP/wrk.lua"

# The proxy's CPU time so far (user + system), in clock ticks.
TICK=$(getconf CLK_TCK)
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }

# run_once I OUT: one timed run through proxy I; OUT gets "count seconds errors p50_us p99_us
# proxy_cpu_ticks".
run_once() {
  local before
  before=$(cpu_ticks "${PROXY_PID[$1]}")
  if [[ $MODE == keep-alive ]]; then
    WRK_AUTH=${AUTH[$1]} wrk -t 2 -c "$CONC" -d "${DURATION}s" -s "$TMP/wrk.lua" \
      "http://127.0.0.1:${PORTS[$1]}" | tail -1 >"$2"
  else
    "$H" connect-rate --proxy "127.0.0.1:${PORTS[$1]}" --target "origin.test:$((ORIGIN + 1))" \
      --auth "${AUTH[$1]}" --threads 2 --concurrency "$CONC" --duration "$DURATION" |
      python3 -c 'import json, sys; d = json.load(sys.stdin); print(d["tunnels"], d["seconds"], d["errors"], d["p50_us"], d["p99_us"])' >"$2"
  fi
  echo "$(cat "$2") $(($(cpu_ticks "${PROXY_PID[$1]}") - before))" >"$2"
}

UNIT=$([[ $MODE == keep-alive ]] && echo "req/s" || echo "tunnels/s")
log "${LABELS[0]}: ${BINS[0]}; ${LABELS[1]}: ${BINS[1]}; $MODE, $ROUNDS rounds of ${DURATION} s, $CONC connections"
for r in $(seq "$ROUNDS"); do
  for i in 0 1; do
    run_once "$i" "$TMP/run-$r-$i"
    read -r requests seconds errors p50 p99 ticks <"$TMP/run-$r-$i"
    printf '%s round %d: %.0f %s, p50 %.0f µs, p99 %.0f µs, %d errors, proxy CPU %.1f µs each\n' \
      "${LABELS[$i]}" "$r" "$(echo "$requests / $seconds" | bc -l)" "$UNIT" "$p50" "$p99" "$errors" \
      "$(echo "$ticks * 1000000 / $TICK / $requests" | bc -l)"
  done
done

echo
echo "| binary | median $UNIT | rounds ($UNIT) | median p50 | median proxy CPU each |"
echo "|---|---:|---|---:|---:|"
for i in 0 1; do
  rates=$(for r in $(seq "$ROUNDS"); do awk '{ printf "%.0f\n", $1 / $2 }' "$TMP/run-$r-$i"; done)
  p50s=$(for r in $(seq "$ROUNDS"); do awk '{ printf "%.0f\n", $4 }' "$TMP/run-$r-$i"; done)
  median=$(sort -n <<<"$rates" | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  p50=$(sort -n <<<"$p50s" | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  cpus=$(for r in $(seq "$ROUNDS"); do awk -v tick="$TICK" '{ printf "%.1f\n", $6 * 1e6 / tick / $1 }' "$TMP/run-$r-$i"; done)
  cpu=$(sort -n <<<"$cpus" | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
  echo "| ${LABELS[$i]} | $median | $(paste -sd' ' <<<"$rates") | ${p50} µs | ${cpu} µs |"
done
