//! Watching leasegate: the Grafana dashboard's queries against the real `/metrics`, and the
//! admin page at `/` in a real headless Chromium driven over W3C WebDriver.

use crate::support::harness::status_through;
use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_get, admin_text, curl, eventually, http_origin, open_tunnel, proxy_url, raw, read_head,
    status_of, Harness,
};
use crate::support::missing;
use base64::Engine;
use bytes::Bytes;
use http::{header, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use leasegate::contract::Timestamp;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;
use tokio::net::TcpStream;

/// The Grafana dashboard shipped in `deploy/grafana`.
const GRAFANA: &str = include_str!("../../../deploy/grafana/leasegate.json");

/// The names of the samples in Prometheus text (`name{labels} value` or `name value`).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The `leasegate_*` metric names a PromQL expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("leasegate_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Every query string in a dashboard: panel targets' `expr` and template variables'
/// `definition`/`query`.
fn queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "definition" | "query", Value::String(q)) => out.push(q.clone()),
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_grafana_query_reads_a_metric_that_metrics_exposes() {
    let dashboard: Value = serde_json::from_str(GRAFANA).expect("leasegate.json is JSON");
    assert!(dashboard["panels"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));

    // Traffic, so that the per-lease series exist: one allowed call, one refused.
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]))
        .await;
    let proxy = proxy_url(&server, &lease);
    let port = origin.addr.port();
    let allowed = curl(&["-x", &proxy, &format!("http://origin.test:{port}/")], &[]).await;
    assert_eq!(allowed.status, 200);
    let refused = curl(&["-x", &proxy, &format!("http://other.test:{port}/")], &[]).await;
    assert_eq!(refused.status, 403);
    h.egress_lines(2).await;

    let (status, text) = admin_text(&server, "/metrics").await;
    assert_eq!(status, 200);
    let exposed = sample_names(&text);

    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    let expressions = all.iter().filter(|q| q.contains("leasegate_")).count();
    assert!(expressions >= 10, "only {expressions} queries: {all:?}");
    for query in &all {
        for name in metric_names(query) {
            assert!(
                exposed.contains(&name),
                "{name} (in {query:?}) is not in /metrics; it has {exposed:?}"
            );
        }
    }
    // The metrics the dashboard is for are all there.
    let read: BTreeSet<String> = all.iter().flat_map(|q| metric_names(q)).collect();
    for name in [
        "leasegate_requests_total",
        "leasegate_bytes_total",
        "leasegate_decision_seconds_bucket",
        "leasegate_open_tunnels",
        "leasegate_journal_append_failures_total",
        "leasegate_store_lag_seconds",
        "leasegate_store_reconnects_total",
        "leasegate_store_pending_appends",
    ] {
        assert!(read.contains(name), "the dashboard does not show {name}");
    }
}

/// `chromedriver` from Debian's chromium-driver (`.ci/run` installs it when missing).
fn chromedriver_bin() -> String {
    std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_owned())
}

