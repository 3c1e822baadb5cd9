//! Which lease a request belongs to: per-lease port, `Proxy-Authorization`, `X-Lease-Id`;
//! and, with `--credentials token` (or `--lease-port-credentials token` on a lease port),
//! whether each credential carries the lease's token.
//!
//! Invariant: two different lease ids in one request are a conflict, never a choice; a
//! malformed credential is `lease-unknown`, no credential at all `lease-missing` (on a lease
//! port, only with `--lease-port-credentials token`). A tag that is present is always
//! verified (in either mode); in token mode a bare lease id is `lease-missing` and a tag that
//! does not verify under the lease's own key `lease-unknown`.

use crate::config::{Credentials, LeasePortCredentials};
use crate::contract::lease::is_lease_id;
use crate::contract::{token, Key};
use crate::policy::codes::{Code, Refusal};
use crate::registry::Snapshot;
use base64::Engine;
use http::HeaderMap;

/// The lease a request names, and the free-form label of Basic credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub lease_id: String,
    pub label: Option<String>,
    /// One entry per credential that named the lease: its token tag, `None` for a bare id.
    /// Empty when only the per-lease port names it.
    pub tags: Vec<Option<String>>,
    /// Whether the connection arrived on the lease's own port.
    pub on_port: bool,
}

/// Checks the tags of `identity` against the key its lease is signed with, looked up in
/// `snapshot` (the lease's key fingerprint in the registry's keyring): `credentials` on the
/// shared listener, `on_port` on a lease's own port.
pub fn authenticate(
    identity: &Identity,
    credentials: Credentials,
    on_port: LeasePortCredentials,
    snapshot: &Snapshot,
) -> Result<(), Refusal> {
    let key = snapshot.ledger.signing_key(&identity.lease_id);
    check_tags(identity, required(identity, credentials, on_port)?, key)
}

/// What the credentials of `identity` must prove where it arrived: on a lease port with
/// `--lease-port-credentials token`, a token, and at least one credential.
fn required(
    identity: &Identity,
    credentials: Credentials,
    on_port: LeasePortCredentials,
) -> Result<Credentials, Refusal> {
    if !identity.on_port || on_port == LeasePortCredentials::None {
        return Ok(credentials);
    }
    if identity.tags.is_empty() {
        return Err(Refusal::new(
            Code::LeaseMissing,
            "this lease port requires the lease's token: put <lease-id>.<tag> in the proxy URL \
             (`leasegate token`, or line 2 of `leasegate issue`)",
        ));
    }
    Ok(Credentials::Token)
}

fn check_tags(
    identity: &Identity,
    credentials: Credentials,
    key: Option<&Key>,
) -> Result<(), Refusal> {
    for tag in &identity.tags {
        match tag {
            // A lease we do not know has no key: its token cannot verify.
            Some(tag) if !key.is_some_and(|key| token::verify(key, &identity.lease_id, tag)) => {
                return Err(unknown(&format!(
                    "the token for lease {} does not verify",
                    identity.lease_id
                )))
            }
            Some(_) => {}
            None if credentials == Credentials::Token => {
                return Err(Refusal::new(
                    Code::LeaseMissing,
                    "a lease token is required, not a bare lease id: put <lease-id>.<tag> in the \
                     proxy URL (`leasegate token`, or line 2 of `leasegate issue`)",
                ))
            }
            None => {}
        }
    }
    Ok(())
}

/// The header carrying a lease id without credentials syntax.
pub const LEASE_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-lease-id");

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
    for value in headers.get_all(&LEASE_ID_HEADER) {
        let text = value
            .to_str()
            .map_err(|_| unknown("X-Lease-Id is not text"))?
            .trim();
        named.push(checked(text, None)?);
    }
    let label = named.iter_mut().find_map(|i| i.label.take());
    let mut credentials = named.into_iter();
    // One credential (the usual request) becomes the identity as it is, without copies.
    let mut identity = match port_lease {
        Some(id) => Identity {
            lease_id: id.to_owned(),
            label: None,
            tags: Vec::new(),
            on_port: true,
        },
        None => credentials.next().ok_or_else(|| {
            Refusal::new(
                Code::LeaseMissing,
                "no lease named: put the lease id in the proxy URL (http://agent:<lease-id>@host:port)",
            )
        })?,
    };
    for other in credentials {
        if other.lease_id != identity.lease_id {
            return Err(Refusal::new(
                Code::LeaseConflict,
                format!(
                    "request names two leases: {} and {}",
                    identity.lease_id, other.lease_id
                ),
            ));
        }
        identity.tags.extend(other.tags);
    }
    identity.label = label;
    Ok(identity)
}

