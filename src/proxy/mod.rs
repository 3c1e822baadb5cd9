//! The proxy: listeners, the per-connection HTTP/1.1 server, and the decision pipeline shared
//! by CONNECT tunnels and forwarded requests.
//!
//! Invariant: every CONNECT and forwarded request passes, in order: identify the lease →
//! check its chain opens now → normalise the target → host verdict → resolve and guard →
//! dial the checked address; any failure becomes exactly one refusal response (through
//! [`Proxy::refuse`]) and every exchange writes exactly one egress line.

pub mod body;
pub mod connect;
pub mod exchange;
pub mod forward;
pub mod identify;
pub mod lease_ports;
pub mod refusal;
pub mod upstream;

use crate::contract::{Lease, Timestamp};
use crate::policy::guard::Exception;
use crate::policy::target::TargetHost;
use crate::policy::verdict::{decide, HostVerdict};
use crate::policy::{Guard, HostPolicy, Target, UpstreamAddr};
use crate::registry::{Registry, Snapshot};
use crate::telemetry::egress::LoggedVerdict;
use crate::telemetry::Telemetry;
use bytes::Bytes;
use exchange::Exchange;
use http::{Request, Response};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use refusal::{Code, Refusal};
use serde_json::{json, Map};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use upstream::{Pool, Resolver};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of every response we send and every request we forward.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;
/// Request bodies toward upstreams.
pub type UpBody = Body;

pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Refuse what policy refuses.
    Enforce,
    /// Let policy refusals through, logged as `report` (for rolling out allow lists).
    Report,
}

/// `--on-refusal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// The first revoking refusal appends a signed `revoked` record.
    Revoke,
    /// Refusals are only logged.
    Log,
}

/// What the proxy needs to decide and connect, validated.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub mode: Mode,
    pub on_refusal: OnRefusal,
    pub guard: Guard,
    pub resolver: Resolver,
    pub header_read_timeout: Duration,
    /// A tunnel (or upgraded connection) with no bytes either way for this long is closed.
    pub tunnel_idle_timeout: Duration,
    /// Client connections at once, in total and per lease (`too-many-connections`).
    pub max_connections: usize,
    pub max_connections_per_lease: usize,
    /// How long the metric series of a closed lease stay visible.
    pub series_grace: Duration,
    pub max_header_bytes: usize,
    pub dns_timeout: Duration,
    pub connect_timeout: Duration,
}

