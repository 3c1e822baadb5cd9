//! One entry of `allow.hosts` / `deny.hosts`, and containment between entries.
//!
//! Invariant: `*` matches every host; `*.x` matches strict subdomains of `x` at any depth,
//! never `x` itself and never an IP literal; an exact entry matches exactly one host. Any other
//! spelling is not a pattern ([`MalformedPattern`]) and is never read as a wider one.

use super::target::{parse_host, TargetHost};
use std::net::IpAddr;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// `*`
    Any,
    /// `*.suffix`: strict subdomains of `suffix` (a DNS name, never an IP literal).
    Subdomains(String),
    /// An exact DNS name, or an IPv4 literal as a dotted quad.
    Exact(String),
}

/// A spelling that is not a host pattern, and why, in words an operator can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{pattern}': {why}")]
pub struct MalformedPattern {
    /// The pattern as written.
    pub pattern: String,
    pub why: String,
}

const WILDCARD_NEEDS_DOMAIN: &str = "a wildcard needs a domain after '*.', e.g. '*.example.com'";
const WILDCARD_LEADING_LABEL: &str =
    "a wildcard is only a whole leading label: '*' alone, or '*.' and a domain, e.g. '*.example.com'";

impl HostPattern {
    /// Reads a pattern: exactly `*`, `*.` followed by a DNS name, or a DNS name or IPv4
    /// literal (as the lease schema admits them: lower-case letters, digits and `-` in labels;
    /// case is folded and one trailing dot dropped, as in targets). Any other spelling — `*.`,
    /// `*x.com`, a scheme, a port, a path, an IPv6 literal, a wildcard over an IP literal, a
    /// name IDNA refuses — is refused with the reason. Callers that meet a refused pattern in
    /// a signed lease let it match nothing: it never widens to `*`.
    pub fn parse(text: &str) -> Result<HostPattern, MalformedPattern> {
        let malformed = |why: String| MalformedPattern {
            pattern: text.to_owned(),
            why,
        };
        let lower = text.to_ascii_lowercase();
        if lower == "*" {
            return Ok(HostPattern::Any);
        }
        // Before the trailing dot goes: `*.` is a wildcard without its domain, not `*`.
        if lower == "*." || lower.starts_with("*..") {
            return Err(malformed(WILDCARD_NEEDS_DOMAIN.into()));
        }
        let body = lower.strip_suffix('.').unwrap_or(&lower);
        if let Some(why) = shape_problem(body) {
            return Err(malformed(why));
        }
        match body.strip_prefix("*.") {
            Some(suffix) => match host_name(suffix).map_err(malformed)? {
                TargetHost::Name(name) => Ok(HostPattern::Subdomains(name)),
                TargetHost::Ip(_) => Err(malformed(
                    "a wildcard covers the subdomains of a name, never an IP address: list the address itself".into(),
                )),
            },
            None => Ok(HostPattern::Exact(
                host_name(body).map_err(malformed)?.as_text(),
            )),
        }
    }

    /// For `*.x` where `x` is itself a public suffix (`*.com`, `*.co.uk`, `*.github.io`:
    /// every name anyone may register there), `x`. Unknown suffixes (`*.test`) are not.
    pub fn public_suffix_wildcard(&self) -> Option<&str> {
        let HostPattern::Subdomains(domain) = self else {
            return None;
        };
        psl::suffix(domain.as_bytes())
            .is_some_and(|suffix| suffix.is_known() && suffix.as_bytes().len() == domain.len())
            .then_some(domain.as_str())
    }

    /// Whether this pattern matches a normalised host.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Any => true,
            HostPattern::Subdomains(suffix) => is_strict_subdomain(host, suffix),
            HostPattern::Exact(name) => name == host,
        }
    }

    /// Whether every host this pattern matches is matched by `self` too: `*` contains all,
    /// `*.x` contains its strict subdomains and `*.sub.x` (and itself), an exact entry only
    /// itself.
    pub fn contains(&self, other: &HostPattern) -> bool {
        match (self, other) {
            (HostPattern::Any, _) => true,
            (HostPattern::Subdomains(x), HostPattern::Subdomains(y)) => {
                x == y || is_strict_subdomain(y, x)
            }
            (HostPattern::Subdomains(_), HostPattern::Exact(host)) => self.matches(host),
            (HostPattern::Exact(a), HostPattern::Exact(b)) => a == b,
            _ => false,
        }
    }
}

impl std::fmt::Display for HostPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostPattern::Any => f.write_str("*"),
            HostPattern::Subdomains(s) => write!(f, "*.{s}"),
            HostPattern::Exact(s) => f.write_str(s),
        }
    }
}

