//! Which lease a request belongs to: per-lease port, `Proxy-Authorization`, `X-Lease-Id`.
//!
//! Invariant: two different lease ids in one request are a conflict, never a choice; a
//! malformed credential is `lease-unknown`, no credential at all `lease-missing`.

use crate::contract::lease::is_lease_id;
use crate::policy::refusal::{Code, Refusal};
use base64::Engine;
use http::HeaderMap;

/// The lease a request names, and the free-form label of Basic credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub lease_id: String,
    pub label: Option<String>,
}

/// The header carrying a lease id without credentials syntax.
pub const LEASE_ID_HEADER: &str = "x-lease-id";

/// Identifies the lease. `port_lease` is the lease of a per-lease port, if the connection
/// arrived on one.
pub fn identify(headers: &HeaderMap, port_lease: Option<&str>) -> Result<Identity, Refusal> {
    let mut named: Vec<Identity> = Vec::new();
    for value in headers.get_all(http::header::PROXY_AUTHORIZATION) {
        let text = value
            .to_str()
            .map_err(|_| unknown("Proxy-Authorization is not text"))?;
        named.push(parse_authorization(text)?);
    }
    for value in headers.get_all(LEASE_ID_HEADER) {
        let text = value
            .to_str()
            .map_err(|_| unknown("X-Lease-Id is not text"))?
            .trim();
        named.push(Identity {
            lease_id: checked_id(text)?,
            label: None,
        });
    }
    let label = named.iter().find_map(|i| i.label.clone());
    let first = match port_lease {
        Some(id) => id.to_owned(),
        None => match named.first() {
            Some(identity) => identity.lease_id.clone(),
            None => {
                return Err(Refusal::new(
                    Code::LeaseMissing,
                    "no lease named: put the lease id in the proxy URL (http://agent:<lease-id>@host:port)",
                ))
            }
        },
    };
    if let Some(other) = named.iter().find(|i| i.lease_id != first) {
        return Err(Refusal::new(
            Code::LeaseConflict,
            format!("request names two leases: {first} and {}", other.lease_id),
        ));
    }
    Ok(Identity {
        lease_id: first,
        label,
    })
}

fn unknown(detail: &str) -> Refusal {
    Refusal::new(Code::LeaseUnknown, detail)
}

fn parse_authorization(text: &str) -> Result<Identity, Refusal> {
    let (scheme, rest) = text
        .trim()
        .split_once(' ')
        .ok_or_else(|| unknown("malformed Proxy-Authorization"))?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Ok(Identity {
            lease_id: checked_id(rest)?,
            label: None,
        });
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(unknown(
            "Proxy-Authorization scheme is neither Basic nor Bearer",
        ));
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(rest)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or_else(|| unknown("Basic credentials are not base64 text"))?;
    let (user, password) = decoded.split_once(':').unwrap_or((&decoded, ""));
    let (id, label) = if password.is_empty() {
        (user, None)
    } else {
        (password, (!user.is_empty()).then(|| user.to_owned()))
    };
    Ok(Identity {
        lease_id: checked_id(id)?,
        label,
    })
}

/// A lease id has the contract's form (lower-case UUID).
fn checked_id(text: &str) -> Result<String, Refusal> {
    if is_lease_id(text) {
        Ok(text.to_owned())
    } else {
        Err(unknown("the lease id is not a lower-case UUID"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const A: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    const B: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

    fn headers(pairs: &[(&str, String)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        map
    }

    fn basic(user_pass: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_pass)
        )
    }

    fn code(result: Result<Identity, Refusal>) -> Code {
        result.unwrap_err().code
    }

    #[test]
    fn every_credential_form_names_the_lease() {
        let with_label = identify(
            &headers(&[("proxy-authorization", basic(&format!("agent:{A}")))]),
            None,
        )
        .unwrap();
        assert_eq!(
            with_label,
            Identity {
                lease_id: A.into(),
                label: Some("agent".into())
            }
        );
        let as_user = identify(
            &headers(&[("proxy-authorization", basic(&format!("{A}:")))]),
            None,
        )
        .unwrap();
        assert_eq!(as_user.lease_id, A);
        let bearer = identify(
            &headers(&[("proxy-authorization", format!("bearer {A}"))]),
            None,
        )
        .unwrap();
        assert_eq!(bearer.lease_id, A);
        let header = identify(&headers(&[("x-lease-id", A.into())]), None).unwrap();
        assert_eq!(header.lease_id, A);
        let port = identify(&HeaderMap::new(), Some(B)).unwrap();
        assert_eq!(port.lease_id, B);
    }

    #[test]
    fn conflicts_missing_and_malformed() {
        assert_eq!(code(identify(&HeaderMap::new(), None)), Code::LeaseMissing);
        assert_eq!(
            code(identify(
                &headers(&[
                    ("proxy-authorization", format!("Bearer {A}")),
                    ("x-lease-id", B.into())
                ]),
                None
            )),
            Code::LeaseConflict
        );
        assert_eq!(
            code(identify(&headers(&[("x-lease-id", A.into())]), Some(B))),
            Code::LeaseConflict
        );
        assert!(identify(&headers(&[("x-lease-id", B.into())]), Some(B)).is_ok());
        for bad in [
            "Basic !!!",
            "Digest abc",
            "Bearer",
            &format!("Bearer {}", A.to_uppercase()),
            &basic("agent:not-a-lease"),
        ] {
            assert_eq!(
                code(identify(
                    &headers(&[("proxy-authorization", bad.to_string())]),
                    None
                )),
                Code::LeaseUnknown,
                "{bad}"
            );
        }
    }
}
