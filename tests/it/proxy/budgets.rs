//! Model budgets enforced on the request path: a lease chain's `budget.tokens` and
//! `budget.cost_usd` spent by metered calls through terminated hosts (the fake model API),
//! on one proxy and across three replicas folding each other's calls from the egress stream.
//! A spent budget refuses new model calls (`budget-exhausted`, 429) and nothing else: the
//! lease stays open, calls in flight finish, other requests pass.

use crate::cluster::scale_out::until_status;
use crate::cluster::usage::stream_config;
use crate::support::harness::*;
use crate::support::model_api::{ModelApi, ANTHROPIC_HOST, HOLD, OPENAI_HOST};
use crate::support::model_proxy::{ModelProxy, Staged, PLAIN_HOST};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::config::ServeConfig;
use leasegate::contract::schema::Schema;
use leasegate::contract::Timestamp;
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::secrets::placeholder;
use leasegate::server::Server;
use leasegate::telemetry::egress::Destination;
use leasegate::telemetry::egress_stream;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Tokens of every [`call_body`] call: 3 words + 7 in, 90 out.
pub(crate) const CALL: u64 = 100;
pub(crate) const HOSTS: [&str; 3] = [OPENAI_HOST, ANTHROPIC_HOST, PLAIN_HOST];

/// A chat completion (or, `anthropic`, a message) the fake counts [`CALL`] tokens for.
pub(crate) fn call_body(model: &str, stream: bool) -> String {
    let mut body = json!({
        "model": model,
        "messages": [{"role": "user", "content": "one two three"}],
        "max_tokens": 90,
    });
    if stream {
        body["stream"] = true.into();
        body["stream_options"] = json!({"include_usage": true});
    }
    body.to_string()
}

/// A model call through `server` under `lease`, with the lease's placeholder as the key:
/// OpenAI's chat completions, or Anthropic's messages; `more`: further curl arguments.
pub(crate) async fn model_call(
    m: &ModelProxy,
    server: &Server,
    lease: &str,
    anthropic: bool,
    body: &str,
    more: &[&str],
) -> CurlOutput {
    let proxy = proxy_url(server, lease);
    call_via(&m.h, &m.api, &proxy, lease, anthropic, body, more).await
}

/// [`model_call`] through the proxy at `proxy` (a URL with the lease as its credentials), for
/// the harness `h` with the fake `api`.
pub(crate) async fn call_via(
    h: &Harness,
    api: &ModelApi,
    proxy: &str,
    lease: &str,
    anthropic: bool,
    body: &str,
    more: &[&str],
) -> CurlOutput {
    let port = api.origin.addr.port();
    let (url, key) = match anthropic {
        false => (
            format!("https://{OPENAI_HOST}:{port}/v1/chat/completions"),
            format!(
                "Authorization: Bearer {}",
                placeholder::derive(&h.key, lease, "openai")
            ),
        ),
        true => (
            format!("https://{ANTHROPIC_HOST}:{port}/v1/messages"),
            format!(
                "x-api-key: {}",
                placeholder::derive(&h.key, lease, "anthropic")
            ),
        ),
    };
    let ca = h.dir.path().join("ca/ca.pem").display().to_string();
    let mut args = vec!["-x", proxy, "--cacert", &ca, "-H", &key];
    args.extend_from_slice(&["-H", "content-type: application/json", "--data", body]);
    args.extend_from_slice(more);
    args.push(&url);
    curl(&args, &[]).await
}

/// A chat completion of [`CALL`] tokens (gpt-4o-mini) through `server` under `lease`.
pub(crate) async fn chat(m: &ModelProxy, server: &Server, lease: &str) -> CurlOutput {
    model_call(
        m,
        server,
        lease,
        false,
        &call_body("gpt-4o-mini", false),
        &[],
    )
    .await
}

