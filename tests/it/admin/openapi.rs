//! The admin API's OpenAPI document against a real server: every (operation, status) it
//! declares is provoked at least once and every answer is checked against it, so the document
//! claims nothing no answer shows, and no answer goes undocumented. (Every answer the other
//! tests get through `admin_call`, `admin_get` and `admin_text` is checked against it too.)

use crate::support::harness::{
    eventually, exchange, http_origin, port_range, raw, status_of, status_through,
    streaming_tunnel, Harness,
};
use crate::support::openapi::{self, Answered, OTHER_METHOD, OTHER_PATH};
use leasegate::admin::MAX_CONNECTIONS;
use leasegate::contract::Keyring;
use leasegate::intercept::ca;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "openapi-admin-token";

/// A lease id no journal holds.
const UNKNOWN: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

/// An approval id no store holds.
const NO_APPROVAL: &str = "apr-00000000000000000000000000000000";

/// One secret, for the agent `coder`: its leases get a placeholder and the interception CA.
const SECRETS: &str = r#"
[[secret]]
id = "github"
hosts = ["secret.test"]
header = "Authorization"
format = "Bearer {value}"
env = "LG_OPENAPI_GITHUB_PAT"
agents = ["coder"]
env_name = "GITHUB_TOKEN"
"#;

/// What the document declares that this test does not provoke, and why.
const NOT_PROVOKED: &[(&str, u16, &str)] = &[
    // A walk (`/leases`, a `/metrics` render) that panics on the walks' threads: no request
    // makes one panic.
    ("GET /metrics", 500, "a render that panics"),
    ("GET /leases", 500, "a walk that panics"),
    // The lease's signing key not in the keyring: a lease is only loaded when a key of the
    // keyring verifies it, so the key is always there.
    (
        "GET /leases/{id}/placeholders",
        500,
        "a loaded lease without its key",
    ),
    // No record could be built for a known lease (no key signs its records, or the record
    // does not build): as above, a loaded lease's key is in the keyring.
    ("POST /leases/{id}/revoke", 500, "no record can be built"),
    ("POST /leases/{id}/complete", 500, "no record can be built"),
    ("POST /leases/{id}/stop", 500, "no record can be built"),
    // As above: a call is held only once its lease's key signed its request.
    (
        "POST /approvals/{id}",
        500,
        "a held call's lease without its key",
    ),
];

/// Requests to the admin API, each answer checked against the document and noted.
struct Probe {
    admin: SocketAddr,
    seen: BTreeSet<Answered>,
}

