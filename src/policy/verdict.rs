//! Host verdicts over a chain of leases.
//!
//! Invariant: deny beats allow — refused if any lease of the chain denies the host; allowed
//! only if the lease and every ancestor allow it. Each lease's patterns are compiled once into
//! hash sets, so a lookup costs O(labels in the host), whatever the number of patterns.

use super::pattern::HostPattern;
use super::target::{parse_host, TargetHost};
use std::collections::HashSet;

/// One lease's allow or deny list, compiled.
#[derive(Debug, Clone, Default)]
pub struct HostSet {
    any: bool,
    /// Exact names and IP literals, normalised like targets.
    exact: HashSet<String>,
    /// Suffixes of `*.suffix` patterns.
    subdomains: HashSet<String>,
}

impl HostSet {
    pub fn compile<S: AsRef<str>>(patterns: &[S]) -> HostSet {
        let mut set = HostSet::default();
        for pattern in patterns {
            match HostPattern::parse(pattern.as_ref()) {
                HostPattern::Any => set.any = true,
                HostPattern::Subdomains(suffix) => {
                    set.subdomains.insert(suffix);
                }
                HostPattern::Exact(name) => {
                    // `0177.0.0.1` in a lease names the same host as `127.0.0.1` in a target.
                    let normal = parse_host(&name).map_or(name, |h| h.as_text());
                    set.exact.insert(normal);
                }
            }
        }
        set
    }

    /// The pattern of this set that matches `host`, if any (exact first, then the nearest
    /// wildcard, then `*`).
    pub fn find(&self, host: &TargetHost) -> Option<HostPattern> {
        let text = host.as_text();
        if self.exact.contains(&text) {
            return Some(HostPattern::Exact(text));
        }
        if let TargetHost::Name(name) = host {
            // Every strict suffix at a label boundary: "b.example.com", "example.com", "com".
            let mut rest = name.as_str();
            while let Some((_, suffix)) = rest.split_once('.') {
                if self.subdomains.contains(suffix) {
                    return Some(HostPattern::Subdomains(suffix.to_owned()));
                }
                rest = suffix;
            }
        }
        self.any.then_some(HostPattern::Any)
    }

    /// Whether `host` is listed exactly (not through a wildcard).
    pub fn lists_exactly(&self, host: &TargetHost) -> bool {
        self.exact.contains(&host.as_text())
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
}

/// What decided a verdict: which pattern of which lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decider {
    pub lease_id: String,
    /// `None` when the lease has no matching pattern (host-not-allowed).
    pub pattern: Option<HostPattern>,
}

/// The outcome of matching a host against a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostVerdict {
    /// Allowed; the lease's own matching allow pattern.
    Allowed(Decider),
    /// A lease of the chain denies the host.
    Denied(Decider),
    /// Some lease of the chain (the nearest such) has no allow pattern for the host.
    NotAllowed(Decider),
}

/// Matches `host` against a chain, the lease itself first, then its ancestors.
pub fn decide<'a>(
    chain: impl IntoIterator<Item = (&'a str, &'a HostPolicy)> + Clone,
    host: &TargetHost,
) -> HostVerdict {
    for (lease_id, policy) in chain.clone() {
        if let Some(pattern) = policy.deny.find(host) {
            return HostVerdict::Denied(Decider {
                lease_id: lease_id.to_owned(),
                pattern: Some(pattern),
            });
        }
    }
    let mut own = None;
    for (lease_id, policy) in chain {
        match policy.allow.find(host) {
            Some(pattern) => {
                own.get_or_insert(Decider {
                    lease_id: lease_id.to_owned(),
                    pattern: Some(pattern),
                });
            }
            None => {
                return HostVerdict::NotAllowed(Decider {
                    lease_id: lease_id.to_owned(),
                    pattern: None,
                })
            }
        }
    }
    match own {
        Some(decider) => HostVerdict::Allowed(decider),
        // An empty chain allows nothing.
        None => HostVerdict::NotAllowed(Decider {
            lease_id: String::new(),
            pattern: None,
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

    fn verdict(chain: &[(&str, &HostPolicy)], h: &str) -> HostVerdict {
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
                lease_id: "parent".into(),
                pattern: Some(HostPattern::Subdomains("evil.example".into()))
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
                lease_id: "parent".into(),
                pattern: None
            })
        );
        assert_eq!(
            verdict(&chain, "a.example.com"),
            HostVerdict::Allowed(Decider {
                lease_id: "child".into(),
                pattern: Some(HostPattern::Any)
            })
        );
    }
}
