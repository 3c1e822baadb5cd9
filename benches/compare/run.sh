#!/usr/bin/env bash
# End-to-end comparison: direct vs the floor vs leasegate (credentials, lease port) vs Squid vs
# tinyproxy, on one local origin, with each proxy's CPU per operation. Writes
# benches/compare/RESULTS.md and results.json. See README.md here.
#
#   benches/compare/run.sh                 # full run (ROUNDS=3, DURATION=10, 10,000 idle tunnels)
#   QUICK=1 benches/compare/run.sh         # smoke test: 1 round, 2 s runs, 1,000 tunnels, 10 MiB bulk
#   CPUSET=force QUICK=1 benches/compare/run.sh   # the pinned mode's code path on a small machine
#
# Knobs (environment): ROUNDS, DURATION (s per load run), QUICK=1, CONC (32), IDLE_TUNNELS,
# BULK_BYTES, BULK_REPEAT (3), LOAD_TOOL (auto|oha|wrk), TINYPROXY_LOGLEVEL (Warning),
# PROFILE (dist: the build the image ships; release), LEASEGATE_BIN (a prebuilt leasegate
# binary: no leasegate build), SKIP_BUILD=1, KEEP_TMP=1, OUT_MD, OUT_JSON, CPUSET
# (auto|off|force), PROXY_CORES ("1 4").
#
# Every address used is on 127.0.0.1. Runs as root (apt-get, mount namespace for tinyproxy).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=squid-conf.sh
. "$HERE/squid-conf.sh"
REPO=$(cd "$HERE/../.." && pwd)
# (grep finds nothing when no knob is set: that is not an error.)
COMMAND_LINE="$( { env | grep -E '^(QUICK|ROUNDS|DURATION|CONC|IDLE_TUNNELS|BULK_BYTES|BULK_REPEAT|LOAD_TOOL|TINYPROXY_LOGLEVEL|CPUSET|PROXY_CORES|LEASEGATE_BIN)=' || true; } | sort | tr '\n' ' ')benches/compare/run.sh"

QUICK=${QUICK:-0}
if [[ $QUICK == 1 ]]; then
  ROUNDS=${ROUNDS:-1}
  DURATION=${DURATION:-2}
  IDLE_TUNNELS=${IDLE_TUNNELS:-1000}
  BULK_BYTES=${BULK_BYTES:-$((10 * 1024 * 1024))}
else
  ROUNDS=${ROUNDS:-3}
  DURATION=${DURATION:-10}
  IDLE_TUNNELS=${IDLE_TUNNELS:-10000}
  BULK_BYTES=${BULK_BYTES:-$((100 * 1024 * 1024))}
fi
BULK_REPEAT=${BULK_REPEAT:-3}
CONC=${CONC:-32}
LOAD_TOOL=${LOAD_TOOL:-auto}
TINYPROXY_LOGLEVEL=${TINYPROXY_LOGLEVEL:-Warning}
OUT_MD=${OUT_MD:-$HERE/RESULTS.md}
OUT_JSON=${OUT_JSON:-$HERE/results.json}

ORIGIN_HTTP=18080
ORIGIN_HTTPS=18443
LG_PORT=13128
LG_ADMIN=13129
SQUID_PORT=13130
TP_PORT=13131
FLOOR_PORT=13132
LEASE_PORTS=14000-14010
VARIANTS=(direct floor leasegate-credentials leasegate-lease-port squid tinyproxy)
FIGURES=(ka1 ka32 close32 connect bulk)

# ------------------------------------------------------------------------------------------
# CPU sets. Pinned (CPUSET=auto on >= 8 cores, or CPUSET=force): the proxies on cores 0-3
# (1 and 4 of them, one pass each), the origin on the next third of the rest, the load tools
# on the remainder, all disjoint. Unpinned (fewer cores, or CPUSET=off): every process shares
# every core, one pass. CPUSET=force on a small machine puts the proxy on the last core and
# the origin and load tools together on the others: it checks the code path, not the figures.
NPROC=$(nproc)
CPUSET=${CPUSET:-auto}
case $CPUSET in
  auto) PINNED=$((NPROC >= 8 ? 1 : 0)) ;;
  off) PINNED=0 ;;
  force) PINNED=1 ;;
  *) echo "CPUSET must be auto, off or force" >&2; exit 1 ;;
