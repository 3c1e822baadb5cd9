//! What the benchmarks share: signed leases, the keyring that opens them, and the
//! configuration of a proxy whose origin listens on loopback.
//!
//! Invariant: a lease built here passes `Lease::load` under [`keyring`] of the same key.

pub mod nats;

/// The number in the environment variable `name`, or `default`.
#[allow(dead_code)] // not every benchmark is scaled from the environment
pub fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `samples` as "p50 …, p99 …, max … ms over N" (nearest rank).
#[allow(dead_code)] // not every benchmark times samples
pub fn percentiles(mut samples: Vec<std::time::Duration>) -> String {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms over {}",
        ms(at(0.5)),
        ms(at(0.99)),
        ms(samples[samples.len() - 1]),
        samples.len()
    )
}

use leasegate::config::ServeConfig;
use leasegate::contract::lease::sign;
use leasegate::contract::{Key, Keyring};
use leasegate::proxy::upstream::Resolver;
use leasegate::proxy::ProxyConfig;
use leasegate::registry::{JournalLocation, StoreOptions};
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

/// Lease `n` (its id is `n` in hex), live from `issued_at` to `expires_at`, allowing `hosts`
/// and denying `evil.example.com`, signed with `key`.
pub fn signed_lease(
    key: &Key,
    n: u64,
    (issued_at, expires_at): (&str, &str),
    hosts: &[&str],
) -> Value {
    let mut lease = json!({
        "schema_version": "1.2",
        "lease_id": lease_id(n),
        "declared_hash": "0".repeat(64),
        "issued_at": issued_at,
        "expires_at": expires_at,
        "issuer_session_id": "bench",
        "manifest": {
            "schema_version": "1.2",
            "agent": {"name": "bench", "kind": "external", "runtime_agent": "unknown"},
            "intent": {"purpose": "benchmark"},
            "allow": {"tools": [], "read_paths": [], "write_paths": [],
                      "hosts": hosts, "commands": []},
            "deny": {"commands": [], "paths": [], "hosts": ["evil.example.com"]},
            "budget": {},
            "approvals": [],
        },
    });
    sign(&mut lease, key).unwrap();
    lease
}

/// The id of lease `n`.
pub fn lease_id(n: u64) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

/// A keyring holding `key` alone.
pub fn keyring(key: &Key) -> Keyring {
    let mut ring = Keyring::new(false);
    ring.insert(key.clone());
    ring
}

/// A proxy that resolves `origin.test` to 127.0.0.1 and may reach it on any port (benchmark
/// origins listen on loopback, on a random port).
#[allow(dead_code)] // not every benchmark starts a proxy
pub fn loopback_proxy() -> ProxyConfig {
    let mut resolver = Resolver::default();
    resolver
        .overrides
        .insert("origin.test".into(), vec!["127.0.0.1".parse().unwrap()]);
    ProxyConfig {
        resolver,
        guard: leasegate::policy::Guard {
            allow_private: vec!["127.0.0.1/32".parse().unwrap()],
            ..Default::default()
        },
        connect_ports: leasegate::policy::Ports::all(),
        forward_ports: leasegate::policy::Ports::all(),
        ..ProxyConfig::default()
    }
}

/// A proxy on a free loopback port following `journal` (keyring: `key`; local state under
/// `dir`), as [`loopback_proxy`] configures it: no admin API, no egress log.
#[allow(dead_code)] // not every benchmark starts a proxy
pub fn serve_config(journal: JournalLocation, dir: &Path, key: &Key) -> ServeConfig {
    ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        journal,
        store: StoreOptions {
            data_dir: dir.join("data"),
            ..StoreOptions::default()
        },
        keyring: keyring(key),
        egress: None,
        egress_stream: None,
        proxy: loopback_proxy(),
        admin: None,
        admin_hosts: Vec::new(),
        lease_ports: None,
        tls: None,
        admin_token: None,
        admin_insecure: false,
        drain_timeout: Duration::from_secs(1),
        wall: Default::default(),
        broker: None,
        issuing: Default::default(),
        approvals: Default::default(),
    }
}