/// One WebDriver command: the answer's status and its `value`.
async fn webdriver(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<(StatusCode, Value), String> {
    let stream = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(header::HOST, addr.to_string())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .unwrap();
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    Ok((status, value["value"].clone()))
}

/// A headless Chromium behind a chromedriver of its own; both go when it drops.
struct Browser {
    /// chromedriver, leader of the process group Chromium runs in.
    driver: tokio::process::Child,
    addr: SocketAddr,
    session: String,
    /// Chromium's profile, apart from any other run's.
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        // A port that was free a moment ago (chromedriver takes no listening socket).
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let driver = tokio::process::Command::new(chromedriver_bin())
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group, so that dropping the browser ends Chromium too.
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e} (install Debian's chromium and chromium-driver; .ci/run does)",
                    chromedriver_bin()
                )
            });
        let ready = eventually(Duration::from_secs(20), || async {
            match webdriver(addr, Method::GET, "/status", None).await {
                Ok((_, status)) if status["ready"] == true => Some(()),
                _ => None,
            }
        })
        .await;
        assert!(ready.is_some(), "chromedriver on {addr} did not get ready");
        let profile = tempfile::tempdir().unwrap();
        let mut options = json!({
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1500,1000",
                format!("--user-data-dir={}", profile.path().display()),
            ],
        });
        if std::path::Path::new("/usr/bin/chromium").exists() {
            options["binary"] = json!("/usr/bin/chromium");
        }
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": options,
        }}});
        let (status, value) = webdriver(addr, Method::POST, "/session", Some(capabilities))
            .await
            .unwrap();
        assert!(status.is_success(), "new session: {status} {value}");
        let session = value["sessionId"].as_str().unwrap().to_owned();
        Browser {
            driver,
            addr,
            session,
            _profile: profile,
        }
    }

    /// A command on this session; a WebDriver error fails the test.
    async fn command(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let path = format!("/session/{}{path}", self.session);
        let (status, value) = webdriver(self.addr, method.clone(), &path, body)
            .await
            .unwrap();
        assert!(status.is_success(), "{method} {path}: {status} {value}");
        value
    }

    async fn goto(&self, url: &str) {
        self.command(Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body) in the page and returns what it returns.
    async fn script(&self, script: &str) -> Value {
        self.command(
            Method::POST,
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Polls `script` until it returns a truthy value, for at most `limit`.
    async fn until(&self, limit: Duration, script: &str) -> Option<Value> {
        eventually(limit, || async {
            let value = self.script(script).await;
            let truthy = !matches!(&value, Value::Null | Value::Bool(false))
                && value != json!("")
                && value != json!(0);
            truthy.then_some(value)
        })
        .await
    }

    async fn element(&self, css: &str) -> String {
        let found = self
            .command(
                Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        found["element-6066-11e4-a52e-4f735466cecf"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let element = self.element(css).await;
        self.command(
            Method::POST,
            &format!("/element/{element}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let element = self.element(css).await;
        self.command(
            Method::POST,
            &format!("/element/{element}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    async fn screenshot(&self) -> Vec<u8> {
        let png = self.command(Method::GET, "/screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap()
    }

    async fn quit(self) {
        let _ = webdriver(
            self.addr,
            Method::DELETE,
            &format!("/session/{}", self.session),
            None,
        )
        .await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Chromium runs in chromedriver's process group: end the group we started.
        if let Some(pid) = self.driver.id() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// `method path` on the admin API with the bearer token: status and JSON body.
async fn admin_with_token(server: &Server, method: &str, path: &str, token: &str) -> (u16, Value) {
    let answer = raw(
        server.admin_addr.unwrap(),
        format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    (
        status_of(&answer),
        serde_json::from_str(body).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_calls_and_refusals_live_and_revokes() {
    if missing(
        &[&chromedriver_bin(), "chromium"],
        "apt-get install chromium chromium-driver; .ci/run does",
    ) {
        return;
    }
    const TOKEN: &str = "dashboard-admin-token";
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    // A refusal revokes its lease (the kill switch): the refused call goes through this one.
    let strayed = h.lease(&["origin.test"], &[]);
    let child = h.lease_with(
        &["origin.test"],
        &[],
        Some(&lease),
        Timestamp::now(),
        Duration::from_secs(1800),
    );
    let mut serve = h.serve_config(
        h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]),
        None,
    );
    serve.admin_token = Some(TOKEN.into());
    let server = Server::start(serve).await.unwrap();
    let admin = server.admin_addr.unwrap();

    // The page loads without the token; it is HTML that fetches nothing from elsewhere.
    let page = raw(
        admin,
        b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&page), 200, "{page}");
    let head = page.split("\r\n\r\n").next().unwrap().to_lowercase();
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(page.contains("<title>leasegate</title>"));
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));
    let post = raw(
        admin,
        b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&post), 405, "{post}");

    let browser = Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    // Without a token the API answers 401, and the page asks for the token.
    browser
        .until(
            Duration::from_secs(5),
            "return getComputedStyle(document.getElementById('auth')).display === 'block';",
        )
        .await
        .expect("the page asks for the admin token");
    browser.type_into("#token", TOKEN).await;
    browser.click("#token-save").await;
    let row = format!("tr.lease[data-lease-id='{lease}']");
    browser
        .until(
            Duration::from_secs(5),
            &format!("return document.querySelector(\"{row}\") !== null;"),
        )
        .await
        .expect("the lease appears once the token is given");
    assert_eq!(
        browser
            .script("return sessionStorage.getItem('leasegate-admin-token');")
            .await,
        TOKEN
    );

    // Traffic: allowed calls through the lease and its child, one refused through `strayed`.
    let port = origin.addr.port();
    let allowed = format!("http://origin.test:{port}/");
    let calls = 1;
    assert_eq!(status_through(&server, &lease, &allowed).await, 200);
    assert_eq!(status_through(&server, &child, &allowed).await, 200);
    assert_eq!(status_through(&server, &strayed, &allowed).await, 200);
    let denied = format!("http://other.test:{port}/");
    assert_eq!(status_through(&server, &strayed, &denied).await, 403);
    let since = std::time::Instant::now();
    let strayed_row = format!("tr.lease[data-lease-id='{strayed}']");
    let field = |row: &str, name: &str| {
        format!(
            "return (document.querySelector(\"{row} [data-field='{name}']\") || {{}}).textContent;"
        )
    };
    let shown = browser
        .until(
            AT_ONCE,
            &format!(
                "const text = (row, f) => (document.querySelector(row + \" [data-field='\" + f + \"']\") || {{}}).textContent;
                 return text(\"{row}\", 'calls') === '{calls}' && text(\"{row}\", 'refused') === '0'
                     && text(\"{strayed_row}\", 'calls') === '2' && text(\"{strayed_row}\", 'refused') === '1';"
            ),
        )
        .await;
    if shown.is_none() {
        panic!(
            "the calls and the refusal do not show within {AT_ONCE:?}: lease calls {} (want {calls}), strayed calls {} refused {}",
            browser.script(&field(&row, "calls")).await,
            browser.script(&field(&strayed_row, "calls")).await,
            browser.script(&field(&strayed_row, "refused")).await
        );
    }
    let refusal = format!("tr.refusal[data-lease-id='{strayed}'][data-code='host-not-allowed']");
    browser
        .until(
            AT_ONCE.saturating_sub(since.elapsed()),
            &format!("return document.querySelector(\"{refusal}\") !== null;"),
        )
        .await
        .expect("the refusal and its code show in time");
    assert_eq!(
        browser
            .script(&format!(
                "return document.querySelector(\"{refusal} [data-field='code']\").textContent;"
            ))
            .await,
        "host-not-allowed"
    );
    assert_eq!(browser.script(&field(&row, "status")).await, "open");
    // The refusal revoked its lease, and the page says so.
    browser
        .until(
            AT_ONCE,
            &format!(
                "return document.querySelector(\"{strayed_row}\").dataset.status === 'revoked';"
            ),
        )
        .await
        .expect("the refused lease shows as revoked");
    browser
        .until(
            AT_ONCE,
            "return document.getElementById('open-count').textContent === '2';",
        )
        .await
        .expect("the header counts two open leases of three");
    let hosts = browser.script(&field(&row, "hosts")).await;
    assert!(
        hosts.as_str().unwrap().contains("origin.test"),
        "top hosts: {hosts}"
    );

    // Revoke: the first click arms the button, the second revokes.
    let button = format!("button.revoke[data-lease-id='{lease}']");
    browser.click(&button).await;
    assert_eq!(
        browser
            .script(&format!(
                "return document.querySelector(\"{button}\").textContent;"
            ))
            .await,
        "Confirm revoke"
    );
    browser.click(&button).await;
    browser
        .until(
            AT_ONCE,
            &format!("return document.querySelector(\"{row}\").dataset.status === 'revoked';"),
        )
        .await
        .expect("the lease shows as revoked");
    let (status, view) = admin_with_token(&server, "GET", &format!("/leases/{lease}"), TOKEN).await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "revoked");
    let (_, view) = admin_with_token(&server, "GET", &format!("/leases/{child}"), TOKEN).await;
    assert_eq!(view["status"], "ancestor-closed");
    let revocations = h.revocations().await;
    let ours: Vec<&Value> = revocations
        .iter()
        .filter(|r| r["lease_id"] == lease.as_str())
        .collect();
    assert_eq!(ours.len(), 1, "{revocations:?}");
    assert_eq!(ours[0]["reason"], "revoked from the dashboard");
    browser.quit().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_pages_through_leases_and_filters_them() {
    if missing(
        &[&chromedriver_bin(), "chromium"],
        "apt-get install chromium chromium-driver; .ci/run does",
    ) {
        return;
    }
    const LEASES: usize = 105;
    let h = Harness::new();
    let leases: Vec<String> = (0..LEASES)
        .map(|_| h.lease(&["origin.test"], &[]))
        .collect();
    let server = h.start(h.config(&[])).await;
    let admin = server.admin_addr.unwrap();
    let browser = Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    const ROWS: &str = "document.querySelectorAll('tr.lease').length";
    // The first page: the newest 100, the count of all, and a way on to the older ones.
    browser
        .until(Duration::from_secs(5), &format!("return {ROWS} === 100;"))
        .await
        .expect("a page of 100 leases");
    let newest = format!("tr.lease[data-lease-id='{}']", leases[LEASES - 1]);
    let oldest = format!("tr.lease[data-lease-id='{}']", leases[0]);
    assert_eq!(
        browser
            .script(&format!("return document.querySelector(\"{newest}\") !== null && document.querySelector(\"{oldest}\") === null;"))
            .await,
        true
    );
    assert_eq!(
        browser
            .script("return document.getElementById('lease-total').textContent;")
            .await,
        "105"
    );
    assert_eq!(
        browser
            .script("return document.getElementById('open-count').textContent;")
            .await,
        "105"
    );
    browser.click("#page-older").await;
    browser
        .until(
            Duration::from_secs(5),
            &format!("return document.querySelectorAll('tr.lease').length === 5 && document.querySelector(\"{oldest}\") !== null;"),
        )
        .await
        .expect("the second page holds the 5 oldest");
    assert_eq!(
        browser
            .script("return document.getElementById('page-older').disabled;")
            .await,
        true
    );
    browser.click("#page-newer").await;
    browser
        .until(Duration::from_secs(5), &format!("return {ROWS} === 100;"))
        .await
        .expect("back on the first page");

    // A status filter: none revoked, then one.
    browser
        .script("const s = document.getElementById('filter-status'); s.value = 'revoked'; s.dispatchEvent(new Event('change')); return true;")
        .await;
    browser
        .until(
            Duration::from_secs(5),
            "return document.querySelectorAll('tr.lease').length === 0 && getComputedStyle(document.getElementById('no-leases')).display === 'block';",
        )
        .await
        .expect("no revoked lease");
    let revoked = &leases[7];
    crate::live::follow::revoke_cli(&h, revoked).await;
    browser
        .until(
            Duration::from_secs(5),
            &format!("return document.querySelectorAll('tr.lease').length === 1 && document.querySelector(\"tr.lease[data-lease-id='{revoked}']\") !== null;"),
        )
        .await
        .expect("the revoked lease, alone");
    browser.quit().await;
    server.shutdown().await;
}

/// Serves `page` (HTML) on every request, from `ip` on a port of its own: another origin, and
/// another site, than an admin API on 127.0.0.1.
async fn serve_page(ip: [u8; 4], page: String) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind(SocketAddr::from((ip, 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let page = page.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

/// A page from another site tries what CSRF and a curious script would: a no-cors POST with a
/// JSON-looking text body, a text/plain form POST spelling JSON, a CORS POST with a JSON body
/// (which needs a preflight), and a read of `/leases`. Nothing is revoked and nothing is read;
/// the dashboard on the admin API's own origin still revokes, with no token configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_from_another_site_cannot_revoke_or_read_leases() {
    if missing(
        &[&chromedriver_bin(), "chromium"],
        "apt-get install chromium chromium-driver; .ci/run does",
    ) {
        return;
    }
    let h = Harness::new();
    let by_fetch = h.lease(&["origin.test"], &[]);
    let by_form = h.lease(&["origin.test"], &[]);
    let by_cors = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[])).await;
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let page = format!(
        r#"<!doctype html><title>elsewhere</title>
<iframe name="sink"></iframe>
<form id="csrf" method="POST" enctype="text/plain" target="sink" action="{admin}/leases/{by_form}/revoke">
<input name='{{"reason":"csrf","x":"' value='"}}'></form>
<script>
window.results = {{}};
const admin = "{admin}";
fetch(admin + "/leases/{by_fetch}/revoke", {{method: "POST", mode: "no-cors", body: '{{"reason":"csrf"}}'}})
  .then(() => results.no_cors = "done", () => results.no_cors = "done");
fetch(admin + "/leases/{by_cors}/revoke", {{method: "POST", headers: {{"Content-Type": "application/json"}}, body: '{{"reason":"csrf"}}'}})
  .then((r) => results.cors = "answered " + r.status, () => results.cors = "blocked");
fetch(admin + "/leases").then((r) => r.text())
  .then((t) => results.read = "read " + t, () => results.read = "blocked");
const sink = document.querySelector("iframe");
sink.addEventListener("load", () => {{ if (sink.contentDocument === null) results.form = "done"; }});
document.getElementById("csrf").submit();
</script>"#
    );
    let elsewhere = serve_page([127, 0, 0, 2], page).await;
    let browser = Browser::start().await;
    browser.goto(&format!("http://{elsewhere}/")).await;
    let results = browser
        .until(
            Duration::from_secs(10),
            "const r = window.results || {}; return r.no_cors && r.cors && r.read && r.form ? r : null;",
        )
        .await
        .expect("the page's four attempts finish");
    assert_eq!(results["cors"], "blocked", "{results}");
    assert_eq!(results["read"], "blocked", "{results}");
    for lease in [&by_fetch, &by_form, &by_cors] {
        let (status, view) = admin_get(&server, &format!("/leases/{lease}")).await;
        assert_eq!(
            (status, view["status"].as_str()),
            (200, Some("open")),
            "{results}"
        );
    }
    assert!(h.revocations().await.is_empty());

    // The admin API's own page, no token configured, still revokes.
    browser.goto(&format!("{admin}/")).await;
    let button = format!("button.revoke[data-lease-id='{by_fetch}']");
    browser
        .until(
            Duration::from_secs(5),
            &format!("return document.querySelector(\"{button}\") !== null;"),
        )
        .await
        .expect("the dashboard lists the lease");
    browser.click(&button).await;
    browser.click(&button).await;
    let row = format!("tr.lease[data-lease-id='{by_fetch}']");
    browser
        .until(
            Duration::from_secs(5),
            &format!("return document.querySelector(\"{row}\").dataset.status === 'revoked';"),
        )
        .await
        .expect("the dashboard revokes");
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1, "{revocations:?}");
    assert_eq!(revocations[0]["lease_id"], by_fetch.as_str());
    browser.quit().await;
    server.shutdown().await;
}

/// `method path` on the admin API with extra header lines: status, body, and the whole
/// answer.
async fn admin_raw(
    server: &Server,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String, String) {
    let answer = raw(
        server.admin_addr.unwrap(),
        format!(
            "{method} {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status_of(&answer), body, answer)
}

/// DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 reaches the admin
/// API with `Host: evil.example:PORT`, and gets nothing. A write must be JSON from the admin
/// API's own origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_only_its_own_host_and_same_origin_json_writes() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[])).await;
    let port = server.admin_addr.unwrap().port();
    let evil = format!("Host: evil.example:{port}\r\n");
    for path in ["/leases", &format!("/leases/{lease}"), "/metrics", "/"] {
        let (status, body, _) = admin_raw(&server, "GET", path, &evil, "").await;
        assert_eq!(status, 421, "{path}: {body}");
        assert!(!body.contains(&lease), "{path}: {body}");
        let error: Value = serde_json::from_str(&body).unwrap();
        assert!(
            error["error"].as_str().unwrap().contains("--admin-host"),
            "{body}"
        );
    }
    let revoke = format!("/leases/{lease}/revoke");
    let json = "Content-Type: application/json\r\n";
    let reason = r#"{"reason":"x"}"#;
    let (status, _, _) =
        admin_raw(&server, "POST", &revoke, &format!("{evil}{json}"), reason).await;
    assert_eq!(status, 421);
    let (status, _, _) = admin_raw(&server, "GET", "/leases", "", "").await;
    assert_eq!(status, 400, "no Host");

    // Its own names: localhost and its address, any port.
    let own = format!("Host: 127.0.0.1:{port}\r\n");
    for host in [own.as_str(), "Host: localhost\r\n", "Host: [::1]:1\r\n"] {
        assert_eq!(
            admin_raw(&server, "GET", "/leases", host, "").await.0,
            200,
            "{host}"
        );
    }

    // Writes: not JSON, or from another origin or site, are refused.
    let refused = [
        ("Content-Type: text/plain\r\n".to_owned(), 415),
        (String::new(), 415),
        (format!("{json}Origin: http://127.0.0.2:{port}\r\n"), 403),
        (format!("{json}Origin: null\r\n"), 403),
        (format!("{json}Sec-Fetch-Site: same-site\r\n"), 403),
        (format!("{json}Sec-Fetch-Site: cross-site\r\n"), 403),
    ];
    for (headers, expected) in &refused {
        let (status, body, _) =
            admin_raw(&server, "POST", &revoke, &format!("{own}{headers}"), reason).await;
        assert_eq!(status, *expected, "{headers}: {body}");
        assert!(serde_json::from_str::<Value>(&body).is_ok(), "{body}");
    }
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "open");
    // The id in upper case names the same lease, shown in lower case.
    let (status, upper) = admin_get(&server, &format!("/leases/{}", lease.to_uppercase())).await;
    assert_eq!(
        (status, &upper["lease_id"]),
        (200, &view["lease_id"]),
        "{upper}"
    );
    assert!(h.revocations().await.is_empty());
    // From its own origin, it revokes; no CORS header is ever sent.
    let same =
        format!("{own}{json}Origin: http://127.0.0.1:{port}\r\nSec-Fetch-Site: same-origin\r\n");
    let (status, _, answer) = admin_raw(&server, "POST", &revoke, &same, reason).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        !answer.to_lowercase().contains("access-control-allow"),
        "{answer}"
    );
    assert_eq!(h.revocations().await.len(), 1);
    server.shutdown().await;
}

/// Calls of the busy lease per round, a second apart: a shape the sparkline must keep.
const SHAPE: [usize; 4] = [2, 5, 1, 4];

/// The page's first paint, with no history of its own, shows the last minutes the server kept:
/// a non-flat sparkline and the mean rate of the last minute. The health panel shows the
/// version and the limits in force; a refusal row shows its agent, rule and whether it revoked;
/// the lease page shows hosts, last requests, children, the allow and deny lists; a revoked
/// lease says why and when it closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_paint_shows_the_minutes_before_it_and_the_lease_page_what_a_lease_did() {
    use crate::admin::dashboard_api::{call, lease_for};
    if missing(
        &[&chromedriver_bin(), "chromium"],
        "apt-get install chromium chromium-driver; .ci/run does",
    ) {
        return;
    }
    let screenshot = std::env::var_os("LEASEGATE_SCREENSHOT").is_some();
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let crawler = lease_for(
        &h,
        "crawler",
        &["origin.test", "api.origin.test"],
        &["secrets.origin.test"],
        None,
    );
    let fetcher = lease_for(&h, "crawler-fetch", &["origin.test"], &[], Some(&crawler));
    let strayed = lease_for(&h, "summarizer", &["origin.test"], &[], None);
    let downloader = lease_for(&h, "downloader", &["origin.test"], &[], None);
    let mut config = h.config(&[
        ("origin.test", "127.0.0.1"),
        ("api.origin.test", "127.0.0.1"),
        ("other.test", "127.0.0.1"),
    ]);
    config.max_connections = 321;
    config.max_connections_per_lease = 17;
    config.max_connections_per_client = 9;
    let server = h.start(config).await;
    let admin = server.admin_addr.unwrap();

    // Traffic before the page is opened: rounds a second apart, in the shape of SHAPE.
    let rounds = if screenshot { 24 } else { SHAPE.len() };
    let (mut on_origin, mut on_api, mut fetched) = (0, 0, 0);
    for round in 0..rounds {
        if round > 0 {
            tokio::time::sleep(Duration::from_millis(1000)).await;
        }
        for i in 0..SHAPE[round % SHAPE.len()] {
            let (host, n) = match i % 2 {
                0 => ("origin.test", &mut on_origin),
                _ => ("api.origin.test", &mut on_api),
            };
            assert_eq!(
                call(&server, &crawler, &format!("http://{host}:{port}/")).await,
                200
            );
            *n += 1;
        }
        assert_eq!(
            call(&server, &fetcher, &format!("http://origin.test:{port}/")).await,
            200
        );
        fetched += 1;
    }
    assert_eq!(
        call(&server, &strayed, &format!("http://origin.test:{port}/")).await,
        200
    );
    assert_eq!(
        call(&server, &strayed, &format!("http://other.test:{port}/")).await,
        403
    );
    let crawled = on_origin + on_api;
    let total = crawled + fetched + 2;
    h.egress_lines(total).await;

    let browser = Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    let row = format!("tr.lease[data-lease-id='{crawler}']");
    // What the page shows as soon as it has painted, read in one go.
    let read = format!(
        "if (!document.body.dataset.paints) return null;
         const row = document.querySelector(\"{row}\");
         const line = row && row.querySelector('svg.spark polyline');
         const points = line ? line.getAttribute('points').split(' ') : [];
         return {{
           paints: Number(document.body.dataset.paints),
           total: document.getElementById('rate-total').textContent,
           rate: row ? row.querySelector(\"[data-field='rate-now']\").textContent : null,
           points: points.length,
           heights: new Set(points.map((p) => p.split(',')[1])).size,
         }};"
    );
    let rate = |n: usize| format!("{:.2}", n as f64 / 60.0);
    let want_total = rate(total);
    let want_rate = format!("{} req/s", rate(crawled));
    let first = browser
        .until(
            Duration::from_secs(10),
            &format!(
                "const r = (() => {{ {read} }})();
                 return r && r.total === '{want_total}' && r.rate === '{want_rate}' ? r : null;"
            ),
        )
        .await;
    let Some(first) = first else {
        let shown = browser.script(&read).await;
        panic!("the first paint shows no rates from before it: {shown} (want total {want_total}, crawler {want_rate})");
    };
    // A page that sampled counters itself could not know the minute before it opened; the
    // second under way is not in the server's history, so a second paint may be needed.
    assert!(first["paints"].as_u64().unwrap() <= 3, "{first}");
    assert_eq!(first["points"], 120, "{first}");
    assert!(
        first["heights"].as_u64().unwrap() >= 3,
        "a flat sparkline: {first}"
    );

    // The health panel.
    let health = |field: &str| {
        format!("return document.querySelector(\"#health [data-field='{field}']\").textContent;")
    };
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let target = format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS);
    for (field, want) in [
        (
            "version",
            format!("{} ({profile}, {target})", env!("CARGO_PKG_VERSION")),
        ),
        ("ready", "yes".to_owned()),
        ("proxy", server.addr.to_string()),
        ("admin", admin.to_string()),
        ("lease-ports", "off".to_owned()),
        ("mode", "enforce, on refusal revoke".to_owned()),
        ("pending", "0".to_owned()),
        ("per-lease", "17".to_owned()),
        ("per-client", "9".to_owned()),
        ("header-timeout", "5 s".to_owned()),
        ("connect-timeout", "10 s".to_owned()),
        ("upstream-timeout", "1 min".to_owned()),
        ("idle-timeout", "60 min".to_owned()),
    ] {
        assert_eq!(
            browser.script(&health(field)).await,
            want.as_str(),
            "{field}"
        );
    }
    let connections = browser.script(&health("connections")).await;
    assert!(
        connections.as_str().unwrap().ends_with(" of 321"),
        "{connections}"
    );

    // The refusal: its lease, agent, code, rule and whether it revoked.
    let refusal = format!("tr.refusal[data-lease-id='{strayed}']");
    let cell = |row: &str, field: &str| {
        format!("return (document.querySelector(\"{row} [data-field='{field}']\") || {{}}).textContent;")
    };
    browser
        .until(
            AT_ONCE,
            &format!("return document.querySelector(\"{refusal}\") !== null;"),
        )
        .await
        .expect("the refusal row");
    assert_eq!(browser.script(&cell(&refusal, "agent")).await, "summarizer");
    assert_eq!(
        browser.script(&cell(&refusal, "code")).await,
        "host-not-allowed"
    );
    assert_eq!(browser.script(&cell(&refusal, "revoked")).await, "revoked");
    assert_eq!(
        browser.script(&cell(&refusal, "lease")).await,
        &strayed[..8]
    );
    let (_, refusals) = admin_get(&server, "/refusals").await;
    let rule = &refusals["refusals"][0]["rule"];
    assert!(!rule.is_null(), "refusals carry \"rule\": {refusals}");
    assert_eq!(browser.script(&cell(&refusal, "rule")).await, *rule);

    if screenshot {
        let png = browser.screenshot().await;
        assert!(png.starts_with(b"\x89PNG"));
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/images/dashboard.png");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, png).unwrap();
    }

    // The lease page, from the lease's link.
    browser.click(&format!("{row} a")).await;
    browser
        .until(
            AT_ONCE,
            &format!("return document.getElementById('lp-id').textContent === '{crawler}' && document.querySelectorAll('#lp-requests tr').length > 0;"),
        )
        .await
        .expect("the lease page opens");
    let texts = |css: &str| {
        format!("return [...document.querySelectorAll(\"{css}\")].map((e) => e.textContent);")
    };
    assert_eq!(
        browser.script(&texts("#lp-agent")).await,
        json!(["crawler"])
    );
    assert_eq!(
        browser.script(&texts("#lp-calls")).await,
        json!([crawled.to_string()])
    );
    assert_eq!(
        browser
            .script(&texts(
                "#lp-hosts tr [data-field='host'], #lp-hosts tr [data-field='calls']"
            ))
            .await,
        json!([
            "origin.test",
            on_origin.to_string(),
            "api.origin.test",
            on_api.to_string()
        ])
    );
    // No model budget and no metered call: the model table says so, with no rows.
    assert_eq!(
        browser
            .script("return [document.querySelectorAll('#lp-model tr').length, document.getElementById('lp-no-model').style.display];")
            .await,
        json!([0, "block"])
    );
    let requests = browser.script(&texts("#lp-requests tr")).await;
    assert_eq!(
        requests.as_array().unwrap().len(),
        crawled.min(50),
        "{requests}"
    );
    let last = browser
        .script(&texts("#lp-requests tr:first-child td"))
        .await;
    let last: Vec<&str> = last
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let last_host = match SHAPE[(rounds - 1) % SHAPE.len()] % 2 {
        0 => "api.origin.test",
        _ => "origin.test",
    };
    assert_eq!(
        &last[1..6],
        ["GET", &format!("{last_host}:{port}"), "allow", "–", "200"],
        "{last:?}"
    );
    assert_eq!(
        browser.script(&texts("#lp-children tr td")).await,
        json!([&fetcher[..8], "crawler-fetch", "open"])
    );
    assert_eq!(
        browser.script(&texts("#lp-allow li")).await,
        json!(["origin.test", "api.origin.test"])
    );
    assert_eq!(
        browser.script(&texts("#lp-deny li")).await,
        json!(["secrets.origin.test"])
    );
    assert_eq!(
        browser
            .script("return getComputedStyle(document.getElementById('overview')).display;")
            .await,
        "none"
    );

    // An open tunnel's bytes, live, on its lease's page.
    let mut tunnel = open_tunnel(
        server.addr,
        &format!("origin.test:{port}"),
        Some(&downloader),
    )
    .await;
    {
        use tokio::io::AsyncWriteExt;
        tunnel
            .write_all(format!("GET / HTTP/1.1\r\nHost: origin.test:{port}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        read_head(&mut tunnel).await;
    }
    browser
        .goto(&format!("http://{admin}/#/lease/{downloader}"))
        .await;
    browser
        .until(
            AT_ONCE,
            &format!("return document.getElementById('lp-id').textContent === '{downloader}';"),
        )
        .await
        .expect("the downloader's page");
    let (_, view) = admin_get(&server, &format!("/leases/{downloader}")).await;
    assert!(
        view.get("open").is_some(),
        "lease objects carry \"open\": {view}"
    );
    let shown = browser
        .until(
            AT_ONCE,
            "const row = document.querySelector('#lp-open tr.open');
             return row && row.querySelector(\"[data-field='bytes-up']\").textContent !== '0 B'
                 ? [...row.children].map((td) => td.textContent) : null;",
        )
        .await
        .expect("the open tunnel with its bytes so far");
    assert_eq!(shown[0], "connect", "{shown}");
    assert_eq!(shown[1], format!("origin.test:{port}"), "{shown}");
    drop(tunnel);

    // A lease revoked from its page says why and when it closed, there and in the list.
    browser
        .goto(&format!("http://{admin}/#/lease/{fetcher}"))
        .await;
    browser
        .until(
            AT_ONCE,
            &format!("return document.getElementById('lp-id').textContent === '{fetcher}' && getComputedStyle(document.getElementById('lp-revoke')).visibility === 'visible';"),
        )
        .await
        .expect("the fetcher's page, with its revoke button");
    browser.click("#lp-revoke").await;
    assert_eq!(
        browser
            .script("return document.getElementById('lp-revoke').textContent;")
            .await,
        "Confirm revoke"
    );
    browser.click("#lp-revoke").await;
    browser
        .until(
            AT_ONCE,
            "return document.getElementById('lp-status').textContent === 'revoked';",
        )
        .await
        .expect("the page shows the lease revoked");
    let revocations = h.revocations().await;
    let ours: Vec<&Value> = revocations
        .iter()
        .filter(|r| r["lease_id"] == fetcher.as_str())
        .collect();
    assert_eq!(ours.len(), 1, "{revocations:?}");
    assert_eq!(ours[0]["reason"], "revoked from the dashboard");
    let on_page = browser
        .script("return document.getElementById('lp-closed').textContent;")
        .await;
    browser.goto(&format!("http://{admin}/#/")).await;
    let fetcher_row = format!("tr.lease[data-lease-id='{fetcher}']");
    browser
        .until(AT_ONCE, &format!("return (document.querySelector(\"{fetcher_row}\") || {{dataset: {{}}}}).dataset.status === 'revoked';"))
        .await
        .expect("the child shows as revoked");
    let (_, view) = admin_get(&server, &format!("/leases/{fetcher}")).await;
    assert!(
        view.get("closed").is_some(),
        "lease objects carry \"closed\": {view}"
    );
    let closed = browser.script(&cell(&fetcher_row, "closed")).await;
    let closed = closed.as_str().unwrap();
    assert!(closed.starts_with("revoked at "), "{closed}");
    assert!(closed.ends_with(": revoked from the dashboard"), "{closed}");
    assert_eq!(on_page, closed);
    browser.quit().await;
    server.shutdown().await;
}

/// A `tools/call` of `tool` to the plain MCP server `mcp.notes.test` on `port`, as `lease`,
/// sent in the background: the raw answer.
fn held_call(
    proxy: SocketAddr,
    port: u16,
    lease: &str,
    tool: &str,
) -> tokio::task::JoinHandle<String> {
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{{"name":"{tool}","arguments":{{}}}}}}"#
    );
    let request = crate::support::harness::mcp_post_to("mcp.notes.test", port, lease, &body);
    tokio::spawn(
        async move { crate::support::harness::raw_to_close(proxy, request.as_bytes()).await },
    )
}

/// The approval buttons: a call held for a human shows with Approve and Deny (behind the admin
/// token); Approve lets it go on, Deny refuses it with the reason typed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_approves_and_denies_held_calls() {
    if missing(
        &[&chromedriver_bin(), "chromium"],
        "apt-get install chromium chromium-driver; .ci/run does",
    ) {
        return;
    }
    const TOKEN: &str = "dashboard-approvals-token";
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease_from(
        &["mcp.notes.test"],
        json!({"allow": {"tools": ["notes/send_mail", "notes/delete_note"]},
               "approvals": ["notes/send_mail", "notes/delete_note"]}),
        None,
    );
    let mut config = h.config(&[("mcp.notes.test", "127.0.0.1")]);
    let mcp = format!("notes=http://mcp.notes.test:{port}/mcp");
    crate::support::harness::with_mcp_server(&mut config, &mcp);
    let mut serve = h.serve_config(config, None);
    serve.admin_token = Some(TOKEN.into());
    let server = Server::start(serve).await.unwrap();
    let admin = server.admin_addr.unwrap();

    let browser = Browser::start().await;
    browser.goto(&format!("http://{admin}/")).await;
    browser
        .script(&format!(
            "sessionStorage.setItem('leasegate-admin-token', '{TOKEN}'); location.reload();"
        ))
        .await;
    let held = held_call(server.addr, port, &lease, "send_mail");
    let row = "tr.approval";
    browser
        .until(
            Duration::from_secs(10),
            &format!("return document.querySelector(\"{row}\") !== null;"),
        )
        .await
        .expect("the held call is listed");
    assert_eq!(
        browser
            .script(&format!(
                "return document.querySelector(\"{row} [data-field=tool]\").textContent;"
            ))
            .await,
        "notes/send_mail"
    );
    browser.click(&format!("{row} button.approve")).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the approved call goes on")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    browser
        .until(
            Duration::from_secs(10),
            &format!("return document.querySelector(\"{row}\") === null;"),
        )
        .await
        .expect("a decided call leaves the list");

    let held = held_call(server.addr, port, &lease, "delete_note");
    browser
        .until(
            Duration::from_secs(10),
            &format!("return document.querySelector(\"{row}\") !== null;"),
        )
        .await
        .expect("the second held call is listed");
    browser
        .script("window.prompt = () => 'not from the dashboard'; return null;")
        .await;
    browser.click(&format!("{row} button.deny")).await;
    let answer = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the denied call is answered")
        .unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 403 approval-denied"),
        "{answer}"
    );
    assert!(answer.contains("not from the dashboard"), "{answer}");
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the approved call reached the server"
    );
    browser.quit().await;
}
