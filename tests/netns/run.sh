#!/usr/bin/env bash
# Network-boundary test for leasegate, with real Linux network namespaces.
#
#   agent (10.203.1.2) --veth-- gate (10.203.1.1 | 10.203.2.1) --veth-- origin (10.203.2.2)
#
# The gate does not forward IP packets, so the agent's only way to the origin is leasegate,
# listening on 10.203.1.1:3128 inside the gate namespace. Every packet this script sends goes
# to loopback or to an address inside the namespaces it creates (10.203.0.0/16 only).
#
# Usage: tests/netns/run.sh            (as root, on Linux; skips otherwise, fails under CI=true)
#        LEASEGATE_BIN=path/to/leasegate tests/netns/run.sh
#
# Output: one `ok - ...` / `not ok - ...` line per check, diagnostics as `# ...` lines, and a
# final `N passed, M failed` line; exit status 1 if anything failed, 2 on a setup error.
set -euo pipefail

caller_pwd=$PWD
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/../.." && pwd)
cd "$repo_root"

# Under CI=true nothing passes by skipping: a missing precondition fails the run.
skip() {
    if [[ "${CI:-}" == true ]]; then
        echo "error: the netns test cannot run: $* (CI=true)" >&2
        exit 2
    fi
    echo "SKIPPED netns test: $*"
    exit 0
}

# ---- preconditions: skip (exit 0; under CI=true fail) when this machine cannot run the test -
[[ "$(uname -s)" == Linux ]] || skip "not Linux ($(uname -s))"
[[ "$(id -u)" -eq 0 ]] || skip "not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
IP=$(command -v ip || true)
[[ -z "$IP" && -x /usr/sbin/ip ]] && IP=/usr/sbin/ip
[[ -z "$IP" && -x /sbin/ip ]] && IP=/sbin/ip
[[ -n "$IP" ]] || skip "'ip' (iproute2) not found"
command -v curl >/dev/null || skip "curl not found"
PYTHON=$(command -v python3 || true)
[[ -n "$PYTHON" ]] || skip "python3 not found"

