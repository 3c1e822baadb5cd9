//! A line of an approval store as every replica reads it, on arbitrary bytes: never panics; a
//! line it accepts holds an approval id, a lease id and a `<server>/<tool>`, writes back to a
//! line that reads the same, verifies only under the key it was signed with (and no longer
//! once its outcome or tool is changed), and folds into a book without a panic, the first
//! decision staying the decision.

use leasegate::approvals::book::{self, Book, Entry, Outcome};
use leasegate::contract::Key;

pub fn check(data: &[u8]) {
    let Ok(entry) = book::read(data) else {
        return;
    };
    let (id, lease) = match &entry {
        Entry::Requested(r) => (r.id.clone(), r.lease_id.clone()),
        Entry::Decided(d) => (d.id.clone(), d.lease_id.clone()),
    };
    assert!(book::is_id(&id));
    assert_eq!(book::lease_of(&entry), lease);
    let again = serde_json::to_vec(&entry).unwrap();
    assert_eq!(
        book::read(&again).expect("a written line reads back"),
        entry
    );
    let key = Key::from_bytes([7; 32]);
    let signed = book::read(&book::signed(entry.clone(), &key)).expect("a signed line reads");
    assert!(book::verifies(&signed, &key));
    assert!(!book::verifies(&signed, &Key::from_bytes([8; 32])));
    let mut changed = signed.clone();
    match &mut changed {
        Entry::Requested(r) => r.tool.push('x'),
        Entry::Decided(d) => {
            d.outcome = match d.outcome {
                Outcome::Approved => Outcome::Denied,
                _ => Outcome::Approved,
            }
        }
    }
    assert!(
        !book::verifies(&changed, &key),
        "a changed line still verifies"
    );
    let mut folded = Book::default();
    folded.apply(signed.clone());
    folded.apply(changed);
    if let Entry::Decided(d) = &signed {
        if let Some(first) = folded.decision(&d.id) {
            assert_eq!(first, d, "a later decision replaced the first");
        }
    }
    folded.forget_oldest(0);
}
