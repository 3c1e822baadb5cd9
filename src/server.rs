//! Starting, draining and stopping a proxy: load the journal, bind every listener, follow the
//! journal, keep per-lease ports in step, reap idle upstream connections and closed leases'
//! metric series on timers, serve until told to stop.
//!
//! Invariant: the guard knows every address we listen on (proxy, admin, the per-lease range)
//! and, for wildcard listeners, every interface address of the host (read again every 30 s)
//! before the first connection is accepted, so no request can be routed back into leasegate;
//! `/readyz` is 200 only between "journal loaded and every listener bound" and the start of a
//! drain.

use crate::admin::{self, AdminHosts, AdminState};
use crate::config::ServeConfig;
use crate::policy::guard::LocalAddrs;
use crate::proxy::lease_ports::LeasePorts;
use crate::proxy::{self, Proxy, Workers};
use crate::registry::follower::Follower;
use crate::registry::open::{clock_path, open_registry};
use crate::registry::{Clock, ClockError, OpenError};
use crate::telemetry::egress::Destination;
use crate::telemetry::{egress_stream, EgressLog, EgressStream, Telemetry};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Journal(#[from] OpenError),
    #[error("listening on {addr}: {error}")]
    Bind {
        addr: SocketAddr,
        error: std::io::Error,
    },
    #[error("opening the egress log {path}: {error}")]
    Egress { path: String, error: std::io::Error },
    #[error("TLS listener: {0}")]
    Tls(String),
    #[error("starting the connection workers: {0}")]
    Workers(std::io::Error),
    #[error("starting the journal follower's thread: {0}")]
    Follower(std::io::Error),
    #[error("starting the admin API's threads: {0}")]
    Admin(std::io::Error),
    #[error("the lease port assignments under {data_dir} (--data-dir): {error}")]
    LeasePorts {
        data_dir: String,
        error: std::io::Error,
    },
    #[error(transparent)]
    Clock(#[from] ClockError),
    #[error("the spend log {path}: {error}")]
    SpendLog { path: String, error: String },
    #[error("the approval store: {0}")]
    Approvals(String),
}

/// How long a drain waits, after closing what was left, for the last exchanges to end.
const AFTER_HARD_STOP: Duration = Duration::from_secs(5);

/// A running proxy.
pub struct Server {
    /// The bound proxy address (useful with port 0).
    pub addr: SocketAddr,
    /// The bound admin address, if any.
    pub admin_addr: Option<SocketAddr>,
    pub proxy: Arc<Proxy>,
    pub ports: Option<Arc<LeasePorts>>,
    admin: Option<Arc<AdminState>>,
    drain_timeout: Duration,
    /// Stops accepting (proxy and lease ports) and starts graceful connection shutdown.
    accepting: CancellationToken,
    /// Stops the journal follower, the admin API, the pool reaper and the series pruner.
    background: CancellationToken,
    /// The journal follower's own thread (the store lives there too); stops when dropped.
    _follower: Follower,
}

/// When the oldest lease open now was issued (now, when none is): budgets need every model
/// call of the open leases and their subtrees, and a child is issued after its parent.
fn oldest_open(registry: &crate::registry::Registry) -> crate::contract::Timestamp {
    let now = crate::contract::Timestamp::now();
    let snapshot = registry.snapshot();
    snapshot
        .ledger
        .leases()
        .filter(|lease| {
            snapshot
                .ledger
                .status(&lease.id, now)
                .is_some_and(|status| status == crate::registry::Status::Open)
        })
        .map(|lease| lease.issued_at)
        .min()
        .unwrap_or(now)
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|error| StartError::Bind { addr, error })?;
    let bound = listener
        .local_addr()
        .map_err(|error| StartError::Bind { addr, error })?;
    Ok((listener, bound))
}

