#!/usr/bin/env bash
# Development CA and proxy server certificate for leasegate's TLS listener.
#
#   certs/make-dev-certs.sh [EXTRA_SAN...]    e.g. proxy.internal 10.0.0.5 DNS:*.lab
#
# Writes to $OUT_DIR (default certs/out): ca.pem, ca.key, server.pem, server.key.
# An existing CA is reused, so re-running to add a SAN keeps clients' trust in ca.pem.
# For development only: the CA can sign for any name, so trust it nowhere else.
set -euo pipefail

OUT_DIR=${OUT_DIR:-"$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/out"}
DAYS=825 # the longest validity Apple platforms accept for a TLS server certificate

command -v openssl >/dev/null || { echo "make-dev-certs: openssl not found" >&2; exit 1; }

san="DNS:localhost,DNS:leasegate,IP:127.0.0.1"
for name in "$@"; do
  if [[ $name == *[,[:space:]]* || -z $name ]]; then
    echo "make-dev-certs: bad SAN '$name'" >&2; exit 2
  fi
  case $name in
    DNS:*|IP:*) san+=",$name" ;;
    *:*) san+=",IP:$name" ;; # IPv6
    *) if [[ $name =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi ;;
  esac
done

# Keys must never be readable by others, not even for the instant before a chmod.
umask 077
mkdir -p "$OUT_DIR"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -s $OUT_DIR/ca.pem && -s $OUT_DIR/ca.key ]]; then
  echo "reusing CA $OUT_DIR/ca.pem"
else
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/ca.key"
  openssl req -x509 -new -sha256 -days "$DAYS" -key "$work/ca.key" -out "$work/ca.pem" \
    -subj "/O=leasegate development/CN=leasegate development CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash"
  mv "$work/ca.key" "$work/ca.pem" "$OUT_DIR/"
fi

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$work/server.key"
openssl req -new -sha256 -key "$work/server.key" -out "$work/server.csr" \
  -subj "/O=leasegate development/CN=leasegate"
cat > "$work/server.ext" <<EXT
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=$san
subjectKeyIdentifier=hash
authorityKeyIdentifier=keyid
EXT
openssl x509 -req -sha256 -days "$DAYS" -in "$work/server.csr" \
  -CA "$OUT_DIR/ca.pem" -CAkey "$OUT_DIR/ca.key" \
  -set_serial "0x$(openssl rand -hex 16)" -extfile "$work/server.ext" -out "$work/server.pem"
mv "$work/server.key" "$work/server.pem" "$OUT_DIR/"

chmod 0600 "$OUT_DIR/ca.key" "$OUT_DIR/server.key"
chmod 0644 "$OUT_DIR/ca.pem" "$OUT_DIR/server.pem"
openssl verify -CAfile "$OUT_DIR/ca.pem" "$OUT_DIR/server.pem" >/dev/null

echo "CA:     $OUT_DIR/ca.pem (key $OUT_DIR/ca.key)"
echo "server: $OUT_DIR/server.pem (key $OUT_DIR/server.key), SANs: $san"
