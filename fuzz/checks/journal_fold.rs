//! The journal fold on arbitrary bytes, with and without a keyring: never panics, counts every
//! line it skipped (reported at once, or as a held closing record its grant turned down), and a
//! lease it loaded is one whose grant it saw.

use leasegate::contract::{Key, Keyring};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::Ledger;

/// The contract's published test key: the seed corpus's leases are signed with it.
const TEST_KEY: &str = include_str!("../../tests/data/contract/vectors/test-key.txt");

pub fn check(data: &[u8]) {
    let mut keyring = Keyring::new(true);
    keyring.insert(Key::parse(TEST_KEY).expect("the published test key parses"));
    for ledger in [Ledger::new(keyring), Ledger::unverified()] {
        let mut ledger = ledger;
        let problems = fold_bytes(&mut ledger, data);
        let stats = ledger.stats();
        // A closing record held for its grant and skipped when the grant came is counted
        // then, on the grant's line, which itself is no problem.
        assert_eq!(
            stats.invalid_lines,
            problems.len() as u64 + stats.held_skipped,
            "every skipped line is counted"
        );
        assert!(stats.invalid_lines <= stats.lines);
        for lease in ledger.leases() {
            assert!(ledger.lease(&lease.id).is_some());
        }
    }
}
