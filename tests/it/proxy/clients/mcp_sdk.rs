//! The official MCP Python SDK (`mcp`), unmodified, its streamable HTTP client against the
//! SDK's own server (`MCPServer`), through the proxy as `--mcp-server`: plain HTTP (a forwarded
//! host) and HTTPS (a terminated one). The lease's `allow.tools` decides: the tool list the
//! client sees is cut to it, an allowed tool runs, another is answered with a JSON-RPC error
//! the SDK raises (naming the refusal) and never reaches the server, `budget.steps` refuses
//! the call past it, along the chain. Each client runs in a network namespace with only
//! loopback, so one that ignored its proxy settings would fail.

use super::{client_for, python_finds, text};
use crate::support::harness::{proxy_url, Harness};
use crate::support::netns::in_loopback_only_namespace;
use crate::support::skip;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub(super) const PLAIN: &str = "mcp.notes.test";
const TLS: &str = "mcp.secure.test";

/// The SDK's server on a free loopback port (HTTPS with `tls`: certificate and key files),
/// and the file each tool call it runs is written to.
pub(super) struct McpServerProcess {
    _child: tokio::process::Child,
    pub(super) port: u16,
    calls: PathBuf,
}

impl McpServerProcess {
    pub(super) async fn start(dir: &Path, tls: Option<(&Path, &Path)>) -> McpServerProcess {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let calls = dir.join(format!("calls-{port}.txt"));
        let script = crate::support::data("clients/mcp/server.py");
        let mut command = tokio::process::Command::new("python3");
        command
            .arg(script)
            .arg(port.to_string())
            .arg(&calls)
            .kill_on_drop(true)
            .stdout(std::process::Stdio::null());
        if let Some((cert, key)) = tls {
            command.arg(cert).arg(key);
        }
        let child = command.spawn().expect("python3 runs");
        let up = crate::support::harness::eventually(Duration::from_secs(60), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await;
        assert!(up.is_some(), "the MCP server did not listen on {port}");
        McpServerProcess {
            _child: child,
            port,
            calls,
        }
    }

    /// The tools it ran, in order.
    pub(super) fn ran(&self) -> Vec<String> {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

/// Runs the client script against `url` with `env`, returning the JSON line of each step.
pub(super) async fn client(
    dir: &Path,
    url: &str,
    env: &[(&str, &str)],
    steps: &[&str],
) -> Vec<Value> {
    let script = crate::support::data("clients/mcp/client.py");
    let mut args = vec![script.to_str().unwrap(), url];
    args.extend_from_slice(steps);
    let out = client_for(Duration::from_secs(120), "python3", &args, env, dir).await;
    let (printed, warned) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{printed}{warned}");
    printed
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// The egress lines with an `mcp` object, once there are `n`.
pub(super) async fn mcp_lines(h: &Harness, n: usize) -> Vec<Value> {
    let found = crate::support::harness::eventually(Duration::from_secs(10), || async {
        let text = tokio::fs::read_to_string(&h.egress).await.ok()?;
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|l| l.get("mcp").is_some())
            .collect();
        (lines.len() >= n).then_some(lines)
    })
    .await;
    found.unwrap_or_else(|| panic!("fewer than {n} MCP lines"))
}

/// The `tools/call` lines: (tool, verdict, code, steps).
pub(super) fn calls(lines: &[Value]) -> Vec<(String, String, Value, u64)> {
    lines
        .iter()
        .filter_map(|l| {
            let m = &l["mcp"]["messages"][0];
            (m["method"] == "tools/call").then(|| {
                (
                    m["tool"].as_str().unwrap().to_owned(),
                    m["verdict"].as_str().unwrap().to_owned(),
                    l["code"].clone(),
                    l["mcp"]["steps"].as_u64().unwrap(),
                )
            })
        })
        .collect()
}

pub(super) fn tools(names: &[&str]) -> Value {
    json!(names
        .iter()
        .map(|n| format!("notes/{n}"))
        .collect::<Vec<_>>())
}

pub(super) async fn proxy_for(
    h: &Harness,
    server: &str,
    adjust: impl FnOnce(&mut leasegate::config::ServeConfig),
) -> Server {
    let names = [(PLAIN, "127.0.0.1"), (TLS, "127.0.0.1")];
    let mut config = h.config(&names);
    crate::support::harness::with_mcp_server(&mut config, server);
    let mut serve = h.serve_config(config, None);
    adjust(&mut serve);
    Server::start(serve).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mcp_sdk_sees_only_its_leases_tools_and_the_step_past_its_budget_is_refused() {
    if !python_finds(&["mcp", "uvicorn"]) {
        return skip("the Python MCP SDK is missing (python3 -m pip install mcp; .ci/run does)");
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let h = Harness::new();
    let mcp = McpServerProcess::start(h.dir.path(), None).await;
    let url = format!("http://{PLAIN}:{}/mcp", mcp.port);
    let lease = h.lease_from(
        &[PLAIN],
        json!({"allow": {"tools": tools(&["read_note", "send_mail"])}, "budget": {"steps": 3}}),
        None,
    );
    let server = proxy_for(
        &h,
        &format!("notes=http://{PLAIN}:{}/mcp", mcp.port),
        |_| {},
    )
    .await;
    let proxy = proxy_url(&server, &lease);
    let env = [("HTTP_PROXY", proxy.as_str())];
    let steps = [
        "list",
        "call:read_note",
        "call:delete_note",
        "call:send_mail",
        "call:read_note",
        "call:read_note",
    ];
    let out = client(h.dir.path(), &url, &env, &steps).await;
    assert_eq!(
        out[0],
        json!({"step": "list", "tools": ["read_note", "send_mail"]})
    );
    assert_eq!(
        out[1],
        json!({"step": "call:read_note", "text": "note 1: buy milk", "is_error": false})
    );
    // The refused tool: a JSON-RPC error the SDK raises, naming the code and the lease.
    assert_eq!(out[2]["error"], "MCPError", "{}", out[2]);
    let message = out[2]["message"].as_str().unwrap();
    assert!(message.contains("tool-not-allowed"), "{message}");
    assert!(
        message.contains(&format!(
            "tool notes/delete_note is not in lease {lease}'s allow.tools"
        )),
        "{message}"
    );
    assert_eq!(out[3]["text"], "sent to a@b.test");
    assert_eq!(out[4]["text"], "note 1: buy milk");
    // The fourth call is the third step of three: the next one is refused.
    assert_eq!(out[5]["error"], "MCPError", "{}", out[5]);
    let message = out[5]["message"].as_str().unwrap();
    assert!(message.contains("budget-exhausted"), "{message}");
    // The third step is spent, or still settling as its answer's last bytes go out.
    let spent = format!("lease {lease}'s budget.steps is spent: 3 of 3");
    let settling = format!("lease {lease}'s budget.steps is spent: 2 of 3, and 1 reserved");
    assert!(
        message.contains(&spent) || message.contains(&settling),
        "{message}"
    );
    // Only the allowed calls within the budget reached the server.
    assert_eq!(mcp.ran(), ["read_note", "send_mail", "read_note"]);

    // Every request is on the egress line: the list cut by one, each call with its verdict.
    let lines = mcp_lines(&h, 8).await;
    let listed: Vec<&Value> = lines
        .iter()
        .filter(|l| l["mcp"]["messages"][0]["method"] == "tools/list")
        .collect();
    assert_eq!(listed.len(), 1, "{lines:?}");
    assert_eq!(listed[0]["mcp"]["tools_hidden"], 1);
    assert_eq!(listed[0]["mcp"]["server"], "notes");
    let (ok, no) = (Value::Null, |c: &str| Value::from(c));
    let seen = calls(&lines);
    assert_eq!(
        seen,
        [
            ("read_note".into(), "allowed".into(), ok.clone(), 1),
            (
                "delete_note".into(),
                "refused".into(),
                no("tool-not-allowed"),
                0
            ),
            ("send_mail".into(), "allowed".into(), ok.clone(), 1),
            ("read_note".into(), "allowed".into(), ok.clone(), 1),
            (
                "read_note".into(),
                "refused".into(),
                no("budget-exhausted"),
                0
            ),
        ]
    );
    // A tool refusal answers the call; it does not revoke the lease.
    assert!(h.revocations().await.is_empty());
    for line in &lines {
        crate::support::egress_schema_valid(line);
    }
    // `leasegate usage` counts the three calls that went out.
    let egress = h.egress.display().to_string();
    let args = [
        "usage",
        "--from",
        egress.as_str(),
        "--lease",
        lease.as_str(),
        "--json",
    ];
    let out = crate::support::leasegate_command(&args).output().unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{printed}");
    let usage: Value = serde_json::from_str(printed.lines().next().unwrap()).unwrap();
    assert_eq!(usage["tool_calls"], 3, "{printed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_mcp_server_is_read_too_and_a_childs_tools_are_its_whole_chains() {
    if !python_finds(&["mcp", "uvicorn"]) {
        return skip("the Python MCP SDK is missing (python3 -m pip install mcp; .ci/run does)");
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let h = Harness::new();
    // The server's own certificate, which the proxy verifies the origin against.
    let cert = rcgen::generate_simple_self_signed(vec![TLS.to_owned()]).unwrap();
    let (cert_path, key_path) = (
        h.dir.path().join("mcp.pem"),
        h.dir.path().join("mcp-key.pem"),
    );
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.key_pair.serialize_pem()).unwrap();
    let mcp = McpServerProcess::start(h.dir.path(), Some((&cert_path, &key_path))).await;
    let broker = h.broker(&[TLS], "canaries = []\n", &[], Some(&cert_path));
    // The parent allows two tools and two steps; the child, written as it is (no issuer
    // narrowed it), lists a tool its parent does not and has no steps ceiling of its own:
    // the chain decides both.
    let parent = h
        .grant_edited(1, None, &[TLS], |lease| {
            lease["manifest"]["allow"]["tools"] = tools(&["read_note", "delete_note"]);
            lease["manifest"]["budget"] = json!({"steps": 2});
        })
        .await;
    let child = h
        .grant_edited(2, Some(&parent), &[TLS], |lease| {
            lease["manifest"]["allow"]["tools"] = tools(&["read_note", "send_mail"]);
        })
        .await;
    let server = proxy_for(
        &h,
        &format!("notes=https://{TLS}:{}/mcp", mcp.port),
        |serve| serve.broker = Some(broker.clone()),
    )
    .await;
    let proxy = proxy_url(&server, &child);
    let ca = h.dir.path().join("ca/ca.pem");
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("SSL_CERT_FILE", ca.to_str().unwrap()),
    ];
    let url = format!("https://{TLS}:{}/mcp", mcp.port);
    let steps = [
        "list",
        "call:send_mail",
        "call:read_note",
        "call:read_note",
        "call:read_note",
    ];
    let out = client(h.dir.path(), &url, &env, &steps).await;
    // Listed: what the child and its parent both allow.
    assert_eq!(out[0], json!({"step": "list", "tools": ["read_note"]}));
    let message = out[1]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "tool notes/send_mail is not in lease {parent}'s allow.tools"
        )),
        "{}",
        out[1]
    );
    assert_eq!(out[2]["text"], "note 1: buy milk");
    assert_eq!(out[3]["text"], "note 1: buy milk");
    let message = out[4]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!("lease {parent}'s budget.steps is spent: 2 of 2")),
        "{}",
        out[4]
    );
    assert_eq!(mcp.ran(), ["read_note", "read_note"]);
    let lines = mcp_lines(&h, 6).await;
    assert!(lines.iter().all(|l| l["kind"] == "https"), "{lines:?}");
    assert_eq!(calls(&lines).len(), 4);
}

