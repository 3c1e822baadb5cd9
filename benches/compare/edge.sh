#!/usr/bin/env bash
# The edge's cost per call: a short streamed answer (TOKENS one-token chunks, 20) through
# leasegate terminating the origin's host, in five leasegate processes that differ in one thing
# each. **unread**: the host's secret has no `meter` and the host is no MCP server (the request
# is relayed unread, the baseline); **mcp**: the host is an MCP server (`--mcp-server`), the
# request a JSON-RPC `tools/call` read, judged along the chain (`allow.tools`) and on the
# egress line; **steps**: the same with `budget.steps` on the lease (the step reserved and
# kept in the spend log); **metered**: the secret has `meter = "openai"` (the request read for
# its bound, the answer for its usage); **reserved**: the same with `budget.tokens` (the bound
# reserved along the chain and kept in the spend log, fsynced, before the call goes out).
# Per variant: calls/s, leasegate's CPU per call (user+sys from /proc/PID/stat), call p50, and
# instructions per call under callgrind; each ratio to unread. Before anything is timed, each
# answer is compared with the origin's and each egress line must show what its variant reads.
# Replaces the "The edge's cost per call" section of benches/compare/RESULTS.md.
#
#   benches/compare/edge.sh              # 3 rounds, 6 s per run (~4 min + builds)
#   QUICK=1 benches/compare/edge.sh      # smoke test: 1 round, 2 s runs
#
# Knobs (environment): ROUNDS (3), DURATION (6), CONC (4), TOKENS (20), QUICK=1, PROFILE
# (release), SKIP_BUILD=1, KEEP_TMP=1, OUT_MD (RESULTS.md here), INSTRUCTIONS (1 where valgrind
# is installed), INSTR_DURATION (10).
#
# Every address used is on 127.0.0.1; needs python3 and curl, not root.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
COMMAND_LINE="$( { env | grep -E '^(QUICK|ROUNDS|DURATION|CONC|TOKENS|PROFILE|INSTRUCTIONS|INSTR_DURATION)=' || true; } | sort | tr '\n' ' ')benches/compare/edge.sh"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then ROUNDS=${ROUNDS:-1} DURATION=${DURATION:-2} INSTR_DURATION=${INSTR_DURATION:-3}; fi
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-6}
CONC=${CONC:-4}
TOKENS=${TOKENS:-20}
PROFILE=${PROFILE:-release}
INSTRUCTIONS=${INSTRUCTIONS:-$(command -v valgrind >/dev/null && echo 1 || echo 0)}
INSTR_DURATION=${INSTR_DURATION:-10}
OUT_MD=${OUT_MD:-$HERE/RESULTS.md}

# Ports apart from run.sh's, brokered.sh's and metered.sh's.
ORIGIN_HTTP=18390
ORIGIN_HTTPS=18753
VARIANTS=(unread mcp steps metered reserved)
declare -A PORT=([unread]=13440 [mcp]=13442 [steps]=13444 [metered]=13446 [reserved]=13448)
CALL_PATH="/v1/chat/completions?tokens=$TOKENS"

# shellcheck source=lib.sh
. "$HERE/lib.sh"
for tool in curl python3; do command -v $tool >/dev/null || die "$tool is needed"; done

START_EPOCH=$(date +%s)
TMP=$(mktemp -d /tmp/leasegate-edge.XXXXXX)
RUNS="$TMP/runs"
mkdir -p "$RUNS"

trap cleanup EXIT
trap 'exit 130' INT TERM
ports_free $ORIGIN_HTTP $ORIGIN_HTTPS "${PORT[@]}"

# ------------------------------------------------------------------------------------------
# 1. Build leasegate and the harness (as metered.sh does).
build_binaries

# ------------------------------------------------------------------------------------------
# 2. The origin, then a leasegate per variant: its secret, its lease, its flags.
"$H" origin --http 127.0.0.1:$ORIGIN_HTTP --https 127.0.0.1:$ORIGIN_HTTPS --cert-dir "$TMP/certs" \
  --threads 1 >"$TMP/origin.out" 2>"$TMP/origin.err" &
PID[origin]=$!
wait_port $ORIGIN_HTTPS origin
ORIGIN_CA="$TMP/certs/ca.pem"

