//! What reading the whole lease at the edge costs per call, beside doing nothing: an MCP POST
//! read and judged (`mcp::message::read` and `mcp::judge` along a chain of two), a `tools/list`
//! answer cut to the lease (50 tools, JSON and an event), a model call's request read and
//! rewritten to ask for its usage (a streamed Chat Completions call of 2 KB without
//! `include_usage`), and a budget's reservation and settlement along a chain of two (in
//! memory, and with the spend log fsynced, as `serve` keeps it).
//! `cargo bench --bench edge`.

use criterion::{criterion_group, criterion_main, Criterion};
use leasegate::budget::{Bound, Ceilings, Charge, Spending};
use leasegate::contract::Lease;
use leasegate::mcp::filter::{Filter, Framing};
use leasegate::meter::request;
use leasegate::meter::Call;
use serde_json::json;
use std::hint::black_box;
use std::sync::Arc;

/// An unsigned lease (`Lease::check`) allowing `tools` of `notes`.
fn lease(id: &str, tools: &[String]) -> Arc<Lease> {
    let manifest = leasegate::contract::narrow::completed(
        &json!({
            "agent": {"name": "bench"}, "intent": {"purpose": "a benchmark"},
            "allow": {"hosts": ["mcp.test"], "tools": tools}, "approvals": ["notes/send_mail"],
        }),
        "1.0",
    );
    Arc::new(
        Lease::check(json!({
            "schema_version": "1.0", "lease_id": id, "manifest": manifest,
            "declared_hash": "0".repeat(64), "issued_at": "2026-12-01T00:00:00.000Z",
            "expires_at": "2027-12-01T00:00:00.000Z", "issuer_session_id": "bench",
            "key_fingerprint": "sha256:0000000000000000", "signature": "0".repeat(64),
        }))
        .expect("a lease"),
    )
}

fn edge(c: &mut Criterion) {
    let tools: Vec<String> = (0..50).map(|i| format!("notes/tool_{i}")).collect();
    let chain = vec![
        lease("3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c", &tools[..25]),
        lease("0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c", &tools),
    ];
    let call = br#"{"jsonrpc":"2.0","id":42,"method":"tools/call","params":{"name":"tool_7","arguments":{"path":"/notes/2026/12/shopping.md","text":"buy milk, eggs and bread; call the plumber about the kitchen sink"},"_meta":{"progressToken":42}}}"#;
    let mut group = c.benchmark_group("edge");
    group.bench_function("mcp_call_read_and_judged", |b| {
        b.iter(|| {
            let messages = leasegate::mcp::message::read(black_box(call)).unwrap();
            let tool = messages.messages[0].tool.as_deref().unwrap();
            black_box(leasegate::mcp::judge(&chain, &format!("notes/{tool}")))
        })
    });
    let listed = json!({"jsonrpc": "2.0", "id": 1, "result": {"tools": (0..50).map(|i| json!({
        "name": format!("tool_{i}"), "description": "Reads a note by its id and says what it holds.",
        "inputSchema": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    })).collect::<Vec<_>>()}})
    .to_string();
    let event = format!("event: message\ndata: {listed}\n\n");
    for (name, framing, body) in [
        ("mcp_tool_list_cut_json", Framing::Json, listed.as_bytes()),
        ("mcp_tool_list_cut_event", Framing::Events, event.as_bytes()),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let allowed = |tool: &str| leasegate::mcp::listed(&chain, &format!("notes/{tool}"));
                let mut filter = Filter::new(framing, allowed);
                let mut out = Vec::with_capacity(body.len());
                filter.feed(black_box(body), &mut out).unwrap();
                filter.finish(&mut out).unwrap();
                black_box(out)
            })
        });
    }
    let prompt = "lorem ipsum dolor sit amet ".repeat(70);
    let model_call = json!({"model": "gpt-4o-mini", "stream": true, "max_tokens": 256,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]})
    .to_string();
    group.bench_function("model_request_read_and_rewritten", |b| {
        b.iter(|| {
            let read =
                request::read(Call::ChatCompletions, black_box(model_call.as_bytes())).unwrap();
            assert!(read.rewritten.is_some());
            black_box(read)
        })
    });
    let budget = Ceilings {
        tokens: Some(u64::MAX / 2),
        cost_usd: None,
        steps: None,
    };
    let ids: Vec<(Arc<str>, Ceilings)> = vec![("child".into(), budget), ("parent".into(), budget)];
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let spending = Arc::new(Spending::default());
    group.bench_function("reserve_and_settle_in_memory", |b| {
        b.iter(|| {
            let reserved = runtime
                .block_on(spending.reserve(&ids, Bound::tool_calls(1)))
                .unwrap();
            reserved.settle(Charge::tool_calls(1));
        })
    });
    let dir = tempfile::tempdir().unwrap();
    let logged = Arc::new(Spending::default());
    let (log, _) = leasegate::budget::log::SpendLog::open(dir.path().join("bench.spent")).unwrap();
    logged.keep_in(log);
    group.sample_size(30);
    group.bench_function("reserve_and_settle_with_the_spend_log", |b| {
        b.iter(|| {
            let reserved = runtime
                .block_on(logged.reserve(&ids, Bound::tool_calls(1)))
                .unwrap();
            reserved.settle(Charge::tool_calls(1));
        })
    });
    group.finish();
}

criterion_group!(benches, edge);
criterion_main!(benches);
