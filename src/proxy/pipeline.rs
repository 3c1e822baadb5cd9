//! The decision pipeline (pingora's fixed phases): one [`Proxy::decide`] for every CONNECT,
//! every forwarded request and `check`, then the dial and the relay, and the one rescue point
//! that turns a refusal into the client's answer.
//!
//! Invariant: phases 1–5 run in order, once, here only: identify the lease → its chain opens
//! now → normalise the target → host verdict, then the port → resolve and guard. A refusal found before the
//! client heard anything is answered through [`Proxy::refuse`]; one found after the tunnel's
//! 200 (the SNI check) cannot change the status any more, so it is recorded through
//! [`Proxy::record_refusal`] and the tunnel is closed. Either way a revoking code revokes.

use super::body;
use super::dialer;
use super::exchange::Exchange;
use super::identify;
use super::listener::ClientConn;
use super::refusal;
use super::state::Proxy;
use super::Body;
use crate::config::{Mode, OnRefusal};
use crate::contract::Lease;
use crate::policy::guard::Exception;
use crate::policy::refusal::{host_refusal, Code, Refusal};
use crate::policy::target::{parse_authority, TargetHost};
use crate::policy::verdict::{decide as verdict_over, denied_address};
use crate::policy::{HostPolicy, HostVerdict, Target, UpstreamAddr};
use crate::registry::revocation::RefusedEgress;
use crate::registry::Snapshot;
use crate::telemetry::egress::{Kind, LoggedVerdict};
use http::{header, HeaderMap, Response};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// What phases 1–5 decided: the lease and its open chain, the target, and the checked
/// addresses that may be dialled.
pub struct Decision {
    pub lease_id: String,
    /// The lease first, then its ancestors.
    pub chain: Vec<Arc<Lease>>,
    /// The registry state the decision was made on.
    pub snapshot: Arc<Snapshot>,
    /// Cancelled when the lease (or an ancestor) closes.
    pub token: CancellationToken,
    pub target: Target,
    /// Checked addresses in resolver order; empty only when names are not resolved
    /// (`check` without `--resolve-names`).
    pub addrs: Vec<UpstreamAddr>,
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

impl Decision {
    /// The host verdict of `host` for this decision's chain (the SNI check asks again).
    pub fn verdict(&self, host: &TargetHost) -> HostVerdict<'_> {
        verdict_over(policies(&self.snapshot, &self.chain), host)
    }
}

/// The lease and chain of phases 1–2, before the target is known.
struct Admitted {
    lease_id: String,
    chain: Vec<Arc<Lease>>,
    snapshot: Arc<Snapshot>,
    token: CancellationToken,
}

impl Proxy {
    /// Phases 1–5 for one request. `authority` is what the client asked for (the CONNECT
    /// target, or the absolute URI's authority), `default_port` applies when it has none.
    /// Forwarded requests (`ex.kind` http) are also checked for their method and `Host`.
    pub async fn decide(
        &self,
        conn: &ClientConn,
        headers: &HeaderMap,
        authority: &str,
        default_port: Option<u16>,
        ex: &mut Exchange,
    ) -> Result<Decision, Refusal> {
        // An identification refusal's line names the target too, when the request names one.
        if let Ok(target) = parse_authority(authority, default_port) {
            ex.target = Some(target);
        }
        // Nothing new is admitted on a state the process may have missed changes to while it
        // was not running (an atomic check unless it was).
        self.registry.admission(ex.started()).await;
        let admitted = self.admit(conn, headers, ex)?;
        if ex.kind == Kind::Http && is_trace(ex.method.as_str()) {
            return Err(Refusal::new(
                Code::MethodNotAllowed,
                format!("{} is not forwarded", ex.method),
            ));
        }
        let target = self.target(headers, authority, default_port, ex)?;
        self.judge_host(&admitted, &target, ex)?;
        self.check_port(&target, ex.kind)?;
        let addrs = self.resolve_and_guard(&admitted, &target, ex).await?;
        Ok(Decision {
            lease_id: admitted.lease_id,
            chain: admitted.chain,
            snapshot: admitted.snapshot,
            token: admitted.token,
            target,
            addrs,
        })
    }

