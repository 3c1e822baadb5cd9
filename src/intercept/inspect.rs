//! The misuse checks of one request an agent sends, and the secrets it gets: exact-byte scans
//! of the request target, the header values and a bounded prefix of the body, then the route
//! rules of the secrets the lease is entitled to for the host.
//!
//! Invariant: pure (no I/O, no clock, no state). The order is fixed: a secret's real value or a
//! canary (`secret-exposed`, `canary-tripped`) → a placeholder of this lease where its secret
//! is not for (`secret-misdirected`) → the route rules (`route-not-allowed`) → what is put in.
//! A refusal names a secret by id and a canary by number, never a value or a placeholder.
//! A secret is put in only inside a terminated tunnel, for a lease whose manifest names an
//! agent the secret lists, to a host the secret is for (and the decision already allowed).

use super::broker::{is_entitled, is_for};
use crate::contract::{Key, Lease};
use crate::policy::codes::{Code, Refusal};
use crate::policy::path::Ambiguous;
use crate::secrets::{placeholder, Hit, Placement, Secret, SecretSet};

/// How much of a request body the checks read: the first 64 KiB (the rest streams unread).
pub const MAX_BODY_SCAN: usize = 64 * 1024;

/// What the checks see of one request.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    pub method: &'a str,
    /// The path, without the query, as outputs show it
    /// ([`SecretSet::shown_target`]): what a refusal names.
    pub path: &'a str,
    /// The path [`normalise`](crate::policy::path::normalise)d, or why origins would resolve it
    /// differently: what route rules match.
    pub normal: Result<&'a str, Ambiguous>,
    /// The DNS name the request goes to; `None` for an address.
    pub host: Option<&'a str>,
    /// The request target, each header value, the body's first [`MAX_BODY_SCAN`] bytes.
    pub parts: &'a [&'a [u8]],
    /// Inside a terminated tunnel: the proxy may put secrets in. A forwarded plain-HTTP request
    /// is only checked.
    pub terminated: bool,
}

/// Checks `seen` for `lease` (signed with `key`) against `set`; the secrets to put in. The
/// lease's placeholders come from `memo`.
pub fn inspect<'s>(
    set: &'s SecretSet,
    lease: &Lease,
    key: Option<&Key>,
    memo: &placeholder::Memo,
    seen: &Seen<'_>,
) -> Result<Vec<&'s Secret>, Refusal> {
    for part in seen.parts {
        match set.find_exact(part) {
            None => {}
            Some(Hit::Secret { id }) => {
                return Err(Refusal::new(
                    Code::SecretExposed,
                    format!(
                        "the request carries the value of secret {id:?}: an agent never holds \
                         it, the proxy puts it in"
                    ),
                ))
            }
            Some(Hit::Canary { number }) => {
                return Err(Refusal::new(
                    Code::CanaryTripped,
                    format!("the request carries canary #{number}"),
                ))
            }
        }
    }
    let goes_to = |secret: &Secret| -> Result<bool, Refusal> {
        Ok(seen.terminated
            && seen.host.is_some_and(|host| is_for(secret, host))
            && routes_take(secret, seen)?)
    };
    if let Some(key) = key {
        for secret in set.secrets() {
            let stand_in = memo.derive(key, &lease.id, &secret.spec().id);
            let carried = seen
                .parts
                .iter()
                .any(|part| memchr::memmem::find(part, stand_in.as_bytes()).is_some());
            if carried && !(is_entitled(secret, lease) && goes_to(secret)?) {
                return Err(misdirected(secret, lease, seen, &stand_in));
            }
        }
    }
    if !seen.terminated {
        return Ok(Vec::new());
    }
    let Some(host) = seen.host else {
        return Ok(Vec::new());
    };
    let for_host: Vec<&Secret> = set
        .secrets()
        .iter()
        .filter(|secret| is_entitled(secret, lease) && is_for(secret, host))
        .collect();
    let mut taken: Vec<&Secret> = Vec::with_capacity(for_host.len());
    for secret in &for_host {
        if routes_take(secret, seen)? {
            taken.push(secret);
        }
    }
    if taken.is_empty() && !for_host.is_empty() {
        let ids: Vec<&str> = for_host.iter().map(|s| s.spec().id.as_str()).collect();
        return Err(Refusal::new(
            Code::RouteNotAllowed,
            format!(
                "{} {} is outside the routes of secret {} for {host}",
                seen.method,
                seen.path,
                ids.join(", ")
            ),
        ));
    }
    Ok(taken)
}

