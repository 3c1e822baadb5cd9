//! What the benchmarks share: signed leases and the keyring that opens them.
//!
//! Invariant: a lease built here passes `Lease::load` under [`keyring`] of the same key.

use leasegate::contract::lease::sign;
use leasegate::contract::{Key, Keyring};
use serde_json::{json, Value};

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
