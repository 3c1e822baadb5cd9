//! Target normalisation: one canonical spelling of host and port for every later step.
//!
//! Invariant: a [`Target`] host is lower-case ASCII (IDNA A-labels) without a trailing dot, or
//! an IP address (IPv4-mapped IPv6 folded to IPv4); anything ambiguous (userinfo,
//! percent-escapes, whitespace, control characters, zone ids, empty host, port 0 or out of
//! range) is refused rather than guessed. Host parsing is the `url` crate's (WHATWG: IDNA /
//! UTS 46, and every IPv4 spelling such as `127.1`, `0x7f.0.0.1`, `2130706433`, `0177.0.0.1`).

use std::fmt;
use std::net::IpAddr;

/// A normalised host.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum TargetHost {
    Name(String),
    Ip(IpAddr),
}

impl TargetHost {
    /// The host as patterns and logs spell it (IPv6 without brackets).
    pub fn as_text(&self) -> String {
        match self {
            TargetHost::Name(n) => n.clone(),
            TargetHost::Ip(ip) => ip.to_string(),
        }
    }

    /// [`TargetHost::as_text`], keeping a name's own `String`.
    pub fn into_text(self) -> String {
        match self {
            TargetHost::Name(n) => n,
            TargetHost::Ip(ip) => ip.to_string(),
        }
    }
}

impl fmt::Display for TargetHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetHost::Name(n) => f.write_str(n),
            TargetHost::Ip(ip) => write!(f, "{ip}"),
        }
    }
}

/// Host and port the client asked for, normalised.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub host: TargetHost,
    pub port: u16,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            TargetHost::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            host => write!(f, "{host}:{}", self.port),
        }
    }
}

/// Why a target is refused as `bad-target`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TargetError {
    #[error("empty host")]
    EmptyHost,
    #[error("whitespace or control character in target")]
    Whitespace,
    #[error("percent-escape or zone id in target")]
    PercentOrZone,
    #[error("userinfo in target")]
    Userinfo,
    #[error("target has no port")]
    NoPort,
    #[error("unclosed '['")]
    UnclosedBracket,
    #[error("junk after ']'")]
    JunkAfterBracket,
    #[error("IPv6 address without brackets")]
    UnbracketedIpv6,
    #[error("port out of range")]
    BadPort,
    #[error("more than one trailing dot")]
    TrailingDots,
    #[error("unparseable host")]
    Unparseable,
    #[error("host is not a DNS name")]
    NotDnsName,
}

/// Normalises an authority (`host`, `host:port`, `[v6]:port`). `default_port` applies when
/// the authority has none; without one a missing port is an error.
pub fn parse_authority(authority: &str, default_port: Option<u16>) -> Result<Target, TargetError> {
    if authority.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    if authority.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(TargetError::Whitespace);
    }
    if authority.contains('%') {
        return Err(TargetError::PercentOrZone);
    }
    if authority.contains('@') {
        return Err(TargetError::Userinfo);
    }
    let (host, port) = split_port(authority)?;
    let port = match port {
        Some(text) => parse_port(text)?,
        None => default_port.ok_or(TargetError::NoPort)?,
    };
    Ok(Target {
        host: parse_host(host)?,
        port,
    })
}

fn split_port(authority: &str) -> Result<(&str, Option<&str>), TargetError> {
    if let Some(rest) = authority.strip_prefix('[') {
        let (inner, after) = rest.split_once(']').ok_or(TargetError::UnclosedBracket)?;
        if inner.is_empty() {
            return Err(TargetError::EmptyHost);
        }
        return match after {
            "" => Ok((&authority[..inner.len() + 2], None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((&authority[..inner.len() + 2], Some(port))),
                None => Err(TargetError::JunkAfterBracket),
            },
        };
    }
    match authority.split_once(':') {
        Some((_, port)) if port.contains(':') => Err(TargetError::UnbracketedIpv6),
        Some((host, port)) => Ok((host, Some(port))),
        None => Ok((authority, None)),
    }
}

fn parse_port(text: &str) -> Result<u16, TargetError> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) || text.len() > 5 {
        return Err(TargetError::BadPort);
    }
    match text.parse::<u32>() {
        Ok(port @ 1..=65535) => Ok(port as u16),
        _ => Err(TargetError::BadPort),
    }
}

