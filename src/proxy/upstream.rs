//! Our side toward upstreams: name resolution and the pool of idle forwarded-request
//! connections.
//!
//! Invariant: the pool is keyed by the checked address ([`UpstreamAddr`]), never by a name, so
//! a rebinding name cannot reuse a connection to an address it no longer resolves to.

use super::body::Body;
use crate::policy::refusal::{Code, Refusal};
use crate::policy::UpstreamAddr;
use hyper::client::conn::http1::SendRequest;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How names become addresses.
#[derive(Debug, Clone, Default)]
pub struct Resolver {
    /// Fixed answers (`--resolve NAME=ADDR`, and the test harness), consulted first.
    pub overrides: HashMap<String, Vec<IpAddr>>,
    /// Fall back to the system resolver for other names.
    pub system: bool,
}

impl Resolver {
    pub fn system() -> Resolver {
        Resolver {
            overrides: HashMap::new(),
            system: true,
        }
    }

    /// Resolves `name` once, within `timeout`.
    pub async fn resolve(
        &self,
        name: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<Vec<SocketAddr>, Refusal> {
        if let Some(ips) = self.overrides.get(name) {
            return Ok(ips.iter().map(|&ip| SocketAddr::new(ip, port)).collect());
        }
        if !self.system {
            return Err(Refusal::new(
                Code::DnsFailed,
                format!("{name} does not resolve"),
            ));
        }
        match tokio::time::timeout(timeout, tokio::net::lookup_host((name, port))).await {
            Ok(Ok(addrs)) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                if addrs.is_empty() {
                    Err(Refusal::new(
                        Code::DnsFailed,
                        format!("{name} has no addresses"),
                    ))
                } else {
                    Ok(addrs)
                }
            }
            Ok(Err(e)) => Err(Refusal::new(
                Code::DnsFailed,
                format!("{name} does not resolve: {e}"),
            )),
            Err(_) => Err(Refusal::new(
                Code::DnsFailed,
                format!("resolving {name} timed out after {timeout:?}"),
            )),
        }
    }
}

/// Idle connections kept per upstream address.
const IDLE_PER_ADDR: usize = 32;
/// How long an idle connection may wait for reuse.
const IDLE_FOR: Duration = Duration::from_secs(60);

/// A pooled connection and when it went idle.
type Idle = (SendRequest<Body>, Instant);

/// Idle HTTP/1.1 connections to upstreams, keyed by checked address.
#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<UpstreamAddr, Vec<Idle>>>,
}

impl Pool {
    /// An idle, ready connection to `addr`, if one is pooled.
    pub fn checkout(&self, addr: UpstreamAddr) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(&addr)?;
        while let Some((sender, since)) = list.pop() {
            if sender.is_ready() && since.elapsed() < IDLE_FOR {
                return Some(sender);
            }
        }
        None
    }

    /// Returns a connection to the pool once its current exchange has finished.
    pub fn checkin(self: &Arc<Pool>, addr: UpstreamAddr, mut sender: SendRequest<Body>) {
        let pool = self.clone();
        tokio::spawn(async move {
            if sender.ready().await.is_ok() {
                let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
                let list = idle.entry(addr).or_default();
                list.retain(|(s, since)| !s.is_closed() && since.elapsed() < IDLE_FOR);
                if list.len() < IDLE_PER_ADDR {
                    list.push((sender, Instant::now()));
                }
            }
        });
    }
}