esac
if [[ $PINNED == 1 ]] && ((NPROC >= 8)); then
  PROXY_SET=(0 1 2 3)
  origin_n=$(((NPROC - 4) / 3))
  ORIGIN_SET=$(seq -s, 4 $((3 + origin_n)))
  LOAD_SET=$(seq -s, $((4 + origin_n)) $((NPROC - 1)))
  read -r -a PASSES <<<"${PROXY_CORES:-1 4}"
  PINNING="pinned: proxy on cores ${PROXY_SET[0]}-…, origin on $ORIGIN_SET, load tools on $LOAD_SET"
elif [[ $PINNED == 1 ]]; then
  ((NPROC >= 2)) || { echo "CPUSET=force needs 2 cores" >&2; exit 1; }
  PROXY_SET=($((NPROC - 1)))
  ORIGIN_SET=$(seq -s, 0 $((NPROC - 2)))
  LOAD_SET=$ORIGIN_SET
  PASSES=(1)
  PINNING="forced pinning on $NPROC cores (CPUSET=force): proxy on core ${PROXY_SET[0]}, origin and load tools sharing $ORIGIN_SET — checks the code path only, figures not comparable"
else
  PASSES=(all) PROXY_SET=() ORIGIN_SET="" LOAD_SET=""
  PINNING="unpinned: origin, proxies and load tools share all $NPROC cores (pinning needs >= 8 cores; CPUSET=force to try it)"
fi
# on SET: sets ON to the command prefix that runs a command on the cores of SET (a comma
# list): `taskset -c SET`, or nothing when unpinned. A prefix, not a function, so that `$!`
# of `"${ON[@]}" cmd &` is cmd's own pid (taskset execs it).
ON=()
on() { if [[ $PINNED == 1 ]]; then ON=(taskset -c "$1"); else ON=(); fi; }
count_set() { tr ',' '\n' <<<"$1" | grep -c .; }
if [[ $PINNED == 1 ]]; then
  ORIGIN_THREADS=$(count_set "$ORIGIN_SET")
  LOAD_THREADS=$(count_set "$LOAD_SET")
else
  ORIGIN_THREADS=$NPROC LOAD_THREADS=$NPROC
fi

log() { printf '[%s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (apt-get, squid's cache_effective_user, a mount namespace for tinyproxy)"

START_EPOCH=$(date +%s)
TMP=$(mktemp -d /tmp/leasegate-compare.XXXXXX)
chmod 755 "$TMP" # squid drops to the proxy user and writes its logs here
RUNS="$TMP/runs"
mkdir -p "$RUNS"

# ------------------------------------------------------------------------------------------
# Process bookkeeping: everything started here is stopped by its pid on exit.
declare -A PID=()
HOSTS_EDITED=0
HOSTS_MARK="# leasegate-compare $$"

stop_pid() { # stop_pid NAME: SIGTERM, then SIGKILL after 10 s
  local name=$1 pid=${PID[$1]:-}
  [[ -n $pid ]] || return 0
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$name ($pid) did not stop on SIGTERM; SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  wait "$pid" 2>/dev/null || true
  unset "PID[$name]"
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for name in "${!PID[@]}"; do stop_pid "$name"; done
  if [[ $HOSTS_EDITED == 1 ]]; then
    sed -i "/$HOSTS_MARK\$/d" /etc/hosts || true
  fi
  if [[ $rc == 0 && ${KEEP_TMP:-0} != 1 ]]; then
    rm -rf "$TMP"
  else
    log "logs and raw runs kept in $TMP"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_busy() { ss -Hltn "( sport = :$1 )" 2>/dev/null | grep -q .; }

wait_port() { # wait_port PORT NAME: until something accepts on 127.0.0.1:PORT
  for _ in $(seq 200); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    if [[ -n ${PID[$2]:-} ]] && ! kill -0 "${PID[$2]}" 2>/dev/null; then die "$2 exited; see $TMP/$2.err"; fi
    sleep 0.1
  done
  die "$2 is not listening on 127.0.0.1:$1 after 20 s; see $TMP/$2.err"
}

proc_kib() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status"; }

# Highest fd limit we may have (children inherit it).
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
NOFILE=$(ulimit -n)

# ------------------------------------------------------------------------------------------
# 1. Install what is missing.
INSTALLED_NOW=()
apt_install() {
  [[ $# -gt 0 ]] || return 0
  log "apt-get install $*"
  if [[ ! -f $TMP/.apt-updated ]]; then
    apt-get update -qq
    touch "$TMP/.apt-updated"
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >"$TMP/apt.log" 2>&1 ||
    { cat "$TMP/apt.log" >&2; die "apt-get install $* failed"; }
}
missing=()
command -v squid >/dev/null || { missing+=(squid); INSTALLED_NOW+=(squid); }
command -v tinyproxy >/dev/null || { missing+=(tinyproxy); INSTALLED_NOW+=(tinyproxy); }
for tool in curl ss unshare; do
  command -v $tool >/dev/null || case $tool in
    curl) missing+=(curl) ;;
    ss) missing+=(iproute2) ;;
    unshare) missing+=(util-linux) ;;
  esac
