//! A stream that crosses its budget is cut: on two replicas sharing a budget through the egress
//! stream, a streamed call in flight on one is ended, at its next event boundary, with the
//! API's own error event once the other replica's calls spend the budget — its SDK raises — and
//! the call is charged as a cut one. With sixteen streamed calls at once across the two, what
//! the budget is overshot by is printed against the bound the model budgets page states.

use super::budgets::{
    budgeted, call_body, chat, model_call, model_lines, model_view, on_nats, propagation_delay,
    spend, HOSTS,
};
use crate::cluster::scale_out::until_status;
use crate::cluster::usage::stream_config;
use crate::support::harness::*;
use crate::support::model_api::HOLD;
use crate::support::model_proxy::ModelProxy;
use crate::support::nats::{publish_file, NatsCluster};
use crate::support::nats_missing;
use leasegate::contract::Timestamp;
use leasegate::server::Server;
use leasegate::telemetry::egress_stream;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

/// Two replicas of one NATS journal and egress stream, both reading each other's calls, with
/// lease 1's budget `budget`: the proxy (A, with the fake model API), replica B, their egress
/// logs, and the lease.
struct Two {
    _cluster: NatsCluster,
    journal: leasegate::nats::NatsStream,
    m: ModelProxy,
    b: Server,
    egress: [PathBuf; 2],
    lease: String,
}

async fn two(budget: Value) -> Two {
    let cluster = NatsCluster::start(3);
    let journal = cluster.journal("LG").await;
    let (staged, lease) = budgeted(None, budget).await;
    let h = &staged.h;
    let probe = h
        .grant_budgeted(
            9,
            None,
            Timestamp::now(),
            &HOSTS,
            json!({"tokens": 1_000_000}),
        )
        .await;
    let mut stream = stream_config(h, &cluster, egress_stream::DEFAULT_BACKLOG);
    stream.nats.replicas = 3;
    let dir = h.dir.path().to_owned();
    let (first, egress_a) = on_nats(&cluster, &stream, &dir, "a");
    let m = staged.start(first).await;
    let (second, egress_b) = on_nats(&cluster, &stream, &dir, "b");
    let b = m.another(second).await;
    publish_file(&journal, &m.h.journal).await;
    for server in [&m.server, &b] {
        assert!(until_status(server, &lease, "open", AT_ONCE * 2).await);
        let live = eventually(Duration::from_secs(20), || async {
            (chat(&m, server, &probe).await.status == 200).then_some(())
        });
        assert!(
            live.await.is_some(),
            "a replica never read the egress stream"
        );
    }
    Two {
        _cluster: cluster,
        journal,
        m,
        b,
        egress: [egress_a, egress_b],
        lease,
    }
}

/// Runs `cut_stream.py api` (the SDK's streamed call, held in flight by the fake) as `lease`
/// through replica A while `elsewhere` runs: what the script printed, and what `elsewhere`
/// returned.
async fn sdk_stream_while<T>(
    t: &Two,
    api: &str,
    elsewhere: impl std::future::Future<Output = T>,
) -> (Value, T) {
    let env = t.m.agent_env_of(&t.m.server, &t.lease);
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let script = crate::support::data("clients/brokered/cut_stream.py");
    let args = [script.to_str().unwrap(), api];
    let run = super::clients::client_for(
        Duration::from_secs(120),
        "python3",
        &args,
        &env,
        t.m.h.dir.path(),
    );
    let (out, other) = tokio::join!(run, elsewhere);
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (serde_json::from_str(printed.trim()).unwrap(), other)
}

