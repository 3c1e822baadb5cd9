// A Node client for the clients tests: GET one URL with `fetch`, printing "status N", a
// refusal's code (the X-Leasegate-Refusal header) when there is one, and the body, or the
// error and each of its causes on a line of its own; exits 0 for a 2xx answer, 1 otherwise.
//
//   node fetch_get.cjs undici|builtin URL
//
// `undici`: undici's fetch with its EnvHttpProxyAgent, which reads HTTPS_PROXY, HTTP_PROXY
// and NO_PROXY (undici is found through NODE_PATH). `builtin`: Node's own fetch as it is,
// which on Node 20 ignores every proxy variable. NODE_EXTRA_CA_CERTS names the CA to trust.
'use strict';

async function main(mode, url) {
  let response;
  if (mode === 'undici') {
    const { fetch, EnvHttpProxyAgent } = require('undici');
    response = await fetch(url, { dispatcher: new EnvHttpProxyAgent() });
  } else {
    response = await fetch(url);
  }
  const body = await response.text();
  const refusal = response.headers.get('x-leasegate-refusal');
  const code = refusal ? `x-leasegate-refusal: ${refusal}\n` : '';
  process.stdout.write(`status ${response.status}\n${code}${body}`);
  return response.ok ? 0 : 1;
}

main(process.argv[2], process.argv[3]).then(
  (code) => process.exit(code),
  (err) => {
    // fetch rejects with "TypeError: fetch failed"; why is in err.cause (and its causes).
    for (let e = err, depth = 0; e; e = e.cause, depth++) {
      const code = e.code ? ` [${e.code}]` : '';
      console.log(`${'cause: '.repeat(depth ? 1 : 0)}${e.name}: ${e.message}${code}`);
    }
    process.exit(1);
  },
);
