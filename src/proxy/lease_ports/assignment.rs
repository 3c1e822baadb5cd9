//! Which port of the range each lease holds: a home port derived from the lease id, then the
//! next ports in turn (wrapping) past those other leases hold.
//!
//! Invariant: a port is held by at most one lease and a lease holds at most one port, always
//! inside the range; a derivation depends only on the range, the lease id and the ports held
//! when it is made, so processes that hold the same ports derive the same port for a lease.

use crate::contract::Timestamp;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::ops::RangeInclusive;

/// Where a lease's probe starts: the range's start plus the first 8 bytes of SHA-256 of the
/// lease id (big-endian), modulo the range's size. A fixed hash, not the standard library's
/// (seeded per process): every build and every replica derives the same home.
pub fn home_port(range: &RangeInclusive<u16>, lease_id: &str) -> u16 {
    let digest = Sha256::digest(lease_id.as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let offset = u64::from_be_bytes(first) % size(range);
    // Below the range's size, which fits in a u16 past the start.
    *range.start() + offset as u16
}

fn size(range: &RangeInclusive<u16>) -> u64 {
    u64::from(*range.end() - *range.start()) + 1
}

/// What a lease holds: its port, and its expiry (so a holder the journal no longer knows is
/// released once it could be retired: see [`super::LeasePorts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    pub port: u16,
    pub expires_at: Timestamp,
}

/// The ports held in one range.
#[derive(Debug)]
pub struct Assignments {
    range: RangeInclusive<u16>,
    by_lease: HashMap<String, Held>,
    /// The other direction of `by_lease`, for the probe.
    by_port: HashMap<u16, String>,
}

impl Assignments {
    pub fn new(range: RangeInclusive<u16>) -> Assignments {
        Assignments {
            range,
            by_lease: HashMap::new(),
            by_port: HashMap::new(),
        }
    }

    /// What `lease_id` holds.
    pub fn of(&self, lease_id: &str) -> Option<Held> {
        self.by_lease.get(lease_id).copied()
    }

    /// Whether every port of the range is held.
    pub fn is_full(&self) -> bool {
        self.by_port.len() as u64 >= size(&self.range)
    }

    pub fn len(&self) -> usize {
        self.by_lease.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_lease.is_empty()
    }