/// Waits for a call to reach the fake API past `before`, then has replica B spend the budget
/// (two calls of 100 tokens against 150) and A read it, then lets the held stream go on.
async fn spend_on_b_while_held(t: &Two, before: usize) -> u64 {
    let m = &t.m;
    let in_flight = eventually(Duration::from_secs(60), || async {
        (m.api.seen().len() > before).then_some(())
    });
    assert!(in_flight.await.is_some(), "the stream never went out");
    // B does not know A's call in flight: it spends the budget (100 tokens a call).
    let (calls, refused) = spend(m, &t.b, &t.lease).await;
    assert_eq!(refused.status, 429, "{}", refused.body_text());
    let folded = eventually(AT_ONCE * 4, || async {
        let spent = model_view(&m.server, &t.lease).await["spent"]["tokens"].as_u64()?;
        (spent >= 150).then_some(spent)
    });
    assert!(folded.await.is_some(), "A never read B's calls");
    m.api.release();
    calls
}

/// The official SDKs, unmodified: a stream cut for its budget raises, naming the refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sdks_raise_when_their_stream_is_cut_for_the_budget() {
    if nats_missing() {
        return;
    }
    if !super::clients::python_finds(&["openai", "anthropic"]) {
        return crate::support::skip("the Python SDKs openai and anthropic are missing (python3 -m pip install openai anthropic; .ci/run does)");
    }
    for (api, class) in [("openai", "APIError"), ("anthropic", "APIStatusError")] {
        let t = two(json!({"tokens": 150})).await;
        let before = t.m.api.seen().len();
        let (printed, calls) = sdk_stream_while(&t, api, spend_on_b_while_held(&t, before)).await;
        assert_eq!(calls, 2);
        let error = &printed["error"];
        assert!(
            error.is_object(),
            "{api}: the stream was not cut: {printed}"
        );
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("leasegate cut this stream: budget-exhausted"),
            "{api}: {printed}"
        );
        assert!(
            error["class"] == class || message.contains("budget_exhausted"),
            "{api}: {printed}"
        );
        assert!(printed["deltas"].as_u64().unwrap() < 90, "{api}: {printed}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_in_flight_is_cut_with_the_apis_error_once_another_replica_spends_its_budget() {
    if nats_missing() {
        return;
    }
    let t = two(json!({"tokens": 150})).await;
    let (m, lease) = (&t.m, &t.lease);
    let before = m.api.seen().len();
    let streamed = call_body("gpt-4o-mini", true);
    let hold = format!("{HOLD}: 1");
    let held = ["-H", hold.as_str()];
    let on_a = model_call(m, &m.server, lease, false, &streamed, &held);
    let elsewhere = async {
        let in_flight = eventually(Duration::from_secs(10), || async {
            (m.api.seen().len() > before).then_some(())
        });
        assert!(in_flight.await.is_some(), "the stream never went out");
        // B does not know A's call in flight: it spends the budget (100 tokens a call).
        let (calls, refused) = spend(m, &t.b, lease).await;
        assert_eq!(refused.status, 429, "{}", refused.body_text());
        let folded = eventually(AT_ONCE * 4, || async {
            let spent = model_view(&m.server, lease).await["spent"]["tokens"].as_u64()?;
            (spent >= 150).then_some(spent)
        });
        assert!(folded.await.is_some(), "A never read B's calls");
        m.api.release();
        calls
    };
    let (out, calls) = tokio::join!(on_a, elsewhere);
    assert_eq!(calls, 2);
    let body = out.body_text();
    assert_eq!(out.status, 200, "{body}");
    assert!(
        !body.contains("[DONE]"),
        "the stream ran to its end: {body}"
    );
    assert!(
        body.ends_with("\n\n") && body.contains(r#""code":"budget-exhausted""#),
        "{body}"
    );
    assert!(
        body.contains(&format!(
            "leasegate cut this stream: budget-exhausted (lease {lease}"
        )),
        "{body}"
    );
    let lines = model_lines(&t.egress[0], 2).await;
    let cut: Vec<&Value> = lines
        .iter()
        .filter(|l| l["lease_id"] == lease.as_str())
        .collect();
    assert_eq!(cut.len(), 1, "{lines:?}");
    assert!(
        cut[0]["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("cut for the budget: lease")),
        "{}",
        cut[0]
    );
    crate::support::egress_schema_valid(cut[0]);
}

/// What a model line charged: its usage, or (unread, cut) its bound.
fn charged(line: &Value) -> u64 {
    let m = &line["model"];
    match m["charged_tokens"].as_u64() {
        Some(bound) => bound,
        None => m["input_tokens"].as_u64().unwrap() + m["output_tokens"].as_u64().unwrap(),
    }
}

/// Sixteen streamed calls at once, eight on each replica, each worker calling until refused,
/// against one budget: what it is overshot by, printed beside the bound model-budgets.md
/// states — per replica, what its calls in flight reserve when its view of the budget is
/// reached (each at most a call's bound), plus the calls the other replica ended within the
/// propagation delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_parallel_streams_on_two_replicas_overshoot_by_at_most_the_stated_bound() {
    if nats_missing() {
        return;
    }
    const BUDGET: u64 = 1000;
    let t = two(json!({"tokens": BUDGET})).await;
    // A lease of its own (no budget), to measure the propagation delay with.
    let witness =
        t.m.h
            .grant_budgeted(10, None, Timestamp::now(), &HOSTS, json!({}))
            .await;
    publish_file(&t.journal, &t.m.h.journal).await;
    assert!(until_status(&t.b, &witness, "open", AT_ONCE * 2).await);
    let (call_time, delay) = propagation_delay(&t.m, &t.m.server, &t.b, &witness).await;
    let streamed = call_body("gpt-4o-mini", true);
    let bound = streamed.len() as u64 + 90;
    let started = std::time::Instant::now();
    let workers = (0..16).map(|i| {
        let server = if i % 2 == 0 { &t.m.server } else { &t.b };
        let streamed = &streamed;
        let t = &t;
        async move {
            let mut calls = 0;
            loop {
                let out = model_call(&t.m, server, &t.lease, false, streamed, &[]).await;
                if out.status != 200 {
                    assert_eq!(out.status, 429, "{}", out.body_text());
                    return calls;
                }
                calls += 1;
            }
        }
    });
    let calls: u64 = futures_util::future::join_all(workers).await.iter().sum();
    let took = started.elapsed();
    // Every answered call's line, from both egress logs.
    let lines = eventually(Duration::from_secs(10), || async {
        let mut lines = Vec::new();
        for file in &t.egress {
            let text = tokio::fs::read_to_string(file).await.unwrap_or_default();
            lines.extend(
                text.lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap())
                    .filter(|l| l["lease_id"] == t.lease.as_str() && l["code"].is_null())
                    .filter(|l| l.get("model").is_some()),
            );
        }
        (lines.len() as u64 == calls).then_some(lines)
    })
    .await
    .unwrap_or_else(|| panic!("no line for each of the {calls} answered calls"));
    let cut = lines
        .iter()
        .filter(|l| {
            l["error"]
                .as_str()
                .is_some_and(|e| e.starts_with("cut for the budget"))
        })
        .count() as u64;
    let total: u64 = lines.iter().map(charged).sum();
    let overshoot = total.saturating_sub(BUDGET);
    // Per replica: its eight in flight, each at most its bound, and the calls the other
    // replica's eight ended within a propagation delay (taken twice over: it varies), each at
    // most its bound. A call's time: the witness's (a plain call, shorter than a stream).
    let per_call = call_time.min(took);
    let within = (2 * delay.as_millis() / per_call.as_millis().max(1)) as u64 + 1;
    let stated = 2 * 8 * bound + 2 * 8 * within * bound;
    println!(
        "budget {BUDGET} tokens; 16 streamed calls at once on two replicas: {calls} answered \
         in {took:?}, {cut} cut, {total} tokens charged: overshoot {overshoot}; stated bound \
         {stated} (a call's bound {bound}, propagation delay {delay:?}, a call {per_call:?})"
    );
    assert!(total >= BUDGET, "the budget was not spent: {total}");
    assert!(overshoot <= stated, "overshoot {overshoot} over {stated}");
}