/// A rustls acceptor from PEM files (HTTP/1.1 only).
fn tls_acceptor(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<tokio_rustls::TlsAcceptor, StartError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read_error = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
        StartError::Tls(format!("{what} {}: {e}", path.display()))
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| read_error("certificate", cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| read_error("certificate", cert, &e))?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| read_error("key", key, &e))?;
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| StartError::Tls(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| StartError::Tls(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// How often the host's interface addresses are read again: DHCP, VPNs and hot-plugged
/// interfaces change them while we run.
const LOCAL_ADDRS_EVERY: Duration = Duration::from_secs(30);

/// Every address of the host's interfaces, or why they cannot be read.
fn interface_addrs() -> nix::Result<Vec<IpAddr>> {
    let mut addrs: Vec<IpAddr> = nix::ifaddrs::getifaddrs()?
        .filter_map(|interface| {
            let address = interface.address?;
            address
                .as_sockaddr_in()
                .map(|a| IpAddr::V4(a.ip()))
                .or_else(|| address.as_sockaddr_in6().map(|a| IpAddr::V6(a.ip())))
        })
        .collect();
    addrs.sort_unstable();
    addrs.dedup();
    Ok(addrs)
}

/// Reads the interface addresses into `local` (off the runtime's threads: getifaddrs is a
/// blocking netlink exchange).
async fn read_local_addrs(local: &LocalAddrs) {
    match tokio::task::spawn_blocking(interface_addrs).await {
        Ok(read) => update_local_addrs(local, read),
        Err(error) => {
            tracing::warn!(%error, "reading the interface addresses failed; the last ones read are kept")
        }
    }
}

/// Takes a fresh read of the interface addresses. A failed read keeps what was known (fail
/// closed: an address once ours stays recognised as ours, never forgotten by an error);
/// loopback and the unspecified address are recognised without the list.
fn update_local_addrs(local: &LocalAddrs, read: nix::Result<Vec<IpAddr>>) {
    match read {
        Ok(addrs) => {
            if **local.load() != addrs {
                tracing::debug!(?addrs, "interface addresses");
                local.store(Arc::new(addrs));
            }
        }
        Err(error) => {
            tracing::warn!(%error, known = ?**local.load(), "reading the interface addresses failed: the last ones read are kept");
        }
    }
}

/// Keeps the guard's interface addresses current until `shutdown`.
async fn refresh_local_addrs(local: LocalAddrs, every: Duration, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => read_local_addrs(&local).await,
        }
    }
}

/// How often closed leases' metric series are looked for: half the grace (a series goes at
/// most grace + 2 periods after its lease closed), at most every 30 s, at least 10 ms apart.
fn prune_every(grace: Duration) -> Duration {
    (grace / 2).clamp(Duration::from_millis(10), Duration::from_secs(30))
}

/// Drops the metric series of closed leases on a timer, so they go even when nobody scrapes
/// `/metrics` (or there is no admin listener at all).
async fn prune_series(proxy: Arc<Proxy>, every: Duration, shutdown: CancellationToken) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {
                let now = proxy.registry.now();
                let snapshot = proxy.registry.snapshot();
                proxy
                    .telemetry
                    .metrics
                    .prune(|id| snapshot.ledger.check_chain(id, now).is_ok());
                // A retired lease spends nothing more, nor does anything under it.
                proxy
                    .telemetry
                    .spending
                    .retain(|id| snapshot.ledger.retired(id).is_none());
            }
        }
    }
}

/// Opens the spend log for this journal, restores what earlier runs spent (charging the
/// calls they left in flight their bound) and keeps `telemetry`'s spending in it from now
/// on. Returns the egress-stream publisher ids of this run and the earlier ones: their calls
/// are counted from the log, not again from the stream.
async fn open_spend_log(
    journal: &crate::registry::JournalLocation,
    store: &crate::registry::StoreOptions,
    telemetry: &Telemetry,
) -> Result<std::collections::HashSet<String>, StartError> {
    let path = crate::registry::open::spent_path(journal, store);
    let shown = path.display().to_string();
    let failed = |error: String| StartError::SpendLog {
        path: shown.clone(),
        error,
    };
    let dir = path.parent().map(std::path::Path::to_owned);
    let opened = tokio::task::spawn_blocking(move || {
        if let Some(dir) = dir.filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        crate::budget::log::SpendLog::open(path)
    })
    .await
    .map_err(|e| failed(e.to_string()))?;
    let (log, restored) = opened.map_err(|e| failed(e.to_string()))?;
    for (chain, spent) in &restored.totals {
        telemetry
            .spending
            .restore(chain.iter().map(String::as_str), spent);
    }
    if restored.charged_at_bound > 0 {
        tracing::warn!(
            path = %shown,
            calls = restored.charged_at_bound,
            "model calls were in flight when the last run ended: each is charged its bound"
        );
    }
    if restored.unreadable > 0 {
        tracing::warn!(path = %shown, lines = restored.unreadable, "lines of the spend log did not read (a line torn by a crash): skipped");
    }
    let mut own: std::collections::HashSet<String> = restored.runs.into_iter().collect();
    if let Some(publisher) = telemetry.stream.publisher_id() {
        log.run(publisher).await.map_err(failed)?;
        own.insert(publisher.to_owned());
    }
    telemetry.spending.keep_in(log);
    Ok(own)
}

