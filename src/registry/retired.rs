//! Leases retired after their retention, by id, in little memory: sorted runs of 48-byte
//! entries behind shared pointers (a B-tree's leaves cost about three times that: 64-byte
//! entries in nodes half full when ids arrive in order).
//!
//! Invariant: runs are non-empty and sorted, every id of a run is below every id of the next,
//! and an id is in at most one run. A clone shares every run; a clone changed afterwards copies
//! the list of runs and the one run it touches, never the others.

use super::ledger::{Closure, Status};
use crate::contract::lease::is_lease_id;
use crate::contract::{Event, Timestamp};
use std::sync::Arc;

/// A lease id (a lower-case UUID, the schema's pattern) as two words: 16 bytes, not a string,
/// and aligned to 8 (a `u128` would pad every entry to a multiple of 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseKey {
    high: u64,
    low: u64,
}

impl LeaseKey {
    /// The nil UUID: no parent.
    const NIL: LeaseKey = LeaseKey { high: 0, low: 0 };

    /// `None` for anything but a lower-case UUID (such a lease is never retired).
    pub fn of(id: &str) -> Option<LeaseKey> {
        let uuid = is_lease_id(id)
            .then(|| uuid::Uuid::try_parse(id).ok())
            .flatten()?;
        let (high, low) = uuid.as_u64_pair();
        Some(LeaseKey { high, low })
    }

    pub fn is_nil(self) -> bool {
        self == LeaseKey::NIL
    }

    /// The id as the journal writes it.
    pub fn to_id(self) -> String {
        uuid::Uuid::from_u64_pair(self.high, self.low)
            .hyphenated()
            .to_string()
    }
}

/// What is left of a lease retired after its retention: enough to answer "known, and why
/// closed", to refuse a descendant (`ancestor-closed`), to check a revocation's `by` (L3) and
/// a token for it. 32 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retired {
    /// The parent's id, or nil for none (a lease whose parent is the nil UUID is not retired).
    parent: LeaseKey,
    /// When the closing that applied (the earliest) says it closed, or, if `closing` is
    /// `None`, when it expired.
    closed_at: Timestamp,
    /// The event of that closing, or `None`: it expired.
    closing: Option<Event>,
    /// The key it was signed with, as an index into [`RetiredMap`]'s fingerprints.
    key: u32,
}

impl Retired {
    pub fn status(&self) -> Status {
        match self.closing {
            Some(event) => Status::closed_by(event),
            None => Status::Expired,
        }
    }

    pub fn parent(&self) -> Option<String> {
        (!self.parent.is_nil()).then(|| self.parent.to_id())
    }

    /// The closing that applied (the earliest), or `None`: it expired.
    pub fn closing(&self) -> Option<(Event, Timestamp)> {
        self.closing.map(|event| (event, self.closed_at))
    }

    /// What closed it, as far as it is kept: the event and time of its closing (its `by` and
    /// `reason` are not kept), or its expiry.
    pub fn closure(&self) -> Closure {
        Closure {
            event: self.closing.unwrap_or(Event::Expired),
            at: self.closed_at,
            by: None,
            reason: None,
        }
    }
}

/// Entries per run, at most: a change to a shared run copies at most this many (6 KB).
const RUN: usize = 128;

type Run = Vec<(LeaseKey, Retired)>;

/// Retired leases by id (see the module's invariant).
#[derive(Debug, Clone, Default)]
pub struct RetiredMap {
    runs: Arc<Vec<Arc<Run>>>,
    len: usize,
    /// The signing keys' fingerprints, each once (a deployment has a handful).
    fingerprints: Arc<Vec<Arc<str>>>,
}

