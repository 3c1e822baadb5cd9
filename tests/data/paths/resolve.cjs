// What the WHATWG URL parser (Node's `URL`, and so Express, Fastify and browsers) makes of a
// request target: each argument is a raw target; prints its `pathname` as JSON, or "error".
for (const raw of process.argv.slice(2)) {
  try {
    console.log(JSON.stringify(new URL(raw, "http://origin.test").pathname));
  } catch (e) {
    console.log("error");
  }
}
