//! The rule that decided a request: the allow or deny pattern, the missing allow entry, the
//! guarded range or the port list, as the egress line and `GET /refusals` name it.
//!
//! Invariant: pure, and a value: a rule is what the decision already found, never looked up
//! again; its text is the pattern as written in the lease (`allow *.example.com`,
//! `deny *.evil.test`), `not in allow`, `guard: <range>` or `not in --connect-ports`.

use super::HostPattern;

/// What decided a request, when a host pattern, the guard or a port list did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rule {
    /// The lease's allow pattern that matched.
    Allow(HostPattern),
    /// The deny pattern (or IP literal) of a lease of the chain that matched.
    Deny(HostPattern),
    /// A lease of the chain has no allow pattern for the host.
    NotInAllow,
    /// The address guard's range, by name (`Loopback`, `cloud metadata`, ...).
    Guard(&'static str),
    /// The port list the target's port is not in (`--connect-ports`, `--forward-ports`).
    Ports(&'static str),
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rule::Allow(pattern) => write!(f, "allow {pattern}"),
            Rule::Deny(pattern) => write!(f, "deny {pattern}"),
            Rule::NotInAllow => f.write_str("not in allow"),
            Rule::Guard(range) => write!(f, "guard: {range}"),
            Rule::Ports(flag) => write!(f, "not in {flag}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_reads_as_the_lease_wrote_it() {
        let shown = |rule: Rule| rule.to_string();
        assert_eq!(
            shown(Rule::Deny(HostPattern::Subdomains("evil.test".into()))),
            "deny *.evil.test"
        );
        assert_eq!(
            shown(Rule::Allow(HostPattern::Exact("a.test".into()))),
            "allow a.test"
        );
        assert_eq!(shown(Rule::Allow(HostPattern::Any)), "allow *");
        assert_eq!(shown(Rule::NotInAllow), "not in allow");
        assert_eq!(shown(Rule::Guard("Loopback")), "guard: Loopback");
        assert_eq!(
            shown(Rule::Ports("--connect-ports")),
            "not in --connect-ports"
        );
    }
}
