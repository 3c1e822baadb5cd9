//! `journal compact`: the compacted journal folds the same for every lease within the
//! retention, nothing is deleted, and a running proxy follows the swap without folding again.

use crate::support::{event_line, granted_line, id, key, lease, signed_line};
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::registry::compact::{select, DEFAULT_RETENTION};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::Ledger;
use serde_json::json;
use std::collections::BTreeSet;

const HOUR: i64 = 3600 * 1000;

/// Noon, the instant the compaction runs at.
fn noon() -> Timestamp {
    Timestamp::parse("2026-12-01T12:00:00.000Z").unwrap()
}

/// `hours` from noon, in the contract's form.
fn at(hours: i64) -> String {
    noon().saturating_add_millis(hours * HOUR).to_string()
}

fn ring(key: &Key) -> Keyring {
    let mut ring = Keyring::new(false);
    ring.insert(key.clone());
    ring
}

fn fold(ring: Keyring, lines: &[&str]) -> Ledger {
    let mut ledger = Ledger::new(ring);
    fold_bytes(&mut ledger, (lines.join("\n") + "\n").as_bytes());
    ledger
}

/// A journal with every kind of lease and line a compaction meets, around noon.
fn journal(k: &Key) -> (Vec<String>, BTreeSet<String>) {
    let grant = |n: u32, parent: Option<u32>, from: i64, to: i64| {
        let parent = parent.map(id);
        let lease = lease(
            k,
            &id(n),
            parent.as_deref(),
            (&at(from), &at(to)),
            &["a.test"],
            &[],
        );
        granted_line(&lease, &at(from))
    };
    let closing = |event: &str, n: u32, hours: i64| {
        event_line(
            event,
            &id(n),
            &at(hours),
            json!({"by": "issuer", "reason": "test"}),
        )
    };
    let stranger = lease(&key(99), &id(50), None, (&at(-1), &at(1)), &["a.test"], &[]);
    let lines = vec![
        grant(1, None, -1, 1),     // open
        grant(2, None, 1, 2),      // not yet valid
        grant(3, None, -120, -72), // expired three days ago: dropped
        grant(4, None, -30, -2),   // expired two hours ago
        grant(5, None, -120, -96), // revoked and expired long ago: dropped
        closing("revoked", 5, -100),
        grant(6, None, -2, 5), // revoked an hour ago
        closing("revoked", 6, -1),
        grant(7, None, -120, 120), // revoked long ago, its grant still valid
        closing("stopped", 7, -100),
        grant(8, None, -120, -72), // expired long ago, parent of an open lease
        grant(9, Some(8), -1, 1),  // open, ancestor closed
        grant(10, None, -120, -72), // a chain expired long ago whose leaf closed
        grant(11, Some(10), -120, -72), //   an hour ago: all three kept
        grant(12, Some(11), -120, -72),
        closing("completed", 12, -1),
        signed_line(&closing("revoked", 13, -3), k), // signed, before its grant: held
        grant(13, None, -2, 2),
        closing("revoked", 14, -5), // a closing whose grant never came
        grant(1, None, -1, 1),      // duplicate grant
        event_line("heartbeat", &id(1), &at(0), json!({})),
        "not json".to_owned(),
        granted_line(&stranger, &at(-1)), // a key we do not know
        grant(15, None, -120, -72),       // expired long ago, closed twice, last
        closing("revoked", 15, -100),     //   within the retention
        closing("stopped", 15, -3),
        grant(16, None, -3, 3), // open, a forged signed revocation
        {
            let mut forged: serde_json::Value =
                serde_json::from_str(&signed_line(&closing("revoked", 16, -1), k)).unwrap();
            forged["reason"] = "changed after signing".into();
            forged.to_string()
        },
    ];
    let dropped = [3, 5].map(id).into_iter().collect();
    (lines, dropped)
}

#[test]
fn a_compacted_journal_folds_the_same_for_every_kept_lease() {
    let k = key(7);
    let (lines, dropped) = journal(&k);
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let selection = select(
        refs.iter().map(|l| l.as_bytes()),
        ring(&k),
        noon(),
        DEFAULT_RETENTION,
    );
    let kept: Vec<&str> = selection.kept.iter().map(|&i| refs[i]).collect();
    assert_eq!(selection.duplicate_grants, 1);
    assert_eq!(selection.notes_dropped, 1);
    assert_eq!(
        selection.invalid.iter().sum::<usize>(),
        3,
        "parse, lease, signature"
    );
    assert_eq!(selection.orphan_closings, 1);
    assert!(
        kept.contains(&refs[18]),
        "the closing without a grant is kept"
    );
    assert_eq!(selection.leases_dropped, 2);

    for required in [false, true] {
        let ring = ring(&k).requiring_record_signatures(required);
        let whole = fold(ring.clone(), &refs);
        let compacted = fold(ring, &kept);
        let mut gone = BTreeSet::new();
        for lease in whole.leases() {
            let id = &lease.id;
            if compacted.lease(id).is_none() {
                gone.insert(id.clone());
                continue;
            }
            for now in [noon(), noon().saturating_add_millis(HOUR + 1)] {
                assert_eq!(compacted.status(id, now), whole.status(id, now), "{id}");
                let chain = |l: &Ledger| {
                    l.check_chain(id, now)
                        .map(|c| c.iter().map(|l| l.id.clone()).collect::<Vec<_>>())
                };
                assert_eq!(chain(&compacted), chain(&whole), "{id}");
            }
        }
        assert_eq!(
            gone, dropped,
            "exactly the leases past the retention are dropped"
        );
        assert_eq!(
            compacted.leases().count() + gone.len(),
            whole.leases().count()
        );
    }
    // A grant of a closed lease appended again stays closed: the closing record was kept.
    let mut again = kept.clone();
    again.push(refs[8]);
    let folded = fold(ring(&k), &again);
    assert_eq!(
        folded.status(&id(7), noon()),
        fold(ring(&k), &refs).status(&id(7), noon())
    );
}
