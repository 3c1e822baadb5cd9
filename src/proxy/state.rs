//! The running proxy's shared state: configuration, registry, telemetry, upstream pool, dialer
//! and the drain's handles.
//!
//! Invariant: built once per `serve` (or per `check`) and shared read-only behind an `Arc`;
//! everything mutable inside it synchronises itself.

use super::dialer::{Dialer, TcpDialer};
use super::upstream::Pool;
use crate::config::ProxyConfig;
use crate::registry::Registry;
use crate::telemetry::Telemetry;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The running proxy's shared state.
pub struct Proxy {
    pub config: ProxyConfig,
    /// Folded lease state: what every decision reads, and where revocations go.
    pub registry: Arc<Registry>,
    /// Egress log, metrics and recent refusals: where every exchange ends up.
    pub telemetry: Arc<Telemetry>,
    /// Idle keep-alive connections to upstreams, for forwarded requests.
    pub pool: Arc<Pool>,
    /// How phase 6 connects (a test double watches every dial).
    pub dialer: Arc<dyn Dialer>,
    /// One permit per open client connection (`max_connections`).
    pub connections: Arc<tokio::sync::Semaphore>,
    /// Open client connections per source IP (`max_connections_per_client`).
    pub clients: Arc<super::connection::ClientCounts>,
    /// Cancelled when a drain's time is up: open tunnels and upgraded connections close.
    pub hard_stop: CancellationToken,
    /// Every connection and tunnel task, so a drain can wait for them.
    pub tasks: tokio_util::task::TaskTracker,
    /// Set: the proxy listeners speak TLS (`--tls-cert`, `--tls-key`).
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// The threads connections live on (`serve`); none: the caller's runtime.
    pub workers: super::Workers,
    /// The descriptor line the accept loops stop at, and what happened there.
    pub descriptors: Arc<crate::descriptors::Descriptors>,
    /// Set: tunnels to the hosts of its secrets are terminated (`--secrets`, `--ca-dir`).
    pub broker: Option<Arc<crate::intercept::Broker>>,
    /// Where calls needing a human's approval wait (none: such a call is refused).
    pub approvals: Arc<crate::approvals::Approvals>,
}

impl Proxy {
    pub fn new(config: ProxyConfig, registry: Arc<Registry>, telemetry: Arc<Telemetry>) -> Proxy {
        let max_connections = config.max_connections;
        Proxy {
            connections: Arc::new(tokio::sync::Semaphore::new(config.max_connections)),
            clients: Arc::default(),
            config,
            registry,
            telemetry,
            // Idle upstream connections count against the descriptor budget: at most one
            // per client connection allowed.
            pool: Arc::new(Pool::default().holding_at_most(max_connections)),
            dialer: Arc::new(TcpDialer),
            hard_stop: CancellationToken::new(),
            tasks: tokio_util::task::TaskTracker::new(),
            tls: None,
            workers: super::Workers::default(),
            descriptors: Arc::new(crate::descriptors::Descriptors::current()),
            broker: None,
            approvals: Arc::new(crate::approvals::Approvals::none()),
        }
    }
}
