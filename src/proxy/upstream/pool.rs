//! The pool of idle forwarded-request connections to upstreams.
//!
//! Invariant: the pool is keyed by the lease and the checked address ([`PoolKey`]), never by a
//! name, so a rebinding name cannot reuse a connection to an address it no longer resolves
//! to, and one lease's connection never carries another lease's request.

use crate::fast_hash::FastMap;
use crate::policy::UpstreamAddr;
use crate::proxy::body::Body;
use hyper::client::conn::http1::SendRequest;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Idle connections kept per lease and upstream address.
const IDLE_PER_KEY: usize = 32;
/// How long an idle connection may wait for reuse, by default.
pub const IDLE_FOR: Duration = Duration::from_secs(60);
/// The reaper never runs more often than this (a zero idle time must not spin).
const REAP_AT_MOST_EVERY: Duration = Duration::from_millis(10);

/// Whose idle connection it is: the lease that opened it and the checked address it reaches.
/// A connection is the lease's own (its bytes were metered and its requests logged under
/// that lease; an upstream may tie state such as cookies or auth to it), so it is never lent
/// to another lease, even one allowed the same address.
///
/// And by the connection worker whose runtime runs the connection's task: a connection serves
/// requests of its own worker only, so a request and its upstream connection are polled on
/// one thread, without a wake across threads for each request ([`crate::proxy::workers`]). Each
/// worker thus keeps its own idle connections (at most `IDLE_PER_KEY` per worker).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub lease_id: String,
    pub addr: UpstreamAddr,
    /// [`crate::proxy::workers::Workers::current`] where the connection was opened; `None` off the
    /// workers.
    pub worker: Option<usize>,
    /// TLS to the origin under this name (inside a terminated tunnel); `None`: plain HTTP.
    pub tls_name: Option<String>,
}

/// A pooled connection and when it went idle.
type Idle = (SendRequest<Body>, Instant);

/// Idle HTTP/1.1 connections to upstreams, keyed by lease and checked address. A key exists only while
/// it holds a connection: checkout and the reaper remove the keys they empty, so addresses
/// visited once do not stay in the map.
pub struct Pool {
    idle: Mutex<Lists>,
    /// How long an idle connection may wait for reuse.
    idle_for: Duration,
    /// The most idle connections kept, all keys together: each holds a descriptor, and the
    /// descriptor budget counts them ([`crate::descriptors`]).
    most: usize,
}

/// The idle connections by key, and how many there are in all.
#[derive(Default)]
struct Lists {
    by_key: FastMap<PoolKey, Vec<Idle>>,
    count: usize,
}

impl Lists {
    /// Keeps, in every list (or the one of `key`), only what `keep` accepts, and drops the
    /// lists it empties.
    fn retain(&mut self, key: Option<&PoolKey>, mut keep: impl FnMut(&Idle) -> bool) {
        let mut dropped = 0;
        let mut sift = |list: &mut Vec<Idle>| {
            let before = list.len();
            list.retain(&mut keep);
            dropped += before - list.len();
            !list.is_empty()
        };
        match key {
            None => self.by_key.retain(|_, list| sift(list)),
            Some(key) => {
                if let Some(list) = self.by_key.get_mut(key) {
                    if !sift(list) {
                        self.by_key.remove(key);
                    }
                }
            }
        }
        self.count -= dropped;
    }
}

impl Default for Pool {
    fn default() -> Pool {
        Pool::with_idle(IDLE_FOR)
    }
}

impl Pool {
    pub fn with_idle(idle_for: Duration) -> Pool {
        Pool {
            idle: Mutex::new(Lists::default()),
            idle_for,
            most: usize::MAX,
        }
    }

    /// This pool, keeping at most `most` idle connections in all (beyond, one finished with
    /// is closed rather than kept).
    pub fn holding_at_most(self, most: usize) -> Pool {
        Pool { most, ..self }
    }

    pub fn idle_for(&self) -> Duration {
        self.idle_for
    }

    /// Whether a connection pooled `since` has not idled too long at `now` (one clock read
    /// for a whole list).
    fn is_fresh(&self, since: Instant, now: Instant) -> bool {
        now.saturating_duration_since(since) < self.idle_for
    }

    /// Whether a pooled connection may still serve a request at `now`.
    fn is_reusable(&self, (sender, since): &Idle, now: Instant) -> bool {
        !sender.is_closed() && self.is_fresh(*since, now)
    }