/// Whether `secret`'s route rules take the request; a secret without route rules takes every
/// request to its hosts. A path origins resolve differently matches no rule for sure: refused.
fn routes_take(secret: &Secret, seen: &Seen<'_>) -> Result<bool, Refusal> {
    let routes = &secret.spec().routes;
    if routes.is_empty() {
        return Ok(true);
    }
    match seen.normal {
        Ok(normal) => Ok(routes.iter().any(|r| r.matches(seen.method, normal))),
        Err(why) => Err(Refusal::new(
            Code::PathAmbiguous,
            format!(
                "{} {}: the routes of secret {:?} cannot be matched against this path, as {why}",
                seen.method,
                seen.path,
                secret.spec().id
            ),
        )),
    }
}

fn misdirected(secret: &Secret, lease: &Lease, seen: &Seen<'_>, stand_in: &str) -> Refusal {
    let id = &secret.spec().id;
    let host = seen.host.unwrap_or("an address");
    // The placeholder may be in the path itself: the refusal never repeats it (the path is
    // shown redacted already; this holds even where it was not).
    let path = seen
        .path
        .replace(stand_in, crate::secrets::redact::REDACTED);
    let place = match seen.terminated {
        true => format!("{} {host}{path}", seen.method),
        false => format!("{} http://{host}{path} (plain HTTP)", seen.method),
    };
    Refusal::new(
        Code::SecretMisdirected,
        format!(
            "the request carries lease {}'s placeholder for secret {id:?}, which is not for {place}",
            lease.id
        ),
    )
}