/// The approval store every replica of this journal shares (a file beside a file journal,
/// `<STREAM>_APPROVALS` beside a stream), read whole and followed: any lease may name a tool
/// or a route that waits for a human.
async fn open_approvals(
    (journal, options, settings): (
        &crate::registry::JournalLocation,
        &crate::registry::StoreOptions,
        &crate::approvals::Settings,
    ),
    registry: &Arc<crate::registry::Registry>,
    stop: &CancellationToken,
) -> Result<Arc<crate::approvals::Approvals>, StartError> {
    use crate::approvals::{store::ApprovalStore, Approvals};
    let failed = |e: String| StartError::Approvals(e);
    let store = match journal {
        crate::registry::JournalLocation::File(_) => {
            ApprovalStore::File(crate::registry::open::approvals_path(journal, options))
        }
        crate::registry::JournalLocation::Nats(location) => {
            ApprovalStore::nats(location, &options.nats)
                .await
                .map_err(|e| failed(e.to_string()))?
        }
    };
    let described = store.describe();
    Approvals::open(store, settings.clone(), registry.clone(), stop.clone())
        .await
        .map_err(|e| failed(format!("{described}: {e}")))
}

/// The clock over the floor an earlier run wrote down for this journal (made if missing).
async fn open_clock(config: &ServeConfig) -> Result<Arc<Clock>, StartError> {
    let path = clock_path(&config.journal, &config.store);
    let wall = config.wall.clone();
    let dir = path.parent().map(std::path::Path::to_owned);
    let shown = path.display().to_string();
    let opened = tokio::task::spawn_blocking(move || {
        // A stream's clock lives under --data-dir, which may not exist yet.
        if let Some(dir) = dir.filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        Clock::open(&path, wall)
    })
    .await
    .map_err(|e| ClockError::Unreadable {
        path: shown,
        reason: e.to_string(),
    })??;
    Ok(Arc::new(opened))
}

/// The lease port range's assignments as an earlier run left them under `--data-dir`.
async fn open_lease_ports(
    range: std::ops::RangeInclusive<u16>,
    ip: IpAddr,
    store: &crate::registry::StoreOptions,
) -> Result<LeasePorts, StartError> {
    let (data_dir, retention) = (store.data_dir.clone(), store.closed_lease_retention);
    let failed = |data_dir: &std::path::Path, error| StartError::LeasePorts {
        data_dir: data_dir.display().to_string(),
        error,
    };
    let dir = data_dir.clone();
    tokio::task::spawn_blocking(move || LeasePorts::open(range, ip, &dir, retention))
        .await
        .map_err(|e| failed(&data_dir, std::io::Error::other(e)))?
        .map_err(|e| failed(&data_dir, e))
}

/// The listeners of a server, bound before anything else happens (so `serve --dev` issues
/// its demo lease only once the addresses are known to be free).
pub struct Bound {
    proxy: (TcpListener, SocketAddr),
    admin: Option<(TcpListener, SocketAddr)>,
}

impl Bound {
    /// The proxy listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.proxy.1
    }
}

impl Server {
    /// Loads the journal, binds the listeners and starts serving.
    pub async fn start(config: ServeConfig) -> Result<Server, StartError> {
        let bound = Server::bind(&config).await?;
        Server::start_bound(config, bound).await
    }

    /// Binds the proxy and admin listeners of `config`.
    pub async fn bind(config: &ServeConfig) -> Result<Bound, StartError> {
        let proxy = bind(config.listen).await?;
        let admin = match config.admin {
            Some(admin) => Some(bind(admin).await?),
            None => None,
        };
        Ok(Bound { proxy, admin })
    }

