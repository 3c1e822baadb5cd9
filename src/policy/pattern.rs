//! One entry of `allow.hosts` / `deny.hosts`, and containment between entries.
//!
//! Invariant: `*` matches every host; `*.x` matches strict subdomains of `x` at any depth,
//! never `x` itself and never an IP literal; anything else matches exactly one host.

use std::net::IpAddr;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// `*`
    Any,
    /// `*.suffix`: strict subdomains of `suffix`.
    Subdomains(String),
    /// An exact name or IP literal.
    Exact(String),
}

impl HostPattern {
    /// Reads a pattern as the schema admits it (lower-case; the schema has checked the form).
    /// One trailing dot is dropped, as in targets. A spelling the schema would refuse (`*.`,
    /// `*..`, `*x.com`, a port, a scheme) becomes an `Exact` entry no normalised target can
    /// equal: it matches nothing rather than widening to `*`.
    pub fn parse(text: &str) -> HostPattern {
        let text = text.to_ascii_lowercase();
        if text == "*" {
            return HostPattern::Any;
        }
        let text = text.strip_suffix('.').unwrap_or(&text);
        match text.strip_prefix("*.") {
            Some(suffix) if !suffix.is_empty() => HostPattern::Subdomains(suffix.to_owned()),
            _ => HostPattern::Exact(text.to_owned()),
        }
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
        HostPattern::parse(s)
    }

    #[test]
    fn wildcards_match_strict_subdomains_only() {
        assert!(p("*.example.com").matches("a.example.com"));
        assert!(p("*.example.com").matches("a.b.example.com"));
        assert!(!p("*.example.com").matches("example.com"));
        assert!(!p("*.example.com").matches("badexample.com"));
        assert!(!p("*.0.1").matches("127.0.0.1"));
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
