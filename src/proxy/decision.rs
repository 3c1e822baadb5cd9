//! The decision as a value: [`decide`], one synchronous function of (registry snapshot, policy
//! configuration, identity, what the request asks, now) → a [`Decision`] or a [`Refused`], shared
//! by CONNECT tunnels, forwarded requests and `check`; then [`resolve_and_guard`], the one async
//! step after it.
//!
//! Invariant: `decide` reads nothing but its arguments and writes nothing (no exchange,
//! connection, telemetry, clock or I/O), and runs the phases in order: the credential proves
//! the lease → its chain opens at `now` → a forwarded request's method → the normalised target
//! → a forwarded request's `Host` → the host verdict → the port. Report mode's relaxations come
//! back in [`Decision::reported`], never as a side effect. `resolve_and_guard` relaxes only host
//! policy in report mode, never the guard; its only I/O is the resolver.

use super::identify::{self, Identity};
use crate::config::{Mode, ProxyConfig};
use crate::contract::{Lease, Timestamp};
use crate::policy::codes::{host_refusal, Code, Refusal};
use crate::policy::guard::Exception;
use crate::policy::target::{parse_authority, TargetError, TargetHost};
use crate::policy::verdict::{decide as verdict_over, denied_address};
use crate::policy::{HostPattern, HostPolicy, HostVerdict, Rule, Target, UpstreamAddr};
use crate::registry::Snapshot;
use http::HeaderValue;
use std::net::SocketAddr;
use std::sync::Arc;

/// How the client asks to reach the target.
#[derive(Debug, Clone, Copy)]
pub enum Asked<'a> {
    /// A CONNECT tunnel (judged against `--connect-ports`).
    Tunnel,
    /// A forwarded request (judged against `--forward-ports`): its method, and its `Host`
    /// header if it has one.
    Forward {
        method: &'a http::Method,
        host: Option<&'a HeaderValue>,
    },
    /// A request inside a terminated tunnel (judged against `--connect-ports`, the tunnel's):
    /// its method, and the host it names (`Host`, or HTTP/2's `:authority`).
    Inside {
        method: &'a http::Method,
        host: Option<&'a HeaderValue>,
    },
}

/// What one request asks for.
#[derive(Debug)]
pub struct Ask<'a> {
    pub asked: Asked<'a>,
    /// The target as the client wrote it (the CONNECT target, or the absolute URI's authority).
    pub authority: &'a str,
    /// The port when `authority` names none (80 for forwarded requests).
    pub default_port: Option<u16>,
    /// `authority` normalised ([`Ask::new`] parses it once; the caller logs the same value).
    pub target: Result<Target, TargetError>,
}

impl<'a> Ask<'a> {
    pub fn new(asked: Asked<'a>, authority: &'a str, default_port: Option<u16>) -> Ask<'a> {
        Ask {
            asked,
            authority,
            default_port,
            target: parse_authority(authority, default_port),
        }
    }
}

/// What [`decide`] allows: the lease's open chain over the snapshot it was read from, the
/// target, and what report mode let through.
pub struct Decision {
    /// The lease first, then its ancestors.
    pub chain: Vec<Arc<Lease>>,
    /// The registry state the decision was made on.
    pub snapshot: Arc<Snapshot>,
    pub target: Target,
    /// Report mode: each policy refusal enforce mode would have answered, in phase order
    /// (empty in enforce mode, and for a request nothing would refuse).
    pub reported: Vec<Refusal>,
    /// The lease's allow pattern that let the target through (`None` when report mode let
    /// it through without one).
    pub rule: Option<Rule>,
}

impl Decision {
    /// The host verdict of `host` for this decision's chain (the SNI check asks again).
    pub fn verdict(&self, host: &TargetHost) -> HostVerdict<'_> {
        verdict_over(policies(&self.snapshot, &self.chain), host)
    }
}

/// How far a refused request got: what its exchange may say about the lease, and whether the
/// connection is tied to the lease before the refusal is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reached {
    /// The credential did not prove the lease: not the lease's traffic.
    Nothing,
    /// The lease is proven, but its chain does not open now.
    Lease,
    /// The lease's chain opens now: the connection is the lease's.
    OpenChain,
}

/// A refusal from [`decide`] and how far the request got.
#[derive(Debug)]
pub struct Refused {
    pub refusal: Refusal,
    pub reached: Reached,
}

static EMPTY_POLICY: std::sync::LazyLock<HostPolicy> =
    std::sync::LazyLock::new(HostPolicy::default);

/// The compiled host lists of a chain, the lease first.
fn policies<'a>(
    snapshot: &'a Snapshot,
    chain: &'a [Arc<Lease>],
) -> impl Iterator<Item = (&'a str, &'a HostPolicy)> + Clone {
    chain.iter().map(|lease| {
        let policy = snapshot
            .ledger
            .policy(&lease.id)
            .map(Arc::as_ref)
            .unwrap_or(&EMPTY_POLICY);
        (lease.id.as_str(), policy)
    })
}

