#!/usr/bin/env bash
# Brokered HTTPS side by side: kept-alive HTTPS requests through leasegate terminating a host
# and putting a secret in, leasegate blind-tunnelling to the same origin, mitmproxy (mitmdump
# with a one-line addon setting Authorization) and Squid with ssl-bump (request_header_add),
# against the origin direct; plus the cost of a new connection (TLS handshake) through the
# terminating leasegate with and without TLS session resumption. Replaces the "Brokered HTTPS"
# section of benches/compare/RESULTS.md. See README.md here.
#
#   benches/compare/brokered.sh              # 3 rounds, 8 s per run (~8 min + builds)
#   QUICK=1 benches/compare/brokered.sh      # smoke test: 1 round, 2 s runs
#
# Knobs (environment): ROUNDS (3), DURATION (8), CONC (32), QUICK=1, PROFILE (release),
# SKIP_BUILD=1, KEEP_TMP=1, OUT_MD (RESULTS.md here).
#
# Every address used is on 127.0.0.1. Runs as root (apt-get, squid's cache_effective_user, a
# mount namespace giving mitmproxy the origin's name).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
COMMAND_LINE="$( { env | grep -E '^(QUICK|ROUNDS|DURATION|CONC|PROFILE)=' || true; } | sort | tr '\n' ' ')benches/compare/brokered.sh"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then ROUNDS=${ROUNDS:-1} DURATION=${DURATION:-2}; fi
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-8}
CONC=${CONC:-32}
PROFILE=${PROFILE:-release}
OUT_MD=${OUT_MD:-$HERE/RESULTS.md}

# Ports apart from run.sh's, so that neither disturbs the other's leftovers.
ORIGIN_HTTP=18280
ORIGIN_HTTPS=18643
LG_PORT=13328
LG_ADMIN=13329
MITM_PORT=13330
SQUID_PORT=13331
# The value every proxy puts in; the origin's /auth route echoes what it received.
TOKEN="bench-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
VARIANTS=(direct lg-terminated lg-blind mitmproxy squid-bump)
HANDSHAKE_VARIANTS=(direct lg-terminated lg-blind)

# shellcheck source=lib.sh
. "$HERE/lib.sh"
[[ $(id -u) == 0 ]] || die "run as root (apt-get, squid's cache_effective_user, a mount namespace for mitmproxy)"

START_EPOCH=$(date +%s)
TMP=$(mktemp -d /tmp/leasegate-brokered.XXXXXX)
chmod 755 "$TMP" # squid drops to the proxy user and writes here
RUNS="$TMP/runs"
mkdir -p "$RUNS"

trap cleanup EXIT
trap 'exit 130' INT TERM
ports_free $ORIGIN_HTTP $ORIGIN_HTTPS $LG_PORT $LG_ADMIN $MITM_PORT $SQUID_PORT
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

# ------------------------------------------------------------------------------------------
# 1. Install what is missing: squid-openssl (Debian's squid has no ssl-bump), mitmproxy.
missing=()
command -v mitmdump >/dev/null || missing+=(mitmproxy)
[[ -x /usr/lib/squid/security_file_certgen ]] || missing+=(squid-openssl)
for tool in curl openssl python3 unshare; do
  command -v $tool >/dev/null || missing+=("$(case $tool in unshare) echo util-linux ;; *) echo $tool ;; esac)")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >"$TMP/apt.log" 2>&1 ||
    { cat "$TMP/apt.log" >&2; die "apt-get install failed"; }
  # A service the install started would share the CPU.
  service squid stop >/dev/null 2>&1 || true
fi

# ------------------------------------------------------------------------------------------
# 2. Build leasegate (release: the dist profile's fat LTO is a long build on a small machine;
#    PROFILE=dist for the shipped build) and the harness.
build_binaries

