//! The most recent refusals, for `GET /refusals`.
//!
//! Invariant: bounded — the ring holds at most its capacity, oldest dropped first.

use super::egress::EgressEvent;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;

/// Refusals kept.
pub const CAPACITY: usize = 1000;

#[derive(Debug, Default)]
pub struct RefusalRing {
    ring: Mutex<VecDeque<Arc<EgressEvent>>>,
}

impl RefusalRing {
    pub fn push(&self, event: Arc<EgressEvent>) {
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() == CAPACITY {
            ring.pop_front();
        }
        ring.push_back(event);
    }

    /// The newest `limit` refusals, newest first.
    pub fn recent(&self, limit: usize) -> Vec<Arc<EgressEvent>> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().take(limit).cloned().collect()
    }
}