cat >"$TMP/body-chat.json" <<'EOF'
{"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Count to twenty."}]}
EOF
cat >"$TMP/body-mcp.json" <<'EOF'
{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"search","arguments":{"query":"count to twenty"}}}
EOF
cat >"$TMP/prices.toml" <<'EOF'
[[model]]
name = "gpt-4o-mini*"
input_per_million = 0.15
output_per_million = 0.60
EOF
"$LG" keygen --out "$TMP/lease.key" >/dev/null
declare -A AUTH=() BODY=() FLAGS=()
for v in "${VARIANTS[@]}"; do
  BODY[$v]="$TMP/body-chat.json"
  FLAGS[$v]=""
  lease_flags=()
  case $v in
    mcp) BODY[$v]="$TMP/body-mcp.json"; lease_flags=(--tool bench/search) ;;
    steps) BODY[$v]="$TMP/body-mcp.json"; lease_flags=(--tool bench/search --steps 1000000000) ;;
    reserved) lease_flags=(--tokens 1000000000000) ;;
  esac
  [[ $v == mcp || $v == steps ]] && FLAGS[$v]="--mcp-server bench=https://origin.test:$ORIGIN_HTTPS/mcp"
  "$LG" ca init --dir "$TMP/ca-$v" --host origin.test >/dev/null
  {
    printf '[[secret]]\nid = "bench"\nhosts = ["origin.test"]\nheader = "Authorization"\n'
    printf 'format = "Bearer {value}"\nenv = "BENCH_TOKEN"\nagents = ["bench"]\nenv_name = "BENCH_API_KEY"\n'
    [[ $v == metered || $v == reserved ]] && printf 'meter = "openai"\n'
  } >"$TMP/secrets-$v.toml"
  lease=$("$LG" issue --journal "$TMP/journal-$v.jsonl" --key-file "$TMP/lease.key" \
    --allow-host origin.test --ttl 4h --name bench "${lease_flags[@]}" --print id)
  AUTH[$v]="Basic $(printf 'agent:%s' "$lease" | base64 -w0)"
done
start_lg() { # start_lg VARIANT [WRAPPER ...]: leasegate of VARIANT on its port, under WRAPPER
  local v=$1; shift
  # shellcheck disable=SC2086 # FLAGS holds whole flags, split on purpose
  BENCH_TOKEN=bench-token RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN_HTTPS \
    "$@" "$LG" serve --listen 127.0.0.1:${PORT[$v]} --admin 127.0.0.1:$((PORT[$v] + 1)) \
    --journal "$TMP/journal-$v.jsonl" --key-file "$TMP/lease.key" \
    --secrets "$TMP/secrets-$v.toml" --ca-dir "$TMP/ca-$v" --upstream-ca "$ORIGIN_CA" \
    --prices "$TMP/prices.toml" ${FLAGS[$v]} \
    --resolve origin.test=127.0.0.1 --allow-private 127.0.0.1/32 \
    --egress-log "$TMP/egress-$v.jsonl" --drain-timeout 2s \
    >>"$TMP/$v.out" 2>>"$TMP/$v.err" &
  PID[$v]=$!
  wait_port "${PORT[$v]}" "$v"
}
for v in "${VARIANTS[@]}"; do start_lg "$v"; done

# ------------------------------------------------------------------------------------------
# 3. Sanity, before anything is timed: each answer is the origin's, byte for byte, and each
#    egress line shows what its variant reads (an mcp object with the tool; a model object;
#    neither on unread).
call() { # call OUT BODY [curl args...]: one call
  local out=$1 body=$2; shift 2
  curl -sf -X POST -H 'content-type: application/json' --data-binary @"$body" \
    "$@" "https://origin.test:$ORIGIN_HTTPS$CALL_PATH" -o "$out"
}
call "$TMP/answer-direct" "$TMP/body-chat.json" --cacert "$ORIGIN_CA" \
  --resolve "origin.test:$ORIGIN_HTTPS:127.0.0.1" || die "the origin did not answer $CALL_PATH"
EXPECT=$(wc -c <"$TMP/answer-direct")
for v in "${VARIANTS[@]}"; do
  call "$TMP/answer-$v" "${BODY[$v]}" --cacert "$TMP/ca-$v/ca.pem" -x "http://127.0.0.1:${PORT[$v]}" \
    --proxy-header "Proxy-Authorization: ${AUTH[$v]}" || die "the call through $v failed"
  cmp -s "$TMP/answer-direct" "$TMP/answer-$v" || die "the answer through $v differs from the origin's"
