//! Host verdicts over a chain of leases.
//!
//! Invariant: deny beats allow — refused if any lease of the chain denies the host; allowed
//! only if the lease and every ancestor allow it. Each lease's patterns are compiled once into
//! hash sets, so a lookup costs O(labels in the host), whatever the number of patterns.

use super::guard::embedded_ipv4;
use super::pattern::{HostPattern, MalformedPattern};
use super::target::TargetHost;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use crate::fast_hash::Hasher;

/// One lease's allow or deny list, compiled.
#[derive(Debug, Clone, Default)]
pub struct HostSet {
    any: bool,
    /// Exact names, normalised like targets.
    names: HashSet<Box<str>, Hasher>,
    /// Exact IP literals.
    ips: HashSet<IpAddr, Hasher>,
    /// Suffixes of `*.suffix` patterns.
    subdomains: HashSet<Box<str>, Hasher>,
    /// Bit `n` set: some suffix is `n` bytes long (bit 127: 127 or more). Most of a host's
    /// suffixes have a length no pattern has, and skip the hash lookup.
    suffix_lengths: u128,
    /// Entries that are not patterns (kept to be reported; they match nothing).
    malformed: Vec<MalformedPattern>,
}

fn length_bit(len: usize) -> u128 {
    1u128 << len.min(127)
}

/// A pattern that matched, borrowed from its set (no allocation on the hot path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matched<'a> {
    Any,
    Subdomains(&'a str),
    Exact,
}

impl Matched<'_> {
    /// The pattern as written in the lease (`host` is the target that matched).
    pub fn to_pattern(self, host: &TargetHost) -> HostPattern {
        match self {
            Matched::Any => HostPattern::Any,
            Matched::Subdomains(suffix) => HostPattern::Subdomains(suffix.to_owned()),
            Matched::Exact => HostPattern::Exact(host.as_text()),
        }
    }
}

impl HostSet {
    /// Compiles a lease's list. A malformed entry is kept aside (see [`HostSet::malformed`])
    /// and matches nothing: a bad spelling in a signed lease never widens what it grants.
    pub fn compile<S: AsRef<str>>(patterns: &[S]) -> HostSet {
        let mut set = HostSet::default();
        for pattern in patterns {
            match HostPattern::parse(pattern.as_ref()) {
                Ok(HostPattern::Any) => set.any = true,
                Ok(HostPattern::Subdomains(suffix)) => {
                    set.suffix_lengths |= length_bit(suffix.len());
                    set.subdomains.insert(suffix.into());
                }
                // Parsing wrote IPv4 literals as dotted quads and checked names are normal.
                Ok(HostPattern::Exact(name)) => match name.parse::<IpAddr>() {
                    Ok(ip) => {
                        set.ips.insert(ip);
                    }
                    Err(_) => {
                        set.names.insert(name.into());
                    }
                },
                Err(malformed) => set.malformed.push(malformed),
            }
        }
        set
    }

    /// The entries that are not patterns: they match nothing.
    pub fn malformed(&self) -> &[MalformedPattern] {
        &self.malformed
    }

    /// The pattern of this set that matches `host`, if any (exact first, then the nearest
    /// wildcard, then `*`): one lookup per label of the host.
    pub fn find(&self, host: &TargetHost) -> Option<Matched<'_>> {
        match host {
            TargetHost::Ip(ip) => {
                if self.ips.contains(ip) {
                    return Some(Matched::Exact);
                }
            }
            TargetHost::Name(name) => {
                if self.names.contains(name.as_str()) {
                    return Some(Matched::Exact);
                }
                // Every strict suffix at a label boundary: "b.example.com", "example.com", "com".
                // (A plain byte scan: `split_once('.')` was half the cost of a verdict.)
                if self.suffix_lengths != 0 {
                    for (dot, _) in name.bytes().enumerate().filter(|&(_, b)| b == b'.') {
                        let suffix = &name[dot + 1..];
                        if self.suffix_lengths & length_bit(suffix.len()) != 0 {
                            if let Some(found) = self.subdomains.get(suffix) {
                                return Some(Matched::Subdomains(found));
                            }
                        }
                    }
                }
            }
        }
        self.any.then_some(Matched::Any)
    }

    /// Whether `ip` is listed as an IP literal (one hash lookup).
    pub fn lists_ip(&self, ip: IpAddr) -> bool {
        self.ips.contains(&ip)
    }

    /// Whether `host` is listed exactly (not through a wildcard).
    pub fn lists_exactly(&self, host: &TargetHost) -> bool {
        self.find(host) == Some(Matched::Exact)
    }
}

/// One lease's compiled host lists.
#[derive(Debug, Clone, Default)]
pub struct HostPolicy {
    pub allow: HostSet,
    pub deny: HostSet,
}

impl HostPolicy {
    pub fn compile<S: AsRef<str>>(allow: &[S], deny: &[S]) -> HostPolicy {
        HostPolicy {
            allow: HostSet::compile(allow),
            deny: HostSet::compile(deny),
        }
    }

