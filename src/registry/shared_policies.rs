//! Compiled host lists shared by the loaded leases that carry the same lists: leases granted to
//! one kind of agent usually do, and a million such leases need not hold a million copies.
//!
//! Invariant: a lease is given a policy compiled for another lease only if their allow and deny
//! lists are equal, entry for entry and in order; an entry keeps neither a lease nor a policy
//! alive (weak references), and leaves when its lease is retired.

use super::ledger::PersistentMap;
use crate::contract::Lease;
use crate::policy::HostPolicy;
use std::hash::BuildHasher;
use std::sync::{Arc, Weak};

/// Leases (one per list pair) whose compiled policy others may share, by a hash of the lists.
#[derive(Debug, Clone, Default)]
pub struct SharedPolicies {
    by_lists: PersistentMap<u64, Vec<Exemplar>>,
}

/// A lease and the policy compiled for its lists.
#[derive(Debug, Clone)]
struct Exemplar {
    lease: Weak<Lease>,
    policy: Weak<HostPolicy>,
}

fn lists_hash(lease: &Lease) -> u64 {
    foldhash::fast::FixedState::with_seed(0).hash_one((&lease.allow_hosts, &lease.deny_hosts))
}

fn same_lists(a: &Lease, b: &Lease) -> bool {
    a.allow_hosts == b.allow_hosts && a.deny_hosts == b.deny_hosts
}

impl SharedPolicies {
    /// The policy `lease` keeps: one compiled for the same lists, or else `compiled`, which
    /// later leases with these lists then share.
    pub fn share(&mut self, lease: &Arc<Lease>, compiled: Arc<HostPolicy>) -> Arc<HostPolicy> {
        let hash = lists_hash(lease);
        let mut bucket = self.by_lists.get(&hash).cloned().unwrap_or_default();
        for exemplar in &bucket {
            if let (Some(other), Some(policy)) =
                (exemplar.lease.upgrade(), exemplar.policy.upgrade())
            {
                if same_lists(&other, lease) {
                    return policy;
                }
            }
        }
        bucket.retain(|e| e.lease.strong_count() > 0 && e.policy.strong_count() > 0);
        bucket.push(Exemplar {
            lease: Arc::downgrade(lease),
            policy: Arc::downgrade(&compiled),
        });
        self.by_lists.insert(hash, bucket);
        compiled
    }

    /// Forgets `lease` as an exemplar (it is being retired); leases sharing its policy keep it.
    pub fn forget(&mut self, lease: &Arc<Lease>) {
        let hash = lists_hash(lease);
        let Some(bucket) = self.by_lists.get_mut(&hash) else {
            return;
        };
        bucket.retain(|e| !Weak::ptr_eq(&e.lease, &Arc::downgrade(lease)));
        if bucket.is_empty() {
            self.by_lists.remove(&hash);
        }
    }
}
