//! The per-request hot path: host verdicts, target normalisation, identification + chain check.
//!
//! Targets (docs/performance.md, micro-benchmarks): verdict ≤ 200 ns at 10,000 patterns and flat in the pattern count.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::{HeaderMap, HeaderValue};
use leasegate::contract::lease::sign;
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::policy::target::{parse_authority, parse_host};
use leasegate::policy::verdict::{decide, HostPolicy};
use leasegate::proxy::identify::identify;
use leasegate::registry::Ledger;
use serde_json::json;
use std::hint::black_box;

/// `n` allow patterns, half exact names and half wildcards, plus a deny list of `n / 10`.
fn policy(n: usize) -> HostPolicy {
    let allow: Vec<String> = (0..n)
        .map(|i| {
            if i % 2 == 0 {
                format!("api{i}.service{i}.example.com")
            } else {
                format!("*.tenant{i}.example.net")
            }
        })
        .chain(["*.github.com".to_owned(), "pypi.org".to_owned()])
        .collect();
    let deny: Vec<String> = (0..n / 10)
        .map(|i| format!("blocked{i}.example.org"))
        .chain(["evil.github.com".to_owned()])
        .collect();
    HostPolicy::compile(&allow, &deny)
}

fn verdicts(c: &mut Criterion) {
    let mut group = c.benchmark_group("verdict");
    let cases = [
        ("exact", "pypi.org"),
        ("wildcard", "a.b.c.api.github.com"),
        ("deny-hit", "evil.github.com"),
        ("miss", "nothing.matches.example.io"),
    ];
    for n in [10usize, 1_000, 10_000] {
        let p = policy(n);
        for (case, host) in cases {
            let host = parse_host(host).unwrap();
            group.bench_with_input(BenchmarkId::new(case, n), &host, |b, host| {
                b.iter(|| decide([("lease", &p)], black_box(host)))
            });
        }
    }
    let chain: Vec<HostPolicy> = (0..4).map(|_| policy(10_000)).collect();
    let host = parse_host("a.b.c.api.github.com").unwrap();
    group.bench_function("chain-of-4/10000", |b| {
        b.iter(|| {
            decide(
                chain
                    .iter()
                    .enumerate()
                    .map(|(i, p)| (["a", "b", "c", "d"][i], p)),
                black_box(&host),
            )
        })
    });
    group.finish();
}

fn normalisation(c: &mut Criterion) {
    let mut group = c.benchmark_group("normalise");
    for (name, authority) in [
        ("name", "api.github.com:443"),
        ("mixed-case-dot", "API.GitHub.COM.:443"),
        ("ipv4-short", "127.1:80"),
        ("ipv6-mapped", "[::ffff:127.0.0.1]:443"),
        ("idn", "bücher.example:443"),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| parse_authority(black_box(authority), None))
        });
    }
    group.finish();
}

fn identification_and_chain(c: &mut Criterion) {
    let key = Key::from_bytes([9; 32]);
    let mut keyring = Keyring::new(false);
    keyring.insert(key.clone());
    let mut ledger = Ledger::new(keyring);
    let id = |n: u32| format!("{n:08x}-0000-4000-8000-000000000000");
    for n in 0..1_000u32 {
        let parent = (n % 2 == 1).then(|| id(n - 1));
        let mut lease = json!({
            "schema_version": "1.2", "lease_id": id(n), "declared_hash": "0".repeat(64),
            "issued_at": "2026-01-01T00:00:00.000Z", "expires_at": "2036-01-01T00:00:00.000Z",
            "issuer_session_id": "bench",
            "manifest": {"schema_version": "1.2", "agent": {"name": "a", "kind": "external", "runtime_agent": "unknown"},
                "intent": {"purpose": "bench"},
                "allow": {"tools": [], "read_paths": [], "write_paths": [], "hosts": ["*"], "commands": []},
                "deny": {"commands": [], "paths": [], "hosts": []}, "budget": {}, "approvals": []},
        });
        if let Some(parent) = &parent {
            lease["parent_lease_id"] = parent.as_str().into();
        }
        sign(&mut lease, &key).unwrap();
        let line = json!({"schema_version": "1.2", "at": "2026-01-01T00:00:00.000Z", "event": "granted", "lease_id": id(n), "lease": lease});
        ledger
            .apply_line_bytes(line.to_string().as_bytes())
            .unwrap();
    }
    let lease = id(501);
    let mut headers = HeaderMap::new();
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("agent:{lease}"));
    headers.insert(
        "proxy-authorization",
        HeaderValue::from_str(&format!("Basic {basic}")).unwrap(),
    );
    headers.insert("user-agent", HeaderValue::from_static("curl/8"));
    let now = Timestamp::parse("2026-06-01T00:00:00.000Z").unwrap();
    c.bench_function("identify+chain/1000-leases-depth-2", |b| {
        b.iter(|| {
            let identity = identify(black_box(&headers), None).unwrap();
            ledger.check_chain(&identity.lease_id, now).unwrap()
        })
    });
}

criterion_group!(benches, verdicts, normalisation, identification_and_chain);
criterion_main!(benches);
