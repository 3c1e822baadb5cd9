//! RFC 8785 canonical bytes of arbitrary JSON: never panics, the output is JSON that means the
//! same value, and canonicalising it again changes nothing.

use leasegate::contract::canonical::canonical_bytes;
use serde_json::Value;

pub fn check(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let Ok(canonical) = canonical_bytes(&value) else {
        return;
    };
    let reparsed: Value = serde_json::from_slice(&canonical).expect("canonical bytes are JSON");
    let again = canonical_bytes(&reparsed).expect("canonical JSON canonicalises");
    assert_eq!(canonical, again, "canonicalisation is idempotent");
}