/// Refuses a request that carries a token it proved its lease with anywhere but the fields
/// that never go upstream (`Proxy-Authorization`, `X-Lease-Id`): in `target` (path and query),
/// another field, or the Basic credentials of `Authorization`. A token an origin sees can be
/// replayed against the proxy: `secret-exposed`, which revokes the lease and kills the token.
pub fn token_kept(identity: &Identity, target: &str, headers: &HeaderMap) -> Result<(), Refusal> {
    let tags = identity.tags.iter().flatten().filter(|tag| !tag.is_empty());
    for tag in tags {
        let holds = |bytes: &[u8]| memchr::memmem::find(bytes, tag.as_bytes()).is_some();
        let mut place = holds(target.as_bytes()).then_some("the request target");
        for (name, value) in headers {
            if place.is_some() {
                break;
            }
            if name == http::header::PROXY_AUTHORIZATION || name == LEASE_ID_HEADER {
                continue;
            }
            if holds(value.as_bytes())
                || (name == http::header::AUTHORIZATION && basic_holds(value, &holds))
            {
                place = Some(name.as_str());
            }
        }
        if let Some(place) = place {
            return Err(Refusal::new(
                Code::SecretExposed,
                format!(
                    "the request carries lease {}'s own proxy token in {place}: it goes to the \
                     proxy only (Proxy-Authorization), never to an origin, and the lease is \
                     revoked so the token is worthless",
                    identity.lease_id
                ),
            ));
        }
    }
    Ok(())
}

/// Whether the Basic credentials of an `Authorization` value, decoded, hold what `holds` finds.
fn basic_holds(value: &http::HeaderValue, holds: &dyn Fn(&[u8]) -> bool) -> bool {
    let Some((scheme, rest)) = value.to_str().ok().and_then(|v| v.trim().split_once(' ')) else {
        return false;
    };
    scheme.eq_ignore_ascii_case("basic")
        && base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .is_ok_and(|decoded| holds(&decoded))
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
        return checked(rest, None);
    }
    if !scheme.eq_ignore_ascii_case("basic") {
        return Err(unknown(
            "Proxy-Authorization scheme is neither Basic nor Bearer",
        ));
    }
    // Decoded on the stack (an id, a tag and a label fit many times over); longer ones on
    // the heap.
    let mut stack = [0u8; 512];
    let mut heap = Vec::new();
    let engine = base64::engine::general_purpose::STANDARD;
    let bytes = match engine.decode_slice(rest, &mut stack) {
        Ok(len) => Some(&stack[..len]),
        Err(base64::DecodeSliceError::OutputSliceTooSmall) => engine
            .decode_vec(rest, &mut heap)
            .ok()
            .map(|()| heap.as_slice()),
        Err(base64::DecodeSliceError::DecodeError(_)) => None,
    };
    let decoded = bytes
        .and_then(|bytes| std::str::from_utf8(bytes).ok())
        .ok_or_else(|| unknown("Basic credentials are not base64 text"))?;
    let (user, password) = decoded.split_once(':').unwrap_or((decoded, ""));
    let (id, label) = if password.is_empty() {
        (user, None)
    } else {
        (password, (!user.is_empty()).then(|| user.to_owned()))
    };
    checked(id, label)
}

