//! Approvals of a route: a request a lease's `approvals` names as `METHOD:host/path` waits,
//! unsent, until a human decides, on a terminated host (curl over HTTPS, the host terminated
//! only because the route names it) and on a forwarded plain-HTTP one. Approved from the CLI,
//! it goes on unchanged (the origin hashes the body it got); denied, curl gets 403
//! `approval-denied` with the reason; nobody deciding, `approval-timed-out`; a path origins
//! read differently is refused; a tunnel a route names that cannot be read is refused.

use super::clients::mcp_approvals::{cli, pending, token_file, TOKEN};
use crate::support::harness::*;
use leasegate::config::ServeConfig;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

const PAY: &str = "pay.origin.test";
const PLAIN: &str = "plain.origin.test";
const BODY: &str = r#"{"amount": 4200, "currency": "eur"}"#;

/// A proxy whose broker's CA covers [`PAY`] (no secret is for it), the HTTPS origin there, a
/// plain-HTTP origin at [`PLAIN`], and a lease naming a route on each.
struct Routes {
    h: Harness,
    server: Server,
    pay: Origin,
    plain: Origin,
    ca_pem: PathBuf,
    lease: String,
    token: PathBuf,
}

impl Routes {
    async fn start(with_broker: bool, adjust: impl FnOnce(&mut ServeConfig)) -> Routes {
        let h = Harness::new();
        let (pay, pay_ca) = https_origin(PAY, h.dir.path()).await;
        let plain = http_origin().await;
        let manifest = json!({
            "approvals": ["POST:pay.origin.test/upload", "PUT:plain.origin.test/upload"],
        });
        let lease = h.lease_from(&[PAY, PLAIN, "other.origin.test"], manifest, None);
        let broker = with_broker.then(|| h.broker(&[PAY], "canaries = []\n", &[], Some(&pay_ca)));
        let config = h.config(&[
            (PAY, "127.0.0.1"),
            (PLAIN, "127.0.0.1"),
            ("other.origin.test", "127.0.0.1"),
        ]);
        let mut serve = h.serve_config(config, None);
        serve.broker = broker;
        serve.admin_token = Some(TOKEN.to_owned());
        adjust(&mut serve);
        let server = Server::start(serve).await.unwrap();
        let token = token_file(&h);
        Routes {
            ca_pem: h.dir.path().join("ca").join("ca.pem"),
            h,
            server,
            pay,
            plain,
            lease,
            token,
        }
    }

    fn pay_url(&self, path: &str) -> String {
        format!("https://{PAY}:{}{path}", self.pay.addr.port())
    }

    fn plain_url(&self, path: &str) -> String {
        format!("http://{PLAIN}:{}{path}", self.plain.addr.port())
    }