/// Asserts `out` is the `budget-exhausted` refusal, its body naming `lease`'s `ceiling`.
#[track_caller]
pub(crate) fn assert_exhausted(out: &CurlOutput, lease: &str, ceiling: &str) {
    let body = out.body_text();
    assert_eq!(out.status, 429, "{body}{}", out.stderr);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("budget-exhausted"),
        "{body}"
    );
    let spent = format!("lease {lease}'s budget.{ceiling} is spent");
    assert!(body.contains(&spent), "{body}");
}

/// Calls [`chat`] until refused; the calls answered 200 and the refusal.
pub(crate) async fn spend(m: &ModelProxy, server: &Server, lease: &str) -> (u64, CurlOutput) {
    for answered in 0..50 {
        let out = chat(m, server, lease).await;
        match out.status {
            200 => continue,
            _ => return (answered, out),
        }
    }
    panic!("50 calls under {lease} and no refusal");
}

/// The egress lines in `file` with a `model` object, once there are `n` (up to 10 s); every
/// line of the file, metered or not, refusals included, must be valid against the schema.
pub(crate) async fn model_lines(file: &Path, n: usize) -> Vec<Value> {
    let read = || async {
        let text = tokio::fs::read_to_string(file).await.unwrap_or_default();
        let lines = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap());
        let lines: Vec<Value> = lines.collect();
        for line in &lines {
            assert_eq!(Schema::EgressEvent.validate(line), Ok(()), "{line}");
        }
        lines
            .into_iter()
            .filter(|l| l.get("model").is_some())
            .collect::<Vec<_>>()
    };
    let enough = eventually(Duration::from_secs(10), || async {
        Some(read().await).filter(|lines| lines.len() >= n)
    });
    let lines = match enough.await {
        Some(lines) => lines,
        None => read().await,
    };
    assert_eq!(lines.len(), n, "{lines:?}");
    lines
}

/// Input plus output tokens of the lines of leases `of`.
fn tokens_of(lines: &[Value], of: &[&str]) -> u64 {
    lines
        .iter()
        .filter(|l| of.iter().any(|lease| l["lease_id"] == *lease))
        .map(|l| {
            let m = &l["model"];
            m["input_tokens"].as_u64().unwrap() + m["output_tokens"].as_u64().unwrap()
        })
        .sum()
}

/// `GET /leases/{lease}`'s `model` object on `server`.
pub(crate) async fn model_view(server: &Server, lease: &str) -> Value {
    let (status, view) = admin_get(server, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200, "{view}");
    view["model"].clone()
}

/// A proxy not started yet (with the price table `prices`), and lease 1 granted in its
/// journal with the manifest budget `budget`.
pub(crate) async fn budgeted(prices: Option<&str>, budget: Value) -> (Staged, String) {
    let staged = Staged::new(prices).await;
    let lease = staged
        .h
        .grant_budgeted(1, None, Timestamp::now(), &HOSTS, budget)
        .await;
    (staged, lease)
}

/// A proxy not started yet, lease 1 granted with `budget.tokens` 1,000, and `n` children of
/// it (leases 2, 3, …) with no budget of their own.
async fn family(n: u32) -> (Staged, String, Vec<String>) {
    let (staged, parent) = budgeted(None, json!({"tokens": 1000})).await;
    let mut children = Vec::new();
    for i in 2..n + 2 {
        let issued = Timestamp::now();
        let child = staged
            .h
            .grant_budgeted(i, Some(&parent), issued, &HOSTS, json!({}));
        children.push(child.await);
    }
    (staged, parent, children)
}

