// A Node client for `leasegate run`: GET each URL with Node's own `fetch` and then with
// `http.get`/`https.get`, with no proxy setup of its own, printing one line per call:
//
//   fetch URL status N BODY          or   fetch URL error MESSAGE [CODE] refusal=CODE
//   get URL status N BODY            or   get URL error MESSAGE [CODE] refusal=CODE
//
// (BODY: the answer's first line; for fetch the error is its cause, as `fetch failed` says
// nothing). Exits 0 once every call has been tried.
'use strict';
const http = require('node:http');
const https = require('node:https');

const firstLine = (text) => text.split('\n')[0];
const failed = (what, url, e) => {
  const refusal = e.refusal ? ` refusal=${e.refusal}` : '';
  console.log(`${what} ${url} error ${e.message} [${e.code || ''}]${refusal}`);
};

const viaFetch = async (url) => {
  try {
    const response = await fetch(url);
    console.log(`fetch ${url} status ${response.status} ${firstLine(await response.text())}`);
  } catch (e) {
    failed('fetch', url, e.cause || e);
  }
};

const viaGet = (url) => new Promise((done) => {
  const module = url.startsWith('https:') ? https : http;
  module.get(url, (response) => {
    let body = '';
    response.setEncoding('utf8');
    response.on('data', (chunk) => { body += chunk; });
    response.on('end', () => {
      console.log(`get ${url} status ${response.statusCode} ${firstLine(body)}`);
      done();
    });
  }).on('error', (e) => { failed('get', url, e); done(); });
});

(async () => {
  for (const url of process.argv.slice(2)) {
    await viaFetch(url);
    await viaGet(url);
  }
})();