# ------------------------------------------------------------------------------------------
# 3. The origin (origin.test and blind.test: two names, one certificate), leasegate, mitmproxy
#    and Squid, each given the secret to put in.
printf '127.0.0.1 localhost\n127.0.0.1 origin.test blind.test\n' >"$TMP/hosts"
"$H" origin --http 127.0.0.1:$ORIGIN_HTTP --https 127.0.0.1:$ORIGIN_HTTPS --cert-dir "$TMP/certs" \
  --threads "$(nproc)" --backlog 4096 >"$TMP/origin.out" 2>"$TMP/origin.err" &
PID[origin]=$!
wait_port $ORIGIN_HTTPS origin
ORIGIN_CA="$TMP/certs/ca.pem"

# leasegate: a CA for origin.test, one header secret for it (every route) entitled to agent
# "bench", a lease of that agent allowing both names. blind.test has no secret: a blind tunnel.
"$LG" keygen --out "$TMP/lease.key" >/dev/null
"$LG" ca init --dir "$TMP/lgca" --host origin.test >/dev/null
cat >"$TMP/secrets.toml" <<EOF
[[secret]]
id = "bench"
hosts = ["origin.test"]
header = "Authorization"
format = "Bearer {value}"
env = "BENCH_TOKEN"
agents = ["bench"]
env_name = "BENCH_API_TOKEN"
EOF
LEASE_ID=$("$LG" issue --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
  --allow-host origin.test --allow-host blind.test --ttl 4h --name bench --print id)
LG_AUTH="Basic $(printf 'agent:%s' "$LEASE_ID" | base64 -w0)"
BENCH_TOKEN=$TOKEN RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN_HTTPS \
  "$LG" serve --listen 127.0.0.1:$LG_PORT --admin 127.0.0.1:$LG_ADMIN \
  --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
  --secrets "$TMP/secrets.toml" --ca-dir "$TMP/lgca" --upstream-ca "$ORIGIN_CA" \
  --resolve origin.test=127.0.0.1 --resolve blind.test=127.0.0.1 --allow-private 127.0.0.1/32 \
  --egress-log "$TMP/leasegate-egress.jsonl" --drain-timeout 2s \
  >"$TMP/leasegate.out" 2>"$TMP/leasegate.err" &
PID[leasegate]=$!
wait_port $LG_PORT leasegate

# mitmproxy: its own CA in confdir, the origin verified against its certificate, the header
# set by a one-line addon; it resolves with the system resolver, so it runs in a mount
# namespace with our hosts file over /etc/hosts (the machine's is not touched).
mkdir -p "$TMP/mitm"
printf 'def request(flow): flow.request.headers["Authorization"] = "Bearer %s"\n' "$TOKEN" >"$TMP/mitm-addon.py"
unshare --mount --propagation private -- sh -c "mount --bind '$TMP/hosts' /etc/hosts && exec mitmdump -q \
  --listen-host 127.0.0.1 --listen-port $MITM_PORT --set confdir='$TMP/mitm' \
  --set ssl_verify_upstream_trusted_ca='$ORIGIN_CA' -s '$TMP/mitm-addon.py'" \
  >"$TMP/mitmproxy.out" 2>"$TMP/mitmproxy.err" &
PID[mitmproxy]=$!
wait_port $MITM_PORT mitmproxy

# Squid with ssl-bump: a generated CA (EC P-256, like leasegate's), leaves made by
# security_file_certgen, every CONNECT bumped, the origin verified against its certificate.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
  -subj "/CN=brokered bench squid CA" -addext basicConstraints=critical,CA:TRUE \
  -addext keyUsage=critical,keyCertSign,cRLSign \
  -keyout "$TMP/squid-ca.key" -out "$TMP/squid-ca.pem" 2>"$TMP/openssl.err"