impl Default for ProxyConfig {
    fn default() -> ProxyConfig {
        ProxyConfig {
            mode: Mode::Enforce,
            on_refusal: OnRefusal::Revoke,
            guard: Guard::default(),
            resolver: Resolver::system(),
            header_read_timeout: Duration::from_secs(10),
            tunnel_idle_timeout: Duration::from_secs(3600),
            max_connections: 10_000,
            max_connections_per_lease: 1_000,
            series_grace: crate::telemetry::metrics::GRACE,
            max_header_bytes: 64 * 1024,
            dns_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

/// The running proxy's shared state.
pub struct Proxy {
    pub config: ProxyConfig,
    pub registry: Arc<Registry>,
    pub telemetry: Arc<Telemetry>,
    pub pool: Arc<Pool>,
    /// One permit per open client connection (`max_connections`).
    pub connections: Arc<tokio::sync::Semaphore>,
    /// Cancelled when a drain's time is up: open tunnels and upgraded connections close.
    pub hard_stop: CancellationToken,
    /// Every connection and tunnel task, so a drain can wait for them.
    pub tasks: tokio_util::task::TaskTracker,
    /// Set: the proxy listeners speak TLS (`--tls-cert`, `--tls-key`).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Proxy {
    pub fn new(config: ProxyConfig, registry: Arc<Registry>, telemetry: Arc<Telemetry>) -> Proxy {
        Proxy {
            connections: Arc::new(tokio::sync::Semaphore::new(config.max_connections)),
            config,
            registry,
            telemetry,
            pool: Arc::new(Pool::default()),
            hard_stop: CancellationToken::new(),
            tasks: tokio_util::task::TaskTracker::new(),
            tls: None,
        }
    }
}

/// One client connection.
pub struct ConnInfo {
    pub client: SocketAddr,
    pub listener: SocketAddr,
    /// The lease of a per-lease port.
    pub port_lease: Option<String>,
    /// Cancelled to drop the connection (a lease used on it closed) and when it ends.
    closer: CancellationToken,
    /// Leases whose closing already closes this connection (each counted once against its
    /// per-lease connection limit until this connection, and any tunnel it became, ends).
    linked: Mutex<HashMap<String, CancellationToken>>,
    telemetry: Arc<Telemetry>,
    /// This connection's place under `max_connections`, held as long as the connection (or
    /// the tunnel it became) lives.
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl ConnInfo {
    /// Ties this connection to a lease: counted against the lease's connection limit, and
    /// closed when the lease's token fires.
    fn link(
        &self,
        proxy: &Proxy,
        lease_id: &str,
        now: Timestamp,
    ) -> Result<CancellationToken, Refusal> {
        let mut linked = self.linked.lock().unwrap_or_else(|e| e.into_inner());
        // Keep-alive requests of a lease already tied to this connection reuse its token.
        if let Some(token) = linked.get(lease_id).filter(|t| !t.is_cancelled()) {
            return Ok(token.clone());
        }
        let token = proxy.registry.token(lease_id, now);
        if linked.contains_key(lease_id) {
            return Ok(token);
        }
        let limit = proxy.config.max_connections_per_lease;
        if !proxy
            .telemetry
            .metrics
            .connection_opened_within(lease_id, limit)
        {
            return Err(Refusal::new(
                Code::TooManyConnections,
                format!("lease {lease_id} already has {limit} open connections"),
            ));
        }
        linked.insert(lease_id.to_owned(), token.clone());
        let (watched, closer) = (token.clone(), self.closer.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = watched.cancelled() => closer.cancel(),
                _ = closer.cancelled() => {}
            }
        });
        Ok(token)
    }

    /// Un-counts the connection from every lease it was tied to.
    fn release(&self) {
        let linked = std::mem::take(&mut *self.linked.lock().unwrap_or_else(|e| e.into_inner()));
        for lease in linked.into_keys() {
            self.telemetry.metrics.connection_closed(&lease);
        }
    }
}

/// Accepts connections until `shutdown` fires. `port_lease` makes this a per-lease port.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    port_lease: Option<String>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let local = listener.local_addr()?;
    loop {
        let (stream, client) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    // Out of descriptors and the like: back off rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = proxy.connections.clone().try_acquire_owned() else {
            proxy
                .tasks
                .spawn(refuse_connection(stream, proxy.config.max_connections));
            continue;
        };
        let conn = Arc::new(ConnInfo {
            client,
            listener: local,
            port_lease: port_lease.clone(),
            closer: CancellationToken::new(),
            linked: Mutex::new(HashMap::new()),
            telemetry: proxy.telemetry.clone(),
            _permit: permit,
        });
        let (proxy, shutdown) = (proxy.clone(), shutdown.clone());
        proxy.tasks.clone().spawn(async move {
            handle_connection(proxy, stream, conn, shutdown).await;
        });
    }
}

