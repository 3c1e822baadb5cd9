//! `GET /status`: the health panel in one answer, as Squid's cache manager or Envoy's admin
//! page give it — what listens where, whether the proxy is ready and why not, which build
//! runs, how far behind the journal is, and the limits in force.
//!
//! Invariant: read-only and of fixed size: it reads counters and the configuration, never
//! walks the leases, so it costs the same at ten leases and at a million.

use super::AdminState;
use crate::config::{Mode, OnRefusal};
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Whether the proxy is ready, and if not why: the one decision `/readyz` and `/status` show.
pub fn readiness(state: &AdminState) -> Option<String> {
    match state.ready.load(Ordering::SeqCst) {
        true => state
            .proxy
            .registry
            .journal_problem()
            .or_else(|| state.proxy.descriptors.problem()),
        false => Some("starting or draining".to_owned()),
    }
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// The health panel's figures.
pub fn status(state: &AdminState) -> Value {
    let proxy = &state.proxy;
    let config = &proxy.config;
    let registry = &proxy.registry;
    let store = registry.store_health();
    let problem = readiness(state);
    let open_connections = config
        .max_connections
        .saturating_sub(proxy.connections.available_permits());
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "build": {
            "profile": if cfg!(debug_assertions) { "debug" } else { "release" },
            "target": format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
        },
        "up_seconds": state.started.elapsed().as_secs(),
        "ready": problem.is_none(),
        "reason": problem,
        "listeners": {
            "proxy": state.proxy_addr.to_string(),
            "admin": state.hosts.bound().to_string(),
            "lease_ports": state.ports.as_ref().map(|p| json!({
                "bind": p.bind.to_string(),
                "first": p.range.start(),
                "last": p.range.end(),
            })),
            "tls": proxy.tls.is_some(),
        },
        "mode": match config.mode { Mode::Enforce => "enforce", Mode::Report => "report" },
        "on_refusal": match config.on_refusal { OnRefusal::Revoke => "revoke", OnRefusal::Log => "log" },
        "journal": {
            "follow_lag_seconds": registry.follow_lag().map(seconds),
            "store_lag_seconds": seconds(store.lag),
            "store_reconnects": store.reconnects,
            "pending_appends": registry.pending(),
            "append_failures": registry.append_failures(),
        },
        "connections": {
            "open": open_connections,
            "admin_turned_away": state.refused_connections.load(Ordering::Relaxed),
        },
        "egress_log_dropped": proxy.telemetry.egress.dropped(),
        "limits": {
            "max_connections": config.max_connections,
            "max_connections_per_lease": config.max_connections_per_lease,
            "max_connections_per_client": config.max_connections_per_client,
            "max_header_bytes": config.max_header_bytes,
            "header_read_timeout_seconds": seconds(config.header_read_timeout),
            "tunnel_idle_timeout_seconds": seconds(config.tunnel_idle_timeout),
            "dns_timeout_seconds": seconds(config.dns_timeout),
            "connect_timeout_seconds": seconds(config.connect_timeout),
            "upstream_response_timeout_seconds": seconds(config.upstream_response_timeout),
            "connect_ports": config.connect_ports.to_string(),
            "forward_ports": config.forward_ports.to_string(),
            "max_open_files": proxy.descriptors.limit(),
        },
    })
}
