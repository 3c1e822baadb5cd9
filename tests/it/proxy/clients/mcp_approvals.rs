//! Approvals that hold the request: a `tools/call` of a tool a lease names in `approvals`
//! waits, unsent, until a human decides. With the official MCP Python SDK, unmodified, in a
//! namespace with only loopback: the SDK waits while `leasegate approve` (the CLI, through the
//! admin API) lets the call go on — for the rest of the lease, so the next call of the tool
//! does not wait — and `leasegate deny` refuses the next one with its reason, which the SDK
//! raises; with nobody deciding, the call is refused when its time is up. With raw requests:
//! a decision taken on one replica releases the call held on another, only the operator may
//! decide, and a proxy that stops answers the calls it holds.

use super::mcp_sdk::{
    calls, client, mcp_lines, mcp_post, proxy_for, tools, McpServerProcess, PLAIN,
};
use super::python_finds;
use crate::support::harness::{admin_call, eventually, raw_to_close, Harness};
use crate::support::{leasegate_command, skip};
use leasegate::server::Server;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const TOKEN: &str = "approvals-admin-token";

/// A lease allowing three tools of `notes`, two of which need an approval.
fn manifest() -> Value {
    json!({
        "allow": {"tools": tools(&["read_note", "send_mail", "delete_note"])},
        "approvals": ["notes/send_mail", "notes/delete_note"],
    })
}

pub fn token_file(h: &Harness) -> PathBuf {
    let path = h.dir.path().join("admin-token");
    std::fs::write(&path, TOKEN).unwrap();
    path
}

/// `leasegate ARGS --admin http://ADMIN --admin-token-file FILE`: exit status and stdout.
pub async fn cli(server: &Server, token: &Path, args: &[&str]) -> (bool, String, String) {
    let mut all: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    all.extend([
        "--admin".to_owned(),
        format!("http://{}", server.admin_addr.unwrap()),
        "--admin-token-file".to_owned(),
        token.display().to_string(),
    ]);
    let out = tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = all.iter().map(String::as_str).collect();
        leasegate_command(&refs).output().unwrap()
    })
    .await
    .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The pending approval of `tool` once `leasegate approvals --json` lists one.
pub async fn pending(server: &Server, token: &Path, tool: &str) -> Value {
    let found = eventually(Duration::from_secs(60), || async {
        let (ok, out, _) = cli(server, token, &["approvals", "--json"]).await;
        let listed: Value = serde_json::from_str(&out).ok().filter(|_| ok)?;
        listed["approvals"]
            .as_array()?
            .iter()
            .find(|a| a["tool"] == tool && a["status"] == "pending")
            .cloned()
    })
    .await;
    found.unwrap_or_else(|| panic!("no pending approval of {tool}"))
}

/// The SDK's server, a lease of [`manifest`] and a proxy with an admin token (and
/// `--approval-timeout` when given).
struct Sdk {
    h: Harness,
    mcp: McpServerProcess,
    url: String,
    lease: String,
    server: Server,
}