/// A metered line's `model` object for a [`CALL`] chat completion of gpt-4o-mini.
pub(crate) fn mini_call(cost: Value) -> Value {
    let mut model = json!({"api": "openai", "name": "gpt-4o-mini-2024-07-18",
        "input_tokens": 10, "output_tokens": 90, "cached_tokens": 0, "cost_usd": cost});
    if cost.is_null() {
        model["unpriced"] = true.into();
    }
    model
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn children_calling_at_once_spend_the_parents_tokens_then_only_model_calls_are_refused() {
    let (staged, parent, children) = family(2).await;
    let (a, b) = (children[0].clone(), children[1].clone());
    let m = staged.start(|_| {}).await;

    // Two workers per child, each calling until refused.
    let workers = [&a, &a, &b, &b];
    let spent = futures_util::future::join_all(workers.map(|lease| spend(&m, &m.server, lease)));
    let spent = spent.await;
    for (out, lease) in spent.iter().map(|(_, out)| out).zip(workers) {
        assert_exhausted(out, &parent, "tokens");
        assert!(out.body_text().contains(&format!("for lease {lease}")));
    }
    // A worker refused while others' calls were in flight (their bounds reserved) may
    // leave budget behind: what is left is spent by one caller.
    let (after, last) = spend(&m, &m.server, &a).await;
    assert_exhausted(&last, &parent, "tokens");
    let calls: u64 = spent.iter().map(|(n, _)| n).sum::<u64>() + after;
    let total = calls * CALL;
    // A call passes only while the subtree's spent tokens and the bounds its calls in flight
    // reserved (each more than the 100 a call spends) are under 1,000: whole calls of 100
    // never pass the ceiling, however many workers call at once.
    assert_eq!(total, 1000, "{total} tokens spent in {calls} calls");
    println!(
        "budget 1000 tokens, spent {total} by {} workers",
        workers.len()
    );

    // Refused, not revoked: the leases stay open, and what is no model call passes.
    for lease in [&parent, &a, &b] {
        let (_, view) = admin_get(&m.server, &format!("/leases/{lease}")).await;
        assert_eq!(view["status"], "open", "{view}");
    }
    assert_eq!(m.h.revocations().await, Vec::<Value>::new());
    let port = m.api.origin.addr.port();
    let models = format!("https://{OPENAI_HOST}:{port}/v1/models");
    let ca = m.ca_pem.display().to_string();
    let proxy = proxy_url(&m.server, &a);
    let listed = curl(&["-x", &proxy, "--cacert", &ca, &models], &[]).await;
    assert_eq!(listed.status, 200, "{}", listed.body_text());
    assert!(listed.body_text().contains("\"gpt-4o-mini\""));
    let plain = format!("http://{PLAIN_HOST}:{}/", m.plain.addr.port());
    let other = through(&m.server, &b, &plain).await;
    assert_eq!(
        (other.status, other.body_text().as_str()),
        (200, "hello from origin\n")
    );
    // A new model call is still refused, under either child.
    assert_exhausted(&chat(&m, &m.server, &b).await, &parent, "tokens");

    // Every answered call has its line, and the parent's view sums them.
    let lines = model_lines(&m.h.egress, calls as usize).await;
    for line in &lines {
        assert_eq!(line["model"], mini_call(Value::Null), "{line}");
    }
    let view = model_view(&m.server, &parent).await;
    assert_eq!(
        view["subtree_spent"]["tokens"],
        tokens_of(&lines, &[&a, &b])
    );
    assert_eq!(view["subtree_spent"]["tokens"], total);
    assert_eq!(view["subtree_spent"]["calls"], calls);
    assert_eq!(view["spent"]["tokens"], 0, "the parent made no call itself");
    assert_eq!(
        view["budget"],
        json!({"tokens": 1000, "cost_usd": null, "steps": null})
    );

    // /metrics counts the same per lease: each child's output tokens and metered calls.
    let (status, metrics) = admin_text(&m.server, "/metrics").await;
    assert_eq!(status, 200);
    for child in [&a, &b] {
        let output: u64 = lines
            .iter()
            .filter(|l| l["lease_id"] == json!(child))
            .map(|l| l["model"]["output_tokens"].as_u64().unwrap())
            .sum();
        let metered = lines
            .iter()
            .filter(|l| l["lease_id"] == json!(child))
            .count();
        let series = [
            format!(
                "leasegate_model_tokens_total{{lease_id=\"{child}\",kind=\"output\"}} {output}"
            ),
            format!(
                "leasegate_model_calls_total{{lease_id=\"{child}\",usage=\"metered\"}} {metered}"
            ),
            format!("leasegate_model_calls_total{{lease_id=\"{child}\",usage=\"unmetered\"}} 0"),
        ];
        for line in series {
            assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
        }
    }
    assert!(
        !metrics.contains(&format!(
            "leasegate_model_calls_total{{lease_id=\"{parent}\""
        )),
        "no model series for a lease without calls"
    );
}

/// Every gpt-4o-mini token costs $0.001: a [`CALL`] costs $0.1. Claude models are unpriced.
pub(crate) const PRICES: &str = r#"
[[model]]
name = "gpt-4o-mini*"
input_per_million = 1000
output_per_million = 1000
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_ceiling_is_spent_by_priced_calls_and_refuses_a_model_it_cannot_price() {
    let (staged, lease) = budgeted(Some(PRICES), json!({"cost_usd": 0.25})).await;
    let m = staged.start(|_| {}).await;
    let claude = call_body("claude-haiku-4-5", false);

    // A partial price table never widens a budget: a call whose cost cannot be counted is
    // refused, before it reaches the API.
    let unpriced = model_call(&m, &m.server, &lease, true, &claude, &[]).await;
    assert_eq!(unpriced.status, 429, "{}", unpriced.body_text());
    assert_eq!(
        unpriced.header("x-leasegate-refusal").as_deref(),
        Some("budget-exhausted")
    );
    assert!(
        unpriced.body_text().contains(&format!(
            "lease {lease} has a budget.cost_usd, and the price table (--prices) gives this \
             call's model no price"
        )),
        "{}",
        unpriced.body_text()
    );
    assert!(m.api.seen().is_empty(), "the unpriced call reached the API");
    // $0.1, $0.2, $0.3: the third passes the ceiling, the fourth is refused.
    for _ in 0..3 {
        let out = chat(&m, &m.server, &lease).await;
        assert_eq!(out.status, 200, "{}", out.body_text());
    }
    assert_exhausted(&chat(&m, &m.server, &lease).await, &lease, "cost_usd");

    let lines = model_lines(&m.h.egress, 3).await;
    for line in &lines {
        let cost = line["model"]["cost_usd"].as_f64().unwrap();
        assert!((cost - 0.1).abs() < 1e-12, "{line}");
        assert_eq!(line["model"], mini_call(cost.into()));
    }
    let view = model_view(&m.server, &lease).await;
    let spent = &view["spent"];
    assert!(
        (spent["cost_usd"].as_f64().unwrap() - 0.3).abs() < 1e-9,
        "{view}"
    );
    assert_eq!(
        (&spent["unpriced"], &spent["tokens"]),
        (&json!(0), &json!(300))
    );
}

/// Without a price table a cost ceiling cannot be kept: every model call under it is refused
/// (a token ceiling alone is kept without prices).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_ceiling_without_a_price_table_refuses_every_call() {
    let (staged, lease) = budgeted(None, json!({"cost_usd": 5.0})).await;
    let m = staged.start(|_| {}).await;
    let out = chat(&m, &m.server, &lease).await;
    assert_eq!(out.status, 429, "{}", out.body_text());
    assert!(out.body_text().contains("no price"), "{}", out.body_text());
    assert!(m.api.seen().is_empty());
    let (_, view) = admin_get(&m.server, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "open", "refused, not revoked: {view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_in_flight_when_the_budget_runs_out_arrives_whole() {
    let (staged, lease) = budgeted(None, json!({"tokens": 200})).await;
    let m = staged.start(|_| {}).await;
    assert_eq!(chat(&m, &m.server, &lease).await.status, 200);

    // 100 spent: the stream is let through, and held halfway by the fake.
    let streamed = call_body("gpt-4o-mini", true);
    let hold = format!("{HOLD}: 1");
    let held = ["-H", &hold];
    let stream = model_call(&m, &m.server, &lease, false, &streamed, &held);
    let rest = async {
        let started = eventually(Duration::from_secs(10), || async {
            m.api.seen().iter().any(|s| s.stream).then_some(())
        });
        assert!(started.await.is_some(), "the stream never reached the fake");
        // 100 spent, and the stream in flight holds its bound (more than the 100 left): the
        // next call is refused until the stream ends.
        let refused = chat(&m, &m.server, &lease).await;
        assert_exhausted(&refused, &lease, "tokens");
        assert!(refused.body_text().contains("reserved by calls in flight"));
        m.api.release();
    };
    let (stream, ()) = tokio::join!(stream, rest);
    assert_eq!(stream.status, 200, "{}", stream.stderr);
    let body = stream.body_text();
    let deltas: Vec<&str> = body.matches("\"content\":\"t").collect();
    assert_eq!(deltas.len(), 90, "{body}");
    assert!(body.contains("\"content\":\"t89 \""), "{body}");
    assert!(body.contains("\"completion_tokens\":90"), "{body}");
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");

    let lines = model_lines(&m.h.egress, 2).await;
    assert!(lines.iter().all(|l| l["model"] == mini_call(Value::Null)));
    let view = model_view(&m.server, &lease).await;
    assert_eq!(
        (&view["spent"]["tokens"], &view["spent"]["calls"]),
        (&json!(200), &json!(2))
    );
    assert_exhausted(&chat(&m, &m.server, &lease).await, &lease, "tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_answer_counts_zero_tokens_and_a_stream_that_asked_for_no_usage_is_metered() {
    let staged = Staged::new(None).await;
    let stranger = staged.h.lease_for_agent("someone-else", &HOSTS);
    let m = staged.start(|_| {}).await;
    // No secret for this agent: no key is put in, and the fake answers 401.
    let port = m.api.origin.addr.port();
    let url = format!("https://{OPENAI_HOST}:{port}/v1/chat/completions");
    let (proxy, ca) = (
        proxy_url(&m.server, &stranger),
        m.ca_pem.display().to_string(),
    );
    let body = call_body("gpt-4o-mini", false);
    let args = ["-x", &proxy, "--cacert", &ca, "--data", &body, &url];
    let out = curl(&args, &[]).await;
    assert_eq!(out.status, 401, "{}", out.body_text());
    assert!(out.body_text().contains("invalid_api_key"));
    // A stream that does not ask for its usage (no `stream_options.include_usage`): the
    // proxy asks for it, and the client gets the usage chunk too.
    let streamed = json!({"model": "gpt-4o-mini", "stream": true, "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}]});
    let out = model_call(&m, &m.server, &m.lease, false, &streamed.to_string(), &[]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    let body = out.body_text();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(body.contains("\"completion_tokens\":5"), "{body}");

    let lines = model_lines(&m.h.egress, 2).await;
    let zero = json!({"api": "openai", "name": null, "input_tokens": 0, "output_tokens": 0,
        "cached_tokens": 0, "cost_usd": 0.0});
    assert_eq!(lines[0]["model"], zero);
    let asked = json!({"api": "openai", "name": "gpt-4o-mini-2024-07-18", "input_tokens": 8,
        "output_tokens": 5, "cached_tokens": 0, "cost_usd": null, "unpriced": true});
    assert_eq!(lines[1]["model"], asked);
    let view = model_view(&m.server, &stranger).await;
    let spent = &view["spent"];
    assert_eq!(
        (&spent["calls"], &spent["tokens"], &spent["unmetered"]),
        (&json!(1), &json!(0), &json!(0))
    );
    let view = model_view(&m.server, &m.lease).await;
    let spent = &view["spent"];
    assert_eq!(
        (&spent["calls"], &spent["tokens"], &spent["unmetered"]),
        (&json!(1), &json!(13), &json!(0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_egress_stream_unread_a_budget_cannot_be_checked_and_its_calls_are_refused() {
    let (staged, budgeted) = budgeted(None, json!({"tokens": 1000})).await;
    // An egress stream where no NATS listens: the follower never reads it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let key = crate::cluster::usage::stream_key(&staged.h).1;
    let stream = egress_stream::EgressStreamConfig {
        location: format!("nats://127.0.0.1:{port}/EGRESS").parse().unwrap(),
        nats: Default::default(),
        max_age: egress_stream::DEFAULT_MAX_AGE,
        backlog: egress_stream::DEFAULT_BACKLOG,
        key,
    };
    let m = staged
        .start(|serve| serve.egress_stream = Some(stream))
        .await;
    let out = chat(&m, &m.server, &budgeted).await;
    assert_eq!(out.status, 429, "{}", out.body_text());
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("budget-exhausted")
    );
    assert!(
        out.body_text().contains("the budget cannot be checked"),
        "{}",
        out.body_text()
    );
    let unbudgeted = chat(&m, &m.server, &m.lease).await;
    assert_eq!(unbudgeted.status, 200, "{}", unbudgeted.body_text());
    assert_eq!(m.api.seen().len(), 1, "the refused call never went out");
}

/// The propagation delay between replicas `a` and `b`, with the time of the call that measured
/// it: from a call's end on `a` to `b`'s view showing it, on `witness`, a lease only `a` carries
/// calls of (`b` knows of its first call once it folded `a`'s line).
pub(crate) async fn propagation_delay(
    m: &ModelProxy,
    a: &Server,
    b: &Server,
    witness: &str,
) -> (Duration, Duration) {
    let seen_on_b = model_view(b, witness).await["spent"]["calls"].as_u64();
    assert_eq!(seen_on_b, None, "no call of the witness yet");
    let called = Instant::now();
    assert_eq!(chat(m, a, witness).await.status, 200);
    let call_time = called.elapsed();
    let ended = Instant::now();
    let shown = eventually(AT_ONCE * 4, || async {
        let calls = model_view(b, witness).await["spent"]["calls"].as_u64();
        (calls == Some(1)).then_some(ended.elapsed())
    });
    (call_time, shown.await.expect("B never saw A's call"))
}

/// Where replica `name` keeps its state and egress log, on `cluster`'s journal `LG` and its
/// egress stream.
pub(crate) fn on_nats(
    cluster: &NatsCluster,
    stream: &egress_stream::EgressStreamConfig,
    dir: &Path,
    name: &str,
) -> (impl FnOnce(&mut ServeConfig), PathBuf) {
    let location = cluster.location_as(Role::Replica, "LG");
    let (stream, data) = (stream.clone(), dir.join(name));
    let egress = dir.join(format!("{name}-egress.jsonl"));
    let file = egress.clone();
    let adjust = move |config: &mut ServeConfig| {
        config.journal = JournalLocation::Nats(location);
        config.store = StoreOptions {
            data_dir: data,
            ..StoreOptions::default()
        };
        config.store.nats.replicas = 3;
        config.egress = Some(Destination::File(file));
        config.egress_stream = Some(stream);
    };
    (adjust, egress)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_share_a_budget_through_the_egress_stream() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(3);
    let journal = cluster.journal("LG").await;
    let (staged, parent, children) = family(3).await;
    let h = &staged.h;
    // A lease of its own, with a budget far away, to see when the replicas read each other.
    let probe = h
        .grant_budgeted(
            9,
            None,
            Timestamp::now(),
            &HOSTS,
            json!({"tokens": 1_000_000}),
        )
        .await;
    let witness = h
        .grant_budgeted(10, None, Timestamp::now(), &HOSTS, json!({}))
        .await;
    let mut stream = stream_config(h, &cluster, egress_stream::DEFAULT_BACKLOG);
    stream.nats.replicas = 3;
    let dir = h.dir.path().to_owned();
    let (first, egress_a) = on_nats(&cluster, &stream, &dir, "a");
    let m = staged.start(first).await;
    let (second, egress_b) = on_nats(&cluster, &stream, &dir, "b");
    let (third, egress_c) = on_nats(&cluster, &stream, &dir, "c");
    let replicas = [&m.server, &m.another(second).await, &m.another(third).await];
    publish_file(&journal, &m.h.journal).await;
    for server in replicas {
        assert!(until_status(server, &parent, "open", AT_ONCE * 2).await);
    }
    // Each replica lets a budgeted call through once its follower is live.
    for server in replicas {
        let live = eventually(Duration::from_secs(20), || async {
            (chat(&m, server, &probe).await.status == 200).then_some(())
        });
        assert!(
            live.await.is_some(),
            "a replica never read the egress stream"
        );
    }
    let (a, b) = (replicas[0], replicas[1]);
    let (call_time, delay) = propagation_delay(&m, a, b, &witness).await;
    println!("propagation delay from replica A to replica B: {delay:?}");

    // One child per replica, calling until refused.
    let workers = children.iter().zip(replicas);
    let spent = workers.map(|(child, server)| spend(&m, server, child));
    let spent = futures_util::future::join_all(spent).await;
    for (_, out) in &spent {
        assert_exhausted(out, &parent, "tokens");
    }
    let calls: u64 = spent.iter().map(|(n, _)| n).sum();
    let total = calls * CALL;
    // Each replica knows the others' calls a propagation delay late: the overshoot is the
    // calls in flight on the other replicas plus those ended within the delay — per worker,
    // one in flight and one per call time within the delay (taken twice over: the delay
    // varies), and never less than three.
    let within = (2 * delay.as_millis() / call_time.as_millis().max(1)) as u64 + 1;
    let bound = 1000 + 3 * within.max(3) * CALL;
    println!("budget 1000 tokens, spent {total} across three replicas (a call took {call_time:?})");
    assert!(
        (1000..=bound).contains(&total),
        "{total} tokens in {calls} calls"
    );

    // Every replica comes to the same figure, which the three egress logs sum to.
    let mut lines = Vec::new();
    for file in [&egress_a, &egress_b, &egress_c] {
        let text = tokio::fs::read_to_string(file).await.unwrap();
        lines.extend(
            text.lines()
                .map(|l| serde_json::from_str::<Value>(l).unwrap())
                .filter(|l| l.get("model").is_some()),
        );
    }
    let children: Vec<&str> = children.iter().map(String::as_str).collect();
    assert_eq!(tokens_of(&lines, &children), total);
    for server in replicas {
        let agreed = eventually(AT_ONCE * 2, || async {
            let view = model_view(server, &parent).await;
            (view["subtree_spent"]["tokens"] == total).then_some(())
        });
        assert!(
            agreed.await.is_some(),
            "{}",
            model_view(server, &parent).await
        );
        assert_exhausted(&chat(&m, server, children[0]).await, &parent, "tokens");
        assert!(until_status(server, &parent, "open", AT_ONCE).await);
    }
}

/// `budget.steps` counts model calls: the N+1th is refused, along the chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_call_past_budget_steps_is_refused_along_the_chain() {
    let (staged, parent) = budgeted(None, json!({"steps": 3})).await;
    let child = staged
        .h
        .grant_budgeted(
            2,
            Some(&parent),
            Timestamp::now(),
            &HOSTS,
            json!({"steps": 2}),
        )
        .await;
    let sibling = staged
        .h
        .grant_budgeted(3, Some(&parent), Timestamp::now(), &HOSTS, json!({}))
        .await;
    let m = staged.start(|_| {}).await;
    // The child's own two steps, then its own ceiling.
    let (answered, refused) = spend(&m, &m.server, &child).await;
    assert_eq!(answered, 2);
    assert_exhausted(&refused, &child, "steps");
    // The parent has one step left for the whole family.
    let (answered, refused) = spend(&m, &m.server, &sibling).await;
    assert_eq!(answered, 1);
    assert_exhausted(&refused, &parent, "steps");
    assert!(
        refused.body_text().contains("3 of 3"),
        "{}",
        refused.body_text()
    );
    let view = model_view(&m.server, &parent).await;
    assert_eq!(view["subtree_spent"]["calls"], 3, "{view}");
}