    /// Phases 1 and 2: the lease of the request, and whether its chain opens now; the
    /// connection is then tied to the lease (its connection limit, its teardown).
    fn admit(
        &self,
        conn: &ClientConn,
        headers: &HeaderMap,
        ex: &mut Exchange,
    ) -> Result<Admitted, Refusal> {
        let identity = identify::identify(headers, conn.port_lease.as_deref())?;
        let snapshot = self.registry.snapshot();
        // Before the exchange names the lease: an unproven credential is not the lease's
        // traffic (no series, no revocation on its account).
        identify::authenticate(
            &identity,
            self.config.credentials,
            self.config.lease_port_credentials,
            &snapshot,
        )?;
        ex.lease_id = Some(identity.lease_id.clone());
        ex.label = identity.label;
        ex.lease_known = snapshot.ledger.lease(&identity.lease_id).is_some();
        let now = self.registry.now();
        let chain = snapshot
            .ledger
            .check_chain(&identity.lease_id, now)
            .map_err(Refusal::from)?;
        let token = conn.link(self, &identity.lease_id, now)?;
        ex.token = Some(token.clone());
        Ok(Admitted {
            lease_id: identity.lease_id,
            chain,
            snapshot,
            token,
        })
    }

    /// Phase 3: the normalised target; a forwarded request's `Host` must name it too.
    fn target(
        &self,
        headers: &HeaderMap,
        authority: &str,
        default_port: Option<u16>,
        ex: &mut Exchange,
    ) -> Result<Target, Refusal> {
        let target = parse_authority(authority, default_port)
            .map_err(|e| Refusal::new(Code::BadTarget, e.to_string()))?;
        ex.target = Some(target.clone());
        if ex.kind != Kind::Http {
            return Ok(target);
        }
        // The same bytes normalise the same way (the usual case: a client writes the URI's
        // authority into Host), so only a different Host is parsed.
        if let Some(host) = headers
            .get(header::HOST)
            .filter(|host| host.as_bytes() != authority.as_bytes())
        {
            // Normalised like the target (IDNA, case, trailing dot, default port), so only a
            // real difference is a mismatch. hyper passes a non-ASCII value as raw bytes:
            // a Unicode name arrives as UTF-8, which `to_str` would refuse.
            let named = std::str::from_utf8(host.as_bytes())
                .ok()
                .and_then(|h| parse_authority(h, default_port).ok());
            if named.as_ref() != Some(&target) {
                self.policy_failure(
                    ex,
                    Refusal::new(
                        Code::HostMismatch,
                        format!(
                            "Host header {:?} does not name the URI's {target}",
                            String::from_utf8_lossy(host.as_bytes())
                        ),
                    ),
                )?;
            }
        }
        Ok(target)
    }

    /// Phase 4: the host verdict over the chain.
    fn judge_host(
        &self,
        admitted: &Admitted,
        target: &Target,
        ex: &mut Exchange,
    ) -> Result<(), Refusal> {
        let verdict = verdict_over(policies(&admitted.snapshot, &admitted.chain), &target.host);
        match host_refusal(verdict, &target.host) {
            Ok(_) => Ok(()),
            Err(refusal) => self.policy_failure(ex, refusal),
        }
    }

    /// Phase 4, after the host verdict (so a denied host still revokes): the port is one the
    /// operator opened to this kind of request. No policy check: report mode does not relax
    /// it, and it never revokes.
    fn check_port(&self, target: &Target, kind: Kind) -> Result<(), Refusal> {
        let (ports, flag, what) = match kind {
            Kind::Connect => (&self.config.connect_ports, "--connect-ports", "tunnels"),
            Kind::Http => (
                &self.config.forward_ports,
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
        ))
    }

