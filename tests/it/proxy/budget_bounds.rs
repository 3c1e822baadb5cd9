//! Budgets nobody can outrun: every model call reserves its bound (its request's output cap
//! plus its size as input) before it goes out, is charged that bound when its usage cannot be
//! read (a client hanging up mid-stream), and what was spent and reserved is in the spend log,
//! so neither a restart nor `kill -9` of the proxy gives a spent budget back.

use super::budgets::{
    assert_exhausted, budgeted, call_body, call_via, chat, model_call, model_lines, model_view,
    CALL,
};
use crate::support::bin;
use crate::support::harness::*;
use crate::support::model_api::{ANTHROPIC_HOST, HOLD, OPENAI_HOST};
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::{json, Value};
use std::time::Duration;

/// The bound of a [`call_body`] chat completion: its body's bytes as input, `max_tokens` 90.
fn bound_of(body: &str) -> u64 {
    body.len() as u64 + 90
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_calls_at_once_against_a_one_call_budget_let_one_through() {
    let (staged, lease) = budgeted(None, json!({"tokens": CALL})).await;
    let m = staged.start(|_| {}).await;
    // Streams the fake holds halfway: every call is in flight at once.
    let streamed = call_body("gpt-4o-mini", true);
    let hold = format!("{HOLD}: 1");
    let held = ["-H", hold.as_str()];
    let calls: FuturesUnordered<_> = (0..30)
        .map(|_| model_call(&m, &m.server, &lease, false, &streamed, &held))
        .collect();
    let mut calls = calls;
    // 29 are refused while the first is held (its bound reserved); with nothing reserved,
    // all 30 would be held here.
    let mut refused = Vec::new();
    while refused.len() < 29 {
        let next = tokio::time::timeout(Duration::from_secs(20), calls.next()).await;
        let out = next.expect("calls held in flight: the budget let more than one through");
        refused.push(out.unwrap());
    }
    for out in &refused {
        assert_exhausted(out, &lease, "tokens");
        assert!(
            out.body_text().contains("reserved by calls in flight"),
            "{}",
            out.body_text()
        );
    }
    m.api.release();
    let passed = calls.next().await.unwrap();
    assert_eq!(passed.status, 200, "{}", passed.stderr);
    assert!(passed.body_text().ends_with("data: [DONE]\n\n"));
    assert_eq!(m.api.seen().len(), 1, "one call reached the API");
    let view = model_view(&m.server, &lease).await;
    assert_eq!(
        (&view["spent"]["tokens"], &view["spent"]["calls"]),
        (&json!(CALL), &json!(1))
    );
    assert_eq!(view["subtree_spent"]["calls"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_hung_up_on_is_charged_its_bound() {
    let (staged, lease) = budgeted(None, json!({"tokens": 1_000_000})).await;
    let m = staged.start(|_| {}).await;
    let streamed = call_body("gpt-4o-mini", true);
    let hold = format!("{HOLD}: 1");
    // The client gives up halfway (curl's --max-time), before any usage was sent.
    let args = ["-H", hold.as_str(), "--max-time", "2"];
    let out = model_call(&m, &m.server, &lease, false, &streamed, &args).await;
    assert!(
        out.stderr.contains("timed out"),
        "the client hung up: {}",
        out.stderr
    );
    assert!(!out.body_text().contains("[DONE]"));
    m.api.release();

    let lines = model_lines(&m.h.egress, 1).await;
    let model = &lines[0]["model"];
    let bound = bound_of(&streamed);
    assert_eq!(model["charged_tokens"], bound, "{model}");
    assert!(model["unmetered"].is_string(), "{model}");
    assert_eq!(model.get("input_tokens"), None, "{model}");
    let spent = model_view(&m.server, &lease).await["spent"].clone();
    assert_eq!(
        (&spent["tokens"], &spent["unmetered"], &spent["calls"]),
        (&json!(bound), &json!(1), &json!(1)),
        "{spent}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_what_was_spent() {
    let (staged, lease) = budgeted(None, json!({"tokens": 2 * CALL})).await;
    let m = staged.start(|_| {}).await;
    for _ in 0..2 {
        assert_eq!(chat(&m, &m.server, &lease).await.status, 200);
    }
    assert_exhausted(&chat(&m, &m.server, &lease).await, &lease, "tokens");
    let m = m.restart().await;
    let refused = chat(&m, &m.server, &lease).await;
    assert_exhausted(&refused, &lease, "tokens");
    let view = model_view(&m.server, &lease).await;
    assert_eq!(view["spent"]["tokens"], 2 * CALL, "{view}");
    assert_eq!(m.api.seen().len(), 2, "no call went out after the restart");
    let spent_log = std::fs::read_to_string(format!("{}.spent", m.h.journal.display())).unwrap();
    assert!(spent_log.contains(&lease), "{spent_log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_a_call_in_flight_charges_it_its_bound() {
    // A budget the call in flight spends whole once charged its bound.
    let streamed = call_body("gpt-4o-mini", true);
    let bound = bound_of(&streamed);
    let (staged, lease) = budgeted(None, json!({"tokens": bound})).await;
    let h = &staged.h;
    let dir = h.dir.path();
    let (secrets, ca_dir) = (dir.join("secrets.toml"), dir.join("ca"));
    let resolve = |host: &str| format!("{host}=127.0.0.1");
    let mut child = tokio::process::Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "off"])
        .args(["--journal", h.journal.to_str().unwrap()])
        .args(["--key-file", h.key_path.to_str().unwrap()])
        .args(["--secrets", secrets.to_str().unwrap()])
        .args(["--ca-dir", ca_dir.to_str().unwrap()])
        .args(["--upstream-ca", staged.api.ca.to_str().unwrap()])
        .args(["--resolve", &resolve(OPENAI_HOST)])
        .args(["--resolve", &resolve(ANTHROPIC_HOST)])
        .args([
            "--allow-private",
            "127.0.0.1/32",
            "--connect-ports",
            "1-65535",
        ])
        .env("LG_OPENAI_KEY", crate::support::model_proxy::OPENAI_KEY)
        .env(
            "LG_ANTHROPIC_KEY",
            crate::support::model_proxy::ANTHROPIC_KEY,
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr = crate::support::served_addr(&mut child).await;
    let proxy = format!("http://agent:{lease}@{addr}");

    let hold = format!("{HOLD}: 1");
    let args = ["-H", hold.as_str()];
    let held = call_via(h, &staged.api, &proxy, &lease, false, &streamed, &args);
    let kill = async {
        let started = eventually(Duration::from_secs(10), || async {
            staged.api.seen().iter().any(|s| s.stream).then_some(())
        });
        assert!(started.await.is_some(), "the stream never reached the fake");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().await.unwrap()
    };
    let (out, killed) = tokio::join!(held, kill);
    assert!(!killed.success());
    assert!(
        !out.body_text().contains("[DONE]"),
        "the proxy died mid-stream"
    );
    staged.api.release();

    // Started again: the call the dead proxy had in flight was charged its bound.
    let m = staged.start(|_| {}).await;
    assert_exhausted(&chat(&m, &m.server, &lease).await, &lease, "tokens");
    let view = model_view(&m.server, &lease).await;
    let spent = &view["spent"];
    assert_eq!(
        (&spent["tokens"], &spent["unmetered"]),
        (&json!(bound), &json!(1)),
        "{view}"
    );
    assert_eq!(m.api.seen().len(), 1);
    let _: Value = view;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_call_the_proxy_cannot_bound_never_goes_out() {
    let (staged, lease) = budgeted(None, json!({"tokens": 1_000_000})).await;
    let m = staged
        .start(|serve| serve.proxy.max_model_request_bytes = 1000)
        .await;
    // Two parsers could read this one as streamed or not, capped at 1 or at 100,000.
    for body in [
        r#"{"model":"gpt-4o-mini","stream":false,"stream":true,"messages":[]}"#,
        r#"{"model":"gpt-4o-mini","max_tokens":1,"max_tokens":100000,"messages":[]}"#,
        r#"{"model":"gpt-4o-mini","max_tokens":"9","messages":[]}"#,
    ] {
        let out = model_call(&m, &m.server, &lease, false, body, &[]).await;
        assert_eq!(out.status, 400, "{body}: {}", out.body_text());
        assert_eq!(
            out.header("x-leasegate-refusal").as_deref(),
            Some("bad-target")
        );
        assert!(
            out.body_text().contains("cannot be bounded"),
            "{}",
            out.body_text()
        );
    }
    let big = json!({"model": "gpt-4o-mini", "max_tokens": 5,
        "messages": [{"role": "user", "content": "x ".repeat(600)}]});
    let out = model_call(&m, &m.server, &lease, false, &big.to_string(), &[]).await;
    assert_eq!(out.status, 413, "{}", out.body_text());
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("body-too-large")
    );
    assert!(out.body_text().contains("--max-model-request-bytes (1000)"));
    assert_eq!(m.api.seen().len(), 0, "none of them went out");
    // Within the limit, the same call goes.
    assert_eq!(chat(&m, &m.server, &lease).await.status, 200);
}