/// Decides one request of `identity`'s lease over `snapshot` at `now`.
pub fn decide(
    snapshot: Arc<Snapshot>,
    config: &ProxyConfig,
    identity: &Identity,
    ask: Ask<'_>,
    now: Timestamp,
) -> Result<Decision, Refused> {
    let refused = |reached| move |refusal| Refused { refusal, reached };
    identify::authenticate(
        identity,
        config.credentials,
        config.lease_port_credentials,
        &snapshot,
    )
    .map_err(refused(Reached::Nothing))?;
    let chain = snapshot
        .ledger
        .check_chain(&identity.lease_id, now)
        .map_err(|e| refused(Reached::Lease)(Refusal::from(e)))?;
    let open = refused(Reached::OpenChain);
    if let Asked::Forward { method, .. } | Asked::Inside { method, .. } = ask.asked {
        if is_trace(method.as_str()) {
            return Err(open(Refusal::new(
                Code::MethodNotAllowed,
                format!("{method} is not forwarded"),
            )));
        }
    }
    if let Asked::Inside { method, .. } = ask.asked {
        if method == http::Method::CONNECT {
            return Err(open(Refusal::new(
                Code::MethodNotAllowed,
                "CONNECT inside a tunnel: a tunnel is never a way to another proxy",
            )));
        }
    }
    let target = ask
        .target
        .map_err(|e| open(Refusal::new(Code::BadTarget, e.to_string())))?;
    let mut reported = Vec::new();
    if let Asked::Forward {
        host: Some(host), ..
    }
    | Asked::Inside {
        host: Some(host), ..
    } = ask.asked
    {
        check_host_header(host, ask.authority, ask.default_port, &target)
            .or_else(|refusal| policy_failure(config.mode, refusal, &mut reported))
            .map_err(open)?;
    }
    let verdict = verdict_over(policies(&snapshot, &chain), &target.host);
    let rule = match host_refusal(verdict, &target.host) {
        Ok(by) => by.pattern(&target.host).map(Rule::Allow),
        Err(refusal) => {
            policy_failure(config.mode, refusal, &mut reported).map_err(open)?;
            None
        }
    };
    check_port(config, &target, ask.asked).map_err(open)?;
    Ok(Decision {
        chain,
        snapshot,
        target,
        reported,
        rule,
    })
}

/// A forwarded request's `Host` names the URI's target (inside a terminated tunnel: the
/// CONNECT target).
fn check_host_header(
    host: &HeaderValue,
    authority: &str,
    default_port: Option<u16>,
    target: &Target,
) -> Result<(), Refusal> {
    // The same bytes normalise the same way (the usual case: a client writes the URI's
    // authority into Host), so only a different Host is parsed.
    if host.as_bytes() == authority.as_bytes() {
        return Ok(());
    }
    // Normalised like the target (IDNA, case, trailing dot, default port), so only a real
    // difference is a mismatch. hyper passes a non-ASCII value as raw bytes: a Unicode name
    // arrives as UTF-8, which `to_str` would refuse.
    let named = std::str::from_utf8(host.as_bytes())
        .ok()
        .and_then(|h| parse_authority(h, default_port).ok());
    if named.as_ref() == Some(target) {
        return Ok(());
    }
    Err(Refusal::new(
        Code::HostMismatch,
        format!(
            "Host header {:?} does not name the URI's {target}",
            String::from_utf8_lossy(host.as_bytes())
        ),
    ))
}

/// After the host verdict (so a denied host still revokes): the port is one the operator
/// opened to this kind of request. No policy check: report mode does not relax it, and it
/// never revokes.
fn check_port(config: &ProxyConfig, target: &Target, asked: Asked<'_>) -> Result<(), Refusal> {
    let (ports, flag, what) = match asked {
        Asked::Tunnel | Asked::Inside { .. } => {
            (&config.connect_ports, "--connect-ports", "tunnels")
        }
        Asked::Forward { .. } => (
            &config.forward_ports,
            "--forward-ports",
            "forwarded requests",
        ),
    };
    if ports.contains(target.port) {
        return Ok(());
    }
    Err(Refusal::new(
        Code::PortNotAllowed,
        format!(
            "port {} is not open to {what} ({flag} {ports})",
            target.port
        ),
    )
    .with_rule(Rule::Ports(flag)))
}

/// A failed policy check: refused in enforce mode; in report mode let through and added to
/// `reported`.
pub fn policy_failure(
    mode: Mode,
    refusal: Refusal,
    reported: &mut Vec<Refusal>,
) -> Result<(), Refusal> {
    debug_assert!(refusal.code.is_policy());
    match mode {
        Mode::Enforce => Err(refusal),
        Mode::Report => {
            reported.push(refusal);
            Ok(())
        }
    }
}