done
apt_install "${missing[@]}"
# Packages may start their service on install; ours run on other ports with our own configs,
# but a service we just installed would share the CPU, so stop it.
for svc in "${INSTALLED_NOW[@]}"; do
  if command -v systemctl >/dev/null && systemctl is-active --quiet "$svc" 2>/dev/null; then
    systemctl stop "$svc" || true
  elif command -v service >/dev/null; then
    service "$svc" stop >/dev/null 2>&1 || true
  fi
done

# The load tool: oha (cargo install), else wrk (apt) with an absolute-form Lua script.
OHA=$(command -v oha || true)
if [[ -z $OHA && -x $HOME/.cargo/bin/oha ]]; then OHA=$HOME/.cargo/bin/oha; fi
case $LOAD_TOOL in
  auto | oha)
    if [[ -z $OHA ]]; then
      log "installing oha (cargo install oha --locked; several minutes)"
      if cargo install oha --locked >"$TMP/oha-install.log" 2>&1; then
        OHA=$HOME/.cargo/bin/oha
      elif [[ $LOAD_TOOL == oha ]]; then
        tail -20 "$TMP/oha-install.log" >&2
        die "cargo install oha failed"
      else
        log "cargo install oha failed (see $TMP/oha-install.log); falling back to wrk"
      fi
    fi
    if [[ -n $OHA ]]; then LOAD_TOOL=oha; else LOAD_TOOL=wrk; fi
    ;;
  wrk) ;;
  *) die "LOAD_TOOL must be auto, oha or wrk" ;;
esac
if [[ $LOAD_TOOL == wrk ]]; then
  command -v wrk >/dev/null || apt_install wrk
  LOAD_VERSION="wrk $({ wrk -v 2>&1 || true; } | awk 'NR == 1 { print $2 }') (Lua script, absolute-form requests)"
else
  LOAD_VERSION=$("$OHA" --version | head -1)
fi

# ------------------------------------------------------------------------------------------
# 2. Build leasegate (the `dist` profile the image ships: fat LTO; PROFILE=release for the
#    everyday build, with symbols for perf; none with LEASEGATE_BIN) and the harness (release),
#    which is also the floor proxy.
PROFILE=${PROFILE:-dist}
LEASEGATE_BIN=${LEASEGATE_BIN:-}
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  if [[ -z $LEASEGATE_BIN ]]; then
    log "cargo build --profile $PROFILE (leasegate)"
    (cd "$REPO" && cargo build --profile "$PROFILE" --quiet)
  fi
  log "cargo build --release (harness)"
  CARGO_TARGET_DIR="$HERE/target" cargo build --release --quiet --manifest-path "$HERE/harness/Cargo.toml"
fi
if [[ -n $LEASEGATE_BIN ]]; then
  LG=$LEASEGATE_BIN
  BUILD_NOTE="the prebuilt binary \`$LEASEGATE_BIN\`"
else
  LG="${CARGO_TARGET_DIR:-$REPO/target}/$PROFILE/leasegate"
  BUILD_NOTE="built with the \`$PROFILE\` profile"
fi
H="$HERE/target/release/compare-harness"
[[ -x $LG && -x $H ]] || die "missing $LG or $H (build failed?)"