done
sleep 0.5 # the egress line is written as the exchange ends
python3 - "$TMP" <<'EOF' || die "the egress check failed"
import json, sys
tmp = sys.argv[1]
def inside(v):
    return [l for l in map(json.loads, open(f"{tmp}/egress-{v}.jsonl")) if l["kind"] == "https"]
for v in ["unread", "mcp", "steps", "metered", "reserved"]:
    lines = inside(v)
    assert len(lines) == 1 and lines[0]["status"] == 200, (v, lines)
    line = lines[0]
    mcp, model = line.get("mcp"), line.get("model")
    if v in ("mcp", "steps"):
        assert model is None and mcp["server"] == "bench" and mcp["messages"][0]["tool"] == "search" and mcp["steps"] == 1, (v, line)
    elif v in ("metered", "reserved"):
        assert mcp is None and model["output_tokens"] > 0 and "unmetered" not in model, (v, line)
    else:
        assert mcp is None and model is None, (v, line)
EOF
for v in steps reserved; do
  spent=$(find "$TMP" -maxdepth 1 -name "journal-$v.jsonl.spent" -size +0 | wc -l)
  [[ $spent == 1 ]] || die "$v kept no spend log"
done

# ------------------------------------------------------------------------------------------
# 4. The runs: per round each variant in turn (the order rotating), the leasegate's CPU time
#    read from /proc before and after each.
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
load() { # load VARIANT CONCURRENCY SECONDS OUT
  "$H" https-load --proxy 127.0.0.1:${PORT[$1]} --target origin.test:$ORIGIN_HTTPS \
    --ca "$TMP/ca-$1/ca.pem" --auth "${AUTH[$1]}" --path "$CALL_PATH" --body-file "${BODY[$1]}" \
    --expect-bytes "$EXPECT" --concurrency "$2" --threads 1 --duration "$3" \
    >"$4" 2>"$4.err" || log "$1 failed: $(cat "$4.err")"
}
for r in $(seq "$ROUNDS"); do
  n=${#VARIANTS[@]}
  for i in $(seq 0 $((n - 1))); do
    v=${VARIANTS[$(((i + r) % n))]}
    log "round $r/$ROUNDS: $v"
    t0=$(cpu_ticks "${PID[$v]}")
    load "$v" "$CONC" "$DURATION" "$RUNS/r${r}_$v.load"
    t1=$(cpu_ticks "${PID[$v]}")
    echo "$((t1 - t0))" >"$RUNS/r${r}_$v.ticks"
    kill -0 "${PID[$v]}" 2>/dev/null || die "$v died (round $r); see $TMP/$v.err"
    sleep 1
  done
done

# ------------------------------------------------------------------------------------------
# 4b. Instructions per call (INSTRUCTIONS=1): each leasegate again under callgrind, counting
#     only while one connection makes calls for INSTR_DURATION s, after a warm-up.
if [[ $INSTRUCTIONS == 1 ]]; then
  for v in "${VARIANTS[@]}"; do
    stop_pid "$v"
    log "instructions: $v under callgrind (${INSTR_DURATION} s)"
    start_lg "$v" valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$TMP/callgrind-$v.out"
    load "$v" 1 2 "$RUNS/instr-warm-$v.json"
    callgrind_control -i on "${PID[$v]}" >/dev/null
    load "$v" 1 "$INSTR_DURATION" "$RUNS/instr-$v.load"
    callgrind_control -i off "${PID[$v]}" >/dev/null
    callgrind_control -d "${PID[$v]}" >/dev/null # written to callgrind-$v.out.1
    stop_pid "$v"
    awk '/^totals:/ { print $2; exit }' "$TMP/callgrind-$v.out.1" >"$RUNS/instr-$v.ir"
  done
fi

# ------------------------------------------------------------------------------------------
# 5. The report: the section between the markers in OUT_MD, replaced (or appended).
ELAPSED=$(($(date +%s) - START_EPOCH))
describe_machine
META="$ROUNDS|$DURATION|$CONC|$TOKENS|$EXPECT|$(getconf CLK_TCK)|$INSTR_DURATION"
META="$META|$(nproc) cores, $CPU, $MEM, Linux $(uname -r)|git $REV (\`$PROFILE\` build)"
META="$META|$(date -u '+%Y-%m-%d %H:%M UTC')|$((ELAPSED / 60)) min $((ELAPSED % 60)) s|$COMMAND_LINE"
PYTHONPATH="$HERE" python3 "$HERE/edge_report.py" "$RUNS" "$OUT_MD" "$META"
log "wrote the edge section of $OUT_MD"
