//! The last requests of each lease, for `GET /leases/{id}/requests` and the dashboard's lease
//! page: what a lease did just before it was refused or revoked, without reading the egress log.
//!
//! Invariant: bounded — at most [`PER_LEASE`] exchanges for each of at most [`MAX_LEASES`]
//! leases, and only leases the registry knows (a forged id adds nothing); a lease beyond that
//! takes the place of the one that recorded least recently.

use super::egress::EgressEvent;
use crate::fast_hash::FastMap;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Exchanges kept per lease.
pub const PER_LEASE: usize = 50;
/// Leases with exchanges kept at once.
pub const MAX_LEASES: usize = 500;

#[derive(Debug)]
struct Ring {
    events: VecDeque<Arc<EgressEvent>>,
    /// When it last recorded, in [`Inner::clock`] ticks: the least recent gives its place up.
    touched: u64,
}

#[derive(Debug, Default)]
struct Inner {
    leases: FastMap<String, Ring>,
    /// One tick per recorded exchange.
    clock: u64,
}

/// The recent exchanges of each lease.
#[derive(Debug, Default)]
pub struct LeaseRequests {
    inner: Mutex<Inner>,
}

impl LeaseRequests {
    /// Keeps `event` among its lease's last exchanges; one without a lease id is not kept.
    /// Call it only for a lease the registry knows.
    pub fn push(&self, event: &Arc<EgressEvent>) {
        let Some(lease) = event.lease_id.as_deref() else {
            return;
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.clock += 1;
        let touched = inner.clock;
        // Looked up before it is entered: the id is copied only for a lease new here, which
        // takes the place of the stalest when the map is full.
        if !inner.leases.contains_key(lease) {
            if inner.leases.len() >= MAX_LEASES {
                let stalest = inner
                    .leases
                    .iter()
                    .min_by_key(|(_, ring)| ring.touched)
                    .map(|(id, _)| id.clone());
                if let Some(id) = stalest {
                    inner.leases.remove(&id);
                }
            }
            inner.leases.insert(
                lease.to_owned(),
                Ring {
                    events: VecDeque::with_capacity(PER_LEASE),
                    touched,
                },
            );
        }
        let Some(ring) = inner.leases.get_mut(lease) else {
            return;
        };
        ring.touched = touched;
        if ring.events.len() == PER_LEASE {
            ring.events.pop_front();
        }
        ring.events.push_back(Arc::clone(event));
    }

    /// The newest `limit` exchanges of `lease`, newest first.
    pub fn recent(&self, lease: &str, limit: usize) -> Vec<Arc<EgressEvent>> {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.leases.get(lease).map_or_else(Vec::new, |ring| {
            ring.events.iter().rev().take(limit).cloned().collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Timestamp;
    use crate::telemetry::egress::{Kind, LoggedVerdict};

    fn event(lease: Option<&str>, host: &str) -> Arc<EgressEvent> {
        Arc::new(EgressEvent {
            time: Timestamp::now(),
            ended: Timestamp::now(),
            lease_id: lease.map(str::to_owned),
            label: None,
            client: "127.0.0.1:1".parse().unwrap(),
            listener: "127.0.0.1:2".parse().unwrap(),
            kind: Kind::Http,
            method: http::Method::GET,
            host: Some(host.to_owned()),
            port: Some(80),
            dialed: None,
            verdict: LoggedVerdict::Allow,
            code: None,
            rule: None,
            status: Some(200),
            bytes_up: 0,
            bytes_down: 0,
            duration_ms: 0.0,
            path: None,
            secrets: Vec::new(),
            model: None,
            mcp: None,
            approval: None,
            error: None,
            revoked: None,
        })
    }

    fn hosts(events: &[Arc<EgressEvent>]) -> Vec<String> {
        events.iter().filter_map(|e| e.host.clone()).collect()
    }

    #[test]
    fn keeps_the_newest_per_lease_newest_first() {
        let kept = LeaseRequests::default();
        for i in 0..PER_LEASE + 3 {
            kept.push(&event(Some("a"), &format!("h{i}")));
        }
        kept.push(&event(Some("b"), "other"));
        kept.push(&event(None, "nobody"));
        let a = kept.recent("a", PER_LEASE + 10);
        assert_eq!(a.len(), PER_LEASE);
        assert_eq!(
            hosts(&a[..2]),
            [format!("h{}", PER_LEASE + 2), format!("h{}", PER_LEASE + 1)]
        );
        assert_eq!(hosts(&kept.recent("a", 1)), [format!("h{}", PER_LEASE + 2)]);
        assert_eq!(hosts(&kept.recent("b", 5)), ["other"]);
        assert!(kept.recent("c", 5).is_empty());
    }

    #[test]
    fn a_lease_beyond_the_limit_takes_the_place_of_the_least_recent() {
        let kept = LeaseRequests::default();
        for i in 0..MAX_LEASES {
            kept.push(&event(Some(&format!("l{i}")), "h"));
        }
        // l0 recorded again: l1 is now the least recent.
        kept.push(&event(Some("l0"), "again"));
        kept.push(&event(Some("new"), "h"));
        assert_eq!(kept.inner.lock().unwrap().leases.len(), MAX_LEASES);
        assert!(kept.recent("l1", 5).is_empty());
        assert_eq!(kept.recent("l0", 5).len(), 2);
        assert_eq!(kept.recent("new", 5).len(), 1);
    }
}
