//! The admin API's query strings on arbitrary bytes: never panic; accepted pairs have known keys
//! given once, an accepted limit is within its range, and `GET /rates` accepts at most 100
//! lease ids, each a lower-case UUID.

use leasegate::admin::query::{limit_of, query_pairs, rates_leases, MAX_RATE_LEASES};
use leasegate::contract::lease::is_lease_id;

pub fn check(data: &[u8]) {
    let query = String::from_utf8_lossy(data);
    let known = ["leases", "limit"];
    if let Ok(pairs) = query_pairs(Some(&query), &known) {
        for (i, (key, _)) in pairs.iter().enumerate() {
            assert!(known.contains(&key.as_str()), "{key:?}");
            assert!(!pairs[..i].iter().any(|(k, _)| k == key), "{key:?} twice");
        }
        if let Ok(limit) = limit_of(&pairs, 50, 50) {
            assert!((1..=50).contains(&limit), "{limit}");
        }
    }
    if let Ok(ids) = rates_leases(Some(&query)) {
        assert!(ids.len() <= MAX_RATE_LEASES, "{} ids", ids.len());
        for id in &ids {
            assert!(is_lease_id(id), "{id:?}");
        }
    }
}