    /// curl `args` through the proxy under the lease, trusting the interception CA; spawned,
    /// so the test can decide while it waits.
    fn curl(&self, args: &[&str]) -> tokio::task::JoinHandle<CurlOutput> {
        let mut all: Vec<String> = vec![
            "-x".into(),
            proxy_url(&self.server, &self.lease),
            "--cacert".into(),
            self.ca_pem.display().to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        tokio::spawn(async move {
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            curl(&refs, &[]).await
        })
    }

    async fn decide(&self, args: &[&str]) -> String {
        let (ok, out, err) = cli(&self.server, &self.token, args).await;
        assert!(ok, "{args:?}: {out}{err}");
        out
    }
}

/// The `/upload` route's answer for `body`: its length and SHA-256.
fn uploaded(body: &str) -> String {
    format!("{} {}", body.len(), sha_hex(body.as_bytes()))
}

fn egress_of(lines: &[Value], path: &str) -> Value {
    lines
        .iter()
        .find(|l| l["path"] == path)
        .cloned()
        .unwrap_or_else(|| panic!("no egress line for {path}: {lines:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_waits_for_the_cli_then_goes_on_unchanged_and_a_denial_carries_its_reason() {
    let r = Routes::start(true, |_| {}).await;
    let route = "POST:pay.origin.test/upload";
    let held = r.curl(&["--data-binary", BODY, &r.pay_url("/upload?note=x")]);
    let request = pending(&r.server, &r.token, route).await;
    assert_eq!(request["lease_id"], r.lease.as_str());
    let shown = request["arguments"].as_str().unwrap();
    assert!(
        shown.starts_with(&format!("POST https://{PAY}/upload?note=")) && shown.ends_with(BODY),
        "{shown}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished(), "a held request was answered");
    // Not the route: another path, another method, a longer segment — at once.
    let other = r
        .curl(&["--data-binary", BODY, &r.pay_url("/request")])
        .await
        .unwrap();
    assert_eq!(other.status, 200, "{}", other.stderr);
    let get = r.curl(&[&r.pay_url("/upload")]).await.unwrap();
    assert_eq!(get.status, 200, "{}", get.stderr);
    let id = request["id"].as_str().unwrap();
    let out = r.decide(&["approve", id]).await;
    assert_eq!(
        out.trim(),
        format!(
            "{id} approved ({route} for lease {r_lease})",
            r_lease = r.lease
        )
    );
    let went = held.await.unwrap();
    assert_eq!(went.status, 200, "{}", went.stderr);
    assert_eq!(
        went.body_text(),
        uploaded(BODY),
        "the origin got another body"
    );

    // Another spelling of the same route is held too; denied, curl reads the reason.
    let respelled = r.curl(&["--data-binary", "x", &r.pay_url("//Upload;v=1/")]);
    let second = pending(&r.server, &r.token, route).await;
    assert_ne!(second["id"], request["id"]);
    r.decide(&[
        "deny",
        second["id"].as_str().unwrap(),
        "--reason",
        "not this card",
    ])
    .await;
    let denied = respelled.await.unwrap();
    assert_eq!(denied.status, 403, "{}", denied.stderr);
    assert_eq!(
        denied.header("x-leasegate-refusal").as_deref(),
        Some("approval-denied")
    );
    let text = denied.body_text();
    assert!(
        text.contains(&format!("route {route} was denied for lease {}", r.lease))
            && text.contains("not this card"),
        "{text}"
    );

    // A path origins read differently, on a host routes are named for: refused, never let by.
    let ambiguous = r
        .curl(&[
            "--data-binary",
            "x",
            "--path-as-is",
            &r.pay_url("/x/%2e%2e;/upload"),
        ])
        .await
        .unwrap();
    assert_eq!(
        ambiguous.header("x-leasegate-refusal").as_deref(),
        Some("path-ambiguous"),
        "{}",
        ambiguous.body_text()
    );

    let lines = r.h.egress_lines(10).await;
    let approved = lines
        .iter()
        .find(|l| l["approval"] == id)
        .unwrap_or_else(|| panic!("no line with approval {id}: {lines:?}"));
    assert_eq!(approved["approval"], id, "{approved}");
    assert_eq!(approved["status"], 200);
    let refused = egress_of(&lines, "//Upload;v=1/");
    assert_eq!(refused["code"], "approval-denied", "{refused}");
    assert!(refused.get("approval").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_route_is_held_and_nobody_deciding_refuses_it_in_time() {
    let r = Routes::start(false, |serve| {
        serve.approvals.timeout = Duration::from_secs(2)
    })
    .await;
    let route = "PUT:plain.origin.test/upload";
    let held = r.curl(&["-X", "PUT", "--data-binary", BODY, &r.plain_url("/upload")]);
    let request = pending(&r.server, &r.token, route).await;
    assert_eq!(
        request["arguments"],
        format!("PUT http://{PLAIN}/upload\n\n{BODY}")
    );
    let timed_out = held.await.unwrap();
    assert_eq!(timed_out.status, 403, "{}", timed_out.stderr);
    assert_eq!(
        timed_out.header("x-leasegate-refusal").as_deref(),
        Some("approval-timed-out")
    );
    assert!(
        timed_out.body_text().contains("nobody decided within 2s"),
        "{}",
        timed_out.body_text()
    );
    // POST is not the route.
    let post = r
        .curl(&["--data-binary", BODY, &r.plain_url("/upload")])
        .await
        .unwrap();
    assert_eq!(post.status, 200);
    assert_eq!(post.body_text(), uploaded(BODY));

    // Without a broker a tunnel to a host a route names cannot be read: refused, and one to
    // another host is not.
    let connect = |host: &str, port: u16| {
        format!(
            "CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\nX-Lease-Id: {}\r\n\r\n",
            r.lease
        )
    };
    let answer = raw(r.server.addr, connect(PAY, r.pay.addr.port()).as_bytes()).await;
    assert_eq!(status_of(&answer), 503, "{answer}");
    assert!(
        answer.contains("approval-unavailable") && answer.contains("terminates no TLS"),
        "{answer}"
    );
    let other = format!("other.origin.test:{}", r.pay.addr.port());
    let _tunnel = open_tunnel(r.server.addr, &other, Some(&r.lease)).await;
}

/// A terminated tunnel whose request waits moves no byte: it is not closed as idle meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_whose_request_waits_is_not_idle() {
    let r = Routes::start(true, |serve| {
        serve.proxy.tunnel_idle_timeout = Duration::from_millis(500)
    })
    .await;
    let held = r.curl(&["--data-binary", BODY, &r.pay_url("/upload")]);
    let request = pending(&r.server, &r.token, "POST:pay.origin.test/upload").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    r.decide(&["approve", request["id"].as_str().unwrap()])
        .await;
    let went = held.await.unwrap();
    assert_eq!(went.status, 200, "{}", went.stderr);
    assert_eq!(went.body_text(), uploaded(BODY));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_on_a_host_outside_the_ca_refuses_its_tunnels() {
    let h = Harness::new();
    let (pay, pay_ca) = https_origin(PAY, h.dir.path()).await;
    let manifest = json!({"approvals": ["POST:other.origin.test/x"]});
    let lease = h.lease_from(&[PAY, "other.origin.test"], manifest, None);
    let mut serve = h.serve_config(h.config(&[("other.origin.test", "127.0.0.1")]), None);
    serve.broker = Some(h.broker(&[PAY], "canaries = []\n", &[], Some(&pay_ca)));
    let server = Server::start(serve).await.unwrap();
    let port = pay.addr.port();
    let connect = format!(
        "CONNECT other.origin.test:{port} HTTP/1.1\r\nHost: other.origin.test:{port}\r\nX-Lease-Id: {lease}\r\n\r\n"
    );
    let answer = raw(server.addr, connect.as_bytes()).await;
    assert_eq!(status_of(&answer), 503, "{answer}");
    assert!(answer.contains("outside the interception CA"), "{answer}");
}

/// The official OpenAI SDK, unmodified, in a namespace with only loopback: a Chat Completions
/// call a route names waits, and the human's denial is the `PermissionDeniedError` it raises,
/// reason and all; the call never reached the model API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_raises_a_denied_route_with_its_reason() {
    use crate::support::model_api::OPENAI_HOST;
    use crate::support::model_proxy::Staged;
    if !super::clients::python_finds(&["openai", "anthropic"]) {
        return crate::support::skip(
            "the Python SDKs are missing (python3 -m pip install openai anthropic; .ci/run does)",
        );
    }
    if !crate::support::netns::in_loopback_only_namespace().await {
        return;
    }
    let staged = Staged::new(None).await;
    let route = format!("POST:{OPENAI_HOST}/v1/chat/completions");
    let lease = staged
        .h
        .lease_from(&[OPENAI_HOST], json!({"approvals": [route]}), None);
    let m = staged
        .start(|serve| serve.admin_token = Some(TOKEN.to_owned()))
        .await;
    let token = token_file(&m.h);
    let env = m.agent_env_of(&m.server, &lease);
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let script = crate::support::data("clients/brokered/cut_stream.py");
    let args = [script.to_str().unwrap(), "openai"];
    let run = super::clients::client_for(
        Duration::from_secs(120),
        "python3",
        &args,
        &env,
        m.h.dir.path(),
    );
    let deny = async {
        let request = pending(&m.server, &token, &route).await;
        let id = request["id"].as_str().unwrap().to_owned();
        let args = ["deny", &id, "--reason", "no model calls from this job"];
        let (ok, out, err) = cli(&m.server, &token, &args).await;
        assert!(ok, "{out}{err}");
        request
    };
    let (out, request) = tokio::join!(run, deny);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: Value = serde_json::from_str(printed.trim()).unwrap();
    assert_eq!(
        printed["error"]["class"], "PermissionDeniedError",
        "{printed}"
    );
    let message = printed["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("approval-denied") && message.contains("no model calls from this job"),
        "{message}"
    );
    assert!(
        request["arguments"]
            .as_str()
            .unwrap()
            .contains("\"stream\":true"),
        "{request}"
    );
    assert!(
        m.api.seen().is_empty(),
        "a denied call reached the model API"
    );
}