/// Normalises a host without port (brackets required around IPv6).
pub fn parse_host(host: &str) -> Result<TargetHost, TargetError> {
    let host = host.strip_suffix('.').unwrap_or(host);
    if host.is_empty() {
        return Err(TargetError::EmptyHost);
    }
    if host.ends_with('.') {
        return Err(TargetError::TrailingDots);
    }
    let parsed = url::Host::parse(host).map_err(|_| TargetError::Unparseable)?;
    Ok(match parsed {
        url::Host::Ipv4(ip) => TargetHost::Ip(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => TargetHost::Ip(match ip.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(ip),
        }),
        url::Host::Domain(name) => {
            let name = name.strip_suffix('.').unwrap_or(&name).to_owned();
            if !is_dns_name(&name) {
                return Err(TargetError::NotDnsName);
            }
            TargetHost::Name(name)
        }
    })
}

/// Letters, digits, `-` and `_` in labels of 1 to 63, at most 253 in all.
fn is_dns_name(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(authority: &str) -> String {
        parse_authority(authority, Some(80)).unwrap().to_string()
    }

    fn bad(authority: &str) -> TargetError {
        parse_authority(authority, Some(80)).unwrap_err()
    }

    #[test]
    fn one_spelling_per_host() {
        assert_eq!(ok("Example.COM."), "example.com:80");
        assert_eq!(ok("example.com:8443"), "example.com:8443");
        assert_eq!(ok("bücher.example"), "xn--bcher-kva.example:80");
        assert_eq!(ok("xn--bcher-kva.example"), "xn--bcher-kva.example:80");
    }

    #[test]
    fn every_ipv4_spelling_is_a_dotted_quad() {
        for spelling in [
            "127.1",
            "2130706433",
            "0x7f.0.0.1",
            "0177.0.0.1",
            "127.0.0.1.",
            "[::ffff:127.0.0.1]",
        ] {
            assert_eq!(ok(spelling), "127.0.0.1:80", "{spelling}");
        }
    }

    #[test]
    fn ipv6_is_canonical_and_bracketed_in_display() {
        assert_eq!(ok("[0:0:0:0:0:0:0:1]:443"), "[::1]:443");
        assert_eq!(ok("[64:FF9B::A9FE:A9FE]"), "[64:ff9b::a9fe:a9fe]:80");
        assert_eq!(bad("::1"), TargetError::UnbracketedIpv6);
    }

    #[test]
    fn ambiguous_targets_are_refused() {
        assert_eq!(bad("allowed.example@evil.example"), TargetError::Userinfo);
        assert_eq!(bad("%61llowed.example"), TargetError::PercentOrZone);
        assert_eq!(bad("[fe80::1%25eth0]"), TargetError::PercentOrZone);
        assert_eq!(bad("[denied.example]"), TargetError::Unparseable);
        assert_eq!(bad("a b.example"), TargetError::Whitespace);
        assert_eq!(bad("a\tb"), TargetError::Whitespace);
        assert_eq!(bad(""), TargetError::EmptyHost);
        assert_eq!(bad(":80"), TargetError::EmptyHost);
        assert_eq!(bad("example.com:0"), TargetError::BadPort);
        assert_eq!(bad("example.com:65536"), TargetError::BadPort);
        assert_eq!(bad("example.com:+80"), TargetError::BadPort);
        assert_eq!(bad("example.com.."), TargetError::TrailingDots);
        assert_eq!(bad("*.example.com"), TargetError::NotDnsName);
        assert!(parse_authority("example.com", None).is_err());
    }
}
