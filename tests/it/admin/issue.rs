//! `POST /leases`: the issuer's half of the contract through the admin API: a grant served the
//! moment it is answered, the narrowing rules with their records, who may issue, idempotency,
//! bounds, and the end of a lease.

use crate::support::harness::{admin_call, http_origin, status_through, Harness};
use crate::support::{bin, leasegate_sync};
use leasegate::budget::Charge;
use leasegate::contract::token;
use leasegate::server::Server;
use serde_json::{json, Value};

/// `POST path` with `body`, as the operator (no admin token configured), with `headers`.
async fn post(
    server: &Server,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Value) {
    let (status, text) = admin_call(server, "POST", path, token, headers, &body.to_string()).await;
    let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {status} {text}"));
    (status, value)
}

/// A body asking for a lease of `hosts` with `budget`, under `parent` if given.
fn asking(hosts: &[&str], budget: Value, parent: Option<&str>) -> Value {
    let mut body = json!({
        "manifest": {
            "agent": {"name": "worker"},
            "intent": {"purpose": "test issuing"},
            "allow": {"hosts": hosts},
            "budget": budget,
        },
        "lifetime_seconds": 600,
    });
    if let Some(parent) = parent {
        body["parent_lease_id"] = parent.into();
    }
    body
}

async fn issued(server: &Server, body: &Value) -> Value {
    let (status, answer) = post(server, "/leases", None, &[], body).await;
    assert_eq!(status, 201, "{answer}");
    answer
}