    /// Loads the journal and starts serving on listeners [`Server::bind`] bound.
    pub async fn start_bound(config: ServeConfig, bound: Bound) -> Result<Server, StartError> {
        // First: a floor that cannot be read stops the start before anything is folded.
        let clock = open_clock(&config).await?;
        // The store is opened on the follower's thread: a stream's connection and consumer
        // live there, beside the tail that reads them.
        let follower = Follower::start().map_err(StartError::Follower)?;
        let (journal, keyring, store) = (
            config.journal.clone(),
            config.keyring.clone(),
            config.store.clone(),
        );
        let registry = follower
            .run(async move { open_registry(&journal, keyring, &store, true).await })
            .await
            .map_err(StartError::Follower)??
            .with_clock(clock);
        // Before anything is spawned: a data directory that cannot hold the assignments stops
        // the start here.
        let ports = match config.lease_ports.clone() {
            Some((range, ip)) => Some(Arc::new(open_lease_ports(range, ip, &config.store).await?)),
            None => None,
        };
        let tls = match &config.tls {
            Some((cert, key)) => Some(tls_acceptor(cert, key)?),
            None => None,
        };
        let Bound {
            proxy: (listener, addr),
            admin,
        } = bound;
        let egress = match config.egress {
            Some(destination) => {
                let path = match &destination {
                    Destination::File(path) => path.display().to_string(),
                    Destination::Stdout => "-".to_owned(),
                };
                EgressLog::open(destination)
                    .await
                    .map_err(|error| StartError::Egress { path, error })?
            }
            None => EgressLog::disabled(),
        };
        let mut proxy_config = config.proxy;
        proxy_config.guard.own.push(addr);
        proxy_config
            .guard
            .own
            .extend(admin.as_ref().map(|(_, a)| *a));
        if let Some((range, ip)) = &config.lease_ports {
            proxy_config.guard.own_ranges.push((*ip, range.clone()));
        }
        let local = proxy_config.guard.local.clone();
        read_local_addrs(&local).await;
        let registry = Arc::new(registry);
        // With secrets (some metered now, or after a reload), every replica's model calls
        // count against budgets: followed from the egress stream, from the oldest open lease's
        // start on.
        let follow = match &config.egress_stream {
            Some(stream) if config.broker.is_some() => Some(egress_stream::follow(
                stream.location.clone(),
                stream.nats.clone(),
                stream.key.clone(),
                oldest_open(&registry),
            )),
            _ => None,
        };
        let stream = match config.egress_stream {
            Some(stream) => {
                tracing::info!(stream = %stream.location, "publishing egress lines to the egress stream");
                EgressStream::start(stream)
            }
            None => EgressStream::disabled(),
        };
        let telemetry = Arc::new(
            Telemetry::new(
                egress,
                proxy_config.series_grace,
                proxy_config.series_max_leases,
            )
            .with_stream(stream),
        );
        let own_runs = open_spend_log(&config.journal, &config.store, &telemetry).await?;
        if let Some(follower) = follow {
            tokio::spawn(crate::budget::fold_others(
                follower,
                own_runs,
                telemetry.spending.clone(),
                registry.clone(),
            ));
        }
        let background = CancellationToken::new();
        let approvals = open_approvals(
            (&config.journal, &config.store, &config.approvals),
            &registry,
            &background,
        )
        .await?;
        let workers = proxy_config.workers;
        let mut proxy = Proxy::new(proxy_config, registry.clone(), telemetry);
        proxy.approvals = approvals;
        proxy.tls = tls;
        proxy.broker = config.broker.clone();
        proxy.workers = Workers::start(workers).map_err(StartError::Workers)?;
        let proxy = Arc::new(proxy);
        // Before anything is spawned: its threads may fail to start.
        let admin_state = match &admin {
            Some((_, admin_addr)) => Some(Arc::new(
                AdminState::new(
                    proxy.clone(),
                    ports.clone(),
                    addr,
                    config.admin_token.clone(),
                    AdminHosts::new(*admin_addr, &config.admin_hosts),
                )
                .map_err(StartError::Admin)?
                .issuing(config.issuing),
            )),
            None => None,
        };
        let accepting = CancellationToken::new();
        // Before any connection: the descriptor the journal and the admin API fall back on.
        crate::descriptors::arm_spare();
        follower.follow(registry.clone(), background.clone());
        tokio::spawn(
            proxy
                .pool
                .clone()
                .run_reaper(proxy.pool.idle_for() / 2, background.clone()),
        );
        tokio::spawn(refresh_local_addrs(
            local,
            LOCAL_ADDRS_EVERY,
            background.clone(),
        ));
        tokio::spawn(prune_series(
            proxy.clone(),
            prune_every(proxy.config.series_grace),
            background.clone(),
        ));
        if let Some(ports) = &ports {
            tokio::spawn(ports.clone().run(proxy.clone(), accepting.clone()));
        }
        // An accept loop per worker, all on the one listening socket: the worker that takes a
        // connection keeps it or hands it to the least busy one (`Workers::place`). Each loop's
        // listener is registered with its worker's event loop here, so a failure stops the
        // start rather than leaving a worker that never accepts.
        let listener = listener
            .into_std()
            .map_err(|error| StartError::Bind { addr, error })?;
        proxy
            .workers
            .spawn_each_made(|| {
                let listener = TcpListener::from_std(listener.try_clone()?)?;
                let (proxy, accepting) = (proxy.clone(), accepting.clone());
                Ok(async move {
                    if let Err(error) = proxy::serve(listener, proxy, None, accepting).await {
                        tracing::error!(%error, "the proxy listener failed");
                    }
                })
            })
            .map_err(|error| StartError::Bind { addr, error })?;
        let admin_addr = admin.as_ref().map(|(_, a)| *a);
        if config.admin_insecure {
            if let Some(admin_addr) = admin_addr.filter(|a| !a.ip().is_loopback()) {
                if config.admin_token.is_none() {
                    tracing::warn!(
                        %admin_addr,
                        "--admin-insecure: the admin API is reachable beyond loopback without a \
                         token; anyone who reaches it can list and revoke leases"
                    );
                }
            }
        }
        let admin = match (admin, admin_state) {
            (Some((admin_listener, admin_addr)), Some(state)) => {
                tokio::spawn(admin::serve(
                    admin_listener,
                    state.clone(),
                    background.clone(),
                ));
                tracing::info!(%admin_addr, "admin API listening");
                Some(state)
            }
            _ => None,
        };
        if let Some(admin) = &admin {
            admin.ready.store(true, Ordering::SeqCst);
        }
        tracing::info!(%addr, tls = proxy.tls.is_some(), "leasegate proxy listening");
        Ok(Server {
            addr,
            admin_addr,
            proxy,
            ports,
            admin,
            drain_timeout: config.drain_timeout,
            accepting,
            background,
            _follower: follower,
        })
    }