for p in $ORIGIN_HTTP $ORIGIN_HTTPS $LG_PORT $LG_ADMIN $SQUID_PORT $TP_PORT $FLOOR_PORT $(seq ${LEASE_PORTS%-*} ${LEASE_PORTS#*-}); do
  if port_busy "$p"; then die "127.0.0.1:$p is already in use"; fi
done

# ------------------------------------------------------------------------------------------
# 3. Start the origin, the floor, leasegate, Squid and tinyproxy.
printf '127.0.0.1 localhost\n127.0.0.1 origin.test\n' >"$TMP/hosts"

start_origin() {
  on "$ORIGIN_SET"
  "${ON[@]}" "$H" origin --http 127.0.0.1:$ORIGIN_HTTP --https 127.0.0.1:$ORIGIN_HTTPS --cert-dir "$TMP/certs" \
    --threads "$ORIGIN_THREADS" --backlog 4096 \
    >"$TMP/origin.out" 2>"$TMP/origin.err" &
  PID[origin]=$!
  wait_port $ORIGIN_HTTP origin
  wait_port $ORIGIN_HTTPS origin
}

"$LG" keygen --out "$TMP/lease.key" >/dev/null
# (not `| head -1`: leasegate panics on the broken pipe when head exits, and pipefail stops us)
ISSUED=$("$LG" issue --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
  --allow-host origin.test --ttl 4h --name compare)
LEASE_ID=${ISSUED%%$'\n'*}
LG_AUTH="Basic $(printf 'agent:%s' "$LEASE_ID" | base64 -w0)"

# The current pass's proxy cores: a comma list (pinned) and how many; "all" when unpinned.
PASS_SET="" PASS_N=0
set_pass() {
  if [[ $1 == all ]]; then
    PASS_SET=$(seq -s, 0 $((NPROC - 1))) PASS_N=0
  else
    PASS_SET=$(printf '%s\n' "${PROXY_SET[@]:0:$1}" | paste -sd,) PASS_N=$1
  fi
}

start_leasegate() {
  # The per-lease limit is raised for the idle-tunnel test (default 1,000). The total is left to
  # leasegate: it refuses a --max-connections whose descriptors (7 each) do not fit under
  # RLIMIT_NOFILE, and fits its default (10,000) under it; the limit it took is read below.
  on "$PASS_SET"
  # The origin's ports are no defaults (443, 80): open them to tunnels and forwarded requests.
  RUST_LOG=warn LEASEGATE_CONNECT_PORTS=$ORIGIN_HTTP,$ORIGIN_HTTPS LEASEGATE_FORWARD_PORTS=$ORIGIN_HTTP \
    "${ON[@]}" "$LG" serve --worker-threads "$PASS_N" --listen 127.0.0.1:$LG_PORT --admin 127.0.0.1:$LG_ADMIN \
    --journal "$TMP/journal.jsonl" --key-file "$TMP/lease.key" \
    --resolve origin.test=127.0.0.1 --allow-private 127.0.0.1/32 --lease-ports $LEASE_PORTS \
    --egress-log "$TMP/leasegate-egress.jsonl" --drain-timeout 2s \
    --max-connections-per-lease 100000 \
    >"$TMP/leasegate.out" 2>>"$TMP/leasegate.err" &
  PID[leasegate]=$!
  for _ in $(seq 200); do
    curl -sf "http://127.0.0.1:$LG_ADMIN/healthz" >/dev/null 2>&1 && break
    kill -0 "${PID[leasegate]}" 2>/dev/null || die "leasegate exited; see $TMP/leasegate.err"
    sleep 0.1
  done
  LEASE_PORT=
  for _ in $(seq 100); do
    LEASE_PORT=$(curl -sf "http://127.0.0.1:$LG_ADMIN/leases/$LEASE_ID" | grep -o '"port":[0-9]*' | cut -d: -f2 || true)
    [[ -n $LEASE_PORT ]] && break
    sleep 0.1
  done
  [[ -n $LEASE_PORT ]] || die "no lease port for $LEASE_ID (GET /leases/$LEASE_ID)"
  LG_MAX_CONN=$(curl -sf "http://127.0.0.1:$LG_ADMIN/status" | grep -o '"max_connections":[0-9]*' | cut -d: -f2 || true)
  wait_port "$LEASE_PORT" leasegate
}

# The floor: the harness's proxy doing leasegate's socket work and nothing else, on the same
# cores with the same worker count (0: one per core it may run on, as leasegate's).
start_floor() {
  on "$PASS_SET"
  "${ON[@]}" "$H" floor --listen 127.0.0.1:$FLOOR_PORT --threads "$PASS_N" --resolve origin.test=127.0.0.1 \
    >"$TMP/floor.out" 2>>"$TMP/floor.err" &
  PID[floor]=$!
  wait_port $FLOOR_PORT floor
}

start_squid() {
  # One worker per proxy core, each on its own core (cpu_affinity_map counts cores from 1).
  SQUID_WORKERS=$((PASS_N > 0 ? PASS_N : 1)) SQUID_AFFINITY=""
  if [[ $PINNED == 1 ]]; then
    SQUID_AFFINITY="cpu_affinity_map process_numbers=$(seq -s, 1 "$SQUID_WORKERS") cores=$(tr ',' '\n' <<<"$PASS_SET" | awk '{ printf "%s%d", (NR > 1 ? "," : ""), $1 + 1 }')"
  fi
  squid_conf "$TMP" "$SQUID_PORT" "$SQUID_WORKERS" "$NOFILE" "$SQUID_AFFINITY" >"$TMP/squid.conf"
  # -N runs no workers of its own: SMP (workers > 1) needs the master in --foreground.
  local mode=-N
  if ((SQUID_WORKERS > 1)); then mode=--foreground; fi
  on "$PASS_SET"
  "${ON[@]}" squid "$mode" -f "$TMP/squid.conf" >"$TMP/squid.out" 2>>"$TMP/squid.err" &
  PID[squid]=$!
  wait_port $SQUID_PORT squid
}

# tinyproxy resolves origin.test with the system resolver; rather than edit /etc/hosts it runs
# in its own mount namespace with our hosts file bind-mounted over /etc/hosts.
start_tinyproxy() {
  printf '^origin\\.test$\n' >"$TMP/tinyproxy.filter"
  cat >"$TMP/tinyproxy.conf" <<EOF
Port $TP_PORT
Listen 127.0.0.1
Timeout 600
MaxClients 1000
LogFile "$TMP/tinyproxy.log"
LogLevel $TINYPROXY_LOGLEVEL
PidFile "$TMP/tinyproxy.pid"
Filter "$TMP/tinyproxy.filter"
FilterType ere
FilterURLs Off
FilterDefaultDeny Yes
EOF
  if unshare --mount --propagation private -- true 2>/dev/null; then
    unshare --mount --propagation private -- sh -c \
      "mount --bind '$TMP/hosts' /etc/hosts && exec $(if [[ $PINNED == 1 ]]; then echo "taskset -c $PASS_SET"; fi) tinyproxy -d -c '$TMP/tinyproxy.conf'" \
      >"$TMP/tinyproxy.out" 2>>"$TMP/tinyproxy.err" &
  else
    log "no mount namespace here: adding origin.test to /etc/hosts for the run"
    grep -q "$HOSTS_MARK\$" /etc/hosts || { printf '127.0.0.1 origin.test %s\n' "$HOSTS_MARK" >>/etc/hosts; HOSTS_EDITED=1; }
    on "$PASS_SET"
    "${ON[@]}" tinyproxy -d -c "$TMP/tinyproxy.conf" >"$TMP/tinyproxy.out" 2>>"$TMP/tinyproxy.err" &
  fi
  PID[tinyproxy]=$!
  wait_port $TP_PORT tinyproxy
}

log "starting origin, floor, leasegate, squid, tinyproxy (logs in $TMP; $PINNING)"
start_origin
set_pass "${PASSES[0]}"
start_floor
start_leasegate
start_squid
start_tinyproxy

# Sanity: every variant answers /small with 64 bytes before anything is timed.
check() {
  local n
  n=$(curl -sf "$@" | wc -c) || true
  [[ $n == 64 ]] || die "sanity check failed: curl $* gave $n bytes"
}
check http://127.0.0.1:$ORIGIN_HTTP/small
check -x http://127.0.0.1:$FLOOR_PORT http://origin.test:$ORIGIN_HTTP/small
check -p -x http://127.0.0.1:$FLOOR_PORT http://origin.test:$ORIGIN_HTTP/small
check -x http://127.0.0.1:$LG_PORT -H "Proxy-Authorization: $LG_AUTH" http://origin.test:$ORIGIN_HTTP/small
check -x "http://127.0.0.1:$LEASE_PORT" http://origin.test:$ORIGIN_HTTP/small
check -x http://127.0.0.1:$SQUID_PORT http://origin.test:$ORIGIN_HTTP/small
check -x http://127.0.0.1:$TP_PORT http://origin.test:$ORIGIN_HTTP/small

# ------------------------------------------------------------------------------------------
# 4. The runs.
proxy_of() {
  case $1 in
    direct) echo "" ;;
    floor) echo 127.0.0.1:$FLOOR_PORT ;;
    leasegate-credentials) echo 127.0.0.1:$LG_PORT ;;
    leasegate-lease-port) echo "127.0.0.1:$LEASE_PORT" ;;
    squid) echo 127.0.0.1:$SQUID_PORT ;;
    tinyproxy) echo 127.0.0.1:$TP_PORT ;;
  esac
}
auth_of() { if [[ $1 == leasegate-credentials ]]; then echo "$LG_AUTH"; else echo none; fi; }