# ---- the binary under test ------------------------------------------------------------------
if [[ -n "${LEASEGATE_BIN:-}" ]]; then
    bin=$LEASEGATE_BIN
    if [[ "$bin" != /* ]]; then
        if [[ -e "$caller_pwd/$bin" ]]; then bin="$caller_pwd/$bin"; else bin="$repo_root/$bin"; fi
    fi
elif [[ -x target/release/leasegate && -x target/debug/leasegate ]]; then
    # Both profiles built: take the newer one, so a stale release build is not tested by mistake.
    if [[ target/release/leasegate -nt target/debug/leasegate ]]; then
        bin="$repo_root/target/release/leasegate"
    else
        bin="$repo_root/target/debug/leasegate"
    fi
elif [[ -x target/release/leasegate ]]; then
    bin="$repo_root/target/release/leasegate"
else
    bin="$repo_root/target/debug/leasegate"
fi
if [[ ! -x "$bin" ]]; then
    echo "error: leasegate binary not found or not executable: $bin (build it, or set LEASEGATE_BIN)" >&2
    exit 2
fi
if ! "$bin" serve --help >/dev/null 2>&1; then
    echo "error: $bin has no working 'serve' subcommand (stale build? set LEASEGATE_BIN)" >&2
    exit 2
fi

# No proxy settings from the environment may leak into the curls below.
unset http_proxy HTTP_PROXY https_proxy HTTPS_PROXY all_proxy ALL_PROXY no_proxy NO_PROXY || true

# ---- state and cleanup ----------------------------------------------------------------------
AGENT="lg-agent-$$"
GATE="lg-gate-$$"
ORIGIN="lg-origin-$$"
created_ns=()
pids=()
DIR=""

# alive PID: is our child still running? (kill -0 also succeeds for an unreaped zombie)
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ "${stat:0:1}" != Z ]]
}

cleanup() {
    local rc=$?
    set +e
    trap - EXIT INT TERM HUP
    local pid i
    for pid in ${pids[@]+"${pids[@]}"}; do kill -TERM "$pid" 2>/dev/null; done
    for pid in ${pids[@]+"${pids[@]}"}; do
        for i in 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20; do
            alive "$pid" || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
    done
    # Anything still running inside our namespaces would keep them alive after `netns del`.
    local ns
    for ns in ${created_ns[@]+"${created_ns[@]}"}; do
        for pid in $("$IP" netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    done
    # Deleting a namespace also destroys the veth ends that live in it.
    for ns in ${created_ns[@]+"${created_ns[@]}"}; do "$IP" netns del "$ns" 2>/dev/null; done
    [[ -n "$DIR" && -d "$DIR" ]] && rm -rf -- "$DIR"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

in_ns() { local ns=$1; shift; "$IP" netns exec "$ns" "$@"; }

setup_fail() {
    echo "error: setup failed: $*" >&2
    for f in "$DIR"/*.log; do
        [[ -s "$f" ]] || continue
        echo "# --- $(basename "$f") ---" >&2
        tail -n 20 "$f" | sed 's/^/# /' >&2
    done
    exit 2
}

# ---- namespaces -----------------------------------------------------------------------------
if ! "$IP" netns add "$AGENT" 2>/dev/null; then
    skip "'ip netns add' failed (no permission to create network namespaces here?)"
fi
created_ns+=("$AGENT")
"$IP" netns add "$GATE" || setup_fail "ip netns add $GATE"
created_ns+=("$GATE")
"$IP" netns add "$ORIGIN" || setup_fail "ip netns add $ORIGIN"
created_ns+=("$ORIGIN")

DIR=$(mktemp -d "${TMPDIR:-/tmp}/leasegate-netns.XXXXXX")

# Veth pairs are created inside the namespaces (ip -n), so no device ever appears in the
# host namespace and fixed names cannot collide between parallel runs.
if ! "$IP" -n "$AGENT" link add eth0 type veth peer name to-agent netns "$GATE" 2>"$DIR/veth.log"; then
    skip "cannot create veth pairs: $(head -n1 "$DIR/veth.log")"
fi
"$IP" -n "$ORIGIN" link add eth0 type veth peer name to-origin netns "$GATE" ||
    setup_fail "veth gate<->origin"

for ns in "$AGENT" "$GATE" "$ORIGIN"; do
    "$IP" -n "$ns" link set lo up
    # No IPv6 on the veths: keeps link-local addresses out of the picture (best effort).
    in_ns "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 >/dev/null 2>&1 || true
    in_ns "$ns" sysctl -qw net.ipv6.conf.default.disable_ipv6=1 >/dev/null 2>&1 || true
done

"$IP" -n "$AGENT" addr add 10.203.1.2/24 dev eth0
"$IP" -n "$AGENT" link set eth0 up
"$IP" -n "$GATE" addr add 10.203.1.1/24 dev to-agent
"$IP" -n "$GATE" addr add 10.203.2.1/24 dev to-origin
"$IP" -n "$GATE" link set to-agent up
"$IP" -n "$GATE" link set to-origin up
"$IP" -n "$ORIGIN" addr add 10.203.2.2/24 dev eth0
"$IP" -n "$ORIGIN" link set eth0 up
# Routes both ways through the gate, so only the gate's forwarding switch stands between
# agent and origin (the route is there; forwarding is what is blocked).
"$IP" -n "$AGENT" route add default via 10.203.1.1
"$IP" -n "$ORIGIN" route add default via 10.203.2.1

set_forwarding() {
    in_ns "$GATE" sysctl -qw "net.ipv4.ip_forward=$1" >/dev/null 2>&1 ||
        in_ns "$GATE" sh -c "echo $1 > /proc/sys/net/ipv4/ip_forward"
    local now
    now=$(in_ns "$GATE" cat /proc/sys/net/ipv4/ip_forward)
    [[ "$now" == "$1" ]] || setup_fail "net.ipv4.ip_forward in $GATE is $now, wanted $1"
}
set_forwarding 0

# ---- origin: a tiny HTTP server -------------------------------------------------------------
BODY="hello from the leasegate netns origin $$"
mkdir -p "$DIR/www"
printf '%s\n' "$BODY" >"$DIR/www/index.html"
# Not `python3 -m http.server --bind`: its server_bind() calls socket.getfqdn(), a reverse DNS
# query that would leave for the system resolver (and stall ~10 s without a route to it).
cat >"$DIR/origin.py" <<'EOF'
import http.server, socketserver, sys

class Server(http.server.ThreadingHTTPServer):
    def server_bind(self):
        socketserver.TCPServer.server_bind(self)  # no getfqdn() lookup
        self.server_name, self.server_port = self.server_address[:2]

handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=sys.argv[1], **kw)
Server(("10.203.2.2", 8080), handler).serve_forever()
EOF
# Background jobs run `ip netns exec` directly, never through a shell function: that way $! is
# the server itself (ip execs into it), not a subshell whose death would orphan the server.
"$IP" netns exec "$ORIGIN" "$PYTHON" "$DIR/origin.py" "$DIR/www" >"$DIR/origin.log" 2>&1 &
pids+=($!)

up=0
for _ in $(seq 1 50); do
    if in_ns "$ORIGIN" curl -s --noproxy '*' --max-time 1 -o /dev/null http://10.203.2.2:8080/; then
        up=1
        break
    fi
    sleep 0.2
done
[[ $up == 1 ]] || setup_fail "origin HTTP server did not come up on 10.203.2.2:8080"

# ---- leasegate in the gate namespace --------------------------------------------------------
"$bin" keygen --out "$DIR/key" >"$DIR/keygen.log" 2>&1 || setup_fail "leasegate keygen"
"$bin" issue --journal "$DIR/journal.jsonl" --key-file "$DIR/key" \
    --allow-host '*.test' --deny-host denied.test >"$DIR/issue.out" 2>"$DIR/issue.log" ||
    setup_fail "leasegate issue"
LEASE=$(sed -n 1p "$DIR/issue.out")
[[ "$LEASE" =~ ^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$ ]] ||
    setup_fail "leasegate issue printed no lease id (got '$LEASE')"

"$IP" netns exec "$GATE" "$bin" serve \
    --listen 10.203.1.1:3128 --admin 127.0.0.1:3129 \
    --journal "$DIR/journal.jsonl" --key-file "$DIR/key" \
    --egress-log "$DIR/egress.jsonl" \
    --resolve origin.test=10.203.2.2 --resolve denied.test=10.203.2.2 \
    --allow-private 10.203.2.0/24 --forward-ports 8080 \
    >"$DIR/serve.log" 2>&1 &
serve_pid=$!
pids+=("$serve_pid")

up=0
for _ in $(seq 1 50); do   # at most ~10 s
    alive "$serve_pid" || setup_fail "leasegate serve exited early"
    if in_ns "$GATE" curl -s --noproxy '*' --max-time 1 -o /dev/null http://127.0.0.1:3129/healthz; then
        up=1
        break
    fi
    sleep 0.2
done
[[ $up == 1 ]] || setup_fail "leasegate did not answer /healthz on 127.0.0.1:3129 within 10 s"

# ---- checks ---------------------------------------------------------------------------------
echo "# leasegate binary: $bin"
echo "# namespaces: $AGENT $GATE $ORIGIN; lease: $LEASE"
passed=0
failed=0
ok() { echo "ok - $*"; passed=$((passed + 1)); }
not_ok() { echo "not ok - $*"; failed=$((failed + 1)); }
diag() { sed 's/^/#   /'; }

PROXY="http://agent:$LEASE@10.203.1.1:3128"

# proxied NAME URL: request URL through leasegate from the agent namespace; sets
# code (HTTP status, 000 if none), body, refusal (X-Leasegate-Refusal value) and crc.
proxied() {
    local name=$1 url=$2
    crc=0
    code=$(in_ns "$AGENT" curl -sS --max-time 5 -x "$PROXY" -o "$DIR/$name.body" \
        -D "$DIR/$name.headers" -w '%{http_code}' "$url" 2>"$DIR/$name.err") || crc=$?
    body=$(cat "$DIR/$name.body" 2>/dev/null || true)
    refusal=$(tr -d '\r' <"$DIR/$name.headers" 2>/dev/null |
        sed -n 's/^[Xx]-[Ll]easegate-[Rr]efusal:[[:space:]]*//p' | tail -n1 || true)
}

# wait_for_json FILE PYEXPR: poll (up to ~3 s) until some JSON line r of FILE satisfies PYEXPR.
# Both logs are written asynchronously, so a line may trail the response a little.
wait_for_json() {
    local file=$1 expr=$2
    for _ in $(seq 1 30); do
        if "$PYTHON" - "$file" "$expr" <<'EOF'
import json, sys
path, expr = sys.argv[1], sys.argv[2]
try:
    lines = open(path, encoding="utf-8").read().splitlines()
except OSError:
    sys.exit(1)
for line in lines:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if isinstance(r, dict) and eval(expr, {}, {"r": r}):
        sys.exit(0)
sys.exit(1)
EOF
        then return 0; fi
        sleep 0.1
    done
    return 1
}

# 0. control: with forwarding switched on, the agent does reach the origin directly, so the
#    failure in check 1 is the gate's forwarding switch and not a broken topology.
set_forwarding 1
if out=$(in_ns "$AGENT" curl -sS --noproxy '*' --max-time 3 http://10.203.2.2:8080/ 2>&1) &&
    [[ "$out" == "$BODY" ]]; then
    ok "control: with ip_forward=1 in the gate the agent reaches the origin directly"
else
    not_ok "control: with ip_forward=1 in the gate the agent reaches the origin directly"
    printf '%s\n' "$out" | diag || true
fi
set_forwarding 0

# 1. no direct egress
if out=$(in_ns "$AGENT" curl -sS --noproxy '*' --max-time 3 http://10.203.2.2:8080/ 2>&1); then
    not_ok "direct egress from the agent to 10.203.2.2:8080 fails (ip_forward=0 in the gate)"
    printf '%s\n' "$out" | diag || true
else
    ok "direct egress from the agent to 10.203.2.2:8080 fails (ip_forward=0 in the gate)"
fi

# 2. allowed host through leasegate
proxied allowed http://origin.test:8080/
if [[ $crc == 0 && "$code" == 200 && "$body" == "$BODY" ]] &&
    wait_for_json "$DIR/egress.jsonl" \
        "r.get('verdict') == 'allow' and r.get('host') == 'origin.test' and r.get('lease_id') == '$LEASE'"; then
    ok "through leasegate origin.test answers 200 with the origin's body and an allow egress line"
else
    not_ok "through leasegate origin.test answers 200 with the origin's body and an allow egress line"
    { echo "curl exit $crc, status $code, body: $body"; cat "$DIR/allowed.err"; cat "$DIR/egress.jsonl"; } 2>/dev/null | diag || true
fi

# 3. denied host: 403 host-denied, and the lease is revoked in the journal
proxied denied http://denied.test:8080/
if [[ $crc == 0 && "$code" == 403 && "$refusal" == host-denied && "$body" != *"$BODY"* ]] &&
    wait_for_json "$DIR/journal.jsonl" \
        "r.get('event') == 'revoked' and r.get('lease_id') == '$LEASE'"; then
    ok "denied.test is refused (403, x-leasegate-refusal: host-denied) and the lease is revoked in the journal"
else
    not_ok "denied.test is refused (403, x-leasegate-refusal: host-denied) and the lease is revoked in the journal"
    { echo "curl exit $crc, status $code, refusal '$refusal', body: $body"; cat "$DIR/denied.err";
      grep '"revoked"' "$DIR/journal.jsonl"; } 2>/dev/null | diag || true
fi

# 4. a revoked lease opens nothing
proxied after http://origin.test:8080/
if [[ $crc == 0 && "$code" == 403 && "$refusal" == lease-revoked && "$body" != *"$BODY"* ]]; then
    ok "after the revocation origin.test is refused (403, x-leasegate-refusal: lease-revoked)"
else
    not_ok "after the revocation origin.test is refused (403, x-leasegate-refusal: lease-revoked)"
    { echo "curl exit $crc, status $code, refusal '$refusal', body: $body"; cat "$DIR/after.err"; } 2>/dev/null | diag || true
fi

# 5. the agent reaches nothing in the gate namespace but 10.203.1.1:3128
# tcp_open NS HOST PORT: does a TCP connect from NS to HOST:PORT succeed within 2 s?
tcp_open() {
    in_ns "$1" timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$2" "$3" 2>/dev/null
}
ports="3128 3129 8080"
if command -v ss >/dev/null; then
    # every TCP port anything in the gate namespace listens on, whatever the address
    ports="$ports $(in_ns "$GATE" ss -Htln 2>/dev/null | awk '{n=split($4,a,":"); print a[n]}' | sort -un | tr '\n' ' ')"
fi
ports=$(tr ' ' '\n' <<<"$ports" | grep -E '^[0-9]+$' | sort -un | tr '\n' ' ')
reached=()
probed=0
for addr in 10.203.1.1 10.203.2.1; do
    for port in $ports; do
        [[ "$addr:$port" == 10.203.1.1:3128 ]] && continue
        probed=$((probed + 1))
        if tcp_open "$AGENT" "$addr" "$port"; then reached+=("$addr:$port"); fi
    done
done
if ! tcp_open "$AGENT" 10.203.1.1 3128; then
    not_ok "the agent reaches the gate only on 10.203.1.1:3128 (3128 itself did not connect)"
elif ((${#reached[@]})); then
    not_ok "the agent reaches the gate only on 10.203.1.1:3128 (also reached: ${reached[*]})"
else
    ok "the agent reaches the gate only on 10.203.1.1:3128 ($probed other address:port pairs refused, admin 3129 included)"
fi

echo "$passed passed, $failed failed"
((failed == 0)) || exit 1
exit 0
