//! Our side toward upstreams: name resolution, dialling checked addresses, and the pool of
//! idle forwarded-request connections.
//!
//! Invariant: connects only to [`UpstreamAddr`]s (built by the address guard); the pool is
//! keyed by that checked address, never by a name, so a rebinding name cannot reuse a
//! connection to an address it no longer resolves to.

use super::refusal::{Code, Refusal};
use super::UpBody;
use crate::policy::UpstreamAddr;
use hyper::client::conn::http1::SendRequest;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

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

/// Connects to the first checked address that answers; each attempt has `timeout`.
pub async fn dial(
    addrs: &[UpstreamAddr],
    timeout: Duration,
) -> Result<(TcpStream, UpstreamAddr), Refusal> {
    let mut last = Refusal::new(Code::UpstreamUnreachable, "no address to dial");
    for &addr in addrs {
        match tokio::time::timeout(timeout, TcpStream::connect(addr.socket_addr())).await {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                return Ok((stream, addr));
            }
            Ok(Err(e)) => {
                last = Refusal::new(
                    Code::UpstreamUnreachable,
                    format!("connecting to {addr}: {e}"),
                )
            }
            Err(_) => {
                last = Refusal::new(
                    Code::UpstreamTimeout,
                    format!("connecting to {addr} timed out after {timeout:?}"),
                )
            }
        }
    }
    Err(last)
}

/// Idle connections kept per upstream address.
const IDLE_PER_ADDR: usize = 32;
/// How long an idle connection may wait for reuse.
const IDLE_FOR: Duration = Duration::from_secs(60);

/// A pooled connection and when it went idle.
type Idle = (SendRequest<UpBody>, Instant);

/// Idle HTTP/1.1 connections to upstreams, keyed by checked address.
#[derive(Default)]
pub struct Pool {
    idle: Mutex<HashMap<UpstreamAddr, Vec<Idle>>>,
}

impl Pool {
    /// An idle, ready connection to `addr`, if one is pooled.
    pub fn checkout(&self, addr: UpstreamAddr) -> Option<SendRequest<UpBody>> {
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
    pub fn checkin(self: &Arc<Pool>, addr: UpstreamAddr, mut sender: SendRequest<UpBody>) {
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