/// `leasegate verify` reads every record of the journal as valid under the harness's key.
fn verifies(h: &Harness) {
    let out = leasegate_sync(&[
        "verify",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn records(h: &Harness, event: &str) -> Vec<Value> {
    std::fs::read_to_string(&h.journal)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["event"] == event)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_served_the_moment_its_answer_arrives() {
    let h = Harness::new();
    let origin = http_origin().await;
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    for _ in 0..20 {
        let answer = issued(
            &server,
            &asking(&["origin.test"], json!({"tokens": 1000}), None),
        )
        .await;
        let id = answer["lease_id"].as_str().unwrap();
        // No wait: the grant was folded before the answer.
        assert_eq!(status_through(&server, id, &url).await, 200, "{answer}");
        assert_eq!(answer["credential"], id, "--credentials id");
        assert_eq!(answer["token"], token::mint(&h.key, id));
        assert_eq!(answer["env"]["HTTPS_PROXY"], answer["proxy_url"]);
        assert_eq!(answer["env"]["NO_PROXY"], "");
        assert!(answer["proxy_url"].as_str().unwrap().contains(id));
        assert_eq!(
            answer["manifest"]["budget"],
            json!({"tokens": 1000, "depth": 4, "fan_out": 8})
        );
        assert_eq!(
            answer["narrowed"],
            json!(["budget.depth set to 4", "budget.fan_out set to 8"])
        );
    }
    let granted = records(&h, "granted");
    assert_eq!(granted.len(), 20);
    // The contract's granted record: the declared manifest and both hashes.
    assert_eq!(
        granted[0]["declared"]["allow"]["hosts"],
        json!(["origin.test"])
    );
    assert!(granted[0]["granted_hash"].as_str().is_some());
    assert_eq!(records(&h, "narrowed").len(), 20);
    // Every record verifies under the key.
    verifies(&h);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_is_narrowed_to_its_parent_and_says_how() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let mut parent_body = asking(
        &["*.example.com"],
        json!({"tokens": 1000, "cost_usd": 2}),
        None,
    );
    parent_body["manifest"]["deny"] = json!({"hosts": ["secret.example.com"]});
    parent_body["manifest"]["approvals"] = json!(["external.write"]);
    parent_body["manifest"]["allow"]["tools"] = json!(["gh/search"]);
    let parent = issued(&server, &parent_body).await;
    let parent_id = parent["lease_id"].as_str().unwrap();
    // Spending measured under the parent lowers what a child may get.
    server.proxy.telemetry.spending.charge(
        [parent_id],
        &Charge {
            metered: true,
            input_tokens: 300,
            output_tokens: 100,
            cached_tokens: 0,
            cost_usd: Some(0.5),
            tool_calls: 0,
        },
    );
    let mut wider = asking(
        &["api.example.com", "*.example.com", "evil.test"],
        json!({"tokens": 5000, "cost_usd": 9, "depth": 9}),
        Some(parent_id),
    );
    wider["manifest"]["allow"]["tools"] = json!(["gh/search", "shell/exec"]);
    wider["lifetime_seconds"] = json!(86400);
    let child = issued(&server, &wider).await;
    let m = &child["manifest"];
    assert_eq!(
        m["allow"]["hosts"],
        json!(["api.example.com", "*.example.com"])
    );
    assert_eq!(m["allow"]["tools"], json!(["gh/search"]));
    assert_eq!(m["deny"]["hosts"], json!(["secret.example.com"]));
    assert_eq!(m["approvals"], json!(["external.write"]));
    assert_eq!(
        m["budget"],
        json!({"tokens": 600, "cost_usd": 1.5, "depth": 3, "fan_out": 8})
    );
    assert_eq!(m["parent_lease_id"], parent_id);
    assert_eq!(
        child["expires_at"], parent["expires_at"],
        "never outlives its parent"
    );
    let narrowed = records(&h, "narrowed");
    let summary = narrowed.last().unwrap()["reason"]
        .as_str()
        .unwrap()
        .to_owned();
    for clause in [
        "allow.hosts -1",
        "allow.tools -1",
        "budget.tokens 5000→600",
        "budget.depth 9→3",
        "deny.hosts +1",
        "approvals +1",
        "expires_at",
    ] {
        assert!(summary.contains(clause), "{clause}: {summary}");
    }
    assert_eq!(narrowed.last().unwrap()["parent_lease_id"], parent_id);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn depth_and_fan_out_refuse_with_recorded_reasons() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let root = issued(
        &server,
        &asking(&["*.example.com"], json!({"depth": 1, "fan_out": 1}), None),
    )
    .await;
    let root_id = root["lease_id"].as_str().unwrap();
    let child = issued(
        &server,
        &asking(&["api.example.com"], json!({}), Some(root_id)),
    )
    .await;
    let child_id = child["lease_id"].as_str().unwrap();
    assert_eq!(
        child["manifest"]["budget"],
        json!({"depth": 0, "fan_out": 1})
    );
    // The parent's one place is taken.
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(&["api.example.com"], json!({}), Some(root_id)),
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["reasons"], json!(["vendor:leasegate:fan-out-full"]));
    // A child at depth 0 has no children.
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(&["api.example.com"], json!({}), Some(child_id)),
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(
        answer["reasons"],
        json!(["vendor:leasegate:depth-exhausted"])
    );
    let refused = records(&h, "refused");
    assert_eq!(refused.len(), 2);
    assert_eq!(refused[1]["lease_id"], answer["refusal_id"]);
    assert_eq!(refused[1]["parent_lease_id"], child_id);
    assert!(refused[1]["declared_hash"].as_str().is_some());
    // Its place is free again once the child completes.
    let (status, done) = post(
        &server,
        &format!("/leases/{child_id}/complete"),
        None,
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    issued(
        &server,
        &asking(&["api.example.com"], json!({}), Some(root_id)),
    )
    .await;
    // An unknown parent is refused and recorded as the contract's runtime error.
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(
            &["a.example.com"],
            json!({}),
            Some("0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c"),
        ),
    )
    .await;
    assert_eq!(status, 404, "{answer}");
    assert_eq!(answer["reasons"], json!(["runtime_error:parent_unknown"]));
    verifies(&h);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_contracts_refusals_are_answered_and_recorded() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let mut body = asking(&["api.example.com"], json!({}), None);
    body["manifest"]["intent"]["purpose"] = json!("");
    body["manifest"]["agent"]["kind"] = json!("native");
    let (status, answer) = post(&server, "/leases", None, &[], &body).await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(answer["reasons"], json!(["R1", "R4"]));
    let (status, answer) = post(&server, "/leases", None, &[], &asking(&[], json!({}), None)).await;
    assert_eq!(status, 422);
    assert_eq!(answer["reasons"], json!(["R2"]));
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(&["*.*.example.com"], json!({}), None),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(answer["reasons"], json!(["runtime_error:schema_invalid"]));
    assert_eq!(records(&h, "refused").len(), 3);
    assert!(records(&h, "granted").is_empty());
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_token_issues_its_own_children_only_and_never_wider() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let a = issued(
        &server,
        &asking(&["*.a.test"], json!({"tokens": 100}), None),
    )
    .await;
    let b = issued(&server, &asking(&["*.b.test"], json!({}), None)).await;
    let (a_id, b_id) = (
        a["lease_id"].as_str().unwrap(),
        b["lease_id"].as_str().unwrap(),
    );
    let a_token = token::mint(&h.key, a_id);
    // No parent named: its own.
    let (status, child) = post(
        &server,
        "/leases",
        Some(&a_token),
        &[],
        &asking(&["x.a.test", "x.b.test"], json!({"tokens": 5000}), None),
    )
    .await;
    assert_eq!(status, 201, "{child}");
    assert_eq!(child["parent_lease_id"], a_id);
    assert_eq!(child["manifest"]["allow"]["hosts"], json!(["x.a.test"]));
    assert_eq!(child["manifest"]["budget"]["tokens"], 100);
    // Another lease as the parent, or a root: refused, nothing written.
    let before = records(&h, "granted").len();
    let (status, answer) = post(
        &server,
        "/leases",
        Some(&a_token),
        &[],
        &asking(&["x.b.test"], json!({}), Some(b_id)),
    )
    .await;
    assert_eq!(status, 403, "{answer}");
    assert_eq!(records(&h, "granted").len(), before);
    // It may end itself, not another.
    let (status, _) = post(
        &server,
        &format!("/leases/{b_id}/stop"),
        Some(&a_token),
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(status, 403);
    // A child of a closed parent is refused.
    let (status, _) = post(
        &server,
        &format!("/leases/{a_id}/revoke"),
        None,
        &[],
        &json!({"reason": "done"}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(&["x.a.test"], json!({}), Some(a_id)),
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["reasons"], json!(["vendor:leasegate:parent-closed"]));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_returns_the_same_lease_never_a_second() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let body = asking(&["api.example.com"], json!({"tokens": 10}), None);
    let key = [("Idempotency-Key", "order-42")];
    let (first_status, first) = post(&server, "/leases", None, &key, &body).await;
    assert_eq!(first_status, 201, "{first}");
    let (again_status, again) = post(&server, "/leases", None, &key, &body).await;
    assert_eq!(again_status, 200, "{again}");
    assert_eq!(again["lease_id"], first["lease_id"]);
    assert_eq!(again["replayed"], true);
    assert_eq!(again["manifest"], first["manifest"]);
    assert_eq!(again["token"], first["token"]);
    // The same key with another body is refused; so is it from another caller's view.
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &key,
        &asking(&["api.example.com"], json!({"tokens": 11}), None),
    )
    .await;
    assert_eq!(status, 422, "{answer}");
    assert!(answer["error"]
        .as_str()
        .unwrap()
        .contains("different request"));
    assert_eq!(records(&h, "granted").len(), 1, "one lease, never a second");
    // A key unlike any other is a new lease.
    let (status, other) = post(
        &server,
        "/leases",
        None,
        &[("Idempotency-Key", "order-43")],
        &body,
    )
    .await;
    assert_eq!(status, 201);
    assert_ne!(other["lease_id"], first["lease_id"]);
    let (status, _) = post(&server, "/leases", None, &[("Idempotency-Key", "")], &body).await;
    assert_eq!(status, 400);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_and_floods_are_refused_before_anything_is_written() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let big = json!({"manifest": {"x": "y".repeat(300 * 1024)}});
    let (status, _) = admin_call(&server, "POST", "/leases", None, &[], &big.to_string()).await;
    assert_eq!(status, 413);
    for (body, why) in [
        ("{", "not JSON"),
        ("[]", "a JSON object"),
        (r#"{"manifest": {}, "ttl": 5}"#, "unknown member"),
        (
            r#"{"manifest": {}, "lifetime_seconds": -1}"#,
            "lifetime_seconds",
        ),
        (
            r#"{"manifest": {}, "lifetime_seconds": 1, "expires_at": "2030-01-01T00:00:00.000Z"}"#,
            "not both",
        ),
        (
            r#"{"manifest": {}, "parent_lease_id": "NOT-AN-ID"}"#,
            "parent_lease_id",
        ),
    ] {
        let (status, text) = admin_call(&server, "POST", "/leases", None, &[], body).await;
        assert_eq!(status, 400, "{body}: {text}");
        assert!(text.contains(why), "{why}: {text}");
    }
    assert!(records(&h, "granted").is_empty() && records(&h, "refused").is_empty());
    server.shutdown().await;
    // A flood is answered 429 with a Retry-After; nothing is written for it.
    let h = Harness::new();
    let mut config = h.serve_config(h.config(&[]), None);
    config.issuing.rate = std::num::NonZeroU32::new(3).unwrap();
    let server = Server::start(config).await.unwrap();
    let mut limited = 0;
    for _ in 0..10 {
        let (status, _) = admin_call(
            &server,
            "POST",
            "/leases",
            None,
            &[],
            &asking(&["a.test"], json!({}), None).to_string(),
        )
        .await;
        limited += usize::from(status == 429);
    }
    assert!(limited >= 6, "{limited}");
    let (_, metrics) = crate::support::harness::admin_text(&server, "/metrics").await;
    let counted = |outcome: &str| {
        crate::admin::operate::sample(
            &metrics,
            &format!("leasegate_leases_issued_total{{outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(counted("rate-limited"), Some(limited as f64), "{metrics}");
    assert_eq!(counted("granted"), Some((10 - limited) as f64));
    assert!(records(&h, "granted").len() <= 4);
    // A Host that is not the admin API's is refused, with `/`, `#` or `@` in it too.
    for host in [
        "localhost/x",
        "localhost#x",
        "evil@localhost",
        "localhost@evil",
    ] {
        let answer = crate::support::harness::raw(
            server.admin_addr.unwrap(),
            format!("POST /leases HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}").as_bytes(),
        )
        .await;
        let status = crate::support::harness::status_of(&answer);
        assert!(status == 400 || status == 421, "{host}: {answer}");
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_records_the_measured_usage_and_stop_ends_once() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let a = issued(&server, &asking(&["a.test"], json!({"tokens": 1000}), None)).await;
    let a_id = a["lease_id"].as_str().unwrap();
    server.proxy.telemetry.spending.charge(
        [a_id],
        &Charge {
            metered: true,
            input_tokens: 40,
            output_tokens: 2,
            cached_tokens: 0,
            cost_usd: Some(0.01),
            tool_calls: 0,
        },
    );
    let (status, done) = post(
        &server,
        &format!("/leases/{a_id}/complete"),
        Some(&token::mint(&h.key, a_id)),
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"], json!({"tokens": 42, "cost_usd": 0.01}));
    let completed = records(&h, "completed");
    assert_eq!(
        completed[0]["usage"],
        json!({"tokens": 42, "cost_usd": 0.01})
    );
    assert!(
        completed[0]["signature"].as_str().is_some(),
        "signed like a revocation"
    );
    let (status, again) = post(
        &server,
        &format!("/leases/{a_id}/complete"),
        None,
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(status, 409, "{again}");
    assert_eq!(again["closed"]["event"], "completed");
    // Nothing measured: no usage member is invented.
    let b = issued(&server, &asking(&["b.test"], json!({}), None)).await;
    let b_id = b["lease_id"].as_str().unwrap();
    let (status, done) = post(
        &server,
        &format!("/leases/{b_id}/complete"),
        None,
        &[],
        &json!({}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(done["usage"], json!({}));
    assert_eq!(records(&h, "completed")[1]["usage"], json!({}));
    let c = issued(&server, &asking(&["c.test"], json!({}), None)).await;
    let c_id = c["lease_id"].as_str().unwrap();
    let (status, _) = post(
        &server,
        &format!("/leases/{c_id}/stop"),
        None,
        &[],
        &json!({"reason": "operator stop"}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(records(&h, "stopped")[0]["reason"], "operator stop");
    let (status, _) = post(
        &server,
        &format!("/leases/{c_id}/revoke"),
        None,
        &[],
        &json!({"reason": "late"}),
    )
    .await;
    assert_eq!(status, 200, "a stopped lease may still be revoked");
    let _ = bin();
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_issue_command_takes_a_manifest_and_issues_through_the_admin_api() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let manifest = h.dir.path().join("manifest.json");
    std::fs::write(
        &manifest,
        json!({"agent": {"name": "from-file", "kind": "delegated-cli", "runtime_agent": "claude-code"},
               "intent": {"purpose": "a manifest file"},
               "allow": {"hosts": ["*.example.com"], "tools": ["gh/search"]},
               "budget": {"tokens": 900}})
        .to_string(),
    )
    .unwrap();
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let from_file = |more: &[&str]| {
        let mut argv = vec![
            "issue",
            "--admin",
            &admin,
            "--manifest",
            manifest.to_str().unwrap(),
            "--tool",
            "gh/issues",
            "--approval",
            "external.write",
            "--cost-usd",
            "1.5",
            "--idempotency-key",
            "cli-1",
        ];
        argv.extend(more);
        leasegate_sync(&argv)
    };
    let out = from_file(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let lines: Vec<&str> = stdout.lines().collect();
    let id = lines[0];
    assert_eq!(lines[1], token::mint(&h.key, id));
    assert!(lines[2].starts_with("expires_at "), "{stdout}");
    // Served at once, by the proxy's own signature.
    let (status, view) =
        crate::support::harness::admin_get(&server, &format!("/leases/{id}")).await;
    assert_eq!(status, 200, "{view}");
    assert_eq!(view["agent"], "from-file");
    let granted = records(&h, "granted");
    let m = &granted[0]["lease"]["manifest"];
    assert_eq!(m["allow"]["tools"], json!(["gh/search", "gh/issues"]));
    assert_eq!(m["approvals"], json!(["external.write"]));
    assert_eq!(m["budget"]["tokens"], 900);
    assert_eq!(m["budget"]["cost_usd"], 1.5);
    assert_eq!(m["agent"]["runtime_agent"], "claude-code");
    // The same key again: the same lease.
    let again = from_file(&["--print", "id"]);
    assert_eq!(String::from_utf8_lossy(&again.stdout).trim(), id);
    // A child into the journal file: narrowed to its parent, and it says so.
    let out = leasegate_sync(&[
        "issue",
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
        "--parent",
        id,
        "--allow-host",
        "api.example.com,evil.test",
        "--tokens",
        "5000",
        "--print",
        "id",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("narrowed: allow.hosts -1")
            && stderr.contains("narrowed: budget.tokens 5000→900"),
        "{stderr}"
    );
    let child = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let granted = records(&h, "granted");
    let last = granted.last().unwrap();
    assert_eq!(last["lease_id"], child.as_str());
    assert_eq!(
        last["lease"]["manifest"]["allow"]["hosts"],
        json!(["api.example.com"])
    );
    assert_eq!(
        last["lease"]["manifest"]["approvals"],
        json!(["external.write"])
    );
    // A refusal through the admin API is the API's words and codes, exit 1.
    let out = leasegate_sync(&[
        "issue",
        "--admin",
        &admin,
        "--allow-host",
        "a.test",
        "--purpose",
        " ",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("422") && stderr.contains("(R1)"),
        "{stderr}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_parent_issues_nothing() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let mut body = asking(&["*.example.com"], json!({}), None);
    body["lifetime_seconds"] = json!(0.2);
    let parent = issued(&server, &body).await;
    let id = parent["lease_id"].as_str().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let (status, answer) = post(
        &server,
        "/leases",
        None,
        &[],
        &asking(&["a.example.com"], json!({}), Some(id)),
    )
    .await;
    assert_eq!(status, 409, "{answer}");
    assert_eq!(answer["reasons"], json!(["vendor:leasegate:parent-closed"]));
    assert!(
        answer["error"].as_str().unwrap().contains("expired"),
        "{answer}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_with_its_own_port_is_answered_with_the_port_open() {
    let h = Harness::new();
    let origin = http_origin().await;
    let server = h
        .start_with_ports(
            h.config(&[("origin.test", "127.0.0.1")]),
            Some(crate::support::harness::port_range(8)),
        )
        .await;
    let answer = issued(&server, &asking(&["origin.test"], json!({}), None)).await;
    let port = answer["port"].as_u64().expect("a port of its own") as u16;
    assert_eq!(answer["proxy_url"], format!("http://127.0.0.1:{port}"));
    assert_eq!(answer["env"]["HTTP_PROXY"], answer["proxy_url"]);
    // Its port serves it at once, with no credential.
    let out = crate::support::harness::curl(
        &[
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "--proxy",
            &format!("http://127.0.0.1:{port}"),
            &format!("http://origin.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(out.body_text(), "hello from origin\n");
    server.shutdown().await;
}

/// Refusals from every caller together write at most so many `refused` records a second;
/// beyond, each is answered the same, with `"recorded": false`, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refusals_cannot_flood_the_journal() {
    let h = Harness::new();
    let mut config = h.serve_config(h.config(&[]), None);
    config.issuing.refusals_recorded = std::num::NonZeroU32::new(2).unwrap();
    let server = Server::start(config).await.unwrap();
    let mut body = asking(&["a.test"], json!({}), None);
    body["manifest"]["intent"]["purpose"] = json!("");
    let mut recorded = 0;
    for _ in 0..10 {
        let (status, answer) = post(&server, "/leases", None, &[], &body).await;
        assert_eq!(status, 422, "{answer}");
        assert_eq!(answer["reasons"], json!(["R1"]));
        recorded += usize::from(answer["recorded"] == true);
    }
    assert!(recorded < 10, "{recorded}");
    assert_eq!(records(&h, "refused").len(), recorded);
    server.shutdown().await;
}
