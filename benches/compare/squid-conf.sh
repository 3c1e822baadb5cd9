# Sourced by run.sh and cost.sh: the Squid configuration both measure.
#
#   squid_conf DIR PORT WORKERS NOFILE [AFFINITY_LINE] > DIR/squid.conf
#
# Logs, pid and hosts file live in DIR (origin.test's address is DIR/hosts); one access-log
# line per request or tunnel, like leasegate's egress log; no cache; origin.test only.
squid_conf() {
  cat <<EOC
http_port 127.0.0.1:$2
workers $3
${5:-}
pid_filename $1/squid.pid
coredump_dir $1
cache_effective_user proxy
hosts_file $1/hosts
# The same allow list as the lease: origin.test only, CONNECT to any port.
acl allowed dstdomain origin.test
http_access allow allowed
http_access deny all
cache deny all
# One line per request or tunnel, like leasegate's egress log.
access_log stdio:$1/squid-access.log
cache_log $1/squid-cache.log
cache_store_log none
logfile_rotate 0
pinger_enable off
max_filedescriptors $4
shutdown_lifetime 1 second
EOC
  touch "$1/squid-access.log" "$1/squid-cache.log"
  chown proxy "$1/squid-access.log" "$1/squid-cache.log" 2>/dev/null || true
}
