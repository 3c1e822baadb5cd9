//! The body of `POST /approvals/{id}` as the admin API reads it, on arbitrary bytes: never
//! panics; a body it accepts is a JSON object whose `decision` is approve or deny, a denial
//! has a reason, `for: lease` only approves, and the reason is within its bound.

use leasegate::admin::approvals::asked;
use leasegate::approvals::book::{Outcome, Scope, REASON_MAX};
use serde_json::Value;

pub fn check(data: &[u8]) {
    let Ok(asked) = asked(data) else {
        return;
    };
    let value: Value = serde_json::from_slice(data).expect("an accepted body is JSON");
    let decision = value["decision"].as_str();
    match asked.outcome {
        Outcome::Approved => assert_eq!(decision, Some("approve")),
        Outcome::Denied => {
            assert_eq!(decision, Some("deny"));
            assert!(!asked.reason.trim().is_empty(), "a denial without a reason");
            assert_eq!(asked.scope, Scope::Once);
        }
        Outcome::Expired => panic!("nobody asks for expired"),
    }
    if asked.scope == Scope::Lease {
        assert_eq!(value["for"], "lease");
    }
    assert!(asked.reason.chars().count() <= REASON_MAX);
}