cat >"$TMP/wrk.lua" <<'EOF'
-- Absolute-form requests through a proxy (or origin-form direct), optional Proxy-Authorization.
wrk.path = os.getenv("WRK_PATH")
wrk.headers["Host"] = os.getenv("WRK_HOST")
local auth = os.getenv("WRK_AUTH")
if auth and auth ~= "" and auth ~= "none" then wrk.headers["Proxy-Authorization"] = auth end
if os.getenv("WRK_CLOSE") == "1" then wrk.headers["Connection"] = "close" end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"tool":"wrk","seconds":%f,"requests":%d,"errors":%d,"non2xx":%d,"p50_us":%f,"p99_us":%f}\n',
    summary.duration / 1e6, summary.requests, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
EOF

# load VARIANT CONNECTIONS KEEPALIVE(1|0) OUT
load() {
  local variant=$1 c=$2 ka=$3 out=$4 proxy url host
  proxy=$(proxy_of "$variant")
  if [[ -z $proxy ]]; then
    url=http://127.0.0.1:$ORIGIN_HTTP/small host=127.0.0.1:$ORIGIN_HTTP
  else
    url=http://origin.test:$ORIGIN_HTTP/small host=origin.test:$ORIGIN_HTTP
  fi
  if [[ $LOAD_TOOL == oha ]]; then
    local args=(--no-tui --output-format json -z "${DURATION}s" -c "$c")
    if [[ $ka == 0 ]]; then args+=(--disable-keepalive); fi
    if [[ -n $proxy ]]; then
      args+=(-x "http://$proxy" --no-pre-lookup)
      if [[ $(auth_of "$variant") != none ]]; then
        args+=(--proxy-header "Proxy-Authorization: $(auth_of "$variant")")
      fi
    fi
    on "$LOAD_SET"
    "${ON[@]}" "$OHA" "${args[@]}" "$url" >"$out" 2>"$out.err" || log "oha exited $? ($variant)"
  else
    local threads=$((c < 2 ? 1 : 2)) path=/small target=http://127.0.0.1:$ORIGIN_HTTP
    if [[ -n $proxy ]]; then path=$url target=http://$proxy; fi
    on "$LOAD_SET"
    WRK_PATH=$path WRK_HOST=$host WRK_AUTH=$(auth_of "$variant") WRK_CLOSE=$((1 - ka)) \
      "${ON[@]}" wrk -t "$threads" -c "$c" -d "${DURATION}s" -s "$TMP/wrk.lua" "$target" >"$out.txt" 2>"$out.err" ||
      log "wrk exited $? ($variant)"
    tail -1 "$out.txt" >"$out"
  fi
}