impl Probe {
    /// `method path` with exactly `head` (header lines, each ending in CRLF: no `Host` unless
    /// it has one) and `body`: the status and the JSON body (null if it is not JSON).
    async fn exact(&mut self, method: &str, path: &str, head: &str, body: &str) -> (u16, Value) {
        let request = format!(
            "{method} {path} HTTP/1.1\r\n{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let answer = raw(self.admin, request.as_bytes()).await;
        self.note(method, path, &answer)
    }

    /// Checks and notes `answer` to `method path`.
    fn note(&mut self, method: &str, path: &str, answer: &str) -> (u16, Value) {
        let answered = openapi::check(method, path, answer)
            .unwrap_or_else(|| panic!("{method} {path} got no answer"));
        let status = answered.status;
        self.seen.insert(answered);
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        (status, serde_json::from_str(body).unwrap_or(Value::Null))
    }

    /// `method path` from `localhost` with `bearer` (none: no `Authorization`), JSON for a
    /// write.
    async fn with(
        &mut self,
        bearer: Option<&str>,
        method: &str,
        path: &str,
        body: &str,
    ) -> (u16, Value) {
        let mut head = "Host: localhost\r\n".to_owned();
        if let Some(token) = bearer {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        if method != "GET" {
            head.push_str("Content-Type: application/json\r\n");
        }
        self.exact(method, path, &head, body).await
    }

    /// `method path` as the operator (the admin token).
    async fn admin(&mut self, method: &str, path: &str, body: &str) -> (u16, Value) {
        self.with(Some(TOKEN), method, path, body).await
    }

    /// `method path` as the operator until `done` says of its answer that it is the one
    /// awaited (for at most `limit`): that answer.
    async fn until(
        &mut self,
        method: &str,
        path: &str,
        limit: Duration,
        done: impl Fn(u16, &Value) -> bool,
    ) -> Value {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let (status, answer) = self.admin(method, path, "").await;
            if done(status, &answer) {
                return answer;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{method} {path} still answers {status} {answer}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Issues a lease as the operator (or `bearer`) from `body`: the answer, which must be 201.
    async fn issued(&mut self, bearer: Option<&str>, body: &Value) -> Value {
        let (status, answer) = self
            .with(bearer.or(Some(TOKEN)), "POST", "/leases", &body.to_string())
            .await;
        assert_eq!(status, 201, "{answer}");
        answer
    }
}

/// A `POST /leases` body: a lease of `agent` for `hosts` with `budget`.
fn asking(agent: &str, hosts: &[&str], budget: Value) -> Value {
    json!({
        "manifest": {
            "agent": {"name": agent},
            "intent": {"purpose": "the OpenAPI document's test"},
            "allow": {"hosts": hosts},
            "budget": budget,
        },
        "lifetime_seconds": 600,
    })
}

fn id_of(issued: &Value) -> String {
    issued["lease_id"].as_str().unwrap().to_owned()
}

/// `method path` with a body announced and never sent, after a body's time is up (10 s): the
/// whole answer.
async fn without_its_body(admin: SocketAddr, method: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(admin).await.unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer));
    let _ = read.await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// The broker: the secrets of [`SECRETS`] under a CA for `secret.test`.
fn broker(h: &Harness) -> std::sync::Arc<leasegate::intercept::Broker> {
    // Origins verified against a CA of their own (the system may have no roots).
    let upstream = ca::make(&["upstream.test".into()], Duration::from_secs(3600)).unwrap();
    let upstream_pem = h.dir.path().join("upstream-ca.pem");
    std::fs::write(&upstream_pem, &upstream.cert_pem).unwrap();
    h.broker(
        &["secret.test"],
        SECRETS,
        &[("LG_OPENAPI_GITHUB_PAT", "ghp_openapi0123456789abcdef")],
        Some(&upstream_pem),
    )
}

/// The leases the phases share, all issued through `POST /leases`.
struct Leases {
    /// The agent `coder`'s: a model budget, a wall-clock budget, one child at most, a
    /// placeholder.
    coder: String,
    /// `coder`'s proxy token.
    coder_token: String,
    /// Another open lease.
    other: String,
    /// The lease whose request is refused (and so revoked).
    refuser: String,
    /// Leases to revoke, complete and stop, twice over.
    ends: Vec<String>,
}

fn leases_of(id: &str, rest: &str) -> String {
    format!("/leases/{id}{rest}")
}

/// One request of each operation, another method and another path.
fn every(l: &Leases) -> Vec<(&'static str, String)> {
    vec![
        ("GET", "/".into()),
        ("GET", "/healthz".into()),
        ("GET", "/readyz".into()),
        ("GET", "/status".into()),
        ("GET", "/metrics".into()),
        ("GET", "/leases".into()),
        ("POST", "/leases".into()),
        ("GET", leases_of(&l.coder, "")),
        ("GET", leases_of(&l.coder, "/requests")),
        ("GET", leases_of(&l.coder, "/placeholders")),
        ("POST", leases_of(&l.coder, "/revoke")),
        ("POST", leases_of(&l.coder, "/complete")),
        ("POST", leases_of(&l.coder, "/stop")),
        ("GET", "/approvals".into()),
        ("GET", format!("/approvals/{NO_APPROVAL}")),
        ("POST", format!("/approvals/{NO_APPROVAL}")),
        ("GET", "/refusals".into()),
        (
            "GET",
            format!("/check?lease={}&target=origin.test", l.coder),
        ),
        ("GET", "/rates".into()),
        ("DELETE", "/status".into()),
        ("GET", "/nope".into()),
    ]
}

/// The phases are functions of their own, each boxed: one async fn holding them all has a
/// frame too large for a test thread's stack in a debug build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_declared_answer_is_given_and_every_answer_is_declared() {
    // Every schema compiles and every reference resolves, before any answer needs one.
    openapi::compile_all();
    let h = Harness::new();
    let origin = http_origin().await;
    // A lease whose tool waits for a human, on an MCP server the origin stands in for.
    let approver = h.lease_from(
        &["origin.test"],
        json!({"allow": {"tools": ["notes/send_mail"]}, "approvals": ["notes/send_mail"]}),
        None,
    );
    let mut proxy = h.config(&[("origin.test", "127.0.0.1")]);
    let mcp = format!("notes=http://origin.test:{}/mcp", origin.addr.port());
    crate::support::harness::with_mcp_server(&mut proxy, &mcp);
    let mut config = h.serve_config(proxy, Some(port_range(16)));
    config.admin_token = Some(TOKEN.into());
    config.broker = Some(broker(&h));
    let server = Server::start(config).await.unwrap();
    let admin = server.admin_addr.unwrap();
    let mut p = Probe {
        admin,
        seen: BTreeSet::new(),
    };
    // 408: bodies that never come, answered once their 10 s are up (meanwhile the rest runs).
    let late: Vec<_> = [
        ("POST", "/leases".to_owned()),
        ("POST", leases_of(UNKNOWN, "/revoke")),
        ("POST", leases_of(UNKNOWN, "/complete")),
        ("POST", leases_of(UNKNOWN, "/stop")),
        ("POST", format!("/approvals/{NO_APPROVAL}")),
    ]
    .into_iter()
    .map(|(method, path)| {
        tokio::spawn(async move {
            let answer = without_its_body(admin, method, &path).await;
            (method, path, answer)
        })
    })
    .collect();
    Box::pin(public_and_reads(&mut p)).await;
    let leases = Box::pin(issuing(&mut p)).await;
    Box::pin(lease_routes(&mut p, &server, origin.addr, &leases)).await;
    Box::pin(endings(&mut p, &leases)).await;
    Box::pin(approvals(&mut p, &server, origin.addr, &approver)).await;
    Box::pin(before_any_route(&mut p, &leases)).await;
    Box::pin(beyond_the_connection_limit(&mut p, &leases)).await;
    for late in late {
        let (method, path, answer) = late.await.unwrap();
        assert_eq!(p.note(method, &path, &answer).0, 408, "{answer}");
    }
    Box::pin(without_a_journal(&mut p, &h, &leases)).await;
    server.shutdown().await;
    Box::pin(without_a_key(&mut p)).await;
    assert_all_seen(&p.seen);
}

/// The routes anyone may call, and the operator's reads.
async fn public_and_reads(p: &mut Probe) {
    assert_eq!(p.with(None, "GET", "/", "").await.0, 200);
    assert_eq!(p.with(None, "GET", "/healthz", "").await.0, 200);
    assert_eq!(p.admin("GET", "/readyz", "").await.0, 200);
    assert_eq!(p.admin("GET", "/status", "").await.0, 200);
    assert_eq!(p.admin("GET", "/metrics", "").await.0, 200);
}

/// `POST /leases`: issued (with the CA and a placeholder), narrowed, replayed, refused.
async fn issuing(p: &mut Probe) -> Leases {
    let budget = json!({"tokens": 1000, "fan_out": 1, "wall_clock_ms": 300_000});
    let coder = p
        .issued(None, &asking("coder", &["origin.test"], budget))
        .await;
    assert!(coder["ca"]["pem"].as_str().is_some(), "{coder}");
    assert_eq!(coder["placeholders"][0]["secret"], "github", "{coder}");
    assert!(coder["port"].as_u64().is_some(), "{coder}");
    let coder_id = id_of(&coder);
    let mut child = asking("coder", &["origin.test"], json!({}));
    child["parent_lease_id"] = coder_id.clone().into();
    let narrowed = p.issued(None, &child).await;
    assert!(
        !narrowed["narrowed"].as_array().unwrap().is_empty(),
        "{narrowed}"
    );
    let (status, answer) = p.admin("POST", "/leases", &child.to_string()).await;
    assert_eq!(status, 409, "fan-out full: {answer}");
    child["parent_lease_id"] = UNKNOWN.into();
    let (status, answer) = p.admin("POST", "/leases", &child.to_string()).await;
    assert_eq!(status, 404, "{answer}");
    assert!(answer["refusal_id"].as_str().is_some(), "{answer}");
    let keyed = asking("tester", &["origin.test"], json!({})).to_string();
    let head = format!(
        "Host: localhost\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n\
         Idempotency-Key: openapi-1\r\n"
    );
    assert_eq!(p.exact("POST", "/leases", &head, &keyed).await.0, 201);
    let (status, again) = p.exact("POST", "/leases", &head, &keyed).await;
    assert_eq!((status, &again["replayed"]), (200, &json!(true)), "{again}");
    let mut undeclared = asking("tester", &["origin.test"], json!({}));
    undeclared["manifest"]["intent"]["purpose"] = "".into();
    let (status, answer) = p.admin("POST", "/leases", &undeclared.to_string()).await;
    assert_eq!(status, 422, "{answer}");
    let big = json!({"manifest": {"x": "y".repeat(300 * 1024)}}).to_string();
    assert_eq!(p.admin("POST", "/leases", &big).await.0, 413);
    assert_eq!(p.admin("POST", "/leases", "{").await.0, 400);
    let plain = asking("tester", &["origin.test"], json!({}));
    let other = id_of(&p.issued(None, &plain).await);
    let refuser = id_of(&p.issued(None, &plain).await);
    let flooder = p.issued(None, &plain).await;
    let mut ends = Vec::new();
    for _ in 0..6 {
        ends.push(id_of(&p.issued(None, &plain).await));
    }
    // A lease's token issues children of its own lease only.
    let mut elsewhere = plain.clone();
    elsewhere["parent_lease_id"] = coder_id.clone().into();
    let flooder_token = flooder["token"].as_str().unwrap().to_owned();
    let (status, answer) = p
        .with(
            Some(&flooder_token),
            "POST",
            "/leases",
            &elsewhere.to_string(),
        )
        .await;
    assert_eq!(status, 403, "{answer}");
    // A caller over its rate (here a lease's token: the operator's own rate is untouched).
    let mut limited = false;
    for _ in 0..1000 {
        let (status, _) = p.with(Some(&flooder_token), "POST", "/leases", "{}").await;
        if status == 429 {
            limited = true;
            break;
        }
    }
    assert!(limited, "the issue rate never ran out");
    Leases {
        coder: coder_id,
        coder_token: coder["token"].as_str().unwrap().to_owned(),
        other,
        refuser,
        ends,
    }
}

/// The lease routes, after traffic that gives counters, open tunnels, requests and refusals
/// something to say.
async fn lease_routes(p: &mut Probe, server: &Server, origin: SocketAddr, l: &Leases) {
    let url = format!("http://origin.test:{}/", origin.port());
    assert_eq!(status_through(server, &l.coder, &url).await, 200);
    let target = format!("origin.test:{}", origin.port());
    let tunnel = streaming_tunnel(server.addr, &target, Some(&l.coder)).await;
    let refused = status_through(server, &l.refuser, "http://elsewhere.test/").await;
    assert_eq!(refused, 403);
    let (status, view) = p.admin("GET", &leases_of(&l.coder, ""), "").await;
    assert_eq!(status, 200, "{view}");
    assert!(view["open_total"].as_u64() >= Some(1), "{view}");
    assert!(
        view["model"].is_object() && view["expires_by"].is_string(),
        "{view}"
    );
    let (status, view) = p.admin("GET", &leases_of(&l.refuser, ""), "").await;
    assert!(status == 200 && view["closed"].is_object(), "{view}");
    let (status, page) = p.admin("GET", "/leases?counts=true&limit=5", "").await;
    assert!(status == 200 && page["next_cursor"].is_string(), "{page}");
    assert_eq!(p.admin("GET", "/leases?order=sideways", "").await.0, 400);
    assert_eq!(p.admin("GET", "/leases/NOPE", "").await.0, 400);
    assert_eq!(p.admin("GET", &leases_of(UNKNOWN, ""), "").await.0, 404);
    // The refusal is among the lease's requests and the recent refusals once its line is
    // written.
    let path = leases_of(&l.refuser, "/requests");
    p.until("GET", &path, Duration::from_secs(10), |status, answer| {
        status == 200 && answer["requests"][0].is_object()
    })
    .await;
    let path = leases_of(&l.coder, "/requests?limit=51");
    assert_eq!(p.admin("GET", &path, "").await.0, 400);
    let path = leases_of(UNKNOWN, "/requests");
    assert_eq!(p.admin("GET", &path, "").await.0, 404);
    let path = leases_of(&l.coder, "/placeholders");
    let (status, placeholders) = p.admin("GET", &path, "").await;
    assert!(
        status == 200 && placeholders["placeholders"][0]["env"] == "GITHUB_TOKEN",
        "{placeholders}"
    );
    assert_eq!(p.admin("GET", "/leases/NOPE/placeholders", "").await.0, 400);
    let path = leases_of(UNKNOWN, "/placeholders");
    assert_eq!(p.admin("GET", &path, "").await.0, 404);
    p.until(
        "GET",
        "/refusals",
        Duration::from_secs(10),
        |status, answer| status == 200 && answer["refusals"][0].is_object(),
    )
    .await;
    assert_eq!(p.admin("GET", "/refusals?limit=1001", "").await.0, 400);
    let (status, checked) = p
        .admin(
            "GET",
            &format!("/check?lease={}&target=nowhere.test", l.coder),
            "",
        )
        .await;
    assert!(status == 200 && checked["verdict"] == "refuse", "{checked}");
    assert_eq!(p.admin("GET", "/check?target=origin.test", "").await.0, 400);
    let path = format!("/rates?leases={},{}", l.coder, l.other);
    assert_eq!(p.admin("GET", &path, "").await.0, 200);
    assert_eq!(p.admin("GET", "/rates?leases=nope", "").await.0, 400);
    drop(tunnel);
}

/// Ending a lease: done, a body not as asked or over 16 KiB, an unknown lease, already done.
async fn endings(p: &mut Probe, l: &Leases) {
    let reason = json!({"reason": "the OpenAPI document's test"}).to_string();
    let too_long = json!({"reason": "y".repeat(17 * 1024)}).to_string();
    let revoke = leases_of(&l.ends[0], "/revoke");
    assert_eq!(p.admin("POST", &revoke, &too_long).await.0, 413);
    assert_eq!(p.admin("POST", &revoke, &reason).await.0, 200);
    assert_eq!(p.admin("POST", &revoke, "{}").await.0, 400);
    let unknown = leases_of(UNKNOWN, "/revoke");
    assert_eq!(p.admin("POST", &unknown, &reason).await.0, 404);
    for (id, end) in [(&l.ends[1], "/complete"), (&l.ends[2], "/stop")] {
        let path = leases_of(id, end);
        assert_eq!(p.admin("POST", &path, &too_long).await.0, 413);
        assert_eq!(p.admin("POST", &leases_of(id, end), "").await.0, 200);
        assert_eq!(p.admin("POST", &leases_of(id, end), "{}").await.0, 409);
        let bad = r#"{"reason": 5}"#;
        assert_eq!(p.admin("POST", &leases_of(id, end), bad).await.0, 400);
        assert_eq!(p.admin("POST", &leases_of(UNKNOWN, end), "").await.0, 404);
    }
}

/// The approvals: a call held (a `tools/call` of a tool the lease's `approvals` names) is
/// listed, shown, approved, and decided only once.
async fn approvals(p: &mut Probe, server: &Server, origin: SocketAddr, lease: &str) {
    let port = origin.port();
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_mail"}}"#;
    let call = crate::support::harness::mcp_post_to("origin.test", port, lease, body);
    let proxy = server.addr;
    let held = tokio::spawn(async move { raw(proxy, call.as_bytes()).await });
    let listed = p
        .until("GET", "/approvals", Duration::from_secs(10), |_, answer| {
            answer["approvals"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
        })
        .await;
    let id = listed["approvals"][0]["id"].as_str().unwrap().to_owned();
    let path = format!("/approvals/{id}");
    assert_eq!(
        p.admin("GET", "/approvals?status=all&limit=5", "").await.0,
        200
    );
    assert_eq!(p.admin("GET", "/approvals?status=some", "").await.0, 400);
    assert_eq!(p.admin("GET", &path, "").await.0, 200);
    assert_eq!(p.admin("GET", "/approvals/apr-1", "").await.0, 400);
    let unknown = format!("/approvals/{NO_APPROVAL}");
    assert_eq!(p.admin("GET", &unknown, "").await.0, 404);
    let approve = r#"{"decision":"approve"}"#;
    assert_eq!(p.admin("POST", &unknown, approve).await.0, 404);
    assert_eq!(
        p.admin("POST", &path, r#"{"decision":"deny"}"#).await.0,
        400
    );
    let too_long = json!({"decision": "deny", "reason": "y".repeat(17 * 1024)}).to_string();
    assert_eq!(p.admin("POST", &path, &too_long).await.0, 413);
    assert_eq!(p.admin("POST", &path, approve).await.0, 200);
    assert_eq!(p.admin("POST", &path, approve).await.0, 409);
    let answer = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status_of(&answer), 200, "{answer}");
}

/// What every request passes before its route, for one request of each operation: a `Host`
/// (400, 421), a token (401; 404 for one naming an unknown lease; 403 for a lease's own token
/// elsewhere than its own routes), JSON for a write (415); then another method (405) and
/// another path (404).
async fn before_any_route(p: &mut Probe, l: &Leases) {
    let stranger = format!("{UNKNOWN}.tag");
    let operator = format!("Host: localhost\r\nAuthorization: Bearer {TOKEN}\r\n");
    for (method, path) in every(l) {
        let (status, _) = p.exact(method, &path, "", "").await;
        assert_eq!(status, 400, "no Host: {method} {path}");
        let (status, _) = p.exact(method, &path, "Host: evil.example\r\n", "").await;
        assert_eq!(status, 421, "{method} {path}");
        if path == "/" || path == "/healthz" {
            continue;
        }
        let (status, _) = p.with(None, method, &path, "").await;
        assert_eq!(status, 401, "{method} {path}");
        let (status, _) = p.with(Some(&stranger), method, &path, "").await;
        assert_eq!(status, 404, "a token of an unknown lease: {method} {path}");
        if method != "GET" {
            let (status, _) = p.exact(method, &path, &operator, "").await;
            assert_eq!(status, 415, "{method} {path}");
        }
    }
    assert_eq!(p.admin("DELETE", "/status", "").await.0, 405);
    assert_eq!(p.admin("GET", "/nope", "").await.0, 404);
    assert_eq!(p.exact("POST", "/nope", &operator, "").await.0, 415);
    for (method, path) in [
        ("GET", "/readyz".to_owned()),
        ("GET", "/status".into()),
        ("GET", "/metrics".into()),
        ("GET", "/leases".into()),
        ("GET", "/refusals".into()),
        (
            "GET",
            format!("/check?lease={}&target=origin.test", l.coder),
        ),
        ("GET", "/rates".into()),
        ("GET", leases_of(&l.other, "")),
        ("GET", leases_of(&l.coder, "/requests")),
        ("GET", leases_of(&l.other, "/placeholders")),
        ("POST", leases_of(&l.coder, "/revoke")),
        ("POST", leases_of(&l.other, "/complete")),
        ("POST", leases_of(&l.other, "/stop")),
        ("GET", "/approvals".into()),
        ("GET", format!("/approvals/{NO_APPROVAL}")),
        ("POST", format!("/approvals/{NO_APPROVAL}")),
        ("DELETE", leases_of(&l.coder, "")),
        ("GET", "/nope".into()),
    ] {
        let (status, answer) = p.with(Some(&l.coder_token), method, &path, "").await;
        assert_eq!(status, 403, "{method} {path}: {answer}");
    }
}

/// 503 beyond the connection limit: a connection is answered before it is read, so its one
/// answer is what every operation gets.
async fn beyond_the_connection_limit(p: &mut Probe, l: &Leases) {
    let mut held = Vec::new();
    let turned_away = loop {
        let mut stream = TcpStream::connect(p.admin).await.unwrap();
        let answer = exchange(
            &mut stream,
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n",
        )
        .await;
        match status_of(&answer) {
            200 => held.push(stream),
            503 => break answer,
            _ => panic!("{answer}"),
        }
        assert!(
            held.len() <= MAX_CONNECTIONS,
            "no connection was turned away"
        );
    };
    for (method, path) in every(l) {
        p.note(method, &path, &turned_away);
    }
    drop(held);
    let admin = p.admin;
    let served = eventually(Duration::from_secs(10), || async move {
        let healthz = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
        (status_of(&raw(admin, healthz).await) == 200).then_some(())
    })
    .await;
    assert!(served.is_some(), "connections are accepted again");
}

/// The journal cannot be written (its path a directory): closings are queued (202), a grant
/// is refused (503), and `/readyz` says why (503).
async fn without_a_journal(p: &mut Probe, h: &Harness, l: &Leases) {
    let saved = std::fs::read(&h.journal).unwrap();
    std::fs::remove_file(&h.journal).unwrap();
    std::fs::create_dir(&h.journal).unwrap();
    let reason = json!({"reason": "the journal is away"}).to_string();
    let path = leases_of(&l.ends[3], "/revoke");
    assert_eq!(p.admin("POST", &path, &reason).await.0, 202);
    let path = leases_of(&l.ends[4], "/complete");
    assert_eq!(p.admin("POST", &path, "").await.0, 202);
    let path = leases_of(&l.ends[5], "/stop");
    assert_eq!(p.admin("POST", &path, "").await.0, 202);
    let body = asking("tester", &["origin.test"], json!({})).to_string();
    assert_eq!(p.admin("POST", "/leases", &body).await.0, 503);
    let unready = p
        .until("GET", "/readyz", Duration::from_secs(10), |status, _| {
            status == 503
        })
        .await;
    assert_eq!(unready["ready"], false, "{unready}");
    std::fs::remove_dir(&h.journal).unwrap();
    std::fs::write(&h.journal, saved).unwrap();
}

/// 500: a proxy without a key has nothing to sign a lease with.
async fn without_a_key(p: &mut Probe) {
    let h = Harness::new();
    let mut config = h.serve_config(h.config(&[]), None);
    config.keyring = Keyring::new(false);
    let server = Server::start(config).await.unwrap();
    let mut keyless = Probe {
        admin: server.admin_addr.unwrap(),
        seen: BTreeSet::new(),
    };
    let body = asking("tester", &["origin.test"], json!({})).to_string();
    let (status, answer) = keyless.with(None, "POST", "/leases", &body).await;
    assert_eq!(status, 500, "{answer}");
    server.shutdown().await;
    p.seen.append(&mut keyless.seen);
}

/// What was seen is what the document declares, but for [`NOT_PROVOKED`].
fn assert_all_seen(seen: &BTreeSet<Answered>) {
    let not_provoked: BTreeSet<Answered> = NOT_PROVOKED
        .iter()
        .map(|(operation, status, _)| Answered {
            operation: (*operation).to_owned(),
            status: *status,
        })
        .collect();
    let declared = openapi::declared();
    assert!(
        not_provoked.is_subset(&declared),
        "NOT_PROVOKED names what the document does not declare: {:?}",
        not_provoked.difference(&declared).collect::<Vec<_>>()
    );
    assert!(
        seen.is_disjoint(&not_provoked),
        "provoked after all, so no longer to be listed in NOT_PROVOKED: {:?}",
        seen.intersection(&not_provoked).collect::<Vec<_>>()
    );
    let expected: BTreeSet<Answered> = declared.difference(&not_provoked).cloned().collect();
    let never: Vec<_> = expected.difference(seen).collect();
    assert!(never.is_empty(), "declared but never answered: {never:?}");
    assert_eq!(seen, &expected);
    assert!(expected.iter().any(|a| a.operation == OTHER_METHOD));
    assert!(expected.iter().any(|a| a.operation == OTHER_PATH));
}
