//! What the admin API answers to from a browser: a request must name the admin API itself in
//! its `Host` (a DNS-rebinding page names its own domain), and a request that changes state
//! must be JSON (a page cannot send that cross-origin without a preflight, which gets no CORS
//! answer) from the admin API's own origin.
//!
//! Invariant: a `Host` is accepted only when it is `localhost`, an address of the listener
//! (any IP literal for a wildcard bind; any loopback literal for a loopback bind) or a name
//! given with `--admin-host`; its port is not compared (a browser sends the port it dialed,
//! which a port mapping may change, so the port says nothing about who wrote the page). A
//! write is accepted only with `Content-Type: application/json`, no cross-site or same-site
//! `Sec-Fetch-Site`, and an `Origin`, when present, naming the request's own `Host`.

use http::{header, HeaderMap, Method, StatusCode};
use std::net::{IpAddr, SocketAddr};

/// The `Host` values the admin API answers to.
#[derive(Debug, Clone)]
pub struct AdminHosts {
    /// The admin listener's address.
    bound: SocketAddr,
    /// `--admin-host` names, lower-case, without a trailing dot.
    names: Vec<String>,
}

/// Why a request was refused, as the status and message it gets.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub message: String,
}

impl Refused {
    fn new(status: StatusCode, message: impl Into<String>) -> Refused {
        Refused {
            status,
            message: message.into(),
        }
    }
}