/usr/lib/squid/security_file_certgen -c -s "$TMP/ssl_db" -M 16MB >/dev/null
chown -R proxy "$TMP/ssl_db"
chmod 644 "$TMP/squid-ca.key" # read by the proxy user
touch "$TMP/squid-access.log" "$TMP/squid-cache.log"
chown proxy "$TMP/squid-access.log" "$TMP/squid-cache.log"
cat >"$TMP/squid.conf" <<EOF
http_port 127.0.0.1:$SQUID_PORT ssl-bump tls-cert=$TMP/squid-ca.pem tls-key=$TMP/squid-ca.key generate-host-certificates=on dynamic_cert_mem_cache_size=16MB
sslcrtd_program /usr/lib/squid/security_file_certgen -s $TMP/ssl_db -M 16MB
sslcrtd_children 4 startup=1 idle=1
ssl_bump bump all
tls_outgoing_options cafile=$ORIGIN_CA
request_header_add Authorization "Bearer $TOKEN" all
workers 1
pid_filename $TMP/squid.pid
coredump_dir $TMP
cache_effective_user proxy
hosts_file $TMP/hosts
acl allowed dstdomain origin.test
http_access allow allowed
http_access deny all
cache deny all
access_log stdio:$TMP/squid-access.log
cache_log $TMP/squid-cache.log
cache_store_log none
logfile_rotate 0
pinger_enable off
shutdown_lifetime 1 second
EOF
squid -N -f "$TMP/squid.conf" >"$TMP/squid-bump.out" 2>"$TMP/squid-bump.err" &
PID[squid-bump]=$!
wait_port $SQUID_PORT squid-bump
for _ in $(seq 100); do [[ -s $TMP/mitm/mitmproxy-ca-cert.pem ]] && break; sleep 0.1; done

# ------------------------------------------------------------------------------------------
# 4. What each variant is: proxy, CONNECT target, CA the client trusts, what /auth must say.
proxy_of() {
  case $1 in
    direct) echo direct ;;
    lg-*) echo 127.0.0.1:$LG_PORT ;;
    mitmproxy) echo 127.0.0.1:$MITM_PORT ;;
    squid-bump) echo 127.0.0.1:$SQUID_PORT ;;
  esac
}
target_of() { if [[ $1 == lg-blind ]]; then echo blind.test:$ORIGIN_HTTPS; else echo origin.test:$ORIGIN_HTTPS; fi; }
ca_of() {
  case $1 in
    direct | lg-blind) echo "$ORIGIN_CA" ;;
    lg-terminated) echo "$TMP/lgca/ca.pem" ;;
    mitmproxy) echo "$TMP/mitm/mitmproxy-ca-cert.pem" ;;
    squid-bump) echo "$TMP/squid-ca.pem" ;;
  esac
}
auth_of() { if [[ $1 == lg-* ]]; then echo "$LG_AUTH"; else echo none; fi; }
expected_auth() { case $1 in direct | lg-blind) echo "" ;; *) echo "Bearer $TOKEN" ;; esac; }

# Sanity, before anything is timed: each variant answers /auth over TLS it verifies, and the
# header is there exactly where a proxy puts it in (the harness's own check, fail-closed).
for v in "${VARIANTS[@]}"; do
  want=$(expected_auth "$v")
  "$H" https-load --proxy "$(proxy_of "$v")" --addr 127.0.0.1:$ORIGIN_HTTPS --target "$(target_of "$v")" \
    --ca "$(ca_of "$v")" --auth "$(auth_of "$v")" --path /auth --expect-bytes ${#want} \
    --concurrency 1 --duration 0.2 >"$TMP/sanity-$v.json" 2>"$TMP/sanity-$v.err" ||
    die "sanity $v: $(cat "$TMP/sanity-$v.err")"
  python3 - "$TMP/sanity-$v.json" "$v" <<'EOF' || die "sanity check failed for $v: $(cat "$TMP/sanity-$v.json")"
import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if r["requests"] > 0 and r["errors"] == 0 else 1)
EOF
done
# The length check cannot tell two tokens of one length apart: the value itself, once, by curl.
got=$(curl -sf --cacert "$TMP/lgca/ca.pem" -x "http://127.0.0.1:$LG_PORT" --proxy-user "agent:$LEASE_ID" \
  "https://origin.test:$ORIGIN_HTTPS/auth") || die "curl through leasegate failed"
