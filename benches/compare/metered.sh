#!/usr/bin/env bash
# Metered model calls: a streamed Chat Completions answer of TOKENS one-token chunks (2,000)
# through leasegate terminating the origin's host with a secret marked `meter = "openai"`,
# against the same through a second leasegate whose secret has no `meter`. Per variant:
# responses/s, leasegate's CPU per response (user+sys from /proc/PID/stat), time to first byte
# p50/p99 and whole-response p50; the ratios metered/unmetered. Before anything is timed, an
# answer through each is compared byte for byte with the origin's own, and the metered egress
# line must carry the call's `model` object. Replaces the "Metered model calls" section of
# benches/compare/RESULTS.md. See README.md here.
#
#   benches/compare/metered.sh              # 3 rounds, 8 s per run (~2 min + builds)
#   QUICK=1 benches/compare/metered.sh      # smoke test: 1 round, 2 s runs
#
# Knobs (environment): ROUNDS (3), DURATION (8), CONC (4), TOKENS (2000), QUICK=1,
# PROFILE (release), SKIP_BUILD=1, KEEP_TMP=1, OUT_MD (RESULTS.md here), INSTRUCTIONS (1 where
# valgrind is installed: instructions per answer under callgrind too), INSTR_DURATION (20).
#
# Every address used is on 127.0.0.1; needs python3 and curl, not root.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
COMMAND_LINE="$( { env | grep -E '^(QUICK|ROUNDS|DURATION|CONC|TOKENS|PROFILE|INSTRUCTIONS|INSTR_DURATION)=' || true; } | sort | tr '\n' ' ')benches/compare/metered.sh"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then ROUNDS=${ROUNDS:-1} DURATION=${DURATION:-2} INSTR_DURATION=${INSTR_DURATION:-5}; fi
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-8}
CONC=${CONC:-4}
TOKENS=${TOKENS:-2000}
PROFILE=${PROFILE:-release}
INSTRUCTIONS=${INSTRUCTIONS:-$(command -v valgrind >/dev/null && echo 1 || echo 0)}
INSTR_DURATION=${INSTR_DURATION:-20}
OUT_MD=${OUT_MD:-$HERE/RESULTS.md}

# Ports apart from run.sh's and brokered.sh's.
ORIGIN_HTTP=18380
ORIGIN_HTTPS=18743
declare -A PORT=([metered]=13428 [unmetered]=13430)
declare -A ADMIN=([metered]=13429 [unmetered]=13431)
VARIANTS=(metered unmetered)
CALL_PATH="/v1/chat/completions?tokens=$TOKENS"

# shellcheck source=lib.sh
. "$HERE/lib.sh"
for tool in curl python3; do command -v $tool >/dev/null || die "$tool is needed"; done

START_EPOCH=$(date +%s)
TMP=$(mktemp -d /tmp/leasegate-metered.XXXXXX)
RUNS="$TMP/runs"
mkdir -p "$RUNS"

trap cleanup EXIT
trap 'exit 130' INT TERM
ports_free $ORIGIN_HTTP $ORIGIN_HTTPS "${PORT[@]}" "${ADMIN[@]}"

# ------------------------------------------------------------------------------------------
# 1. Build leasegate and the harness (as brokered.sh does).
build_binaries

# ------------------------------------------------------------------------------------------
# 2. The origin, then two leasegates terminating origin.test: one whose secret meters it, one
#    whose secret does not; everything else the same (a lease each, one price table).
"$H" origin --http 127.0.0.1:$ORIGIN_HTTP --https 127.0.0.1:$ORIGIN_HTTPS --cert-dir "$TMP/certs" \
  --threads 1 >"$TMP/origin.out" 2>"$TMP/origin.err" &
PID[origin]=$!
wait_port $ORIGIN_HTTPS origin
ORIGIN_CA="$TMP/certs/ca.pem"