/// A host as compared: lower-case, without a trailing dot.
fn normalized(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// A `host[:port]` authority split, or `None` if it is not one (userinfo, no host, a bad port,
/// brackets around anything but an IPv6 address). An IPv6 host comes without its brackets.
fn split_authority(text: &str) -> Option<(String, Option<u16>)> {
    let authority: http::uri::Authority = text.parse().ok()?;
    if authority.as_str().contains('@') || authority.host().is_empty() {
        return None;
    }
    let host = match authority.host().strip_prefix('[') {
        Some(inner) => {
            let ip = inner
                .strip_suffix(']')?
                .parse::<std::net::Ipv6Addr>()
                .ok()?;
            ip.to_string()
        }
        None => normalized(authority.host()),
    };
    let port = match &authority.as_str()[authority.host().len()..] {
        "" => None,
        rest => Some(rest.strip_prefix(':')?.parse::<u16>().ok()?),
    };
    Some((host, port))
}

impl AdminHosts {
    pub fn new(bound: SocketAddr, names: &[String]) -> AdminHosts {
        AdminHosts {
            bound,
            names: names.iter().map(|n| normalized(n)).collect(),
        }
    }

    /// The admin listener's address.
    pub fn bound(&self) -> SocketAddr {
        self.bound
    }

    /// Whether `host` (no port) names this admin API.
    fn is_own(&self, host: &str) -> bool {
        if host == "localhost" || self.names.iter().any(|n| n == host) {
            return true;
        }
        let Ok(ip) = host.parse::<IpAddr>() else {
            return false;
        };
        let bound = self.bound.ip();
        bound.is_unspecified() || ip == bound || (bound.is_loopback() && ip.is_loopback())
    }

    /// Checks the request's `Host` (and an absolute-form target's authority): every one given
    /// must name this admin API, and there must be one.
    pub fn check(&self, uri: &http::Uri, headers: &HeaderMap) -> Result<(), Refused> {
        let given: Vec<String> = uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .into_iter()
            .chain(
                headers
                    .get_all(header::HOST)
                    .iter()
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            )
            .collect();
        if given.is_empty() {
            return Err(Refused::new(
                StatusCode::BAD_REQUEST,
                "the request has no Host header",
            ));
        }
        for host in given {
            let own = split_authority(&host).is_some_and(|(name, _)| self.is_own(&name));
            if !own {
                return Err(Refused::new(
                    StatusCode::MISDIRECTED_REQUEST,
                    format!(
                        "Host {host:?} is not this admin API (it answers to localhost, its \
                         address {} and the names given with --admin-host)",
                        self.bound.ip()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Whether `method` only reads.
fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Checks a request that changes state (any method but GET, HEAD and OPTIONS): JSON, from the
/// admin API's own origin. Reads pass.
pub fn check_write(method: &Method, headers: &HeaderMap) -> Result<(), Refused> {
    if is_safe(method) {
        return Ok(());
    }
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"));
    if !is_json {
        return Err(Refused::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("{method} needs Content-Type: application/json"),
        ));
    }
    for site in headers.get_all("sec-fetch-site") {
        let site = site.to_str().unwrap_or("");
        if !matches!(site, "same-origin" | "none") {
            return Err(Refused::new(
                StatusCode::FORBIDDEN,
                format!("{method} from another site (Sec-Fetch-Site: {site}) is refused"),
            ));
        }
    }
    for origin in headers.get_all(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
        if !host.is_some_and(|host| is_same_origin(origin, host)) {
            return Err(Refused::new(
                StatusCode::FORBIDDEN,
                format!("{method} from origin {origin:?} is refused: only the admin API's own page may change state"),
            ));
        }
    }
    Ok(())
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a page served under `host`
/// (the request's `Host`). `null` is no origin.
fn is_same_origin(origin: &str, host: &str) -> bool {
    let Ok(url) = url::Url::parse(origin) else {
        return false;
    };
    // A browser sends the origin serialized (`scheme://host[:port]`); what only a lenient
    // parse reads as one (`http:host`, `http:/host`) is not an origin.
    let scheme = url.scheme().len();
    let serialized = origin
        .get(..scheme)
        .is_some_and(|s| s.eq_ignore_ascii_case(url.scheme()))
        && origin[scheme..].starts_with("://");
    if !serialized {
        return false;
    }
    let default = match url.scheme() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    let origin_host = match url.host() {
        Some(url::Host::Ipv6(ip)) => ip.to_string(),
        Some(url::Host::Ipv4(ip)) => ip.to_string(),
        Some(url::Host::Domain(name)) => normalized(name),
        None => return false,
    };
    let Some((host, port)) = split_authority(host) else {
        return false;
    };
    origin_host == host && url.port().unwrap_or(default) == port.unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        map
    }

    fn host_ok(bound: &str, names: &[&str], host: &str) -> bool {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        AdminHosts::new(bound.parse().unwrap(), &names)
            .check(&"/leases".parse().unwrap(), &headers(&[("host", host)]))
            .is_ok()
    }

    #[test]
    fn a_loopback_bind_answers_to_loopback_and_localhost_only() {
        let bound = "127.0.0.1:3129";
        for host in [
            "127.0.0.1:3129",
            "127.0.0.1",
            "localhost:3129",
            "LOCALHOST.",
            "[::1]:3129",
            "127.0.0.2:8080",
        ] {
            assert!(host_ok(bound, &[], host), "{host}");
        }
        for host in [
            "evil.example:3129",
            "evil.example",
            "localhost.evil.example",
            "10.0.0.1:3129",
            "user@127.0.0.1:3129",
            "",
            "127.0.0.1:notaport",
            // Forms that broke other proxies' host checks: brackets around a name or an IPv4
            // address, userinfo either way, a fragment, a path, a backslash.
            "[localhost]",
            "[localhost]:3129",
            "[127.0.0.1]:3129",
            "localhost@evil.example",
            "evil.example@localhost",
            "localhost#@evil.example",
            "localhost/evil",
            "localhost\\evil",
            "localhost\\@evil.example",
            "127.0.0.1:3129\\evil",
            "local]host",
            "[::1",
        ] {
            assert!(!host_ok(bound, &[], host), "{host}");
        }
        assert!(host_ok(bound, &[], "[0:0:0:0:0:0:0:1]:3129"));
        assert!(host_ok(bound, &["Admin.Corp."], "admin.corp:443"));
        assert!(!host_ok(bound, &["admin.corp"], "other.corp"));
    }

    #[test]
    fn a_wildcard_bind_answers_to_any_address_but_names_only_when_given() {
        for bound in ["0.0.0.0:3129", "[::]:3129"] {
            assert!(host_ok(bound, &[], "10.1.2.3:3129"), "{bound}");
            assert!(host_ok(bound, &[], "[fd00::1]:3129"), "{bound}");
            assert!(!host_ok(bound, &[], "leasegate.svc:3129"), "{bound}");
            assert!(host_ok(bound, &["leasegate.svc"], "leasegate.svc:3129"));
        }
        assert!(host_ok("10.1.2.3:3129", &[], "10.1.2.3:3129"));
        assert!(!host_ok("10.1.2.3:3129", &[], "10.1.2.4:3129"));
        assert!(!host_ok("10.1.2.3:3129", &[], "127.0.0.1:3129"));
    }

    #[test]
    fn no_host_or_a_second_wrong_one_is_refused() {
        let hosts = AdminHosts::new("127.0.0.1:3129".parse().unwrap(), &[]);
        let refused = hosts
            .check(&"/".parse().unwrap(), &HeaderMap::new())
            .unwrap_err();
        assert_eq!(refused.status, StatusCode::BAD_REQUEST);
        let two = headers(&[("host", "127.0.0.1:3129"), ("host", "evil.example")]);
        let refused = hosts.check(&"/".parse().unwrap(), &two).unwrap_err();
        assert_eq!(refused.status, StatusCode::MISDIRECTED_REQUEST);
        let absolute: http::Uri = "http://evil.example/leases".parse().unwrap();
        let one = headers(&[("host", "127.0.0.1:3129")]);
        assert!(hosts.check(&absolute, &one).is_err());
    }

    #[test]
    fn a_write_must_be_json_from_its_own_origin() {
        let post = Method::POST;
        let json = ("content-type", "application/json; charset=utf-8");
        let host = ("host", "127.0.0.1:3129");
        assert_eq!(check_write(&Method::GET, &headers(&[])), Ok(()));
        assert_eq!(check_write(&post, &headers(&[host, json])), Ok(()));
        for content_type in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let refused =
                check_write(&post, &headers(&[host, ("content-type", content_type)])).unwrap_err();
            assert_eq!(refused.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        }
        assert_eq!(
            check_write(&post, &headers(&[host])).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
        for site in ["cross-site", "same-site", "bogus"] {
            let refused =
                check_write(&post, &headers(&[host, json, ("sec-fetch-site", site)])).unwrap_err();
            assert_eq!(refused.status, StatusCode::FORBIDDEN, "{site}");
        }
        let twice = [
            host,
            json,
            ("sec-fetch-site", "same-origin"),
            ("sec-fetch-site", "cross-site"),
        ];
        assert_eq!(
            check_write(&post, &headers(&twice)).unwrap_err().status,
            StatusCode::FORBIDDEN,
            "every value counts"
        );
        for site in ["same-origin", "none"] {
            assert_eq!(
                check_write(&post, &headers(&[host, json, ("sec-fetch-site", site)])),
                Ok(())
            );
        }
        for origin in ["http://127.0.0.1:3129", "HTTP://127.0.0.1:3129"] {
            assert_eq!(
                check_write(&post, &headers(&[host, json, ("origin", origin)])),
                Ok(()),
                "{origin}"
            );
        }
        for origin in [
            "http://127.0.0.2:3129",
            "http://127.0.0.1:8080",
            "http://127.0.0.1",
            "https://127.0.0.1:3129.evil.example",
            "null",
            "",
        ] {
            let refused =
                check_write(&post, &headers(&[host, json, ("origin", origin)])).unwrap_err();
            assert_eq!(refused.status, StatusCode::FORBIDDEN, "{origin}");
        }
        // Default ports: `Host: admin.corp` is the origin http://admin.corp(:80).
        let named = ("host", "admin.corp");
        assert_eq!(
            check_write(
                &post,
                &headers(&[named, json, ("origin", "http://admin.corp:80")])
            ),
            Ok(())
        );
        assert!(check_write(
            &post,
            &headers(&[named, json, ("origin", "http://admin.corp:81")])
        )
        .is_err());
        // What only a lenient parse takes for an origin is none.
        for origin in ["http:admin.corp", "http:/admin.corp", "http:\\\\admin.corp"] {
            let sent = headers(&[named, json, ("origin", origin)]);
            assert!(check_write(&post, &sent).is_err(), "{origin}");
        }
    }
}
