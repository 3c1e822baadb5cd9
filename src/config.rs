//! Resolved, validated configuration for `serve`: parsed addresses, loaded keys, compiled
//! options. Built from the raw flags in `cli.rs` by `main`.

use crate::contract::Keyring;
use crate::proxy::ProxyConfig;
use crate::telemetry::egress::Destination;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::PathBuf;

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The shared proxy listener.
    pub listen: SocketAddr,
    pub journal: PathBuf,
    pub keyring: Keyring,
    /// `None`: no egress log.
    pub egress: Option<Destination>,
    pub proxy: ProxyConfig,
    /// The admin API listener; `None`: no admin API.
    pub admin: Option<SocketAddr>,
    /// Per-lease ports: the range and the address they bind.
    pub lease_ports: Option<(RangeInclusive<u16>, IpAddr)>,
    /// Certificate chain and key (PEM) for a TLS proxy listener.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Bearer token every admin route but `/healthz` requires.
    pub admin_token: Option<String>,
    /// How long a drain waits for requests and tunnels before closing them.
    pub drain_timeout: std::time::Duration,
}
