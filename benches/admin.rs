//! The admin API's answers at 100,000 leases: a page of `GET /leases` (the first page, and a
//! filter that matches nothing, which scans its whole budget), the counts by status, and a
//! `/metrics` render with 100,000 open leases' counters — with the per-request counting that
//! feeds it.
//!
//! Targets (issue 13): no answer grows with the number of leases (a page holds ≤ 1000 leases;
//! `/metrics` < 1 MB at 100,000 open leases); the per-request counting does no more work than
//! before (one lock, no allocation for a lease already counted).

mod common;

use common::{keyring, lease_id, signed_lease};
use criterion::{criterion_group, criterion_main, Criterion};
use leasegate::contract::{Key, Timestamp};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::listing::{self, Filter, Order};
use leasegate::registry::Ledger;
use leasegate::telemetry::egress::{EgressEvent, Kind, LoggedVerdict};
use leasegate::telemetry::metrics::{self, Metrics, RegistryFigures};
use serde_json::json;
use std::sync::Arc;

const LEASES: u64 = 100_000;

/// 100,000 leases open until 2099, every tenth stopped.
fn ledger() -> Ledger {
    let key = Key::from_bytes([7; 32]);
    let mut journal = String::new();
    for n in 0..LEASES {
        let lease = signed_lease(
            &key,
            n,
            ("2026-01-01T00:00:00.000Z", "2099-01-01T00:00:00.000Z"),
            &["api.example.com", "*.github.com"],
        );
        let line = json!({"schema_version": "1.2", "at": "2026-01-01T00:00:00.000Z",
            "event": "granted", "lease_id": lease_id(n), "lease": lease});
        journal.push_str(&line.to_string());
        journal.push('\n');
        if n % 10 == 0 {
            let line = json!({"schema_version": "1.2", "at": "2026-01-01T00:00:00.000Z",
                "event": "stopped", "lease_id": lease_id(n), "reason": "done"});
            journal.push_str(&line.to_string());
            journal.push('\n');
        }
    }
    let mut ledger = Ledger::new(keyring(&key));
    assert!(fold_bytes(&mut ledger, journal.as_bytes()).is_empty());
    ledger
}

fn leases_page(c: &mut Criterion) {
    let ledger = ledger();
    let now = Timestamp::now();
    let mut group = c.benchmark_group("leases_page_100k");
    group.sample_size(20);
    let all = Filter::default();
    group.bench_function("first_100", |b| {
        b.iter(|| listing::page(&ledger, now, &all, Order::OldestFirst, None, 100).unwrap())
    });
    let page = listing::page(&ledger, now, &all, Order::OldestFirst, None, 100).unwrap();
    let cursor = page.next.unwrap();
    group.bench_function("second_100_by_cursor", |b| {
        b.iter(|| {
            listing::page(&ledger, now, &all, Order::OldestFirst, Some(&cursor), 100).unwrap()
        })
    });
    let nobody = Filter {
        status: None,
        agent: Some("nobody".into()),
        ..Filter::default()
    };
    group.bench_function("filter_matching_none", |b| {
        b.iter(|| listing::page(&ledger, now, &nobody, Order::OldestFirst, None, 100).unwrap())
    });
    group.bench_function("counts_by_status", |b| {
        b.iter(|| listing::counts(&ledger, now))
    });
    group.finish();
}

fn event(lease: &str) -> EgressEvent {
    EgressEvent {
        time: Timestamp::now(),
        ended: Timestamp::now(),
        lease_id: Some(lease.to_owned()),
        label: None,
        client: "127.0.0.1:1".parse().unwrap(),
        listener: "127.0.0.1:2".parse().unwrap(),
        kind: Kind::Connect,
        method: http::Method::CONNECT,
        host: Some("api.example.com".into()),
        port: Some(443),
        dialed: None,
        verdict: LoggedVerdict::Allow,
        code: None,
        rule: None,
        status: Some(200),
        bytes_up: 10,
        bytes_down: 100,
        duration_ms: 1.0,
        path: None,
        secrets: Vec::new(),
        model: None,
        mcp: None,
        approval: None,
        error: None,
        revoked: None,
    }
}

fn metrics_render(c: &mut Criterion) {
    let metrics = Arc::new(Metrics::new(metrics::GRACE, metrics::MAX_LEASES));
    for n in 0..LEASES {
        let id = lease_id(n);
        for _ in 0..1 + n % 5 {
            metrics.record(&event(&id), true, None);
        }
    }
    let size = metrics::render(&metrics, RegistryFigures::default()).len();
    eprintln!("/metrics at {LEASES} open leases: {size} bytes");
    assert!(size < 1 << 20);
    let mut group = c.benchmark_group("metrics_100k_open_leases");
    group.sample_size(20);
    group.bench_function("render", |b| {
        b.iter(|| metrics::render(&metrics, RegistryFigures::default()))
    });
    let busy = event(&lease_id(77));
    group.bench_function("record_one_request", |b| {
        b.iter(|| metrics.record(&busy, true, None))
    });
    group.finish();
}

criterion_group!(benches, leases_page, metrics_render);
criterion_main!(benches);
