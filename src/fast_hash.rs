//! The hash maps and sets on the request path: foldhash, seeded at random per process.
//!
//! Invariant: no key a client can choose (a host, an address, a lease id) picks its own bucket:
//! the seed is random per process, so hash flooding stays off the table. foldhash rather than
//! the standard SipHash because SipHash, over a request's handful of lookups, cost more than
//! the maps' own work.

/// The hasher of every [`FastMap`] (and of the policy's host sets).
pub type Hasher = foldhash::fast::RandomState;

/// A `HashMap` with [`Hasher`]: `FastMap::default()` to make one.
pub type FastMap<K, V> = std::collections::HashMap<K, V, Hasher>;