/// Puts `secret` into the request: its header set (replacing every value the agent sent, a
/// placeholder included; marked sensitive so HTTP/2 never indexes it), or its query parameter
/// set in place of any the agent sent.
pub fn put_in(parts: &mut http::request::Parts, secret: &Secret) -> Result<(), Refusal> {
    let rendered = secret.rendered();
    let unusable = |why: &str| {
        Refusal::new(
            Code::UpstreamUnreachable,
            format!("secret {:?} cannot be put in: {why}", secret.spec().id),
        )
    };
    match &secret.spec().placement {
        Placement::Header(name) => {
            let mut value = http::HeaderValue::from_str(&rendered)
                .map_err(|_| unusable("its value is not a valid header value"))?;
            value.set_sensitive(true);
            parts.headers.insert(name.clone(), value);
        }
        Placement::Query(param) => {
            let query = parts.uri.query().unwrap_or("");
            let mut rebuilt = url::form_urlencoded::Serializer::new(String::new());
            for (name, value) in url::form_urlencoded::parse(query.as_bytes()) {
                if name != param.as_str() {
                    rebuilt.append_pair(&name, &value);
                }
            }
            rebuilt.append_pair(param, &rendered);
            let target = format!("{}?{}", parts.uri.path(), rebuilt.finish());
            let mut uri = http::uri::Parts::from(parts.uri.clone());
            uri.path_and_query = Some(
                target
                    .parse()
                    .map_err(|_| unusable("the request target would not parse"))?,
            );
            parts.uri = http::Uri::from_parts(uri)
                .map_err(|_| unusable("the request target would not parse"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Timestamp;
    use crate::secrets::placeholder::Memo;
    use std::sync::Arc;

    const VALUE: &str = "value-of-the-github-secret";
    const CANARY: &str = "canary-never-to-be-sent";

    fn set() -> Arc<SecretSet> {
        SecretSet::for_tests(
            &format!(
                r#"canaries = ["{CANARY}"]

[[secret]]
id = "github"
hosts = ["api.github.test"]
header = "Authorization"
format = "Bearer {{value}}"
env = "V"
routes = [{{ method = "GET", path = "/repos/**" }}]
agents = ["coder"]
env_name = "GITHUB_TOKEN"
"#
            ),
            VALUE,
        )
    }

    fn lease(agent: &str) -> Lease {
        Lease {
            id: "lease-1".into(),
            parent: None,
            issued_at: Timestamp::from_millis(0),
            expires_at: Timestamp::from_millis(1),
            agent_name: agent.into(),
            allow_hosts: vec![],
            deny_hosts: vec![],
            key_fingerprint: Arc::from("k"),
            budget: None,
            terms: None,
        }
    }

    fn seen<'a>(method: &'a str, path: &'a str, host: &'a str, parts: &'a [&'a [u8]]) -> Seen<'a> {
        Seen {
            method,
            path,
            // Leaked: a test's paths live as long as it does.
            normal: crate::policy::path::normalise(path).map(|n| &*Box::leak(n.into_boxed_str())),
            host: Some(host),
            parts,
            terminated: true,
        }
    }

    fn code(result: Result<Vec<&Secret>, Refusal>) -> Option<Code> {
        result.err().map(|r| r.code)
    }

    #[test]
    fn an_entitled_request_on_a_route_gets_the_secret() {
        let (set, key, lease) = (set(), Key::generate(), lease("coder"));
        let stand_in = placeholder::derive(&key, &lease.id, "github");
        let header = format!("Bearer {stand_in}");
        let parts: [&[u8]; 2] = [b"/repos/a/b", header.as_bytes()];
        let given = inspect(
            &set,
            &lease,
            Some(&key),
            &Memo::default(),
            &seen("GET", "/repos/a/b", "api.github.test", &parts),
        )
        .unwrap();
        assert_eq!(given.len(), 1);
        assert_eq!(given[0].spec().id, "github");
        // Another agent's lease: nothing put in, and its own placeholder is not for it.
        let other = lease_named("someone");
        let given = inspect(
            &set,
            &other,
            Some(&key),
            &Memo::default(),
            &seen("GET", "/repos/a/b", "api.github.test", &[b"/"]),
        )
        .unwrap();
        assert!(given.is_empty());
    }

    fn lease_named(agent: &str) -> Lease {
        lease(agent)
    }

    #[test]
    fn misuse_is_found_in_any_part_and_named_without_the_bytes() {
        let (set, key, lease) = (set(), Key::generate(), lease("coder"));
        let stand_in = placeholder::derive(&key, &lease.id, "github");
        let cases: [(&str, &str, &str, Vec<u8>, Code); 5] = [
            (
                "GET",
                "/repos/x",
                "api.github.test",
                format!("x{VALUE}y").into_bytes(),
                Code::SecretExposed,
            ),
            (
                "GET",
                "/repos/x",
                "api.github.test",
                CANARY.as_bytes().to_vec(),
                Code::CanaryTripped,
            ),
            // Its placeholder to another host, and to another route of its host.
            (
                "GET",
                "/",
                "evil.test",
                stand_in.clone().into_bytes(),
                Code::SecretMisdirected,
            ),
            (
                "POST",
                "/repos/x",
                "api.github.test",
                stand_in.clone().into_bytes(),
                Code::SecretMisdirected,
            ),
            // No placeholder, outside the routes.
            (
                "DELETE",
                "/user",
                "api.github.test",
                b"nothing".to_vec(),
                Code::RouteNotAllowed,
            ),
        ];
        for (method, path, host, part, want) in cases {
            let parts: [&[u8]; 1] = [&part];
            let refused = inspect(
                &set,
                &lease,
                Some(&key),
                &Memo::default(),
                &seen(method, path, host, &parts),
            )
            .unwrap_err();
            assert_eq!(refused.code, want, "{method} {host}{path}");
            for secret in [VALUE, CANARY, stand_in.as_str()] {
                assert!(!refused.detail.contains(secret), "{}", refused.detail);
            }
        }
        // Plain HTTP to the secret's own host: the placeholder is misdirected too.
        let parts: [&[u8]; 1] = [stand_in.as_bytes()];
        let plain = Seen {
            terminated: false,
            ..seen("GET", "/repos/x", "api.github.test", &parts)
        };
        assert_eq!(
            code(inspect(&set, &lease, Some(&key), &Memo::default(), &plain)),
            Some(Code::SecretMisdirected)
        );
        // A placeholder made with another key (another lease's, or a guess) is not this lease's.
        let foreign = placeholder::derive(&Key::generate(), &lease.id, "github");
        let parts: [&[u8]; 1] = [foreign.as_bytes()];
        assert_eq!(
            code(inspect(
                &set,
                &lease,
                Some(&key),
                &Memo::default(),
                &seen("GET", "/", "evil.test", &parts)
            )),
            None
        );
    }

    #[test]
    fn a_placeholder_in_the_path_is_not_repeated_by_the_refusal() {
        let (set, key, lease) = (set(), Key::generate(), lease("coder"));
        let stand_in = placeholder::derive(&key, &lease.id, "github");
        let path = format!("/gists/{stand_in}");
        let parts: [&[u8]; 1] = [path.as_bytes()];
        for terminated in [true, false] {
            let seen = Seen {
                terminated,
                ..seen("GET", &path, "api.github.test", &parts)
            };
            let refused = inspect(&set, &lease, Some(&key), &Memo::default(), &seen).unwrap_err();
            assert_eq!(refused.code, Code::SecretMisdirected);
            assert!(!refused.detail.contains(&stand_in), "{}", refused.detail);
            assert!(
                refused.detail.contains("/gists/[redacted]"),
                "{}",
                refused.detail
            );
        }
    }

    #[test]
    fn a_query_secret_replaces_what_the_agent_sent() {
        let set = SecretSet::for_tests("[[secret]]\nid = \"search\"\nhosts = [\"s.test\"]\nquery = \"key\"\nenv = \"V\"\nagents = [\"coder\"]\nenv_name = \"SEARCH_KEY\"\n", "a+b&c=d/value");
        let (mut parts, ()) = http::Request::get("/find?q=x&key=lgp_search_stand&z=1")
            .body(())
            .unwrap()
            .into_parts();
        put_in(&mut parts, &set.secrets()[0]).unwrap();
        assert_eq!(
            parts.uri.to_string(),
            "/find?q=x&z=1&key=a%2Bb%26c%3Dd%2Fvalue"
        );
    }
}