/// Answers a connection over the total limit with 429 and closes it.
async fn refuse_connection(mut stream: TcpStream, limit: usize) {
    use tokio::io::AsyncWriteExt;
    let body =
        format!("leasegate refused the connection: too-many-connections (all {limit} in use)\n");
    let response = format!(
        "HTTP/1.1 429 Too Many Requests\r\nx-leasegate-refusal: too-many-connections\r\n\
         content-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
}

async fn handle_connection(
    proxy: Arc<Proxy>,
    stream: TcpStream,
    conn: Arc<ConnInfo>,
    shutdown: CancellationToken,
) {
    let _ = stream.set_nodelay(true);
    match proxy.tls.clone() {
        None => serve_io(&proxy, TokioIo::new(stream), &conn, &shutdown).await,
        Some(acceptor) => {
            // The handshake counts against the header-read timeout: a silent client goes.
            match tokio::time::timeout(proxy.config.header_read_timeout, acceptor.accept(stream))
                .await
            {
                Ok(Ok(tls)) => serve_io(&proxy, TokioIo::new(tls), &conn, &shutdown).await,
                Ok(Err(error)) => {
                    tracing::debug!(%error, client = %conn.client, "TLS handshake failed")
                }
                Err(_) => tracing::debug!(client = %conn.client, "TLS handshake timed out"),
            }
        }
    }
    conn.closer.cancel();
}

impl Drop for ConnInfo {
    /// The last holder (the connection task, or the tunnel it became) is gone.
    fn drop(&mut self) {
        self.release();
    }
}

async fn serve_io<I>(
    proxy: &Arc<Proxy>,
    io: TokioIo<I>,
    conn: &Arc<ConnInfo>,
    shutdown: &CancellationToken,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service_conn = conn.clone();
    let service_proxy = proxy.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (proxy, conn) = (service_proxy.clone(), service_conn.clone());
        async move { Ok::<_, std::convert::Infallible>(dispatch(proxy, conn, req).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(proxy.config.header_read_timeout)
        .max_buf_size(proxy.config.max_header_bytes.max(8192))
        .keep_alive(true);
    let connection = builder.serve_connection(io, service).with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, client = %conn.client, "client connection ended with an error");
            }
        }
        _ = conn.closer.cancelled() => {
            tracing::debug!(client = %conn.client, "connection closed: its lease closed");
        }
        _ = shutdown.cancelled() => {
            // Drain: finish the request in flight (until the drain's time is up), then close.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = proxy.hard_stop.cancelled() => {}
                _ = conn.closer.cancelled() => {}
            }
        }
    }
}

async fn dispatch(
    proxy: Arc<Proxy>,
    conn: Arc<ConnInfo>,
    req: Request<Incoming>,
) -> Response<Body> {
    if req.method() == http::Method::CONNECT {
        connect::handle(proxy, conn, req).await
    } else {
        forward::handle(proxy, conn, req).await
    }
}

/// A lease that passed identification and the chain check.
pub struct Admitted {
    pub lease_id: String,
    /// The lease first, then its ancestors.
    pub chain: Vec<Arc<Lease>>,
    pub snapshot: Arc<Snapshot>,
    /// Cancelled when the lease (or an ancestor) closes.
    pub token: CancellationToken,
}

impl Admitted {
    fn policies(&self) -> impl Iterator<Item = (&str, &HostPolicy)> + Clone {
        self.chain.iter().map(|lease| {
            let policy = self
                .snapshot
                .policies
                .get(&lease.id)
                .map(Arc::as_ref)
                .unwrap_or(&EMPTY_POLICY);
            (lease.id.as_str(), policy)
        })
    }

    /// The host verdict of `host` for this chain.
    pub fn verdict(&self, host: &TargetHost) -> HostVerdict<'_> {
        decide(self.policies(), host)
    }
}

static EMPTY_POLICY: std::sync::LazyLock<HostPolicy> =
    std::sync::LazyLock::new(HostPolicy::default);

