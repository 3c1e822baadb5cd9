//! One client connection's state: where it came from, the leases it is tied to, and the
//! places it holds under the connection limits.
//!
//! Invariant: a connection holds one slot of its source IP until it is first tied to a lease
//! and its `max_connections` permit for as long as it (or a tunnel it became) lives; it is
//! counted once against each lease it is tied to, un-counted when the last holder drops it,
//! and closes when any of those leases closes.

use super::workers::Placed;
use crate::contract::Timestamp;
use crate::fast_hash::FastMap;
use crate::policy::codes::{Code, Refusal};
use crate::registry::Registry;
use crate::telemetry::Telemetry;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use tokio_util::sync::CancellationToken;

/// One client connection: where it came from and which leases it is tied to.
pub struct ClientConn {
    pub client: SocketAddr,
    pub listener: SocketAddr,
    /// The lease of a per-lease port.
    pub port_lease: Option<String>,
    /// Cancelled to drop the connection (a lease used on it closed) and when it ends.
    closer: CancellationToken,
    /// Leases whose closing already closes this connection (each counted once against its
    /// per-lease connection limit until this connection, and any tunnel it became, ends).
    linked: Mutex<FastMap<String, CancellationToken>>,
    /// Where the per-lease connection counts live.
    telemetry: Arc<crate::telemetry::Telemetry>,
    /// This connection's place under `max_connections`, held as long as the connection (or
    /// the tunnel it became) lives; `None` for a detached connection, which is not a socket.
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Its place under `max_connections_per_client`, held until the connection is first tied
    /// to a lease ([`ClientConn::link`] gives it back).
    slot: Mutex<Option<ClientSlot>>,
    /// Its place on the connection worker it lives on, held as long as the permit.
    _placed: Option<Placed>,
}

/// Open connections per source IP address (`max_connections_per_client`).
#[derive(Debug, Default)]
pub struct ClientCounts {
    open: Mutex<FastMap<IpAddr, usize>>,
}

impl ClientCounts {
    /// A slot for one more connection from `ip`, or `None` when it already has `limit`.
    pub fn try_take(self: &Arc<Self>, ip: IpAddr, limit: usize) -> Option<ClientSlot> {
        // One client whatever the socket family: `::ffff:a.b.c.d` is a.b.c.d.
        let ip = ip.to_canonical();
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(ip).or_default();
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(ClientSlot {
            counts: self.clone(),
            ip,
        })
    }
}

/// One connection's place in [`ClientCounts`]; given back when dropped.
#[derive(Debug)]
pub struct ClientSlot {
    counts: Arc<ClientCounts>,
    ip: IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            // No entry per client that has gone: the map stays as small as what is open.
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

impl ClientConn {
    pub fn accepted(
        telemetry: Arc<Telemetry>,
        client: SocketAddr,
        listener: SocketAddr,
        port_lease: Option<String>,
        permit: tokio::sync::OwnedSemaphorePermit,
        slot: ClientSlot,
        placed: Option<Placed>,
    ) -> ClientConn {
        ClientConn {
            client,
            listener,
            port_lease,
            closer: CancellationToken::new(),
            linked: Mutex::new(FastMap::default()),
            telemetry,
            _permit: Some(permit),
            slot: Mutex::new(Some(slot)),
            _placed: placed,
        }
    }

    /// A connection that is not a socket (the pipeline tests); with `port_lease`
    /// it asks as if on that lease's own port.
    pub fn detached(telemetry: &Arc<Telemetry>, port_lease: Option<&str>) -> ClientConn {
        let unspecified = SocketAddr::from(([0, 0, 0, 0], 0));
        ClientConn {
            client: unspecified,
            listener: unspecified,
            port_lease: port_lease.map(str::to_owned),
            closer: CancellationToken::new(),
            linked: Mutex::new(FastMap::default()),
            telemetry: telemetry.clone(),
            _permit: None,
            slot: Mutex::new(None),
            _placed: None,
        }
    }

    /// Ties this connection to a lease: counted against the lease's connection limit, and
    /// closed when the lease's token fires. The first tie gives back the connection's
    /// per-address slot: from then on the lease answers for it.
    pub fn link(
        &self,
        registry: &Registry,
        limit: usize,
        lease_id: &str,
        now: Timestamp,
    ) -> Result<CancellationToken, Refusal> {
        let mut linked = self.linked.lock().unwrap_or_else(|e| e.into_inner());
        // Keep-alive requests of a lease already tied to this connection reuse its token.
        if let Some(token) = linked.get(lease_id).filter(|t| !t.is_cancelled()) {
            return Ok(token.clone());
        }
        let token = registry.token(lease_id, now);
        if linked.contains_key(lease_id) {
            return Ok(token);
        }
        if !self
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
        drop(linked);
        drop(self.slot.lock().unwrap_or_else(|e| e.into_inner()).take());
        let (watched, closer) = (token.clone(), self.closer.clone());
        tokio::spawn(async move {
            tokio::select! {
                _ = watched.cancelled() => closer.cancel(),
                _ = closer.cancelled() => {}
            }
        });
        Ok(token)
    }
}

impl ClientConn {
    /// Cancelled to drop the connection: a lease it is tied to closed, or it ended.
    pub fn closer(&self) -> &CancellationToken {
        &self.closer
    }
}

impl Drop for ClientConn {
    /// The last holder (the connection task, or the tunnel it became) is gone: un-count the
    /// connection from every lease it was tied to, and stop the link watchers.
    fn drop(&mut self) {
        self.closer.cancel();
        let linked = std::mem::take(&mut *self.linked.lock().unwrap_or_else(|e| e.into_inner()));
        for lease in linked.into_keys() {
            self.telemetry.metrics.connection_closed(&lease);
        }
    }
}
