//! Who is asking the admin API: the operator (the admin token), one lease (its own proxy token,
//! `<lease-id>.<tag>`), or nobody in particular (no token configured, none presented).
//!
//! Invariant: a lease token opens `GET /leases/{id}` and `GET /leases/{id}/placeholders` and
//! `POST /leases/{id}/complete|stop` for the lease it was minted for and no other, and
//! `POST /leases`, where the issuer grants it children of its own lease only, never wider — so
//! what an agent holding its own token (`leasegate run` hands it one) can reach through the
//! admin API is what its lease already gives it; every other route answers 403 to it. Credentials
//! (`proxy_url` with a credential, placeholders) go only to the operator and, for its own
//! lease, to the lease. Tokens are compared in constant time; a bearer that names a lease but
//! does not verify is refused (401), whatever else is configured.

use crate::contract::token;
use crate::registry::Snapshot;
use subtle::ConstantTimeEq;

/// Who presented what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Presented the configured admin token.
    Operator,
    /// Presented the proxy token of this lease (verified under the lease's key).
    Lease(String),
    /// Presented nothing, and no admin token is configured: may read, never shown a credential.
    Anyone,
}

/// Why a caller is turned away.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotAuthorized {
    /// 401: no credential, or one that does not verify.
    Unauthenticated(&'static str),
    /// 403: a lease token, on a route that is not its lease's own.
    NotItsLease,
    /// 404: a lease token of a lease this proxy does not know (it cannot be checked).
    UnknownLease(String),
}

impl Caller {
    /// Who `authorization` (the request's `Authorization` header) says the caller is; `admin`:
    /// the configured admin token.
    pub fn of(
        authorization: Option<&str>,
        admin: Option<&str>,
        snapshot: &Snapshot,
    ) -> Result<Caller, NotAuthorized> {
        const NEEDED: &str = "this route needs Authorization: Bearer <admin token> (or, for a \
                              lease's own routes, Bearer <its proxy token>)";
        let bearer = authorization.and_then(|v| v.strip_prefix("Bearer ").map(str::trim));
        let given = match (bearer, admin) {
            (Some(given), _) => given,
            (None, None) => return Ok(Caller::Anyone),
            (None, Some(_)) => return Err(NotAuthorized::Unauthenticated(NEEDED)),
        };
        if let Some(admin) = admin {
            if bool::from(given.as_bytes().ct_eq(admin.as_bytes())) {
                return Ok(Caller::Operator);
            }
        }
        if let (id, Some(tag)) = token::split(given) {
            if crate::contract::lease::lease_id(id).is_ok() && snapshot.ledger.lease(id).is_none() {
                return Err(NotAuthorized::UnknownLease(id.to_owned()));
            }
            let verifies = snapshot
                .ledger
                .signing_key(id)
                .is_some_and(|key| token::verify(key, id, tag));
            return match verifies {
                true => Ok(Caller::Lease(id.to_owned())),
                false => Err(NotAuthorized::Unauthenticated(
                    "the bearer token is neither the admin token nor a lease's proxy token",
                )),
            };
        }
        match admin {
            // Without an admin token there is nothing to present; an unknown bearer reads as
            // no credential at all (and is shown none).
            None => Ok(Caller::Anyone),
            Some(_) => Err(NotAuthorized::Unauthenticated(
                "the bearer token is neither the admin token nor a lease's proxy token",
            )),
        }
    }

    /// Whether this caller may use the route `segments` with `method` (GET or other).
    pub fn may(&self, is_get: bool, segments: &[&str]) -> Result<(), NotAuthorized> {
        match (self, segments) {
            (Caller::Operator | Caller::Anyone, _) => Ok(()),
            (Caller::Lease(own), ["leases", id] | ["leases", id, "placeholders"])
                if is_get && own == id =>
            {
                Ok(())
            }
            // Its own children (the issuer refuses any other parent), and its own ending.
            (Caller::Lease(_), ["leases"]) if !is_get => Ok(()),
            (Caller::Lease(own), ["leases", id, "complete" | "stop"]) if !is_get && own == id => {
                Ok(())
            }
            (Caller::Lease(_), _) => Err(NotAuthorized::NotItsLease),
        }
    }

    /// Whether this caller is shown lease `id`'s credentials (its proxy URL with a credential,
    /// its placeholders).
    pub fn sees_credentials_of(&self, id: &str) -> bool {
        match self {
            Caller::Operator => true,
            Caller::Lease(own) => own == id,
            Caller::Anyone => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_token_opens_its_own_two_routes_only() {
        let a = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
        let b = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";
        let caller = Caller::Lease(a.to_owned());
        assert_eq!(caller.may(true, &["leases", a]), Ok(()));
        assert_eq!(caller.may(true, &["leases", a, "placeholders"]), Ok(()));
        for refused in [
            &["leases", b][..],
            &["leases", b, "placeholders"],
            &["leases", a, "requests"],
            &["leases", a, "revoke"],
            &["leases"],
            &["refusals"],
            &["metrics"],
            &["status"],
            &["rates"],
            &["readyz"],
        ] {
            assert_eq!(
                caller.may(true, refused),
                Err(NotAuthorized::NotItsLease),
                "{refused:?}"
            );
        }
        assert_eq!(
            caller.may(false, &["leases", a, "placeholders"]),
            Err(NotAuthorized::NotItsLease),
            "only GET"
        );
        assert!(caller.sees_credentials_of(a));
        assert!(!caller.sees_credentials_of(b));
        assert!(Caller::Operator.sees_credentials_of(b));
        assert!(!Caller::Anyone.sees_credentials_of(a));
    }
}