[[ $got == "Bearer $TOKEN" ]] || die "leasegate put in ${got:-nothing}, not the secret"

# ------------------------------------------------------------------------------------------
# 5. The runs: per round, each figure with the variants alternating (order rotated).
run_one() { # run_one ROUND FIGURE VARIANT
  local r=$1 fig=$2 v=$3 out="$RUNS/r$1_$2_$3.json" args
  args=(--proxy "$(proxy_of "$v")" --addr 127.0.0.1:$ORIGIN_HTTPS --target "$(target_of "$v")"
    --ca "$(ca_of "$v")" --auth "$(auth_of "$v")" --path /small --expect-bytes 64 --duration "$DURATION")
  case $fig in
    ka1) "$H" https-load "${args[@]}" --concurrency 1 --threads 1 ;;
    ka32) "$H" https-load "${args[@]}" --concurrency "$CONC" --threads 2 ;;
    hs-resume) "$H" https-handshakes "${args[@]}" --concurrency 1 --threads 1 --resume on ;;
    hs-full) "$H" https-handshakes "${args[@]}" --concurrency 1 --threads 1 --resume off ;;
  esac >"$out" 2>"$out.err" || log "$fig $v failed: $(cat "$out.err")"
  for name in "${!PID[@]}"; do
    kill -0 "${PID[$name]}" 2>/dev/null || die "$name died during $fig/$v (round $r); see $TMP/$name.err"
  done
  sleep 1
}
rotate() { # rotate ROUND ITEMS...: the items, started at ROUND's offset
  local r=$1; shift
  local items=("$@") i
  for i in "${!items[@]}"; do echo "${items[$(((i + r - 1) % ${#items[@]}))]}"; done
}
for r in $(seq "$ROUNDS"); do
  for fig in ka1 ka32 hs-resume hs-full; do
    if [[ $fig == hs-* ]]; then set -- "${HANDSHAKE_VARIANTS[@]}"; else set -- "${VARIANTS[@]}"; fi
    for v in $(rotate "$r" "$@"); do
      log "round $r/$ROUNDS: $fig $v"
      run_one "$r" "$fig" "$v"
    done
  done
done

LEASE_STATUS=$(curl -sf "http://127.0.0.1:$LG_ADMIN/leases/$LEASE_ID" | grep -o '"status":"[a-z-]*"' | cut -d'"' -f4 || true)
EGRESS_WITH_SECRET=$(grep -c '"secrets":\["bench"\]' "$TMP/leasegate-egress.jsonl" || true)
LG_ERRLINES=$(grep -c . "$TMP/leasegate.err" || true)

# ------------------------------------------------------------------------------------------
# 6. The report: the section between the markers in OUT_MD, replaced (or appended).
ELAPSED=$(($(date +%s) - START_EPOCH))
describe_machine
python3 "$HERE/brokered_report.py" --runs "$RUNS" --out-md "$OUT_MD" \
  --rounds "$ROUNDS" --duration "$DURATION" --conc "$CONC" --quick "$QUICK" \
  --meta "date=$(date -u '+%Y-%m-%d %H:%M UTC')" --meta "elapsed=$((ELAPSED / 60)) min $((ELAPSED % 60)) s" \
  --meta "machine=$(nproc) cores, $CPU, $MEM, Linux $(uname -r), TCP congestion control $(cat /proc/sys/net/ipv4/tcp_congestion_control)" \
  --meta "leasegate=git $REV (\`$PROFILE\` build)" \
  --meta "squid=$(squid -v | head -1) (squid-openssl)" \
  --meta "mitmproxy=$(mitmdump --version | awk '/^Mitmproxy/ { print $2 }')" \
  --meta "command=$COMMAND_LINE" \
  --meta "lease=$LEASE_STATUS" --meta "egress_with_secret=$EGRESS_WITH_SECRET" --meta "lg_errlines=$LG_ERRLINES"
log "wrote the brokered section of $OUT_MD"