    /// [`HostPolicy::compile`] for a lease of the journal, warning once (a lease is compiled
    /// once per fold) about each entry that is not a pattern and so matches nothing. The one
    /// side effect in `policy`: a log line, so an operator learns a grant is narrower than
    /// its issuer meant.
    pub fn compile_lease<S: AsRef<str>>(lease_id: &str, allow: &[S], deny: &[S]) -> HostPolicy {
        let policy = HostPolicy::compile(allow, deny);
        for (list, set) in [("allow.hosts", &policy.allow), ("deny.hosts", &policy.deny)] {
            for bad in set.malformed() {
                tracing::warn!(lease = lease_id, list, pattern = %bad.pattern, why = %bad.why, "a host entry of the lease is not a pattern: it matches nothing");
            }
        }
        policy
    }

    /// Every malformed entry, with the list it is in (`allow.hosts` or `deny.hosts`).
    pub fn malformed(&self) -> impl Iterator<Item = (&'static str, &MalformedPattern)> {
        let allow = self.allow.malformed().iter().map(|m| ("allow.hosts", m));
        let deny = self.deny.malformed().iter().map(|m| ("deny.hosts", m));
        allow.chain(deny)
    }
}

/// What decided a verdict: which pattern of which lease (borrowed: no allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decider<'a> {
    pub lease_id: &'a str,
    /// `None` when the lease has no matching pattern (host-not-allowed).
    pub matched: Option<Matched<'a>>,
}

impl Decider<'_> {
    /// The deciding pattern as written in the lease, if one matched `host`.
    pub fn pattern(&self, host: &TargetHost) -> Option<HostPattern> {
        self.matched.map(|m| m.to_pattern(host))
    }
}

/// The outcome of matching a host against a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostVerdict<'a> {
    /// Allowed; the lease's own matching allow pattern.
    Allowed(Decider<'a>),
    /// A lease of the chain denies the host.
    Denied(Decider<'a>),
    /// Some lease of the chain (the nearest such) has no allow pattern for the host.
    NotAllowed(Decider<'a>),
}

/// A resolved address that a deny list names as an IP literal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeniedAddress<'a> {
    /// The lease whose deny list names it (the nearest such).
    pub lease_id: &'a str,
    /// The resolved address.
    pub addr: IpAddr,
    /// The deny entry that matched: `addr`, or the IPv4 address it embeds.
    pub listed: IpAddr,
}

/// The first resolved address any lease of the chain denies as an IP literal: a deny entry
/// `203.0.113.7` refuses every name that resolves to it, not only the literal. IPv6 forms
/// that embed an IPv4 address (mapped, NAT64, 6to4) are matched by that IPv4 address too.
/// At most two hash lookups per address and lease.
pub fn denied_address<'a>(
    chain: impl IntoIterator<Item = (&'a str, &'a HostPolicy)> + Clone,
    resolved: &[SocketAddr],
) -> Option<DeniedAddress<'a>> {
    for addr in resolved.iter().map(SocketAddr::ip) {
        let embedded = embedded_ipv4(addr).map(IpAddr::V4);
        for (lease_id, policy) in chain.clone() {
            if let Some(listed) = std::iter::once(addr)
                .chain(embedded)
                .find(|&ip| policy.deny.lists_ip(ip))
            {
                return Some(DeniedAddress {
                    lease_id,
                    addr,
                    listed,
                });
            }
        }
    }
    None
}