# The process whose CPU a variant's runs are charged: none for direct (the origin's is read
# for every variant).
process_of() {
  case $1 in
    direct) echo "" ;;
    leasegate-*) echo leasegate ;;
    *) echo "$1" ;;
  esac
}
cpu_now() { # cpu_now VARIANT: `compare-harness cpu` of the variant's proxy and the origin
  local name pids="origin=${PID[origin]}"
  name=$(process_of "$1")
  if [[ -n $name ]]; then pids="proxy=${PID[$name]},$pids"; fi
  "$H" cpu --pids "$pids"
}

run_figure() { # run_figure ROUND FIGURE VARIANT
  local r=$1 fig=$2 v=$3 out proxy target cpu_before
  out="$RUNS/r${r}_${fig}_${v}.json"
  proxy=$(proxy_of "$v")
  cpu_before=$(cpu_now "$v") || die "cannot read the CPU time of $v's process"
  case $fig in
    ka1) load "$v" 1 1 "$out" ;;
    ka32) load "$v" "$CONC" 1 "$out" ;;
    close32) load "$v" "$CONC" 0 "$out" ;;
    connect)
      if [[ -z $proxy ]]; then proxy=direct target=127.0.0.1:$ORIGIN_HTTPS; else target=origin.test:$ORIGIN_HTTPS; fi
      on "$LOAD_SET"
      "${ON[@]}" "$H" connect-rate --proxy "$proxy" --target "$target" --auth "$(auth_of "$v")" \
        --threads "$LOAD_THREADS" --concurrency "$CONC" --duration "$DURATION" >"$out" 2>"$out.err" || log "connect-rate failed ($v): $(cat "$out.err")"
      ;;
    bulk)
      if [[ -z $proxy ]]; then proxy=direct target=127.0.0.1:$ORIGIN_HTTP; else target=origin.test:$ORIGIN_HTTP; fi
      on "$LOAD_SET"
      "${ON[@]}" "$H" bulk --proxy "$proxy" --target "$target" --auth "$(auth_of "$v")" \
        --bytes "$BULK_BYTES" --repeat "$BULK_REPEAT" >"$out" 2>"$out.err" || log "bulk failed ($v): $(cat "$out.err")"
      ;;
  esac
  # The proxy's CPU over the run, charged to what the run did (CPU per operation).
  printf '{"before": %s, "after": %s}\n' "$cpu_before" "$(cpu_now "$v")" >"$RUNS/cpu_r${r}_${fig}_${v}.json" ||
    die "cannot read the CPU time of $v's process after $fig (round $r)"
  # Every proxy process must survive every run.
  for name in floor leasegate squid tinyproxy origin; do
    kill -0 "${PID[$name]}" 2>/dev/null || die "$name died during $fig/$v (round $r); see $TMP/$name.err"
  done
  sleep 1 # let sockets settle between runs
}

