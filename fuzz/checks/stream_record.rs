//! What an append takes as "the stream already holds our closing record", on arbitrary stream
//! messages: never more lenient than the fold. The input is three lines: a journal line (a
//! grant, in the seeds), a subject's lease token, and a message payload. When the grant loads a
//! lease and [`ClosingCheck::accepts`] the payload on that subject, folding the payload after
//! the grant closes the lease, with and without `--require-record-signatures`; and a payload
//! on another lease's subject is never accepted.

use leasegate::contract::{Key, Keyring};
use leasegate::registry::closing::ClosingCheck;
use leasegate::registry::{Applied, Ledger, Status};

/// The contract's published test key: the seed corpus's leases are signed with it.
const TEST_KEY: &str = include_str!("../../tests/data/contract/vectors/test-key.txt");

pub fn check(data: &[u8]) {
    let mut parts = data.splitn(3, |&b| b == b'\n');
    let (Some(grant), Some(subject), Some(payload)) = (parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let Ok(subject) = std::str::from_utf8(subject) else {
        return;
    };
    let key = Key::parse(TEST_KEY).expect("the published test key parses");
    let mut keyring = Keyring::new(true);
    keyring.insert(key.clone());
    let mut ledger = Ledger::new(keyring.clone());
    let Ok(Applied::Granted(lease)) = ledger.apply_line_bytes(grant) else {
        return;
    };
    let check = ClosingCheck::new(&lease, Some(key), b"");
    if !check.accepts(subject, payload) {
        return;
    }
    assert_eq!(subject, lease, "accepted on another lease's subject");
    let issued = ledger.lease(&lease).expect("loaded").issued_at;
    for required in [false, true] {
        let mut ledger = Ledger::new(keyring.clone().requiring_record_signatures(required));
        ledger
            .apply_line_bytes(grant)
            .expect("the grant loads again");
        let applied = ledger.apply_line_bytes(payload);
        assert!(
            matches!(applied, Ok(Applied::Closed(ref id)) if *id == lease),
            "accepted, but the fold (signatures required: {required}) says {applied:?}"
        );
        // Within the lease's lifetime, only the closing can make it anything but open.
        let status = ledger.status(&lease, issued);
        assert!(
            !matches!(status, Some(Status::Open | Status::NotYetValid) | None),
            "accepted, but the lease is {status:?} after the fold"
        );
    }
}
