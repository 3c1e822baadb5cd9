// undici's fetch as an agent runs it through a terminated host: the proxy from HTTPS_PROXY
// (EnvHttpProxyAgent), the CA from NODE_EXTRA_CA_CERTS, the placeholder from GITHUB_TOKEN in
// its Authorization header. HTTP/1.1: undici's HTTP/2 (allowH2) is experimental and its fetch
// does not say which version answered.
//
//   node fetch_get.cjs URL
//
// Prints "status N HTTP/1.1", a refusal's code (x-leasegate-refusal: CODE) when there is one,
// and the body, or the error and its causes; exits 0 for a 2xx answer, 1 otherwise.
'use strict';

const { fetch, EnvHttpProxyAgent } = require('undici');

async function main(url) {
  const response = await fetch(url, {
    dispatcher: new EnvHttpProxyAgent(),
    headers: { authorization: `Bearer ${process.env.GITHUB_TOKEN}` },
  });
  const body = await response.text();
  const refusal = response.headers.get('x-leasegate-refusal');
  const code = refusal ? `x-leasegate-refusal: ${refusal}\n` : '';
  process.stdout.write(`status ${response.status} HTTP/1.1\n${code}${body}`);
  return response.ok ? 0 : 1;
}

main(process.argv[2]).then(
  (code) => process.exit(code),
  (err) => {
    for (let e = err, depth = 0; e; e = e.cause, depth++) {
      console.log(`${depth ? 'cause: ' : ''}${e.name}: ${e.message}`);
    }
    process.exit(1);
  },
);