impl RetiredMap {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, key: &LeaseKey) -> Option<&Retired> {
        let run = self.runs.get(self.run_for(key))?;
        let i = run.binary_search_by(|(k, _)| k.cmp(key)).ok()?;
        Some(&run[i].1)
    }

    pub fn contains(&self, key: &LeaseKey) -> bool {
        self.get(key).is_some()
    }

    /// The fingerprint of the key `retired` was signed with.
    pub fn fingerprint(&self, retired: &Retired) -> &Arc<str> {
        &self.fingerprints[retired.key as usize]
    }

    /// Retires `key` (replacing what was kept of it, if anything): closed by `closing` at
    /// `closed_at`, or, without a closing, expired at `closed_at`.
    pub fn insert(
        &mut self,
        key: LeaseKey,
        parent: Option<LeaseKey>,
        (closing, closed_at): (Option<Event>, Timestamp),
        fingerprint: &Arc<str>,
    ) {
        let retired = Retired {
            parent: parent.unwrap_or(LeaseKey::NIL),
            closed_at,
            closing,
            key: self.intern(fingerprint),
        };
        let at = self.run_for(&key);
        let runs = Arc::make_mut(&mut self.runs);
        let last = at + 1 == runs.len();
        let Some(run) = runs.get_mut(at) else {
            runs.push(Arc::new(vec![(key, retired)]));
            self.len += 1;
            return;
        };
        let run = Arc::make_mut(run);
        let i = match run.binary_search_by(|(k, _)| k.cmp(&key)) {
            Ok(i) => {
                run[i].1 = retired;
                return;
            }
            Err(i) => i,
        };
        self.len += 1;
        if run.len() < RUN {
            run.insert(i, (key, retired));
        } else if i == run.len() && last {
            // Past the last id (ids that arrive in order): the full run stays full.
            let mut next = Vec::with_capacity(RUN);
            next.push((key, retired));
            runs.push(Arc::new(next));
        } else {
            let mut right = run.split_off(RUN / 2);
            if i < RUN / 2 {
                run.insert(i, (key, retired));
            } else {
                right.insert(i - RUN / 2, (key, retired));
            }
            runs.insert(at + 1, Arc::new(right));
        }
    }

    /// Records a closing of a retired lease: the earliest stands.
    pub fn close(&mut self, key: &LeaseKey, event: Event, at: Timestamp) {
        let Some(retired) = self.get(key) else {
            return;
        };
        if retired.closing.is_some() && retired.closed_at <= at {
            return;
        }
        let run = self.run_for(key);
        let run = Arc::make_mut(&mut Arc::make_mut(&mut self.runs)[run]);
        if let Ok(i) = run.binary_search_by(|(k, _)| k.cmp(key)) {
            run[i].1.closing = Some(event);
            run[i].1.closed_at = at;
        }
    }

    /// The run that holds `key` or would take it: the first whose last id is not below it, or
    /// the last run (its index is `runs.len()` only when there is none).
    fn run_for(&self, key: &LeaseKey) -> usize {
        let after = self.runs.partition_point(|run| run[run.len() - 1].0 < *key);
        after.min(self.runs.len().saturating_sub(1))
    }

    fn intern(&mut self, fingerprint: &Arc<str>) -> u32 {
        if let Some(i) = self.fingerprints.iter().position(|f| f == fingerprint) {
            return i as u32;
        }
        let fingerprints = Arc::make_mut(&mut self.fingerprints);
        fingerprints.push(fingerprint.clone());
        (fingerprints.len() - 1) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> LeaseKey {
        LeaseKey {
            high: n >> 7,
            low: n,
        }
    }

    fn fingerprint() -> Arc<str> {
        Arc::from("fp")
    }

    /// Inserts `ids` in their order; checks every one is found with its own parent, and that
    /// runs are sorted and ordered.
    fn check(ids: &[u64]) -> RetiredMap {
        let mut map = RetiredMap::default();
        let fp = fingerprint();
        for &n in ids {
            map.insert(
                key(n),
                Some(key(n + 1)),
                (None, Timestamp::from_millis(n as i64)),
                &fp,
            );
        }
        let mut unique = ids.to_vec();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(map.len(), unique.len());
        for &n in &unique {
            let retired = map.get(&key(n)).expect("retired");
            assert_eq!(retired.parent, key(n + 1));
            assert_eq!(retired.status(), Status::Expired);
        }
        assert!(!map.contains(&key(u64::MAX)));
        let all: Vec<LeaseKey> = map
            .runs
            .iter()
            .flat_map(|r| r.iter().map(|e| e.0))
            .collect();
        assert!(all.windows(2).all(|w| w[0] < w[1]), "sorted across runs");
        assert!(map.runs.iter().all(|r| !r.is_empty() && r.len() <= RUN));
        map
    }

    #[test]
    fn ids_in_order_fill_their_runs() {
        let ids: Vec<u64> = (0..10 * RUN as u64).collect();
        let map = check(&ids);
        assert_eq!(map.runs.len(), 10);
    }

    #[test]
    fn ids_in_any_order() {
        let mut ids: Vec<u64> = (0..5_000).map(|n| n * 7_919 % 5_003).collect();
        ids.extend([3, 3, 4_999, 0]);
        check(&ids);
        let descending: Vec<u64> = (0..1_000).rev().collect();
        check(&descending);
    }

    #[test]
    fn a_clone_is_untouched_by_changes_to_the_other() {
        let fp = fingerprint();
        let mut map = check(&(0..1_000).collect::<Vec<_>>());
        let before = map.clone();
        map.insert(
            key(5_000),
            None,
            (Some(Event::Revoked), Timestamp::from_millis(9)),
            &fp,
        );
        map.close(&key(10), Event::Stopped, Timestamp::from_millis(5));
        assert_eq!(before.len(), 1_000);
        assert!(!before.contains(&key(5_000)));
        assert_eq!(before.get(&key(10)).unwrap().status(), Status::Expired);
        assert_eq!(map.get(&key(10)).unwrap().status(), Status::Stopped);
        assert_eq!(map.get(&key(5_000)).unwrap().parent(), None);
    }

    #[test]
    fn the_earliest_closing_stands() {
        let fp = fingerprint();
        let mut map = RetiredMap::default();
        let at = Timestamp::from_millis;
        map.insert(key(1), None, (Some(Event::Stopped), at(100)), &fp);
        map.close(&key(1), Event::Revoked, at(200));
        assert_eq!(
            map.get(&key(1)).unwrap().closing(),
            Some((Event::Stopped, at(100)))
        );
        map.close(&key(1), Event::Revoked, at(50));
        assert_eq!(
            map.get(&key(1)).unwrap().closing(),
            Some((Event::Revoked, at(50)))
        );
        // An expired lease takes its first closing whenever it says it happened.
        map.insert(key(2), None, (None, at(250)), &fp);
        let expired = map.get(&key(2)).unwrap().closure();
        assert_eq!((expired.event, expired.at), (Event::Expired, at(250)));
        map.close(&key(2), Event::Completed, at(300));
        assert_eq!(map.get(&key(2)).unwrap().status(), Status::Completed);
    }

    #[test]
    fn entries_are_48_bytes_and_fingerprints_are_kept_once() {
        assert_eq!(std::mem::size_of::<(LeaseKey, Retired)>(), 48);
        let mut map = RetiredMap::default();
        let (a, b): (Arc<str>, Arc<str>) = (Arc::from("a"), Arc::from("b"));
        let expired = (None, Timestamp::from_millis(0));
        map.insert(key(1), None, expired, &a);
        map.insert(key(2), None, expired, &b);
        map.insert(key(3), None, expired, &Arc::from("a"));
        assert_eq!(map.fingerprints.len(), 2);
        assert_eq!(&**map.fingerprint(map.get(&key(3)).unwrap()), "a");
        assert_eq!(&**map.fingerprint(map.get(&key(2)).unwrap()), "b");
    }

    #[test]
    fn lease_keys_read_back_as_the_id() {
        let id = "0191f3c0-6a4e-7c1d-9f00-1234567890ab";
        assert_eq!(LeaseKey::of(id).unwrap().to_id(), id);
        assert_eq!(LeaseKey::of("0191F3C0-6A4E-7C1D-9F00-1234567890AB"), None);
        assert_eq!(LeaseKey::of("lease-1"), None);
        assert!(LeaseKey::of("00000000-0000-0000-0000-000000000000").is_some_and(LeaseKey::is_nil));
    }
}