# One pass per proxy core count (one pass, "all", when unpinned); each its own runs directory.
pass_runs() { if [[ $1 == all ]]; then echo "$TMP/runs"; else echo "$TMP/runs-$1core"; fi; }
for pass in "${PASSES[@]}"; do
  RUNS=$(pass_runs "$pass")
  mkdir -p "$RUNS"
  if [[ $pass != "${PASSES[0]}" ]]; then
    set_pass "$pass"
    stop_pid floor
    stop_pid leasegate
    stop_pid squid
    stop_pid tinyproxy
    start_floor
    start_leasegate
    start_squid
    start_tinyproxy
  fi
  log "pass: proxies on ${pass} core(s) ($PASS_SET); $ROUNDS round(s) of ${FIGURES[*]} × ${VARIANTS[*]} (${DURATION} s per run, $CONC connections, load tool: $LOAD_VERSION)"
  for r in $(seq "$ROUNDS"); do
    # Rotate the variant order every round; within a figure the variants alternate.
    order=()
    for i in "${!VARIANTS[@]}"; do order+=("${VARIANTS[$(((i + r - 1) % ${#VARIANTS[@]}))]}"); done
    for fig in "${FIGURES[@]}"; do
      for v in "${order[@]}"; do
        log "round $r/$ROUNDS: $fig $v"
        run_figure "$r" "$fig" "$v"
      done
    done
  done

  # Peak RSS after all rounds.
  write_rss() { # write_rss VARIANT PID
    printf '{"pid": %s, "vmhwm_kib": %s, "vmrss_kib": %s}\n' "$2" "$(proc_kib "$2" VmHWM)" "$(proc_kib "$2" VmRSS)" >"$RUNS/rss_$1.json"
  }
  write_rss floor "${PID[floor]}"
  write_rss leasegate-credentials "${PID[leasegate]}"
  write_rss leasegate-lease-port "${PID[leasegate]}"
  write_rss squid "${PID[squid]}"
  write_rss tinyproxy "${PID[tinyproxy]}"
done

LG_DROPPED=$(curl -sf "http://127.0.0.1:$LG_ADMIN/metrics" | awk '$1 == "leasegate_egress_log_dropped_total" { print $2 }' || true)
LEASE_STATUS=$(curl -sf "http://127.0.0.1:$LG_ADMIN/leases/$LEASE_ID" | grep -o '"status":"[a-z-]*"' | cut -d'"' -f4 || true)
LG_ERRLINES=$(grep -c . "$TMP/leasegate.err" || true)

# ------------------------------------------------------------------------------------------
# 5. Idle tunnels, last, on freshly started leasegate and Squid (so freed buffers of the load
#    runs are not counted as tunnel memory). Each tunnel holds 2 fds in the proxy.
IDLE_COUNT=$IDLE_TUNNELS
max_by_fds=$(((NOFILE - 200) / 2))
if ((IDLE_COUNT > max_by_fds)); then
  log "RLIMIT_NOFILE is $NOFILE (hard $(ulimit -Hn)): $IDLE_TUNNELS tunnels need $((2 * IDLE_TUNNELS + 200)) fds in the proxy; using $max_by_fds"
  IDLE_COUNT=$max_by_fds
fi
# leasegate answers a connection past its limit with 429: stay 10 below it.
if [[ -n ${LG_MAX_CONN:-} ]] && ((IDLE_COUNT > LG_MAX_CONN - 10)); then
  log "leasegate's connection limit is $LG_MAX_CONN (its descriptors fitted under RLIMIT_NOFILE $NOFILE); using $((LG_MAX_CONN - 10)) idle tunnels"
  IDLE_COUNT=$((LG_MAX_CONN - 10))
fi
idle() { # idle VARIANT NAME PORT AUTH
  log "idle tunnels: $IDLE_COUNT through $1"
  "$H" idle-tunnels --proxy "127.0.0.1:$3" --target origin.test:$ORIGIN_HTTP --auth "$4" \
    --count "$IDLE_COUNT" --pid "${PID[$2]}" >"$RUNS/idle_$1.json" 2>"$TMP/idle_$1.err" ||
    log "idle-tunnels failed ($1): $(cat "$TMP/idle_$1.err")"
}
stop_pid leasegate
start_leasegate
idle leasegate-credentials leasegate $LG_PORT "$LG_AUTH"
stop_pid squid
start_squid
idle squid squid $SQUID_PORT none
check -x http://127.0.0.1:$LG_PORT -H "Proxy-Authorization: $LG_AUTH" http://origin.test:$ORIGIN_HTTP/small

