//! What a replica does with a closing broadcast, on arbitrary messages: never more lenient than
//! the fold. The input is three lines: a journal line (a grant, in the seeds), the NATS subject
//! the broadcast came on, and its payload. When the grant loads a lease and the broadcast,
//! heard on stream `LG`, would close a lease, that lease is the subject's and the grant's, and
//! folding the payload after the grant closes it too, with and without
//! `--require-record-signatures`.

use leasegate::contract::{Key, Keyring};
use leasegate::registry::broadcast::{self, Heard};
use leasegate::registry::store::nats_broadcast::lease_of;
use leasegate::registry::{Applied, Ledger, Status};

/// The contract's published test key: the seed corpus's leases are signed with it.
const TEST_KEY: &str = include_str!("../../tests/data/contract/vectors/test-key.txt");

pub fn check(data: &[u8]) {
    let mut parts = data.splitn(3, |&b| b == b'\n');
    let (Some(grant), Some(subject), Some(payload)) = (parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let Some(lease) = std::str::from_utf8(subject)
        .ok()
        .and_then(|subject| lease_of("LG", subject))
    else {
        return;
    };
    let key = Key::parse(TEST_KEY).expect("the published test key parses");
    let mut keyring = Keyring::new(true);
    keyring.insert(key);
    let mut ledger = Ledger::new(keyring.clone());
    let granted = match ledger.apply_line_bytes(grant) {
        Ok(Applied::Granted(id)) => Some(id),
        _ => None,
    };
    let Heard::Closes(_) = broadcast::check(&ledger, lease, payload) else {
        return;
    };
    assert_eq!(
        Some(lease),
        granted.as_deref(),
        "closes a lease not granted"
    );
    let issued = ledger.lease(lease).expect("loaded").issued_at;
    for required in [false, true] {
        let mut ledger = Ledger::new(keyring.clone().requiring_record_signatures(required));
        ledger
            .apply_line_bytes(grant)
            .expect("the grant loads again");
        let applied = ledger.apply_line_bytes(payload);
        assert!(
            matches!(applied, Ok(Applied::Closed(ref id)) if id == lease),
            "heard as closing, but the fold (signatures required: {required}) says {applied:?}"
        );
        let status = ledger.status(lease, issued);
        assert!(
            !matches!(status, Some(Status::Open | Status::NotYetValid) | None),
            "heard as closing, but the lease is {status:?} after the fold"
        );
    }
}