    /// Phase 5: resolve once, drop guarded addresses; what survives may be dialled.
    async fn resolve_and_guard(
        &self,
        admitted: &Admitted,
        target: &Target,
        ex: &mut Exchange,
    ) -> Result<Vec<UpstreamAddr>, Refusal> {
        let resolved = match &target.host {
            TargetHost::Ip(ip) => vec![SocketAddr::new(*ip, target.port)],
            TargetHost::Name(_) if !self.config.resolve_names => {
                ex.observe_decision();
                return Ok(Vec::new());
            }
            TargetHost::Name(name) => self
                .config
                .resolver
                .resolve(name, target.port, self.config.dns_timeout)
                .await
                .map_err(|e| Refusal::new(Code::DnsFailed, e.to_string()))?,
        };
        // A deny entry that is an IP literal denies every name resolving to it (deny beats
        // every exception): host-denied, naming the address and the lease.
        if let Some(denied) =
            denied_address(policies(&admitted.snapshot, &admitted.chain), &resolved)
        {
            let via = if denied.addr == denied.listed {
                String::new()
            } else {
                format!(" (embedding {})", denied.listed)
            };
            self.policy_failure(
                ex,
                Refusal::new(
                    Code::HostDenied,
                    format!(
                        "{} resolves to {}{via}, denied by {} in lease {}",
                        target.host, denied.addr, denied.listed, denied.lease_id
                    ),
                ),
            )?;
        }
        let exception = Exception::for_target(
            policies(&admitted.snapshot, &admitted.chain).map(|(_, p)| p),
            &target.host,
        );
        // Absolute: report mode relaxes host policy, never the guard.
        let checked = self.config.guard.check(&resolved, exception);
        let blocked = checked.blocked.first().map(|b| {
            Refusal::new(
                Code::AddressNotAllowed,
                format!("{} resolves to {}, {}", target.host, b.addr.ip(), b.why),
            )
        });
        ex.observe_decision();
        match (checked.dialable.is_empty(), blocked) {
            (true, Some(refusal)) => Err(refusal),
            (true, None) => Err(Refusal::new(
                Code::DnsFailed,
                format!("{} has no addresses", target.host),
            )),
            (false, _) => Ok(checked.dialable),
        }
    }

    /// A failed policy check: refused in enforce mode, reported and let through in report mode.
    pub fn policy_failure(&self, ex: &mut Exchange, refusal: Refusal) -> Result<(), Refusal> {
        debug_assert!(refusal.code.is_policy());
        match self.config.mode {
            Mode::Enforce => Err(refusal),
            Mode::Report => {
                tracing::info!(code = %refusal.code, detail = %refusal.detail, "report mode: would refuse");
                ex.verdict = LoggedVerdict::Report;
                ex.code.get_or_insert(refusal.code);
                Ok(())
            }
        }
    }

    /// Phase 6: connects to the first checked address that answers (timed).
    pub async fn dial(
        &self,
        addrs: &[UpstreamAddr],
        ex: &mut Exchange,
    ) -> Result<(TcpStream, UpstreamAddr), Refusal> {
        let started = std::time::Instant::now();
        let (stream, dialed) =
            dialer::dial_first(self.dialer.as_ref(), addrs, self.config.connect_timeout)
                .await
                .map_err(|e| e.refusal())?;
        self.telemetry
            .metrics
            .upstream_connect
            .observe(started.elapsed().as_secs_f64());
        ex.dialed = Some(dialed);
        Ok((stream, dialed))
    }

    /// Phase 7 for upgraded connections and tunnels behind the TLS listener: copies bytes
    /// both ways until either side ends, the lease closes, a drain runs out or the tunnel
    /// idles (see `Proxy::relay_counted`).
    pub async fn relay<C, U>(
        &self,
        client: C,
        upstream: U,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let copy = body::relay(client, upstream, self.watch(ex, token));
        self.relay_counted(ex, copy).await;
    }