/// One credential, `<lease-id>` or `<lease-id>.<tag>`; the lease id has the contract's form
/// (a UUID, taken in lower case whatever case it came in).
fn checked(credential: &str, label: Option<String>) -> Result<Identity, Refusal> {
    let (id, tag) = token::split(credential);
    let id = id.to_ascii_lowercase();
    if !is_lease_id(&id) {
        return Err(unknown("the lease id is not a UUID"));
    }
    Ok(Identity {
        lease_id: id,
        label,
        tags: vec![tag.map(str::to_owned)],
        on_port: false,
    })
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
                label: Some("agent".into()),
                tags: vec![None],
                on_port: false,
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
        // Credentials longer than the stack buffer decode on the heap, the same.
        let long_label = "a".repeat(700);
        let long = identify(
            &headers(&[("proxy-authorization", basic(&format!("{long_label}:{A}")))]),
            None,
        )
        .unwrap();
        assert_eq!((long.lease_id.as_str(), long.label), (A, Some(long_label)));
        let header = identify(&headers(&[("x-lease-id", A.into())]), None).unwrap();
        assert_eq!(header.lease_id, A);
        let port = identify(&HeaderMap::new(), Some(B)).unwrap();
        assert_eq!(port.lease_id, B);
        assert!(port.tags.is_empty());
    }

    #[test]
    fn token_mode_needs_a_verifying_tag_on_every_credential() {
        let key = Key::generate();
        let token = token::mint(&key, A);
        let forms = [
            ("proxy-authorization", basic(&format!("agent:{token}"))),
            ("proxy-authorization", basic(&format!("{token}:"))),
            ("proxy-authorization", format!("Bearer {token}")),
            ("x-lease-id", token.clone()),
        ];
        for (name, value) in &forms {
            let identity = identify(&headers(&[(name, value.clone())]), None).unwrap();
            assert_eq!(identity.lease_id, A, "{value}");
            for mode in [Credentials::Token, Credentials::Id] {
                assert!(check_tags(&identity, mode, Some(&key)).is_ok(), "{value}");
            }
            let other = Key::generate();
            assert_eq!(
                check_tags(&identity, Credentials::Token, Some(&other))
                    .unwrap_err()
                    .code,
                Code::LeaseUnknown,
                "a tag under another key: {value}"
            );
            assert_eq!(
                check_tags(&identity, Credentials::Token, None)
                    .unwrap_err()
                    .code,
                Code::LeaseUnknown,
                "a lease without a key: {value}"
            );
        }
        let bare = identify(&headers(&[("x-lease-id", A.into())]), None).unwrap();
        let refusal = check_tags(&bare, Credentials::Token, Some(&key)).unwrap_err();
        assert_eq!(refusal.code, Code::LeaseMissing);
        assert!(
            refusal.detail.contains("token is required"),
            "{}",
            refusal.detail
        );
        assert!(check_tags(&bare, Credentials::Id, Some(&key)).is_ok());
        // A wrong tag is refused in id mode too: a tag that is there is always checked.
        let forged = identify(
            &headers(&[("x-lease-id", format!("{A}.AAAAAAAAAAAAAAAAAAAAAA"))]),
            None,
        )
        .unwrap();
        for mode in [Credentials::Token, Credentials::Id] {
            assert_eq!(
                check_tags(&forged, mode, Some(&key)).unwrap_err().code,
                Code::LeaseUnknown
            );
        }
        // A bare id next to a valid token still fails in token mode.
        let mixed = identify(
            &headers(&[
                ("x-lease-id", A.into()),
                ("proxy-authorization", format!("Bearer {token}")),
            ]),
            None,
        )
        .unwrap();
        assert_eq!(
            check_tags(&mixed, Credentials::Token, Some(&key))
                .unwrap_err()
                .code,
            Code::LeaseMissing
        );
        // The per-lease port needs no credential.
        let port = identify(&HeaderMap::new(), Some(A)).unwrap();
        assert!(check_tags(&port, Credentials::Token, None).is_ok());
        // A tag after a malformed id is still a malformed id.
        assert_eq!(
            code(identify(
                &headers(&[("x-lease-id", format!("{}x.x", &A[..35]))]),
                None
            )),
            Code::LeaseUnknown
        );
        // An id in upper case is the same lease, its tag still checked.
        let upper = identify(
            &headers(&[("x-lease-id", format!("{}.x", A.to_uppercase()))]),
            None,
        )
        .unwrap();
        assert_eq!(upper.lease_id, A);
        assert_eq!(upper.tags, [Some("x".to_owned())]);
    }

    #[test]
    fn a_lease_port_asks_for_the_token_only_when_told_to() {
        let key = Key::generate();
        let token = token::mint(&key, A);
        let check = |headers: &HeaderMap, on_port, credentials| {
            let identity = identify(headers, Some(A))?;
            check_tags(
                &identity,
                required(&identity, credentials, on_port)?,
                Some(&key),
            )
        };
        let nothing = HeaderMap::new();
        let bare = headers(&[("x-lease-id", A.into())]);
        let tokened = headers(&[("proxy-authorization", basic(&format!("agent:{token}")))]);
        for credentials in [Credentials::Id, Credentials::Token] {
            assert!(check(&nothing, LeasePortCredentials::None, credentials).is_ok());
            let missing = check(&nothing, LeasePortCredentials::Token, credentials).unwrap_err();
            assert_eq!(missing.code, Code::LeaseMissing);
            assert!(
                missing.detail.contains("lease port requires"),
                "{}",
                missing.detail
            );
            assert_eq!(
                check(&bare, LeasePortCredentials::Token, credentials)
                    .unwrap_err()
                    .code,
                Code::LeaseMissing,
                "a bare id is not a token"
            );
            assert!(check(&tokened, LeasePortCredentials::Token, credentials).is_ok());
        }
        // On the shared listener the port setting changes nothing.
        let shared = identify(&bare, None).unwrap();
        assert_eq!(
            required(&shared, Credentials::Id, LeasePortCredentials::Token).unwrap(),
            Credentials::Id
        );
        // Another lease's token on the port is still a conflict, before any check.
        let other = headers(&[("x-lease-id", token::mint(&key, B))]);
        assert_eq!(code(identify(&other, Some(A))), Code::LeaseConflict);
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
        let upper = format!("Bearer {}", A.to_uppercase());
        let named = identify(&headers(&[("proxy-authorization", upper)]), None).unwrap();
        assert_eq!(named.lease_id, A);
    }
}
