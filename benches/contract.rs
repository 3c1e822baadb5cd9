//! Lease load (schema + canonical bytes + HMAC) and journal fold throughput.
//!
//! Targets (docs/performance.md, micro-benchmarks): lease load ≤ 50 µs; fold ≥ 200,000 lines/s.

mod common;

use common::keyring;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use leasegate::contract::{Key, Lease};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::Ledger;
use serde_json::{json, Value};

/// A lease of the benchmark's fixed hour.
fn signed_lease(key: &Key, n: u32) -> Value {
    common::signed_lease(
        key,
        u64::from(n),
        ("2026-09-15T10:00:00.000Z", "2026-09-15T11:00:00.000Z"),
        &["api.example.com", "*.github.com", "pypi.org"],
    )
}

fn lease_load(c: &mut Criterion) {
    let key = Key::from_bytes([7; 32]);
    let ring = keyring(&key);
    let text = signed_lease(&key, 1).to_string();
    c.bench_function("lease_load/parse+schema+canonical+hmac", |b| {
        b.iter(|| {
            let value: Value = serde_json::from_str(&text).unwrap();
            Lease::load(value, &ring).unwrap()
        })
    });
}

fn journal_fold(c: &mut Criterion) {
    const LINES: u32 = 100_000;
    let key = Key::from_bytes([7; 32]);
    let ring = keyring(&key);
    // A realistic mix: one grant in ten lines, the rest heartbeats and closings.
    let mut journal = String::new();
    for n in 0..LINES {
        let lease_id = common::lease_id(u64::from(n / 10));
        let line = match n % 10 {
            0 => {
                json!({"schema_version": "1.2", "at": "2026-09-15T10:00:00.000Z", "event": "granted",
                        "lease_id": lease_id, "lease": signed_lease(&key, n / 10)})
            }
            9 => {
                json!({"schema_version": "1.2", "at": "2026-09-15T10:30:00.000Z", "event": "stopped",
                        "lease_id": lease_id, "reason": "done"})
            }
            _ => {
                json!({"schema_version": "1.2", "at": "2026-09-15T10:10:00.000Z", "event": "heartbeat",
                        "lease_id": lease_id})
            }
        };
        journal.push_str(&line.to_string());
        journal.push('\n');
    }
    let mut group = c.benchmark_group("journal_fold");
    group.sample_size(10);
    group.throughput(Throughput::Elements(u64::from(LINES)));
    group.bench_function("100k_lines", |b| {
        b.iter_batched(
            || Ledger::new(ring.clone()),
            |mut ledger| {
                let problems = fold_bytes(&mut ledger, journal.as_bytes());
                assert!(problems.is_empty());
                ledger
            },
            BatchSize::LargeInput,
        )
    });
    group.finish();
}

criterion_group!(benches, lease_load, journal_fold);
criterion_main!(benches);
