//! The admin API's `Host`, `Origin`, `Sec-Fetch-Site` and `Content-Type` checks on arbitrary
//! headers: never panic; an accepted `Host` names localhost, the given name or an IP literal
//! (an address of the bind; brackets around an IPv6 address only); an accepted write is JSON,
//! not cross-site, and its `Origin` (if any) is an http(s) URL.

use http::{header, HeaderMap, HeaderName, HeaderValue, Method};
use leasegate::admin::origin::{check_write, AdminHosts};

const NAME: &str = "admin.test";

/// `[` an IPv6 address `]`, then anything: brackets hold an IPv6 address, never a name.
fn bracketed_v6(host: &str) -> bool {
    host.strip_prefix('[')
        .and_then(|h| h.split_once(']'))
        .is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok())
}

pub fn check(data: &[u8]) {
    // The first byte picks the bind and the method; then one header per line, `name: value`.
    let (pick, rest) = match data.split_first() {
        Some((first, rest)) => (*first, rest),
        None => (0, data),
    };
    let bind = ["127.0.0.1:3129", "0.0.0.0:3129", "10.1.2.3:3129"][usize::from(pick % 3)];
    let method = [Method::GET, Method::POST, Method::DELETE][usize::from(pick / 3 % 3)].clone();
    let mut headers = HeaderMap::new();
    for line in rest.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    let hosts = AdminHosts::new(bind.parse().unwrap(), &[NAME.to_owned()]);
    if hosts.check(&"/leases".parse().unwrap(), &headers).is_ok() {
        let given: Vec<&HeaderValue> = headers.get_all(header::HOST).iter().collect();
        assert!(!given.is_empty());
        for host in given {
            let host = String::from_utf8_lossy(host.as_bytes()).to_ascii_lowercase();
            let address = match bind {
                "127.0.0.1:3129" => host.starts_with("127.") || bracketed_v6(&host),
                "0.0.0.0:3129" => {
                    bracketed_v6(&host) || host.starts_with(|c: char| c.is_ascii_digit())
                }
                _ => host.starts_with("10.1.2.3"),
            };
            let own = host.starts_with("localhost") || host.starts_with(NAME) || address;
            assert!(own, "{host:?} accepted on {bind}");
        }
    }
    if check_write(&method, &headers).is_ok() && method != Method::GET {
        let media = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|m| m.trim().to_ascii_lowercase());
        assert_eq!(media.as_deref(), Some("application/json"));
        for site in headers.get_all("sec-fetch-site") {
            assert!(
                matches!(site.as_bytes(), b"same-origin" | b"none"),
                "{site:?}"
            );
        }
        for origin in headers.get_all(header::ORIGIN) {
            let origin = origin.to_str().unwrap().to_ascii_lowercase();
            assert!(origin.starts_with("http://") || origin.starts_with("https://"));
        }
    }
}