    /// Every lease and what it holds, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Held)> {
        self.by_lease.iter().map(|(id, held)| (id.as_str(), *held))
    }

    /// Takes `held` for `lease_id` as it was decided before (read back from disk), unless its
    /// port is outside the range or held, or the lease holds one already. Returns whether it
    /// was taken.
    pub fn restore(&mut self, lease_id: &str, held: Held) -> bool {
        let free = self.range.contains(&held.port)
            && !self.by_port.contains_key(&held.port)
            && !self.by_lease.contains_key(lease_id);
        if free {
            self.insert(lease_id, held);
        }
        free
    }

    /// Derives a port for `lease_id` (which holds none): its home port, or the first port
    /// after it (wrapping at the range's end) that no lease holds. `None` when every port is
    /// held.
    pub fn assign(&mut self, lease_id: &str, expires_at: Timestamp) -> Option<u16> {
        debug_assert!(!self.by_lease.contains_key(lease_id));
        if self.is_full() {
            return None;
        }
        let home = home_port(&self.range, lease_id);
        let (start, end) = (*self.range.start(), *self.range.end());
        let port = (home..=end)
            .chain(start..home)
            .find(|port| !self.by_port.contains_key(port))?;
        self.insert(lease_id, Held { port, expires_at });
        Some(port)
    }

    /// Gives back what `lease_id` holds.
    pub fn release(&mut self, lease_id: &str) -> Option<Held> {
        let held = self.by_lease.remove(lease_id)?;
        self.by_port.remove(&held.port);
        Some(held)
    }

    fn insert(&mut self, lease_id: &str, held: Held) {
        self.by_port.insert(held.port, lease_id.to_owned());
        self.by_lease.insert(lease_id.to_owned(), held);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    const B: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

    fn at() -> Timestamp {
        Timestamp::from_millis(1_000)
    }

    /// Lease ids of the contract's form whose home port in `range` is `home`.
    fn ids_at(range: &RangeInclusive<u16>, home: u16, n: usize) -> Vec<String> {
        (0u64..)
            .map(|i| format!("00000000-0000-4000-8000-{i:012x}"))
            .filter(|id| home_port(range, id) == home)
            .take(n)
            .collect()
    }

    #[test]
    fn the_home_port_is_fixed_by_the_id_and_inside_the_range() {
        // Pinned (`printf %s ID | sha256sum`: 5d507f75c2e642fa..., 0x5d507f75c2e642fa mod 1000
        // = 42): a change of hash would move every lease's port at an upgrade.
        assert_eq!(home_port(&(40000..=40999), A), 40042);
        for id in [A, B] {
            assert_eq!(
                home_port(&(40000..=40999), id),
                40000 + offset_by_hex(id, 1000)
            );
        }
        for range in [1..=1, 40000..=40999, 1..=65535, 65535..=65535] {
            for id in [A, B] {
                let home = home_port(&range, id);
                assert!(range.contains(&home), "{home} outside {range:?}");
                assert_eq!(home, home_port(&range, id));
            }
        }
    }

    /// The first 8 bytes of SHA-256 of `id`, as a big-endian number, modulo `size`: computed
    /// from the digest's hex form, apart from `home_port`'s byte handling.
    fn offset_by_hex(id: &str, size: u64) -> u16 {
        let hex = format!("{:x}", Sha256::digest(id.as_bytes()));
        (u64::from_str_radix(&hex[..16], 16).unwrap() % size) as u16
    }

    #[test]
    fn a_taken_home_probes_the_next_ports_and_wraps() {
        let range = 100..=103;
        let [a, b, c] = <[String; 3]>::try_from(ids_at(&range, 102, 3)).unwrap();
        let d = &ids_at(&range, 103, 1)[0];
        let mut ports = Assignments::new(range.clone());
        assert_eq!(ports.assign(&a, at()), Some(102));
        assert_eq!(ports.assign(&b, at()), Some(103));
        // Past the end: from the start.
        assert_eq!(ports.assign(&c, at()), Some(100));
        assert_eq!(ports.assign(d, at()), Some(101));
        assert!(ports.is_full());
        let e = &ids_at(&range, 100, 1)[0];
        assert_eq!(ports.assign(e, at()), None, "a full range");
        // A released port goes to the next lease that probes onto it, never twice.
        assert_eq!(ports.release(&b).map(|h| h.port), Some(103));
        assert_eq!(ports.assign(e, at()), Some(103));
        assert_eq!(ports.of(e).map(|h| h.port), Some(103));
        assert_eq!(ports.of(&b), None);
        assert_eq!(ports.len(), 4);
    }

    #[test]
    fn the_same_grants_give_the_same_ports_whatever_process_derives_them() {
        let range = 7000..=7004;
        let mut ids = ids_at(&range, 7001, 3);
        ids.extend(ids_at(&range, 7002, 2));
        let derive = || {
            let mut ports = Assignments::new(range.clone());
            ids.iter()
                .map(|id| ports.assign(id, at()).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(derive(), [7001, 7002, 7003, 7004, 7000]);
        assert_eq!(derive(), derive());
    }

    #[test]
    fn a_restored_port_wins_over_a_derivation_and_is_never_held_twice() {
        let range = 10..=12;
        let ids = ids_at(&range, 10, 3);
        let mut ports = Assignments::new(range.clone());
        // As decided by an earlier run: the second lease on 12, not on 11.
        assert!(ports.restore(
            &ids[1],
            Held {
                port: 12,
                expires_at: at()
            }
        ));
        assert!(
            !ports.restore(
                &ids[2],
                Held {
                    port: 12,
                    expires_at: at()
                }
            ),
            "held"
        );
        assert!(
            !ports.restore(
                &ids[1],
                Held {
                    port: 11,
                    expires_at: at()
                }
            ),
            "has one"
        );
        assert!(
            !ports.restore(
                &ids[2],
                Held {
                    port: 13,
                    expires_at: at()
                }
            ),
            "outside"
        );
        assert_eq!(ports.assign(&ids[0], at()), Some(10));
        assert_eq!(ports.assign(&ids[2], at()), Some(11));
        assert_eq!(ports.of(&ids[1]).map(|h| h.port), Some(12));
    }
}
