//! Rules a schema cannot express: L1, L2, L3 and the lifetime check.
//!
//! Invariant: pure functions of their arguments; `now` is always passed in.

use super::Timestamp;

/// A broken contract rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleViolation {
    #[error("L1: expires_at ({expires_at}) is not after issued_at ({issued_at})")]
    L1 {
        issued_at: Timestamp,
        expires_at: Timestamp,
    },
    #[error("L2: parent_lease_id is the lease's own id ({lease_id})")]
    L2 { lease_id: String },
    #[error("L3: revoked by {by:?}, which is neither \"issuer\" nor an ancestor of {lease_id}")]
    L3 { by: String, lease_id: String },
}

/// L1: `expires_at` strictly after `issued_at`.
pub fn check_l1(issued_at: Timestamp, expires_at: Timestamp) -> Result<(), RuleViolation> {
    if expires_at > issued_at {
        Ok(())
    } else {
        Err(RuleViolation::L1 {
            issued_at,
            expires_at,
        })
    }
}

/// L2: a lease is not its own parent.
pub fn check_l2(lease_id: &str, parent_lease_id: Option<&str>) -> Result<(), RuleViolation> {
    match parent_lease_id {
        Some(parent) if parent == lease_id => Err(RuleViolation::L2 {
            lease_id: lease_id.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// L3: a revocation's `by` is `"issuer"` or one of the lease's ancestors.
pub fn check_l3<'a>(
    lease_id: &str,
    by: &str,
    mut ancestors: impl Iterator<Item = &'a str>,
) -> Result<(), RuleViolation> {
    if by == "issuer" || ancestors.any(|a| a == by) {
        Ok(())
    } else {
        Err(RuleViolation::L3 {
            by: by.to_owned(),
            lease_id: lease_id.to_owned(),
        })
    }
}

/// Where `now` falls in a lease's lifetime `[issued_at, expires_at)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    NotYetValid,
    Live,
    Expired,
}

pub fn lifetime(issued_at: Timestamp, expires_at: Timestamp, now: Timestamp) -> Lifetime {
    if now < issued_at {
        Lifetime::NotYetValid
    } else if now < expires_at {
        Lifetime::Live
    } else {
        Lifetime::Expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    #[test]
    fn l1_wants_expiry_strictly_after_issue() {
        assert!(check_l1(t(1), t(2)).is_ok());
        assert!(matches!(
            check_l1(t(2), t(2)),
            Err(RuleViolation::L1 { .. })
        ));
        assert!(matches!(
            check_l1(t(3), t(2)),
            Err(RuleViolation::L1 { .. })
        ));
    }

    #[test]
    fn l2_refuses_self_parenthood() {
        assert!(check_l2("a", None).is_ok());
        assert!(check_l2("a", Some("b")).is_ok());
        assert_eq!(
            check_l2("a", Some("a")),
            Err(RuleViolation::L2 {
                lease_id: "a".into()
            })
        );
    }

    #[test]
    fn l3_accepts_issuer_and_ancestors_only() {
        let ancestors = ["p", "gp"];
        assert!(check_l3("c", "issuer", ancestors.iter().copied()).is_ok());
        assert!(check_l3("c", "gp", ancestors.iter().copied()).is_ok());
        assert!(matches!(
            check_l3("c", "c", ancestors.iter().copied()),
            Err(RuleViolation::L3 { .. })
        ));
        assert!(matches!(
            check_l3("c", "x", ancestors.iter().copied()),
            Err(RuleViolation::L3 { .. })
        ));
    }

    #[test]
    fn lifetime_is_half_open() {
        assert_eq!(lifetime(t(10), t(20), t(9)), Lifetime::NotYetValid);
        assert_eq!(lifetime(t(10), t(20), t(10)), Lifetime::Live);
        assert_eq!(lifetime(t(10), t(20), t(19)), Lifetime::Live);
        assert_eq!(lifetime(t(10), t(20), t(20)), Lifetime::Expired);
    }
}