/// What is wrong with the outer shape of a pattern (lower-cased, one trailing dot dropped):
/// the things people paste from URLs, and stray wildcards.
fn shape_problem(body: &str) -> Option<String> {
    let host_of = |rest: &str| -> String {
        let end = rest.find(['/', ':', '?', '#']).unwrap_or(rest.len());
        rest[..end]
            .rsplit('@')
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    if body.is_empty() {
        return Some("an empty pattern names no host".into());
    }
    if body.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Some("a host has no spaces or control characters".into());
    }
    if let Some((_, rest)) = body.split_once("://") {
        return Some(format!(
            "no scheme: a pattern is a host, not a URL (write '{}')",
            host_of(rest)
        ));
    }
    if body.contains('@') {
        return Some(format!(
            "no user name: a pattern is a host alone (write '{}')",
            host_of(body)
        ));
    }
    if is_cidr(body) {
        return Some(format!(
            "no range: a pattern is one host, not a CIDR range: list the addresses or host names \
             (a private range is opened to leases by serve --allow-private {body})"
        ));
    }
    if body.contains('[') || body.matches(':').count() > 1 {
        return Some(
            "no IPv6 address: the lease schema admits DNS names and IPv4 literals only".into(),
        );
    }
    if body.contains(':') {
        return Some(format!(
            "no port: ports are not part of a pattern (write '{}')",
            host_of(body)
        ));
    }
    if body.contains(['/', '?', '#']) {
        return Some(format!(
            "no path: a pattern is a host alone (write '{}')",
            host_of(body)
        ));
    }
    match body.strip_prefix("*.") {
        Some("") => Some(WILDCARD_NEEDS_DOMAIN.into()),
        Some(rest) if rest.contains('*') => Some(WILDCARD_LEADING_LABEL.into()),
        Some(_) => None,
        None if body.contains('*') => Some(WILDCARD_LEADING_LABEL.into()),
        None => None,
    }
}

/// `ADDR/LEN`: an address range, which people write where a pattern takes one host.
fn is_cidr(body: &str) -> bool {
    body.split_once('/').is_some_and(|(addr, len)| {
        addr.parse::<IpAddr>().is_ok() && !len.is_empty() && len.bytes().all(|b| b.is_ascii_digit())
    })
}

/// A pattern's host part: a DNS name in the schema's alphabet that IDNA accepts as it is
/// (so it is its own normal form), or an IPv4 literal in any spelling targets accept.
fn host_name(text: &str) -> Result<TargetHost, String> {
    if text.split('.').any(str::is_empty) {
        return Err("an empty label: two dots in a row, or a leading dot".into());
    }
    if text.len() > 253 {
        return Err("longer than 253 characters".into());
    }
    if let Some(label) = text.split('.').find(|l| l.len() > 63) {
        return Err(format!("the label '{label}' is longer than 63 characters"));
    }
    if !text
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    {
        return Err(
            "only letters, digits, '-' and '.' (an international name as its A-labels, 'xn--...')"
                .into(),
        );
    }
    if text
        .split('.')
        .any(|label| label.starts_with('-') || label.ends_with('-'))
    {
        return Err("a label starts or ends with '-'".into());
    }
    match parse_host(text) {
        Ok(TargetHost::Ip(IpAddr::V4(ip))) => Ok(TargetHost::Ip(IpAddr::V4(ip))),
        Ok(TargetHost::Name(name)) if name == text => Ok(TargetHost::Name(name)),
        Ok(TargetHost::Name(name)) => Err(format!("not in normal form (write '{name}')")),
        Ok(TargetHost::Ip(ip)) => Err(format!("'{ip}' is not an IPv4 address")),
        Err(_) if text.rsplit('.').next().is_some_and(is_numeric_label) => {
            Err("not a valid IPv4 address (and a name cannot end in a number)".into())
        }
        Err(_) => Err("not a valid host name (IDNA refuses it)".into()),
    }
}

/// A label WHATWG reads as a number (decimal, or `0x` hex), which makes the host an IPv4 try.
fn is_numeric_label(label: &str) -> bool {
    let digits = label
        .strip_prefix("0x")
        .map_or((label, 10), |hex| (hex, 16));
    digits.0.chars().all(|c| c.is_digit(digits.1))
}