    /// Graceful drain: stop accepting, `/readyz` turns 503, requests in flight and tunnels get
    /// up to the drain timeout, then whatever is left is closed. Returns once every exchange
    /// has ended and the egress log holds its line, synced to disk (and `--egress-stream` has
    /// acknowledged it, or counted it dropped after a few seconds without NATS).
    pub async fn shutdown(self) {
        if let Some(admin) = &self.admin {
            admin.ready.store(false, Ordering::SeqCst);
        }
        // Calls waiting for a human are answered now, not at the drain's end.
        self.proxy.approvals.close();
        self.accepting.cancel();
        self.proxy.tasks.close();
        let open = self.proxy.tasks.len();
        tracing::info!(open, timeout = ?self.drain_timeout, "draining");
        if tokio::time::timeout(self.drain_timeout, self.proxy.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                left = self.proxy.tasks.len(),
                "drain timed out: closing what is left"
            );
            self.proxy.hard_stop.cancel();
        }
        // Every tunnel and request watches hard_stop, so what is left ends promptly; the
        // bound only keeps a stuck task from holding the process forever.
        let exchanges = &self.proxy.telemetry.exchanges;
        exchanges.close();
        let ended = async {
            self.proxy.tasks.wait().await;
            exchanges.wait().await;
        };
        if tokio::time::timeout(AFTER_HARD_STOP, ended).await.is_err() {
            tracing::error!(
                tasks = self.proxy.tasks.len(),
                exchanges = exchanges.len(),
                "exchanges still open after the drain: their egress lines are lost"
            );
        }
        self.background.cancel();
        // The latest time used, for the next start.
        self.proxy.registry.keep_clock().await;
        // Last: every line is queued now; write, sync and stop the writer before we return,
        // and publish what the egress stream holds (for a bounded time).
        let telemetry = &self.proxy.telemetry;
        tokio::join!(telemetry.egress.close(), telemetry.stream.close());
        tracing::info!("stopped");
    }
}

impl Drop for Server {
    /// After a drain, or a server dropped without one (tests): the workers' runtimes stop,
    /// and with them the accept loops and whatever else they still run.
    fn drop(&mut self) {
        self.accepting.cancel();
        self.background.cancel();
        self.proxy.workers.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_interface_read_forgets_no_address() {
        let local = LocalAddrs::default();
        let lan: IpAddr = "10.1.2.3".parse().unwrap();
        update_local_addrs(&local, Ok(vec![lan]));
        assert_eq!(**local.load(), vec![lan]);
        // Before: a failed read stored an empty list, and the guard stopped recognising the
        // host's own LAN address behind a wildcard listener.
        update_local_addrs(&local, Err(nix::errno::Errno::ENOBUFS));
        assert_eq!(**local.load(), vec![lan]);
        update_local_addrs(&local, Ok(vec![]));
        assert!(local.load().is_empty());
    }
}
