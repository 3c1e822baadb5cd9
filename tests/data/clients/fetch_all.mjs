// A client for Deno and Bun under `leasegate run`: GET each URL with the runtime's own
// `fetch`, with no proxy setup of its own, printing one line per call:
//
//   URL status N BODY      or   URL error MESSAGE
//
// (BODY: the answer's first line; MESSAGE: the error's, then its causes'). Exits 0 once
// every call has been tried.
//
//   deno run --allow-net --allow-env fetch_all.mjs URL...     bun fetch_all.mjs URL...
const urls = globalThis.Deno ? Deno.args : process.argv.slice(2);
for (const url of urls) {
  try {
    const response = await fetch(url);
    const body = await response.text();
    console.log(`${url} status ${response.status} ${body.split('\n')[0]}`);
  } catch (e) {
    const messages = [];
    for (let c = e; c; c = c.cause) messages.push(c.message);
    console.log(`${url} error ${messages.join(' | ')}`);
  }
}