# ------------------------------------------------------------------------------------------
# 6. The report.
ELAPSED=$(($(date +%s) - START_EPOCH))
REV=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git -C "$REPO" status --porcelain --untracked-files=no -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
  REV="$REV (with uncommitted changes to src/ or Cargo.*)"
fi
IDLE_NOTE=""
if ((IDLE_COUNT < IDLE_TUNNELS)); then
  IDLE_NOTE=" of the $IDLE_TUNNELS asked for (RLIMIT_NOFILE is capped at $NOFILE here: 2 fds per tunnel in the proxy, and leasegate's connection limit, fitted under it at 7 fds per connection, is ${LG_MAX_CONN:-?})"
fi
NOTES="Notes: the floor ran on leasegate's cores with as many worker threads; leasegate ($BUILD_NOTE) ran with RUST_LOG=warn and its egress log to a file ($LG_DROPPED lines dropped; lease status at the end: ${LEASE_STATUS:-?}; ${LG_ERRLINES:-0} stderr lines); Squid with access_log to a file; tinyproxy with LogLevel $TINYPROXY_LOGLEVEL (tinyproxy fsyncs every log line, so its per-connection Info/Connect logging would cap it at a few hundred connections/s; it writes no request log here, which favours it). tinyproxy closes the client connection after each response, so its keep-alive figures are new-connection figures. Idle tunnels: $IDLE_COUNT$IDLE_NOTE, opened on freshly restarted processes; tinyproxy (a thread per connection, MaxClients 1000) is not measured there."
report() { # report PASS OUT_MD OUT_JSON
  local cores=()
  if [[ $1 != all ]]; then cores=(--proxy-cores "$1"); fi
  "$H" report --runs "$(pass_runs "$1")" --out-md "$2" --out-json "$3" "${cores[@]}" \
    --pinning "$(if [[ $1 == all ]]; then echo "$PINNING"; else echo "$PINNING; this table: each proxy on $1 core(s) (leasegate --worker-threads $1, Squid workers $1)"; fi)" \
    --date "$(date -u '+%Y-%m-%d %H:%M UTC')" --elapsed "$((ELAPSED / 60)) min $((ELAPSED % 60)) s" \
    --leasegate-rev "$REV" --leasegate-profile "$PROFILE" --leasegate-bin "$LEASEGATE_BIN" \
    --squid-version "$(squid -v | head -1)" \
    --tinyproxy-version "$(tinyproxy -v 2>&1 | head -1)" \
    --load-tool "$LOAD_VERSION" \
    --rounds "$ROUNDS" --duration "$DURATION" --concurrency "$CONC" --quick "$QUICK" \
    --bulk-bytes "$BULK_BYTES" --bulk-repeat "$BULK_REPEAT" \
    --command "$COMMAND_LINE" --notes "$NOTES" >/dev/null
}
# brokered.sh's and metered.sh's sections of the file (between their markers) outlive this report.
BROKERED_SECTION=$(sed -n '/^<!-- brokered:begin -->$/,/^<!-- brokered:end -->$/p' "$OUT_MD" 2>/dev/null || true)
METERED_SECTION=$(sed -n '/^<!-- metered:begin -->$/,/^<!-- metered:end -->$/p' "$OUT_MD" 2>/dev/null || true)
if [[ ${#PASSES[@]} == 1 ]]; then
  report "${PASSES[0]}" "$OUT_MD" "$OUT_JSON"
else
  # One table per core count, one after the other; a JSON file per core count.
  : >"$OUT_MD"
  for pass in "${PASSES[@]}"; do
    report "$pass" "$TMP/RESULTS-$pass.md" "${OUT_JSON%.json}.${pass}core.json"
    { printf '<!-- proxies on %s core(s) -->\n' "$pass"; cat "$TMP/RESULTS-$pass.md"; printf '\n'; } >>"$OUT_MD"
  done
  OUT_JSON="${OUT_JSON%.json}.{$(IFS=,; echo "${PASSES[*]}")}core.json"
fi
if [[ -n $BROKERED_SECTION ]]; then printf '\n%s\n' "$BROKERED_SECTION" >>"$OUT_MD"; fi
if [[ -n $METERED_SECTION ]]; then printf '\n%s\n' "$METERED_SECTION" >>"$OUT_MD"; fi
log "wrote $OUT_MD and $OUT_JSON"
cat "$OUT_MD"