/// `host` ends in `.suffix` with at least one label before it, and is not an IP literal.
fn is_strict_subdomain(host: &str, suffix: &str) -> bool {
    host.len() > suffix.len() + 1
        && host.ends_with(suffix)
        && host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
        && host.parse::<IpAddr>().is_err()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> HostPattern {
        HostPattern::parse(s).unwrap()
    }

    fn why(s: &str) -> String {
        HostPattern::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn every_other_spelling_is_refused_in_plain_words() {
        for (text, said) in [
            (
                "*.",
                "'*.': a wildcard needs a domain after '*.', e.g. '*.example.com'",
            ),
            (
                "*..",
                "'*..': a wildcard needs a domain after '*.', e.g. '*.example.com'",
            ),
            (
                "*..x.com",
                "'*..x.com': a wildcard needs a domain after '*.'",
            ),
            (
                "https://x",
                "'https://x': no scheme: a pattern is a host, not a URL (write 'x')",
            ),
            (
                "x:443",
                "'x:443': no port: ports are not part of a pattern (write 'x')",
            ),
            (
                "*x.com",
                "'*x.com': a wildcard is only a whole leading label",
            ),
            (
                "a.*.x.com",
                "'a.*.x.com': a wildcard is only a whole leading label",
            ),
            (
                "*.*.x.com",
                "'*.*.x.com': a wildcard is only a whole leading label",
            ),
            ("**", "'**': a wildcard is only a whole leading label"),
            (
                "x.com/api",
                "'x.com/api': no path: a pattern is a host alone (write 'x.com')",
            ),
            ("user@x.com", "'user@x.com': no user name"),
            ("::1", "'::1': no IPv6 address"),
            ("[::1]", "'[::1]': no IPv6 address"),
            ("", "'': an empty pattern names no host"),
            ("a b.com", "'a b.com': a host has no spaces"),
            ("a..b.com", "'a..b.com': an empty label"),
            (".x.com", "'.x.com': an empty label"),
            ("a_b.com", "'a_b.com': only letters, digits, '-' and '.'"),
            ("bücher.example", "'bücher.example': only letters, digits"),
            ("-x.com", "'-x.com': a label starts or ends with '-'"),
            (
                "*.1.2.3.4",
                "'*.1.2.3.4': a wildcard covers the subdomains of a name, never an IP address",
            ),
            (
                "*.0.0.1",
                "'*.0.0.1': a wildcard covers the subdomains of a name",
            ),
            ("1.2.3.4.5", "'1.2.3.4.5': not a valid IPv4 address"),
            ("256.1.1.1", "'256.1.1.1': not a valid IPv4 address"),
            ("xn--zz.example", "'xn--zz.example': not a valid host name"),
        ] {
            let got = why(text);
            assert!(got.starts_with(said), "{text}: {got}");
        }
        let long_label = "a".repeat(64);
        assert!(why(&format!("{long_label}.com")).contains("longer than 63"));
    }

    /// A CIDR range is named as one, with the flag that opens a private range.
    #[test]
    fn a_range_is_refused_as_a_range() {
        assert_eq!(
            why("10.0.0.0/8"),
            "'10.0.0.0/8': no range: a pattern is one host, not a CIDR range: list the \
             addresses or host names (a private range is opened to leases by serve \
             --allow-private 10.0.0.0/8)"
        );
        assert!(why("fd00::/8").starts_with("'fd00::/8': no range"));
        assert!(why("10.0.0.0/x").starts_with("'10.0.0.0/x': no path"));
    }

    #[test]
    fn wildcards_over_a_public_suffix_are_named() {
        for (text, suffix) in [
            ("*.com", Some("com")),
            ("*.co.uk", Some("co.uk")),
            ("*.github.io", Some("github.io")),
            ("*.example.com", None),
            ("*.test", None),
            ("com", None),
            ("*", None),
        ] {
            assert_eq!(p(text).public_suffix_wildcard(), suffix, "{text}");
        }
    }

    #[test]
    fn valid_spellings_read_as_one_pattern() {
        assert_eq!(p("*"), HostPattern::Any);
        assert_eq!(
            p("*.Example.COM."),
            HostPattern::Subdomains("example.com".into())
        );
        assert_eq!(
            p("api.example.com"),
            HostPattern::Exact("api.example.com".into())
        );
        assert_eq!(
            p("xn--bcher-kva.example"),
            HostPattern::Exact("xn--bcher-kva.example".into())
        );
        assert_eq!(p("localhost"), HostPattern::Exact("localhost".into()));
        // Every IPv4 spelling a target may use is its dotted quad.
        assert_eq!(p("0x7f.0.0.1"), HostPattern::Exact("127.0.0.1".into()));
        assert_eq!(p("10.1.2.3"), HostPattern::Exact("10.1.2.3".into()));
    }

    #[test]
    fn wildcards_match_strict_subdomains_only() {
        assert!(p("*.example.com").matches("a.example.com"));
        assert!(p("*.example.com").matches("a.b.example.com"));
        assert!(!p("*.example.com").matches("example.com"));
        assert!(!p("*.example.com").matches("badexample.com"));
        assert!(
            HostPattern::parse("*.0.1").is_err(),
            "never over IP literals"
        );
        assert!(p("*").matches("127.0.0.1"));
        assert!(p("api.example.com").matches("api.example.com"));
        assert!(!p("api.example.com").matches("x.api.example.com"));
    }

    #[test]
    fn containment_follows_the_issuer_rule() {
        assert!(p("*").contains(&p("*.x.com")));
        assert!(p("*.x.com").contains(&p("*.x.com")));
        assert!(p("*.x.com").contains(&p("*.sub.x.com")));
        assert!(p("*.x.com").contains(&p("a.x.com")));
        assert!(!p("*.x.com").contains(&p("x.com")));
        assert!(!p("*.x.com").contains(&p("*")));
        assert!(!p("*.sub.x.com").contains(&p("*.x.com")));
        assert!(!p("a.x.com").contains(&p("*.a.x.com")));
        assert!(p("a.x.com").contains(&p("a.x.com")));
    }
}