    /// An idle, ready connection of `key`'s lease to its address, if one is pooled.
    pub fn checkout(&self, key: &PoolKey) -> Option<SendRequest<Body>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.by_key.get_mut(key)?;
        let mut found = None;
        let now = Instant::now();
        let before = list.len();
        while let Some((sender, since)) = list.pop() {
            if sender.is_ready() && self.is_fresh(since, now) {
                found = Some(sender);
                break;
            }
        }
        let taken = before - list.len();
        if list.is_empty() {
            idle.by_key.remove(key);
        }
        idle.count -= taken;
        found
    }

    /// Returns a connection to the pool once its current exchange has finished.
    pub fn checkin(self: &Arc<Pool>, key: PoolKey, mut sender: SendRequest<Body>) {
        let pool = self.clone();
        tokio::spawn(async move {
            if sender.ready().await.is_ok() {
                let mut idle = pool.idle.lock().unwrap_or_else(|e| e.into_inner());
                let now = Instant::now();
                idle.retain(Some(&key), |entry| pool.is_reusable(entry, now));
                let held = idle.by_key.get(&key).map_or(0, Vec::len);
                if held < IDLE_PER_KEY && idle.count < pool.most {
                    idle.by_key.entry(key).or_default().push((sender, now));
                    idle.count += 1;
                }
            }
        });
    }

    /// Drops connections the upstream closed or that idled too long, and the keys left empty.
    pub fn reap(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        idle.retain(None, |entry| self.is_reusable(entry, now));
    }

    /// Keys (lease and upstream address) with at least one idle connection.
    pub fn keys(&self) -> usize {
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_key
            .len()
    }

    /// Idle connections kept, all keys together.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    /// Reaps every `every` until `shutdown`, so idle connections to upstreams never asked
    /// again are closed and forgotten.
    pub async fn run_reaper(self: Arc<Pool>, every: Duration, shutdown: CancellationToken) {
        let mut ticker = tokio::time::interval(every.max(REAP_AT_MOST_EVERY));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = ticker.tick() => self.reap(),
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::policy::Guard;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpStream;

    /// A connection to a local listener, as the pool holds it, and the server side of it.
    pub(in crate::proxy::upstream) async fn connection() -> (PoolKey, SendRequest<Body>, TcpStream)
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let guard = Guard {
            allow_private: vec!["127.0.0.1/32".parse().unwrap()],
            ..Guard::default()
        };
        let addr = PoolKey {
            lease_id: "lease-a".into(),
            addr: guard.check(&[at], None).dialable[0],
            worker: None,
            tls_name: None,
        };
        let (client, accepted) = tokio::join!(TcpStream::connect(at), listener.accept());
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(client.unwrap()))
            .await
            .unwrap();
        tokio::spawn(conn);
        (addr, sender, accepted.unwrap().0)
    }

    /// Waits (up to 5 s) until the pool holds `n` keys after a reap.
    async fn reaped_to(pool: &Pool, n: usize) -> bool {
        for _ in 0..500 {
            pool.reap();
            if pool.keys() == n {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    #[tokio::test]
    async fn a_reap_forgets_connections_the_upstream_closed_and_their_key() {
        let pool = Arc::new(Pool::default());
        let (addr, sender, server_side) = connection().await;
        pool.checkin(addr.clone(), sender);
        assert!(reaped_to(&pool, 1).await, "the connection was pooled");
        pool.reap();
        assert_eq!(pool.keys(), 1, "a live idle connection stays");
        drop(server_side);
        assert!(reaped_to(&pool, 0).await, "closed upstream: key removed");
        assert!(pool.checkout(&addr).is_none());
    }

    #[tokio::test]
    async fn a_reap_forgets_connections_idle_too_long() {
        let pool = Arc::new(Pool::with_idle(Duration::from_millis(50)));
        let (addr, sender, _server_side) = connection().await;
        pool.checkin(addr.clone(), sender);
        for _ in 0..100 {
            if pool.keys() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(pool.keys(), 1);
        tokio::time::sleep(Duration::from_millis(60)).await;
        pool.reap();
        assert_eq!(pool.keys(), 0);
    }

    #[tokio::test]
    async fn the_reaper_runs_on_its_own_and_checkout_removes_the_key_it_empties() {
        let pool = Arc::new(Pool::with_idle(Duration::from_millis(30)));
        let stop = CancellationToken::new();
        tokio::spawn(
            pool.clone()
                .run_reaper(Duration::from_millis(10), stop.clone()),
        );
        let (addr, sender, _server_side) = connection().await;
        pool.checkin(addr.clone(), sender);
        let mut seen = false;
        for _ in 0..500 {
            seen |= pool.keys() == 1;
            if seen && pool.keys() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(seen, "the connection was pooled");
        assert_eq!(pool.keys(), 0, "the reaper removed it");
        stop.cancel();

        let pool = Arc::new(Pool::default());
        let (addr, sender, _server_side) = connection().await;
        pool.checkin(addr.clone(), sender);
        assert!(reaped_to(&pool, 1).await);
        assert!(pool.checkout(&addr).is_some());
        assert_eq!(pool.keys(), 0);
    }

    /// Idle connections hold descriptors the budget counts: past the pool's total, one
    /// finished with is closed, whatever its key.
    #[tokio::test]
    async fn the_pool_keeps_no_more_idle_connections_than_its_total() {
        use tokio::io::AsyncReadExt;
        let pool = Arc::new(Pool::default().holding_at_most(2));
        let mut upstream_sides = Vec::new();
        for _ in 0..3 {
            let (key, sender, server_side) = connection().await;
            pool.checkin(key, sender);
            upstream_sides.push(server_side);
        }
        let mut buf = [0u8; 1];
        let mut closed = 0;
        for side in &mut upstream_sides {
            let read = tokio::time::timeout(Duration::from_millis(500), side.read(&mut buf));
            if let Ok(Ok(0)) = read.await {
                closed += 1;
            }
        }
        assert_eq!(pool.idle_count(), 2);
        assert_eq!(closed, 1, "the third was closed, not kept");
        let key = pool
            .idle
            .lock()
            .unwrap()
            .by_key
            .keys()
            .next()
            .unwrap()
            .clone();
        assert!(pool.checkout(&key).is_some());
        assert_eq!(pool.idle_count(), 1, "a checkout makes room");
    }

    #[tokio::test]
    async fn a_connection_is_lent_only_to_the_lease_that_opened_it() {
        let pool = Arc::new(Pool::default());
        let (key, sender, _server_side) = connection().await;
        pool.checkin(key.clone(), sender);
        assert!(reaped_to(&pool, 1).await, "the connection was pooled");
        let other = PoolKey {
            lease_id: "lease-b".into(),
            ..key.clone()
        };
        assert!(
            pool.checkout(&other).is_none(),
            "another lease, same address"
        );
        assert!(pool.checkout(&key).is_some(), "its own lease");
    }
}
