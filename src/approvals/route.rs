//! Routes a lease's `approvals` names: `METHOD:host/path` (`POST:api.example.com/v1/charges`)
//! holds every request of that method to that host whose path is the named one or under it.
//!
//! Invariant: pure (no I/O, no clock), and never narrower than an origin may read a path: the
//! request's path is compared as the origin resolves it ([`crate::policy::path::normalise`]),
//! then with empty segments dropped (origins that merge `//`), `;` parameters cut (servlet
//! containers), `%3A` read as `:`, and letters of any case taken as one; a path whose reading
//! origins disagree on is never taken as outside a route — the caller refuses it. An entry
//! that is not `METHOD:` (upper-case letters and a colon) then a host is not a route, and an
//! MCP server may not be named so ([`is_route_shaped`]).

use crate::contract::Lease;
use crate::policy::path::Ambiguous;
use std::sync::Arc;

/// One route of an `approvals` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route<'a> {
    pub method: &'a str,
    /// Lower-cased.
    pub host: String,
    /// The path's segments, compared as [`segments`] reads a request's.
    pub segments: Vec<String>,
}

/// Whether `name` starts as a route does (`METHOD:`): such a name is not an MCP server's.
pub fn is_route_shaped(name: &str) -> bool {
    name.split_once(':').is_some_and(|(method, _)| {
        !method.is_empty() && method.bytes().all(|b| b.is_ascii_uppercase())
    })
}

/// `entry` as a route, or `None` when it names something else (an MCP tool).
pub fn parse(entry: &str) -> Option<Route<'_>> {
    if !is_route_shaped(entry) {
        return None;
    }
    let (method, rest) = entry.split_once(':')?;
    let (host, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, "/"),
    };
    if host.is_empty() {
        return None;
    }
    Some(Route {
        method,
        host: host.to_ascii_lowercase(),
        // `..` in an entry: taken as a literal segment, which only ever holds more.
        segments: segments(path),
    })
}

/// A path's segments as a route compares them: empty ones dropped, each cut at its first `;`,
/// `%3A` read as `:`, lower-cased.
pub fn segments(path: &str) -> Vec<String> {
    path.split('/')
        .map(|s| s.split(';').next().unwrap_or_default())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.replace("%3A", ":")
                .replace("%3a", ":")
                .to_ascii_lowercase()
        })
        .collect()
}

impl Route<'_> {
    /// Whether a request of `method` to `host` at `path` (segments read by [`segments`]) is
    /// this route's.
    pub fn takes(&self, method: &str, host: &str, path: &[String]) -> bool {
        self.method.eq_ignore_ascii_case(method)
            && self.host.eq_ignore_ascii_case(host)
            && path.starts_with(&self.segments)
    }
}

/// The routes every lease of `chain` names in `approvals`, with the lease naming each.
fn routes(chain: &[Arc<Lease>]) -> impl Iterator<Item = (&Lease, &str, Route<'_>)> {
    chain.iter().flat_map(|lease| {
        let approvals = lease.terms.as_deref().map_or(&[][..], |t| &t.approvals[..]);
        approvals
            .iter()
            .filter_map(move |entry| parse(entry).map(|route| (&**lease, entry.as_str(), route)))
    })
}

/// Whether some lease of `chain` names a route of `host`: a tunnel there must be read.
pub fn names_host(chain: &[Arc<Lease>], host: &str) -> bool {
    routes(chain).any(|(_, _, route)| route.host.eq_ignore_ascii_case(host))
}

/// The route a request must wait for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    /// The lease whose `approvals` names it.
    pub lease_id: String,
    /// The entry, as the lease spells it.
    pub entry: String,
}

/// The first route of `chain` that takes a request of `method` to `host` whose path resolves
/// to `normal`; `Err` when the chain names a route of this method and host and the path is
/// one origins read differently (the request is refused: it cannot be told outside).
pub fn named(
    chain: &[Arc<Lease>],
    method: &str,
    host: &str,
    normal: Result<&str, Ambiguous>,
) -> Result<Option<Named>, Ambiguous> {
    let mut of_host = routes(chain)
        .filter(|(_, _, route)| {
            route.method.eq_ignore_ascii_case(method) && route.host.eq_ignore_ascii_case(host)
        })
        .peekable();
    if of_host.peek().is_none() {
        return Ok(None);
    }
    let path = segments(normal?);
    Ok(of_host
        .find(|(_, _, route)| route.takes(method, host, &path))
        .map(|(lease, entry, _)| Named {
            lease_id: lease.id.clone(),
            entry: entry.to_owned(),
        }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_a_route_only_when_it_starts_with_an_upper_case_method() {
        let route = parse("POST:Api.Example.com/v1/charges").unwrap();
        assert_eq!(route.method, "POST");
        assert_eq!(route.host, "api.example.com");
        assert_eq!(route.segments, ["v1", "charges"]);
        assert_eq!(parse("DELETE:api.example.com").unwrap().segments, [""; 0]);
        for tool in [
            "notes/send_mail",
            "post:api.example.com/x",
            "notes/ns:send",
            ":api.example.com/x",
            "POST:",
            "POST:/x",
            "cdf_send",
        ] {
            assert_eq!(parse(tool), None, "{tool}");
        }
        assert!(is_route_shaped("GET:x"));
        assert!(!is_route_shaped("notes"));
        assert!(!is_route_shaped("my:server"));
    }

    #[test]
    fn a_route_takes_its_path_and_what_is_under_it_however_an_origin_spells_it() {
        let route = parse("POST:api.example.com/v1/charges").unwrap();
        let takes =
            |method: &str, host: &str, path: &str| route.takes(method, host, &segments(path));
        for path in [
            "/v1/charges",
            "/v1/charges/",
            "/v1/charges/ch_1/capture",
            "//v1//charges",
            "/V1/Charges",
            "/v1/charges;jsessionid=1",
            "/v1;x/charges",
        ] {
            assert!(takes("POST", "api.example.com", path), "{path}");
        }
        assert!(takes("post", "API.example.COM", "/v1/charges"));
        for (method, host, path) in [
            ("GET", "api.example.com", "/v1/charges"),
            ("POST", "api.example.com", "/v1/chargesX"),
            ("POST", "api.example.com", "/v1"),
            ("POST", "api.example.com", "/v2/charges"),
            ("POST", "other.example.com", "/v1/charges"),
        ] {
            assert!(!takes(method, host, path), "{method} {host}{path}");
        }
        let colon = parse("PUT:h.test/a:b").unwrap();
        assert!(colon.takes("PUT", "h.test", &segments("/a%3Ab/c")));
        assert!(colon.takes("PUT", "h.test", &segments("/a%3ab")));
    }
}