cat >"$TMP/body.json" <<'EOF'
{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Count to two thousand."}]}
EOF
cat >"$TMP/prices.toml" <<'EOF'
[[model]]
name = "gpt-4o-mini*"
input_per_million = 0.15
output_per_million = 0.60
cached_input_per_million = 0.075
EOF
"$LG" keygen --out "$TMP/lease.key" >/dev/null
declare -A AUTH=()
start_lg() { # start_lg VARIANT [WRAPPER ...]: leasegate of VARIANT on its ports, under WRAPPER
  local v=$1; shift
  BENCH_TOKEN=bench-token RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN_HTTPS \
    "$@" "$LG" serve --listen 127.0.0.1:${PORT[$v]} --admin 127.0.0.1:${ADMIN[$v]} \
    --journal "$TMP/journal-$v.jsonl" --key-file "$TMP/lease.key" \
    --secrets "$TMP/secrets-$v.toml" --ca-dir "$TMP/ca-$v" --upstream-ca "$ORIGIN_CA" \
    --prices "$TMP/prices.toml" \
    --resolve origin.test=127.0.0.1 --allow-private 127.0.0.1/32 \
    --egress-log "$TMP/egress-$v.jsonl" --drain-timeout 2s \
    >>"$TMP/$v.out" 2>>"$TMP/$v.err" &
  PID[$v]=$!
  wait_port "${PORT[$v]}" "$v"
}
for v in "${VARIANTS[@]}"; do
  "$LG" ca init --dir "$TMP/ca-$v" --host origin.test >/dev/null
  {
    printf '[[secret]]\nid = "bench"\nhosts = ["origin.test"]\nheader = "Authorization"\n'
    printf 'format = "Bearer {value}"\nenv = "BENCH_TOKEN"\nagents = ["bench"]\nenv_name = "BENCH_API_KEY"\n'
    [[ $v == metered ]] && printf 'meter = "openai"\n'
  } >"$TMP/secrets-$v.toml"
  lease=$("$LG" issue --journal "$TMP/journal-$v.jsonl" --key-file "$TMP/lease.key" \
    --allow-host origin.test --ttl 4h --name bench --print id)
  AUTH[$v]="Basic $(printf 'agent:%s' "$lease" | base64 -w0)"
  start_lg "$v"
done

# ------------------------------------------------------------------------------------------
# 3. Sanity, before anything is timed: the answer through each leasegate is the origin's, byte
#    for byte, and the metered egress line has the call's model object (the unmetered none).
call() { # call OUT [curl args...]: one streamed call
  local out=$1; shift
  curl -sf -X POST -H 'content-type: application/json' --data-binary @"$TMP/body.json" \
    "$@" "https://origin.test:$ORIGIN_HTTPS$CALL_PATH" -o "$out"
}
call "$TMP/answer-direct" --cacert "$ORIGIN_CA" --resolve "origin.test:$ORIGIN_HTTPS:127.0.0.1" ||
  die "the origin did not answer $CALL_PATH"
EXPECT=$(wc -c <"$TMP/answer-direct")
for v in "${VARIANTS[@]}"; do
  call "$TMP/answer-$v" --cacert "$TMP/ca-$v/ca.pem" -x "http://127.0.0.1:${PORT[$v]}" \
    --proxy-header "Proxy-Authorization: ${AUTH[$v]}" || die "the call through $v failed"
  cmp -s "$TMP/answer-direct" "$TMP/answer-$v" || die "the answer through $v differs from the origin's"
done
sleep 0.5 # the egress line is written as the exchange ends
python3 - "$TMP/egress-metered.jsonl" "$TMP/egress-unmetered.jsonl" "$TOKENS" >"$TMP/model-line.json" <<'EOF' ||
import json, sys
metered = [json.loads(l) for l in open(sys.argv[1])]
unmetered = [json.loads(l) for l in open(sys.argv[2])]
want = {"api": "openai", "name": "gpt-4o-mini", "input_tokens": 12,
        "output_tokens": int(sys.argv[3]), "cached_tokens": 0}
lines = [l for l in metered if "model" in l]
if len(lines) != 1 or {k: lines[0]["model"].get(k) for k in want} != want or lines[0]["model"].get("cost_usd") is None:
    sys.exit(f"metered egress lines: {metered}")
if any("model" in l for l in unmetered):
    sys.exit(f"an unmetered egress line has a model object: {unmetered}")
print(json.dumps(lines[0]["model"]))
EOF
  die "the egress check failed: $(cat "$TMP/model-line.json")"
log "metered line: $(cat "$TMP/model-line.json")"

# ------------------------------------------------------------------------------------------
# 4. The runs: per round each variant in turn (the order alternating), the leasegate's CPU
#    time read from /proc before and after each.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
load() { # load VARIANT CONCURRENCY SECONDS OUT: streamed calls through VARIANT's leasegate
  "$H" https-load --proxy 127.0.0.1:${PORT[$1]} --target origin.test:$ORIGIN_HTTPS \
    --ca "$TMP/ca-$1/ca.pem" --auth "${AUTH[$1]}" --path "$CALL_PATH" --body-file "$TMP/body.json" \
    --expect-bytes "$EXPECT" --concurrency "$2" --threads 1 --duration "$3" \
    >"$4" 2>"$4.err" || log "$1 failed: $(cat "$4.err")"
}
run_one() { # run_one ROUND VARIANT
  local r=$1 v=$2 out="$RUNS/r$1_$2.json" t0 t1
  t0=$(cpu_ticks "${PID[$v]}")
  load "$v" "$CONC" "$DURATION" "$out.load"
  t1=$(cpu_ticks "${PID[$v]}")
  python3 - "$out.load" "$((t1 - t0))" "$(getconf CLK_TCK)" >"$out" <<'EOF'
import json, sys
run = json.load(open(sys.argv[1]))
run["cpu_s"] = int(sys.argv[2]) / int(sys.argv[3])
print(json.dumps(run))
EOF
  for name in "${!PID[@]}"; do
    kill -0 "${PID[$name]}" 2>/dev/null || die "$name died during $v (round $r); see $TMP/$name.err"
  done
  sleep 1
}
for r in $(seq "$ROUNDS"); do
  order=("${VARIANTS[@]}")
  ((r % 2 == 0)) && order=("${VARIANTS[1]}" "${VARIANTS[0]}")
  for v in "${order[@]}"; do
    log "round $r/$ROUNDS: $v"
    run_one "$r" "$v"
  done
done
sleep 0.5

# Every timed call through the metered leasegate must be on its egress log, metered.
METER_CHECK=$(python3 - "$TMP/egress-metered.jsonl" "$TOKENS" <<'EOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
n = int(sys.argv[2])
full = sum(1 for l in lines if l.get("model", {}).get("output_tokens") == n)
unmetered = sum(1 for l in lines if "unmetered" in l.get("model", {}))
print(f"{full} {unmetered} {len(lines)}")
EOF
)
LG_ERRLINES=$(cat "$TMP/metered.err" "$TMP/unmetered.err" | grep -c . || true)

# ------------------------------------------------------------------------------------------
# 4b. Instructions per answer (INSTRUCTIONS=1, the default where valgrind is installed): each
#     leasegate again under callgrind, counting only while one connection streams answers for
#     INSTR_DURATION s (after a warm-up). Exact where CPU time is noisy: the proxy's user-space
#     instructions per answer. The kernel's share of the CPU (the same bytes, reads and writes
#     in both) is not in it: it would only dilute the ratio.
INSTR_OUT="$RUNS/instructions.txt"
: >"$INSTR_OUT"
if [[ $INSTRUCTIONS == 1 ]]; then
  for v in "${VARIANTS[@]}"; do
    stop_pid "$v"
    log "instructions: $v under callgrind (${INSTR_DURATION} s)"
    start_lg "$v" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$TMP/callgrind-$v.out"
    load "$v" 1 3 "$RUNS/instr-warm-$v.json"
    callgrind_control -i on "${PID[$v]}" >/dev/null
    load "$v" 1 "$INSTR_DURATION" "$RUNS/instr-$v.json"
    callgrind_control -i off "${PID[$v]}" >/dev/null
    callgrind_control -d "${PID[$v]}" >/dev/null # written to callgrind-$v.out.1
    stop_pid "$v"
    ir=$(awk '/^totals:/ { print $2; exit }' "$TMP/callgrind-$v.out.1")
    n=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["requests"])' "$RUNS/instr-$v.json")
    echo "$v ${ir:-0} ${n:-0}" >>"$INSTR_OUT"
  done
fi

# ------------------------------------------------------------------------------------------
# 5. The report: the section between the markers in OUT_MD, replaced (or appended).
ELAPSED=$(($(date +%s) - START_EPOCH))
describe_machine
python3 "$HERE/metered_report.py" --runs "$RUNS" --out-md "$OUT_MD" \
  --rounds "$ROUNDS" --duration "$DURATION" --conc "$CONC" --tokens "$TOKENS" --quick "$QUICK" \
  --answer-bytes "$EXPECT" --meter-check "$METER_CHECK" --model-line "$(cat "$TMP/model-line.json")" \
  --meta "date=$(date -u '+%Y-%m-%d %H:%M UTC')" --meta "elapsed=$((ELAPSED / 60)) min $((ELAPSED % 60)) s" \
  --meta "machine=$(nproc) cores, $CPU, $MEM, Linux $(uname -r)" \
  --meta "leasegate=git $REV (\`$PROFILE\` build)" \
  --meta "command=$COMMAND_LINE" --meta "lg_errlines=$LG_ERRLINES" \
  --instructions "$INSTR_OUT" --instr-duration "$INSTR_DURATION"
log "wrote the metered section of $OUT_MD"