impl Sdk {
    async fn start(timeout: Option<Duration>) -> Sdk {
        let h = Harness::new();
        let mcp = McpServerProcess::start(h.dir.path(), None).await;
        let url = format!("http://{PLAIN}:{}/mcp", mcp.port);
        let lease = h.lease_from(&[PLAIN], manifest(), None);
        let server = proxy_for(&h, &format!("notes={url}"), |serve| {
            serve.admin_token = Some(TOKEN.to_owned());
            if let Some(timeout) = timeout {
                serve.approvals.timeout = timeout;
            }
        })
        .await;
        Sdk {
            h,
            mcp,
            url,
            lease,
            server,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdk_waits_while_a_human_approves_from_the_cli_and_raises_a_denial() {
    if !python_finds(&["mcp", "uvicorn"]) {
        return skip("the Python MCP SDK is missing (python3 -m pip install mcp; .ci/run does)");
    }
    let Sdk {
        h,
        mcp,
        url,
        lease,
        server,
    } = Sdk::start(None).await;
    let token = token_file(&h);
    let proxy = crate::support::harness::proxy_url(&server, &lease);
    let agent = {
        let (dir, url, proxy) = (h.dir.path().to_owned(), url.clone(), proxy.clone());
        tokio::spawn(async move {
            let env = [("HTTP_PROXY", proxy.as_str())];
            let steps = [
                "call:send_mail",
                "call:delete_note",
                "call:send_mail",
                "call:read_note",
            ];
            client(&dir, &url, &env, &steps).await
        })
    };

    let first = pending(&server, &token, "notes/send_mail").await;
    assert_eq!(first["lease_id"], lease.as_str());
    assert_eq!(first["arguments"], r#"{"to":"a@b.test"}"#);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(mcp.ran().is_empty(), "a held call reached the server");
    let id = first["id"].as_str().unwrap();
    let (ok, out, err) = cli(
        &server,
        &token,
        &[
            "approve",
            id,
            "--for-lease",
            "--reason",
            "fine for this run",
        ],
    )
    .await;
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.trim(),
        format!("{id} approved (notes/send_mail for lease {lease})")
    );

    let second = pending(&server, &token, "notes/delete_note").await;
    let (ok, out, err) = cli(
        &server,
        &token,
        &[
            "deny",
            second["id"].as_str().unwrap(),
            "--reason",
            "not today",
        ],
    )
    .await;
    assert!(ok, "{out}{err}");

    let out = agent.await.unwrap();
    assert_eq!(out[0]["text"], "sent to a@b.test", "{out:?}");
    assert_eq!(out[1]["error"], "MCPError", "{}", out[1]);
    let message = out[1]["message"].as_str().unwrap();
    assert!(message.contains("approval-denied"), "{message}");
    assert!(
        message.contains(&format!(
            "tool notes/delete_note was denied for lease {lease}"
        )) && message.contains("not today"),
        "{message}"
    );
    // Approved for the rest of the lease: the second send_mail did not wait.
    assert_eq!(out[2]["text"], "sent to a@b.test", "{out:?}");
    assert_eq!(out[3]["text"], "note 1: buy milk", "{out:?}");
    assert_eq!(mcp.ran(), ["send_mail", "send_mail", "read_note"]);

    let (ok, listed, _) = cli(&server, &token, &["approvals", "--all", "--json"]).await;
    assert!(ok);
    let listed: Value = serde_json::from_str(&listed).unwrap();
    let statuses: Vec<(&str, &str, &str)> = listed["approvals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["tool"].as_str().unwrap(),
                a["status"].as_str().unwrap(),
                a["decision"]["scope"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        statuses,
        [
            ("notes/delete_note", "denied", "once"),
            ("notes/send_mail", "approved", "lease")
        ]
    );
    // The table names the same.
    let (ok, table, _) = cli(&server, &token, &["approvals", "--all"]).await;
    assert!(
        ok && table.starts_with("ID ") && table.contains("denied"),
        "{table}"
    );

    let lines = mcp_lines(&h, 6).await;
    let seen: Vec<(String, String, Value, u64)> = calls(&lines);
    assert_eq!(
        seen,
        [
            ("send_mail".into(), "approved".into(), Value::Null, 1),
            (
                "delete_note".into(),
                "refused".into(),
                json!("approval-denied"),
                0
            ),
            ("send_mail".into(), "approved".into(), Value::Null, 1),
            ("read_note".into(), "allowed".into(), Value::Null, 1),
        ]
    );
    let approvals: Vec<&Value> = lines
        .iter()
        .filter_map(|l| l["mcp"]["messages"][0].get("approval"))
        .collect();
    assert_eq!(
        approvals,
        [&json!(id), &json!(id)],
        "the standing approval is the first"
    );
    for line in &lines {
        crate::support::egress_schema_valid(line);
    }
    assert!(h.revocations().await.is_empty(), "a denial does not revoke");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_nobody_decides_is_refused_when_its_time_is_up() {
    if !python_finds(&["mcp", "uvicorn"]) {
        return skip("the Python MCP SDK is missing (python3 -m pip install mcp; .ci/run does)");
    }
    let Sdk {
        h,
        mcp,
        url,
        lease,
        server,
    } = Sdk::start(Some(Duration::from_secs(2))).await;
    let proxy = crate::support::harness::proxy_url(&server, &lease);
    let env = [("HTTP_PROXY", proxy.as_str())];
    let started = Instant::now();
    let out = client(h.dir.path(), &url, &env, &["call:send_mail"]).await;
    assert!(started.elapsed() >= Duration::from_secs(2));
    assert_eq!(out[0]["error"], "MCPError", "{}", out[0]);
    let message = out[0]["message"].as_str().unwrap();
    assert!(
        message.contains("approval-timed-out") && message.contains("nobody decided within 2s"),
        "{message}"
    );
    assert!(mcp.ran().is_empty());
    let (status, body) = admin_call(
        &server,
        "GET",
        "/approvals?status=all",
        Some(TOKEN),
        &[],
        "",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).unwrap();
    let expired = &listed["approvals"][0];
    assert_eq!(expired["status"], "expired", "{listed}");
    assert_eq!(expired["decision"]["by"], "timeout");
    // Too late to decide.
    let path = format!("/approvals/{}", expired["id"].as_str().unwrap());
    let (status, body) = decide(&server, &path, r#"{"decision":"approve"}"#).await;
    assert_eq!(status, 409, "{body}");
    let lines = mcp_lines(&h, 2).await;
    assert_eq!(
        calls(&lines),
        [(
            "send_mail".into(),
            "refused".into(),
            json!("approval-timed-out"),
            0
        )]
    );
}

/// `POST path` (`/approvals/{id}`) with the decision `body` on `on`, as the operator: status
/// and body.
async fn decide(on: &Server, path: &str, body: &str) -> (u16, String) {
    admin_call(on, "POST", path, Some(TOKEN), &[], body).await
}

/// `GET /approvals/{id}` on `on`, as the operator (null if it is not JSON).
async fn approval_on(on: &Server, id: &str) -> Value {
    let path = format!("/approvals/{id}");
    let (_, body) = admin_call(on, "GET", &path, Some(TOKEN), &[], "").await;
    serde_json::from_str(&body).unwrap_or(Value::Null)
}

/// The answer to a held call, once it came (within 10 s).
async fn answer_of(held: tokio::task::JoinHandle<String>) -> String {
    tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the held call was answered")
        .unwrap()
}

/// Two replicas of one journal, each with an origin standing in for the MCP server.
struct Pair {
    h: Harness,
    a: Server,
    b: Server,
    origin: crate::support::harness::Origin,
    lease: String,
}

async fn pair() -> Pair {
    let h = Harness::new();
    let origin = crate::support::harness::http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease_from(&[PLAIN], manifest(), None);
    let at = format!("notes=http://{PLAIN}:{port}/mcp");
    let with_token = |serve: &mut leasegate::config::ServeConfig| {
        serve.admin_token = Some(TOKEN.to_owned());
    };
    let a = proxy_for(&h, &at, with_token).await;
    let b = proxy_for(&h, &at, with_token).await;
    Pair {
        h,
        a,
        b,
        origin,
        lease,
    }
}

impl Pair {
    /// Sends a `tools/call` of `tool` (id `id`) to replica A in the background: its answer.
    fn call(&self, tool: &str, id: u32) -> tokio::task::JoinHandle<String> {
        let body = format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{tool}","arguments":{{"to":"x@y.test"}}}}}}"#
        );
        let request = mcp_post(self.origin.addr.port(), &self.lease, &body);
        let addr = self.a.addr;
        tokio::spawn(async move { raw_to_close(addr, request.as_bytes()).await })
    }

    /// The id of the pending approval of `tool` that replica `on` lists.
    async fn pending_on(&self, on: &Server, tool: &str) -> String {
        let found = eventually(Duration::from_secs(20), || async {
            let (_, body) = admin_call(on, "GET", "/approvals", Some(TOKEN), &[], "").await;
            let listed: Value = serde_json::from_str(&body).ok()?;
            listed["approvals"]
                .as_array()?
                .iter()
                .find(|a| a["tool"] == format!("notes/{tool}") && a["status"] == "pending")
                .map(|a| a["id"].as_str().unwrap().to_owned())
        })
        .await;
        found.unwrap_or_else(|| panic!("no pending approval of {tool}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_on_one_replica_releases_the_call_held_on_another() {
    let p = pair().await;
    let held = p.call("send_mail", 7);
    let id = p.pending_on(&p.b, "send_mail").await;
    let (_, metrics) = admin_call(&p.a, "GET", "/metrics", Some(TOKEN), &[], "").await;
    assert!(
        metrics.contains("\nleasegate_approvals_waiting 1\n"),
        "{metrics}"
    );
    let (_, metrics) = admin_call(&p.b, "GET", "/metrics", Some(TOKEN), &[], "").await;
    assert!(
        metrics.contains("\nleasegate_approvals_waiting 0\n"),
        "held on A only"
    );
    let path = format!("/approvals/{id}");
    let approve = r#"{"decision":"approve","reason":"ok"}"#;
    // Only the operator decides: not the lease's own token, not an unauthenticated caller.
    let own = leasegate::contract::token::mint(&p.h.key, &p.lease);
    let (status, body) = admin_call(&p.b, "POST", &path, Some(&own), &[], approve).await;
    assert_eq!(status, 403, "{body}");
    let (status, _) = admin_call(&p.b, "POST", &path, None, &[], approve).await;
    assert_eq!(status, 401);
    let (status, body) = decide(&p.b, &path, r#"{"decision":"deny"}"#).await;
    assert_eq!(status, 400, "{body}");
    assert!(!held.is_finished(), "the call still waits");
    let (status, body) = decide(&p.b, &path, approve).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["status"],
        "approved"
    );
    let answer = answer_of(held).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(
        p.origin
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    // Decided once: the second decision, on either replica, is refused.
    for on in [&p.a, &p.b] {
        let (status, body) = decide(on, &path, r#"{"decision":"deny","reason":"late"}"#).await;
        assert_eq!(status, 409, "{body}");
        assert!(body.contains("already decided: approved"), "{body}");
    }

    // A denial on B refuses the call held on A, as JSON-RPC, with the reason.
    let held = p.call("delete_note", 8);
    let id = p.pending_on(&p.b, "delete_note").await;
    let deny = r#"{"decision":"deny","reason":"never delete"}"#;
    let (status, body) = decide(&p.b, &format!("/approvals/{id}"), deny).await;
    assert_eq!(status, 200, "{body}");
    let answer = answer_of(held).await;
    assert!(
        answer.starts_with("HTTP/1.1 403 approval-denied\r\n"),
        "{answer}"
    );
    assert!(
        answer.contains(r#""id":8"#) && answer.contains("never delete"),
        "{answer}"
    );
    assert_eq!(
        p.origin
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    assert_eq!(approval_on(&p.a, &id).await["status"], "denied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_stops_answers_the_calls_it_holds() {
    let p = pair().await;
    let held = p.call("send_mail", 9);
    let id = p.pending_on(&p.a, "send_mail").await;
    let started = Instant::now();
    let Pair { a, b, origin, .. } = p;
    let stopping = tokio::spawn(a.shutdown());
    let answer = answer_of(held).await;
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(
        answer.starts_with("HTTP/1.1 503 approval-unavailable\r\n"),
        "{answer}"
    );
    assert!(answer.contains("the proxy stopped"), "{answer}");
    stopping.await.unwrap();
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    // The other replica reads how it ended.
    let ended = eventually(Duration::from_secs(5), || async {
        let view = approval_on(&b, &id).await;
        (view["status"] == "expired").then_some(view)
    })
    .await
    .expect("the end is recorded");
    assert_eq!(ended["decision"]["by"], "shutdown");
}

/// A line written into the approval store by someone without the lease's key — an approval
/// of a held call — is set aside (counted) and releases nothing; the operator's decision still
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_approval_in_the_store_releases_nothing() {
    use leasegate::approvals::book::{self, Decision, Entry, Outcome, Scope};
    let p = pair().await;
    let held = p.call("send_mail", 11);
    let id = p.pending_on(&p.a, "send_mail").await;
    let forged = Entry::Decided(Decision {
        id: id.clone(),
        lease_id: p.lease.clone(),
        tool: "notes/send_mail".to_owned(),
        outcome: Outcome::Approved,
        scope: Scope::Lease,
        reason: "forged".to_owned(),
        by: "operator".to_owned(),
        at: leasegate::contract::Timestamp::now().to_string(),
        signature: String::new(),
    });
    let mut line = book::signed(forged, &leasegate::contract::Key::generate());
    line.push(b'\n');
    let store = format!("{}.approvals", p.h.journal.display());
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&store)
        .unwrap();
    std::io::Write::write_all(&mut file, &line).unwrap();
    let set_aside = eventually(Duration::from_secs(5), || async {
        let (_, metrics) = admin_call(&p.a, "GET", "/metrics", Some(TOKEN), &[], "").await;
        metrics
            .contains("\nleasegate_approval_lines_set_aside_total 1\n")
            .then_some(())
    })
    .await;
    assert!(set_aside.is_some(), "the forged line was not set aside");
    assert!(!held.is_finished(), "a forged approval released the call");
    assert_eq!(approval_on(&p.a, &id).await["status"], "pending");
    let approve = r#"{"decision":"approve","reason":"the real one"}"#;
    let (status, body) = decide(&p.b, &format!("/approvals/{id}"), approve).await;
    assert_eq!(status, 200, "{body}");
    let answer = answer_of(held).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
