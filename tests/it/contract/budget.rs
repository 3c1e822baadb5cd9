//! The manifest's `budget` as a loaded lease keeps it: the ceilings read, and
//! `wall_clock_ms` folded into the lease's end once L1 has passed on the signed values.

use crate::support::{id, key, lease};
use leasegate::contract::lease::{sign, Budget};
use leasegate::contract::rules::{Lifetime, RuleViolation};
use leasegate::contract::{Keyring, Lease, LeaseError, Timestamp};
use serde_json::{json, Value};

const ISSUED: &str = "2026-01-01T10:00:00.000Z";

/// A signed lease issued at [`ISSUED`], expiring at `expires_at`, with `budget`, loaded.
fn loaded(expires_at: &str, budget: Value) -> Result<Lease, LeaseError> {
    let key = key(7);
    let mut signed = lease(&key, &id(1), None, (ISSUED, expires_at), &["a.test"], &[]);
    signed["manifest"]["budget"] = budget;
    sign(&mut signed, &key).unwrap();
    let mut keyring = Keyring::new(false);
    keyring.insert(key);
    Lease::load(signed, &keyring)
}

fn t(text: &str) -> Timestamp {
    Timestamp::parse(text).unwrap()
}

#[test]
fn a_lease_without_ceilings_holds_no_budget() {
    let lease = loaded("2026-01-01T11:00:00.000Z", json!({})).unwrap();
    assert!(lease.budget.is_none());
    assert_eq!(lease.expires_at, t("2026-01-01T11:00:00.000Z"));
    assert!(!lease.ends_by_wall_clock());
    assert_eq!(lease.wall_clock_note(), None);
    // A million leases pay a pointer for the budget, not the struct.
    assert_eq!(
        std::mem::size_of::<Option<Box<Budget>>>(),
        std::mem::size_of::<usize>()
    );
}

#[test]
fn a_wall_clock_budget_ends_the_lease_before_its_signed_expiry() {
    let budget = json!({"tokens": 1000, "cost_usd": 0.5, "wall_clock_ms": 1500, "steps": 7});
    let lease = loaded("2026-01-01T11:00:00.000Z", budget).unwrap();
    assert_eq!(
        lease.budget.as_deref(),
        Some(&Budget {
            tokens: Some(1000),
            cost_usd: Some(0.5),
            wall_clock_ms: Some(1500),
            steps: Some(7),
            depth: None,
            fan_out: None,
        })
    );
    assert_eq!(lease.expires_at, t("2026-01-01T10:00:01.500Z"));
    assert!(lease.ends_by_wall_clock());
    assert_eq!(
        lease.wall_clock_note().as_deref(),
        Some("budget.wall_clock_ms (1500 ms) spent")
    );
    assert_eq!(
        lease.lifetime(t("2026-01-01T10:00:01.499Z")),
        Lifetime::Live
    );
    assert_eq!(
        lease.lifetime(t("2026-01-01T10:00:01.500Z")),
        Lifetime::Expired
    );
}

#[test]
fn an_earlier_signed_expiry_still_ends_the_lease() {
    let lease = loaded("2026-01-01T10:00:01.000Z", json!({"wall_clock_ms": 5000})).unwrap();
    assert_eq!(lease.expires_at, t("2026-01-01T10:00:01.000Z"));
    assert!(!lease.ends_by_wall_clock());
    assert_eq!(lease.wall_clock_note(), None);
}

#[test]
fn a_spent_wall_clock_budget_loads_and_is_expired_at_once() {
    let lease = loaded("2026-01-01T11:00:00.000Z", json!({"wall_clock_ms": 0})).unwrap();
    assert_eq!(lease.expires_at, t(ISSUED));
    assert_eq!(lease.lifetime(t(ISSUED)), Lifetime::Expired);
    // L1 still holds the signed values to account.
    assert!(matches!(
        loaded(ISSUED, json!({"wall_clock_ms": 10})),
        Err(LeaseError::Rule(RuleViolation::L1 { .. }))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_and_verify_show_the_end_the_wall_clock_budget_set() {
    let dir = tempfile::tempdir().unwrap();
    let key = key(7);
    let mut signed = lease(
        &key,
        &id(1),
        None,
        (ISSUED, "2099-01-01T00:00:00.000Z"),
        &["a.test"],
        &[],
    );
    signed["manifest"]["budget"] = json!({"wall_clock_ms": 1500});
    sign(&mut signed, &key).unwrap();
    let [journal, lease_file, key_file] =
        ["journal.jsonl", "lease.json", "lease.key"].map(|name| dir.path().join(name));
    std::fs::write(
        &journal,
        crate::support::granted_line(&signed, ISSUED) + "\n",
    )
    .unwrap();
    std::fs::write(&lease_file, signed.to_string()).unwrap();
    std::fs::write(&key_file, key.to_file_text()).unwrap();
    let [journal, lease_file, key_file] =
        [journal, lease_file, key_file].map(|p| p.to_str().unwrap().to_owned());

    let out = crate::support::leasegate_ok(&[
        "leases",
        "--journal",
        &journal,
        "--key-file",
        &key_file,
        "--json",
    ])
    .await;
    let row: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(row["status"], "expired");
    assert_eq!(row["expires_at"], "2026-01-01T10:00:01.500Z");
    assert_eq!(row["expires_by"], "budget.wall_clock_ms");
    assert_eq!(
        row["closed"]["reason"],
        "budget.wall_clock_ms (1500 ms) spent"
    );

    let out = crate::support::leasegate(&["verify", &lease_file, "--key-file", &key_file]).await;
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(said.contains("/manifest/budget/wall_clock_ms"), "{said}");
    assert!(
        said.contains("expired at 2026-01-01T10:00:01.500Z"),
        "{said}"
    );
}
