#!/usr/bin/env bash
# The orchestrator's flow in plain HTTP, with curl and python3 (for the JSON; no jq needed):
# issue a root lease, issue a child of it with the root's own token, fetch a URL through the
# proxy under the child, complete both and print what they used.
#
#   leasegate serve --dev &          # writes .leasegate/admin-token
#   bash examples/issue.sh https://example.com/
#
# The admin API: $LEASEGATE_ADMIN_URL (default http://127.0.0.1:3129); its token:
# $LEASEGATE_ADMIN_TOKEN, else the file $LEASEGATE_ADMIN_TOKEN_FILE names, else
# ./.leasegate/admin-token when it exists. The URL: the argument, else $LEASEGATE_EXAMPLE_URL.
set -euo pipefail

url="${1:-${LEASEGATE_EXAMPLE_URL:-https://example.com/}}"
admin_url="${LEASEGATE_ADMIN_URL:-http://127.0.0.1:3129}"
admin_url="${admin_url%/}"
admin_token="${LEASEGATE_ADMIN_TOKEN:-}"
if [ -z "$admin_token" ]; then
  token_file="${LEASEGATE_ADMIN_TOKEN_FILE:-.leasegate/admin-token}"
  if [ -f "$token_file" ]; then
    admin_token=$(tr -d '[:space:]' <"$token_file")
  elif [ -n "${LEASEGATE_ADMIN_TOKEN_FILE:-}" ]; then
    echo "issue.sh: $token_file does not exist" >&2
    exit 1
  fi
fi

# field PATH: the member at the dotted PATH of the JSON on stdin (a string as it is, anything
# else as JSON; list members by index).
field() {
  python3 -c '
import json, sys
value = json.load(sys.stdin)
for key in sys.argv[1].split("."):
    value = value[int(key)] if isinstance(value, list) else value[key]
print(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))' "$1"
}

# admin METHOD PATH BEARER BODY: one admin call, straight to the admin API (--noproxy: never
# through an HTTPS_PROXY the environment names); the bearer goes in a header file, not argv.
# Prints the answer; a non-2xx answer is printed on stderr and fails.
admin() {
  local method="$1" path="$2" bearer="$3" body="$4" answer status
  answer=$(curl -sS --noproxy '*' -X "$method" \
    -H 'Content-Type: application/json' \
    -H @<(if [ -n "$bearer" ]; then printf 'Authorization: Bearer %s\n' "$bearer"; fi) \
    --data "$body" -w '\n%{http_code}' "$admin_url$path")
  status="${answer##*$'\n'}"
  answer="${answer%$'\n'*}"
  if [ "${status:0:1}" != 2 ]; then
    echo "issue.sh: $method $path answered $status: $answer" >&2
    return 1
  fi
  printf '%s\n' "$answer"
}

# manifest NAME PURPOSE TOKENS HOST...: a declared manifest as JSON.
manifest() {
  python3 -c '
import json, sys
name, purpose, tokens, *hosts = sys.argv[1:]
print(json.dumps({"agent": {"name": name}, "intent": {"purpose": purpose},
                  "allow": {"hosts": hosts}, "budget": {"tokens": int(tokens)}}))' "$@"
}

host=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.urlsplit(sys.argv[1]).hostname or "")' "$url")
if [ -z "$host" ]; then
  echo "issue.sh: $url has no host" >&2
  exit 1
fi

# 1. A root lease, as the operator: the host of the URL, 10000 tokens, ten minutes.
root=$(admin POST /leases "$admin_token" \
  "{\"manifest\": $(manifest shell-root "fetch $url" 10000 "$host"), \"lifetime_seconds\": 600}")
root_id=$(field lease_id <<<"$root")
root_token=$(field token <<<"$root")
echo "root $root_id: hosts $(field manifest.allow.hosts <<<"$root"), tokens $(field manifest.budget.tokens <<<"$root")"

# 2. A child, with the root's own token as the bearer (no parent named: its own). It asks for
# another host too, which its parent does not have: the answer says what was narrowed.
child=$(admin POST /leases "$root_token" \
  "{\"manifest\": $(manifest shell-child "fetch $url once" 1000 "$host" other.example)}")
child_id=$(field lease_id <<<"$child")
child_token=$(field token <<<"$child")
child_proxy=$(field proxy_url <<<"$child")
echo "child $child_id of $(field parent_lease_id <<<"$child"): hosts $(field manifest.allow.hosts <<<"$child"), tokens $(field manifest.budget.tokens <<<"$child")"
echo "  narrowed: $(field narrowed <<<"$child")"

# 3. The agent: curl through the proxy under the child's lease, with only the lease's variables.
body=$(mktemp)
trap 'rm -f "$body"' EXIT
code=$(env -u NO_PROXY -u no_proxy -u ALL_PROXY -u all_proxy \
  http_proxy="$child_proxy" HTTPS_PROXY="$child_proxy" https_proxy="$child_proxy" \
  curl -sS --max-time 30 -o "$body" -w '%{http_code}' "$url" || true)
echo "curl $url under the child: $code $(head -c 200 "$body" | head -n 1)"

# 4. Complete both, children first: the child with its own token, the root as the operator.
completed=$(admin POST "/leases/$child_id/complete" "$child_token" '{}')
echo "completed child $child_id: usage $(field usage <<<"$completed")"
completed=$(admin POST "/leases/$root_id/complete" "$admin_token" '{"reason": "issue.sh is done"}')
echo "completed root $root_id: usage $(field usage <<<"$completed")"
[ "$code" = 200 ]