/// After [`decide`]: resolve the target once and drop guarded addresses; what survives may be
/// dialled. Empty only when names are not resolved (`check` without `--resolve-names`). A
/// denied address that report mode lets through is added to `decision.reported`.
pub async fn resolve_and_guard(
    config: &ProxyConfig,
    decision: &mut Decision,
) -> Result<Vec<UpstreamAddr>, Refusal> {
    let target = &decision.target;
    let resolved = match &target.host {
        TargetHost::Ip(ip) => vec![SocketAddr::new(*ip, target.port)],
        TargetHost::Name(_) if !config.resolve_names => return Ok(Vec::new()),
        TargetHost::Name(name) => config
            .resolver
            .resolve(name, target.port, config.dns_timeout)
            .await
            .map_err(|e| Refusal::new(Code::DnsFailed, e.to_string()))?,
    };
    let chain = policies(&decision.snapshot, &decision.chain);
    // A deny entry that is an IP literal denies every name resolving to it (deny beats
    // every exception): host-denied, naming the address and the lease.
    if let Some(denied) = denied_address(chain.clone(), &resolved) {
        let via = if denied.addr == denied.listed {
            String::new()
        } else {
            format!(" (embedding {})", denied.listed)
        };
        let refusal = Refusal::new(
            Code::HostDenied,
            format!(
                "{} resolves to {}{via}, denied by {} in lease {}",
                target.host, denied.addr, denied.listed, denied.lease_id
            ),
        )
        .with_rule(Rule::Deny(HostPattern::Exact(denied.listed.to_string())));
        policy_failure(config.mode, refusal, &mut decision.reported)?;
    }
    let exception = Exception::for_target(chain.map(|(_, p)| p), &target.host);
    // Absolute: report mode relaxes host policy, never the guard.
    let checked = config.guard.check(&resolved, exception);
    if !checked.dialable.is_empty() {
        return Ok(checked.dialable);
    }
    Err(match checked.blocked.first() {
        Some(b) => Refusal::new(Code::AddressNotAllowed, b.explain(&target.host))
            .with_rule(Rule::Guard(b.why)),
        None => Refusal::new(Code::DnsFailed, format!("{} has no addresses", target.host)),
    })
}

/// [`decide`], then [`resolve_and_guard`]: the whole decision for a caller with no connection
/// to tie to the lease (`check`).
pub async fn decide_and_guard(
    snapshot: Arc<Snapshot>,
    config: &ProxyConfig,
    identity: &Identity,
    ask: Ask<'_>,
    now: Timestamp,
) -> Result<(Decision, Vec<UpstreamAddr>), Refusal> {
    let mut decision =
        decide(snapshot, config, identity, ask, now).map_err(|refused| refused.refusal)?;
    let addrs = resolve_and_guard(config, &mut decision).await?;
    Ok((decision, addrs))
}

/// TRACE and TRACK echo the request back (credentials included): never forwarded.
fn is_trace(method: &str) -> bool {
    method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(authority: &str, default_port: Option<u16>) -> Target {
        parse_authority(authority, default_port).unwrap()
    }

    /// `Host` is normalised like the target: only a real difference is a mismatch.
    #[test]
    fn a_host_header_must_name_the_target_after_normalisation() {
        let uri = target("a.test", Some(80));
        for same in ["a.test", "A.TEST", "a.test.", "a.test:80"] {
            let host = HeaderValue::from_static(same);
            assert_eq!(
                check_host_header(&host, "a.test", Some(80), &uri),
                Ok(()),
                "{same}"
            );
        }
        for other in ["b.test", "a.test:8080", "a.test:", "\u{0}"] {
            let Ok(host) = HeaderValue::from_bytes(other.as_bytes()) else {
                continue;
            };
            let refused = check_host_header(&host, "a.test", Some(80), &uri).unwrap_err();
            assert_eq!(refused.code, Code::HostMismatch, "{other}");
        }
    }

    /// Tunnels and forwarded requests are judged against their own port lists.
    #[test]
    fn the_port_list_is_the_one_of_the_request_kind() {
        let config = ProxyConfig::default();
        let get = Asked::Forward {
            method: &http::Method::GET,
            host: None,
        };
        assert_eq!(
            check_port(&config, &target("a.test:443", None), Asked::Tunnel),
            Ok(())
        );
        assert_eq!(check_port(&config, &target("a.test:80", None), get), Ok(()));
        let refused = check_port(&config, &target("a.test:80", None), Asked::Tunnel).unwrap_err();
        assert_eq!(refused.code, Code::PortNotAllowed);
        assert_eq!(
            refused.detail,
            "port 80 is not open to tunnels (--connect-ports 443)"
        );
        let refused = check_port(&config, &target("a.test:443", None), get).unwrap_err();
        assert_eq!(refused.code, Code::PortNotAllowed);
    }

    /// Report mode lets a policy refusal through and keeps it; enforce mode refuses.
    #[test]
    fn report_mode_keeps_what_enforce_mode_refuses() {
        let refusal = Refusal::new(Code::HostNotAllowed, "not listed");
        let mut reported = Vec::new();
        let enforced = policy_failure(Mode::Enforce, refusal.clone(), &mut reported);
        assert_eq!(enforced, Err(refusal.clone()));
        assert!(reported.is_empty());
        assert_eq!(
            policy_failure(Mode::Report, refusal.clone(), &mut reported),
            Ok(())
        );
        assert_eq!(reported, [refusal]);
    }
}
