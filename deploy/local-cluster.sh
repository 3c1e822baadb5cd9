#!/usr/bin/env bash
# A local three-replica leasegate cluster on one machine, for trying the NATS journal out:
#
#   deploy/local-cluster.sh nats       # three nats-server nodes (JetStream, one cluster)
#   deploy/local-cluster.sh replicas   # three leasegate replicas sharing one journal stream
#
# Both run in the foreground until Ctrl-C (run them in two terminals). Everything they write
# is under ./.leasegate/cluster/. nats-server is Debian's package (`apt install nats-server`);
# leasegate is `cargo build --release` (or set LEASEGATE=/path/to/leasegate).
#
# NATS clients: 127.0.0.1:4222-4224. Replicas: proxies on 127.0.0.1:3128-3130, admin APIs on
# 127.0.0.1:9090-9092. The key is .leasegate/cluster/lease.key (made on the first run):
#
#   url=nats://127.0.0.1:4222,127.0.0.1:4223,127.0.0.1:4224/LEASES
#   leasegate issue --journal issuer.jsonl --key-file .leasegate/cluster/lease.key --allow-host example.com
#   leasegate journal import issuer.jsonl --to "$url"
#   curl -x http://agent:<lease-id>@127.0.0.1:3130 https://example.com/
set -euo pipefail
dir=".leasegate/cluster"
leasegate="${LEASEGATE:-target/release/leasegate}"
mkdir -p "$dir"
trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT INT TERM

case "${1:-}" in
  nats)
    for i in 0 1 2; do
      routes=""
      for j in 0 1 2; do
        [ "$i" = "$j" ] || routes="$routes nats-route://127.0.0.1:$((6222 + j)),"
      done
      cat >"$dir/n$i.conf" <<EOF
server_name: n$i
listen: 127.0.0.1:$((4222 + i))
jetstream { store_dir: "$dir/n$i" }
cluster { name: leasegate, listen: 127.0.0.1:$((6222 + i)), routes: [${routes%,} ] }
EOF
      nats-server -c "$dir/n$i.conf" &
    done
    ;;
  replicas)
    [ -f "$dir/lease.key" ] || "$leasegate" keygen --out "$dir/lease.key"
    url="nats://127.0.0.1:4222,127.0.0.1:4223,127.0.0.1:4224/LEASES"
    for i in 0 1 2; do
      "$leasegate" serve --journal "$url" --nats-replicas 3 --key-file "$dir/lease.key" \
        --listen "127.0.0.1:$((3128 + i))" --admin "127.0.0.1:$((9090 + i))" \
        --data-dir "$dir/r$i" --egress-log "$dir/r$i-egress.jsonl" &
    done
    ;;
  *)
    echo "usage: $0 nats|replicas" >&2
    exit 2
    ;;
esac
wait
