#!/bin/sh
# curl as an agent runs it through a terminated host: the proxy from HTTPS_PROXY, the CA from
# CURL_CA_BUNDLE, the placeholder from GITHUB_TOKEN in its Authorization header.
#
#   sh curl_get.sh --http1.1|--http2 URL
#
# Prints "status N HTTP/V", a refusal's code (x-leasegate-refusal: CODE) when there is one,
# and the body; exits 0 for a 2xx answer, curl's code when it fails, 1 otherwise.
set -u
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
written=$(curl -sS --max-time 20 "$1" -H "Authorization: Bearer $GITHUB_TOKEN" \
  -D "$dir/head" -o "$dir/body" -w '%{http_code} %{http_version}' "$2") || exit $?
set -- $written
echo "status $1 HTTP/$2"
tr -d '\r' <"$dir/head" | sed -n 's/^[Xx]-[Ll]easegate-[Rr]efusal: */x-leasegate-refusal: /p'
cat "$dir/body"
case "$1" in 2??) exit 0 ;; *) exit 1 ;; esac