impl Proxy {
    /// Phases 1 and 2: the lease of the request, and whether its chain opens now.
    pub fn admit(
        &self,
        conn: &ConnInfo,
        headers: &http::HeaderMap,
        ex: &mut Exchange,
    ) -> Result<Admitted, Refusal> {
        let identity = identify::identify(headers, conn.port_lease.as_deref())?;
        ex.lease_id = Some(identity.lease_id.clone());
        ex.label = identity.label;
        let snapshot = self.registry.snapshot();
        ex.lease_known = snapshot.ledger.lease(&identity.lease_id).is_some();
        let now = Timestamp::now();
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

    /// Phase 4: the host verdict over the chain.
    pub fn judge_host(
        &self,
        admitted: &Admitted,
        target: &Target,
        ex: &mut Exchange,
    ) -> Result<(), Refusal> {
        match refusal::host_refusal(admitted.verdict(&target.host), &target.host) {
            Ok(_) => Ok(()),
            Err(refusal) => self.policy_failure(ex, refusal),
        }
    }

    /// Phase 5: resolve once, drop guarded addresses; what survives may be dialled.
    pub async fn route(
        &self,
        admitted: &Admitted,
        target: &Target,
        ex: &mut Exchange,
    ) -> Result<Vec<UpstreamAddr>, Refusal> {
        let resolved = match &target.host {
            TargetHost::Ip(ip) => vec![SocketAddr::new(*ip, target.port)],
            TargetHost::Name(name) => self
                .config
                .resolver
                .resolve(name, target.port, self.config.dns_timeout)
                .await
                .map_err(|e| Refusal::new(Code::DnsFailed, e.to_string()))?,
        };
        let listed_by_all = |host: &TargetHost| {
            admitted
                .policies()
                .all(|(_, p)| p.allow.lists_exactly(host))
        };
        let exception = match &target.host {
            TargetHost::Ip(ip) if listed_by_all(&target.host) => Exception::Ip(*ip),
            TargetHost::Name(name) if name == "localhost" && listed_by_all(&target.host) => {
                Exception::Localhost
            }
            _ => Exception::None,
        };
        let checked =
            self.config
                .guard
                .check(&resolved, exception, self.config.mode == Mode::Enforce);
        let blocked = checked.blocked.first().map(|b| {
            Refusal::new(
                Code::AddressNotAllowed,
                format!("{} resolves to {}, {}", target.host, b.addr.ip(), b.why),
            )
        });
        self.observe_decision(ex);
        match (checked.dialable.is_empty(), blocked) {
            (true, Some(refusal)) => Err(refusal),
            (true, None) => Err(Refusal::new(
                Code::DnsFailed,
                format!("{} has no addresses", target.host),
            )),
            (false, Some(refusal)) if self.config.mode == Mode::Report => {
                self.policy_failure(ex, refusal)?;
                Ok(checked.dialable)
            }
            (false, _) => Ok(checked.dialable),
        }
    }

    /// Observes the decision latency of an exchange, once.
    fn observe_decision(&self, ex: &mut Exchange) {
        if !std::mem::replace(&mut ex.decided, true) {
            self.telemetry
                .metrics
                .decision
                .observe(ex.elapsed().as_secs_f64());
        }
    }

    /// Phase 6: connects to the first checked address that answers (timed).
    pub async fn dial(
        &self,
        addrs: &[UpstreamAddr],
        ex: &mut Exchange,
    ) -> Result<(TcpStream, UpstreamAddr), Refusal> {
        let started = std::time::Instant::now();
        let (stream, dialed) = upstream::dial(addrs, self.config.connect_timeout).await?;
        self.telemetry
            .metrics
            .upstream_connect
            .observe(started.elapsed().as_secs_f64());
        ex.dialed = Some(dialed);
        Ok((stream, dialed))
    }

    /// Phase 7 for tunnels and upgraded connections: copies bytes both ways until either side
    /// ends, the lease closes, a drain runs out or the tunnel idles; counted as an open tunnel
    /// meanwhile, and the way it ended goes on the exchange's line.
    pub async fn splice<C, U>(
        &self,
        client: C,
        upstream: U,
        token: &CancellationToken,
        ex: &mut Exchange,
    ) where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let lease = ex.lease_id.clone().unwrap_or_default();
        self.telemetry.metrics.tunnel_opened(&lease);
        let end = body::splice(
            client,
            upstream,
            ex.bytes_up.clone(),
            ex.bytes_down.clone(),
            token,
            &self.hard_stop,
            self.config.tunnel_idle_timeout,
        )
        .await;
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
        let target = ex.target_text("?");
        let mut extra = Map::new();
        extra.insert(
            "egress".into(),
            json!({
                "method": ex.method,
                "host": ex.target.as_ref().map(|t| t.host.as_text()),
                "port": ex.target.as_ref().map(|t| t.port),
                "code": refusal.code.as_str(),
                "detail": refusal.detail,
                "client": ex.client.to_string(),
                "listener": ex.listener.to_string(),
            }),
        );
        let reason = format!(
            "leasegate refused {} {target}: {} ({})",
            ex.method, refusal.code, refusal.detail
        );
        match self.registry.revoke(&lease_id, &reason, extra).await {
            Ok(revoked) => ex.revoked = Some(revoked),
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
        self.observe_decision(ex);
        self.record_refusal(ex, &refusal).await;
        ex.status = Some(refusal.code.status().as_u16());
        tracing::info!(code = %refusal.code, lease = ?ex.lease_id, method = %ex.method, target = %ex.target_text(target_fallback), "refused");
        refusal::response(
            &refusal,
            &ex.method,
            &ex.target_text(target_fallback),
            ex.lease_id.as_deref(),
        )
    }
}