    /// Phase 7 for a plain TCP tunnel: [`Proxy::relay`]'s contract, spliced on Linux.
    pub async fn relay_tcp(
        &self,
        client: TcpStream,
        upstream: TcpStream,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) {
        #[cfg(target_os = "linux")]
        {
            let spliced = super::splice::relay(client, upstream, self.watch(ex, token));
            self.relay_counted(ex, spliced).await;
        }
        #[cfg(not(target_os = "linux"))]
        self.relay(client, upstream, token, ex).await;
    }

    /// What a relay of `ex` counts into and what ends it.
    fn watch<'a>(&'a self, ex: &Exchange, token: &'a CancellationToken) -> body::Watch<'a> {
        body::Watch {
            up: ex.bytes_up.clone(),
            down: ex.bytes_down.clone(),
            lease: token,
            hard_stop: &self.hard_stop,
            idle: self.config.tunnel_idle_timeout,
        }
    }

    /// Runs a relay counted as an open tunnel; the way it ended goes on the exchange's line.
    async fn relay_counted(&self, ex: &mut Exchange, relay: impl Future<Output = body::RelayEnd>) {
        let lease = ex.lease_id.clone().unwrap_or_default();
        self.telemetry.metrics.tunnel_opened(&lease);
        let end = relay.await;
        self.telemetry.metrics.tunnel_closed(&lease);
        ex.error = end.describe();
    }

    /// Records a refusal on the exchange and, for a revoking code under `--on-refusal
    /// revoke`, revokes the lease before answering — so the next request already sees it.
    pub async fn record_refusal(&self, ex: &mut Exchange, refusal: &Refusal) {
        ex.verdict = LoggedVerdict::Refuse;
        ex.code = Some(refusal.code);
        let Some(lease_id) = ex.lease_id.clone() else {
            return;
        };
        let revokes = refusal.code.is_policy()
            && self.config.on_refusal == OnRefusal::Revoke
            && self.config.mode == Mode::Enforce;
        if !revokes {
            return;
        }
        let egress = RefusedEgress {
            method: ex.method.as_str(),
            target: ex.target.as_ref(),
            shown_target: ex.target_text("?"),
            refusal,
            client: ex.client,
            listener: ex.listener,
        };
        match self.registry.revoke_for_refusal(&lease_id, &egress).await {
            Ok(revoked) => ex.revoked = Some(revoked),
            // Revoked in memory and torn down; its record waits in the durable queue.
            Err(error) if error.revoked_in_memory() => {
                tracing::warn!(%error, lease = %lease_id, "revoked after a refusal; the record is queued");
                ex.revoked = Some(true);
            }
            Err(error) => {
                tracing::error!(%error, lease = %lease_id, "could not revoke the lease after a refusal");
                ex.revoked = Some(false);
            }
        }
    }

    /// The one rescue point: a refusal becomes the client's response (and maybe a revocation).
    pub async fn refuse(
        &self,
        ex: &mut Exchange,
        refusal: Refusal,
        target_fallback: &str,
    ) -> Response<Body> {
        ex.observe_decision();
        self.record_refusal(ex, &refusal).await;
        ex.status = Some(refusal.code.status().as_u16());
        tracing::info!(code = %refusal.code, lease = %ex.lease_id.as_deref().unwrap_or("(none)"), method = %ex.method, target = %ex.target_text(target_fallback), "refused");
        refusal::response(
            &refusal,
            ex.method.as_str(),
            &ex.target_text(target_fallback),
            ex.lease_id.as_deref(),
        )
    }
}

/// TRACE and TRACK echo the request back (credentials included): never forwarded.
fn is_trace(method: &str) -> bool {
    method.eq_ignore_ascii_case("TRACE") || method.eq_ignore_ascii_case("TRACK")
}