/// The refusal no SDK provokes by itself: a body read two ways. A raw request, answered in the
/// server's place; nothing reaches the origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_body_is_refused_as_json_rpc() {
    let h = Harness::new();
    let origin = crate::support::harness::http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease_from(
        &[PLAIN],
        json!({"allow": {"tools": tools(&["send_mail"])}}),
        None,
    );
    let server = proxy_for(&h, &format!("notes=http://{PLAIN}:{port}/mcp"), |_| {}).await;
    let twice = r#"{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"send_mail","name":"delete_note"}}"#;
    let answer = crate::support::harness::raw_to_close(
        server.addr,
        mcp_post(port, &lease, twice).as_bytes(),
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 400 mcp-unreadable\r\n"),
        "{answer}"
    );
    assert!(answer.contains("application/json"), "{answer}");
    assert!(
        answer.contains(r#""id":null"#) && answer.contains("duplicate field `name`"),
        "{answer}"
    );
    let lines = mcp_lines(&h, 1).await;
    assert_eq!(lines[0]["code"], "mcp-unreadable");
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "nothing reached the server"
    );
}

/// A raw POST of `body` to the plain MCP server on `port` as `lease`.
pub(super) fn mcp_post(port: u16, lease: &str, body: &str) -> String {
    crate::support::harness::mcp_post_to(PLAIN, port, lease, body)
}