/// Matches `host` against a chain, the lease itself first, then its ancestors.
pub fn decide<'a>(
    chain: impl IntoIterator<Item = (&'a str, &'a HostPolicy)> + Clone,
    host: &TargetHost,
) -> HostVerdict<'a> {
    for (lease_id, policy) in chain.clone() {
        if let Some(matched) = policy.deny.find(host) {
            return HostVerdict::Denied(Decider {
                lease_id,
                matched: Some(matched),
            });
        }
    }
    let mut own = None;
    for (lease_id, policy) in chain {
        match policy.allow.find(host) {
            Some(matched) => {
                own.get_or_insert(Decider {
                    lease_id,
                    matched: Some(matched),
                });
            }
            None => {
                return HostVerdict::NotAllowed(Decider {
                    lease_id,
                    matched: None,
                })
            }
        }
    }
    // An empty chain allows nothing.
    match own {
        Some(decider) => HostVerdict::Allowed(decider),
        None => HostVerdict::NotAllowed(Decider {
            lease_id: "",
            matched: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::target::parse_host;

    fn host(h: &str) -> TargetHost {
        parse_host(h).unwrap()
    }

    fn verdict<'a>(chain: &[(&'a str, &'a HostPolicy)], h: &str) -> HostVerdict<'a> {
        decide(chain.iter().copied(), &host(h))
    }

    #[test]
    fn wildcards_cover_strict_subdomains_at_any_depth() {
        let p = HostPolicy::compile(&["*.example.com", "api.other.org", "10.1.2.3"], &[]);
        let chain = [("a", &p)];
        assert!(matches!(
            verdict(&chain, "a.example.com"),
            HostVerdict::Allowed(_)
        ));
        assert!(matches!(
            verdict(&chain, "a.b.example.com"),
            HostVerdict::Allowed(_)
        ));
        assert!(matches!(
            verdict(&chain, "example.com"),
            HostVerdict::NotAllowed(_)
        ));
        assert!(matches!(
            verdict(&chain, "x.api.other.org"),
            HostVerdict::NotAllowed(_)
        ));
        assert!(matches!(
            verdict(&chain, "10.1.2.3"),
            HostVerdict::Allowed(_)
        ));
        assert!(matches!(
            verdict(&chain, "0x0a.1.2.3"),
            HostVerdict::Allowed(_)
        ));
    }

    #[test]
    fn wildcards_never_match_ip_literals_but_star_does() {
        let p = HostPolicy::compile(&["*.0.0.1", "*.1"], &[]);
        assert!(matches!(
            verdict(&[("a", &p)], "127.0.0.1"),
            HostVerdict::NotAllowed(_)
        ));
        let star = HostPolicy::compile(&["*"], &[]);
        assert!(matches!(
            verdict(&[("a", &star)], "127.0.0.1"),
            HostVerdict::Allowed(_)
        ));
    }

    #[test]
    fn deny_beats_allow_anywhere_in_the_chain() {
        let child = HostPolicy::compile(&["*"], &[]);
        let parent = HostPolicy::compile(&["*"], &["*.evil.example"]);
        let chain = [("child", &child), ("parent", &parent)];
        assert_eq!(
            verdict(&chain, "x.evil.example"),
            HostVerdict::Denied(Decider {
                lease_id: "parent",
                matched: Some(Matched::Subdomains("evil.example"))
            })
        );
    }

    #[test]
    fn a_child_is_allowed_only_what_every_ancestor_allows() {
        let child = HostPolicy::compile(&["*"], &[]);
        let parent = HostPolicy::compile(&["*.example.com"], &[]);
        let chain = [("child", &child), ("parent", &parent)];
        assert_eq!(
            verdict(&chain, "other.org"),
            HostVerdict::NotAllowed(Decider {
                lease_id: "parent",
                matched: None
            })
        );
        assert_eq!(
            verdict(&chain, "a.example.com"),
            HostVerdict::Allowed(Decider {
                lease_id: "child",
                matched: Some(Matched::Any)
            })
        );
    }

    #[test]
    fn a_denied_ip_literal_matches_every_address_a_name_resolves_to() {
        let child = HostPolicy::compile(&["*"], &[]);
        let parent = HostPolicy::compile(&["*"], &["203.0.113.7", "*.evil.example"]);
        let chain = [("child", &child), ("parent", &parent)];
        let at = |ips: &[&str]| -> Vec<SocketAddr> {
            ips.iter()
                .map(|ip| SocketAddr::new(ip.parse().unwrap(), 443))
                .collect()
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            denied_address(chain.iter().copied(), &at(&["198.51.100.1", "203.0.113.7"])),
            Some(DeniedAddress {
                lease_id: "parent",
                addr: ip("203.0.113.7"),
                listed: ip("203.0.113.7")
            })
        );
        assert_eq!(
            denied_address(chain.iter().copied(), &at(&["64:ff9b::cb00:7107"])),
            Some(DeniedAddress {
                lease_id: "parent",
                addr: ip("64:ff9b::cb00:7107"),
                listed: ip("203.0.113.7")
            })
        );
        assert_eq!(
            denied_address(chain.iter().copied(), &at(&["203.0.113.8", "::1"])),
            None
        );
    }

    #[test]
    fn a_malformed_pattern_allows_nothing_and_denies_nothing() {
        let spellings = [
            "*.",
            "*..",
            "*x.com",
            "https://x.com",
            "x.com:443",
            "*.1.2.3.4",
            "1.2.3.4.5",
            "a_b.x.com",
            "xn--zz.x.com",
            "x.com/",
            "*.*",
            "**",
        ];
        let allow = HostPolicy::compile(&spellings, &[]);
        assert_eq!(allow.allow.malformed().len(), spellings.len());
        let deny = HostPolicy::compile(&["*"], &spellings);
        for target in [
            "x.com",
            "a.x.com",
            "www.x.com",
            "1.2.3.4",
            "127.0.0.1",
            "xx.com",
            "a_b.x.com",
        ] {
            assert!(
                matches!(
                    verdict(&[("a", &allow)], target),
                    HostVerdict::NotAllowed(_)
                ),
                "{target} allowed by a malformed pattern"
            );
            assert!(
                matches!(verdict(&[("a", &deny)], target), HostVerdict::Allowed(_)),
                "{target} denied by a malformed pattern"
            );
        }
    }
}
