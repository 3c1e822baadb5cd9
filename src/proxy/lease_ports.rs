//! Per-lease ports: every open lease gets its own listening port, so clients that cannot send
//! credentials still belong to exactly one lease.
//!
//! Invariant: a port serves one lease at a time and closes when that lease opens nothing; the
//! lowest free port is handed out, and a released port rests [`REUSE_AFTER`] before another
//! lease may have it (a late client of the old lease never lands in a new one). Every per-lease
//! entry here belongs to a lease that opens now: state is bounded by the open leases. An
//! exhausted range is logged as one episode ([`Flood`]): once when the first lease finds no
//! port, then a count at most once a minute, and once when every open lease has its port.

use super::{serve, Proxy};
use crate::contract::{Lease, Timestamp};
use crate::log_gate::{Flood, Say};
use crate::registry::{ChainError, Ledger};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long a released port rests before it is handed to another lease.
pub const REUSE_AFTER: Duration = Duration::from_secs(60);
/// Passes follow registry changes at most this often (and at most a fifth of the time: see
/// [`LeasePorts::run`]): a journal that changes all the time would otherwise keep a core
/// walking every lease.
const MIN_GAP: Duration = Duration::from_millis(50);
/// A pass runs at least this often, whatever the registry and the clock say.
const RECONCILE_AT_LEAST: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    /// Open leases and their port, with the token that stops its listener.
    by_lease: HashMap<String, (u16, CancellationToken)>,
    /// Released ports and when.
    resting: HashMap<u16, Instant>,
    /// Open leases found without a port (pruned when they close): each counts once.
    warned: HashSet<String>,
    /// The episode of leases without a port, for the log.
    exhausted: Flood,
}

/// The per-lease port range and its assignments.
pub struct LeasePorts {
    pub range: RangeInclusive<u16>,
    pub bind: IpAddr,
    state: Mutex<State>,
}

impl LeasePorts {
    pub fn new(range: RangeInclusive<u16>, bind: IpAddr) -> LeasePorts {
        LeasePorts {
            range,
            bind,
            state: Mutex::new(State::default()),
        }
    }

    /// The port of a lease, if it has one.
    pub fn port_of(&self, lease_id: &str) -> Option<u16> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.by_lease.get(lease_id).map(|(port, _)| *port)
    }

    /// Whether `lease_id` was warned about an exhausted range and still opens (a lease is
    /// warned once while it stays open).
    pub fn is_warned(&self, lease_id: &str) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.warned.contains(lease_id)
    }

    /// Keeps assignments in step with the registry until `shutdown`: a pass after each change
    /// of the registry (at most one per [`MIN_GAP`]) and when a lease may open or close by the
    /// clock alone (see [`LeasePorts::reconcile`]), else every [`RECONCILE_AT_LEAST`].
    ///
    /// A pass walks every lease (~60 ms at 100,000), so it runs on the blocking pool, and the
    /// gap after a change is at least four times the last pass: passes take at most a fifth of
    /// a core however busy the journal.
    pub async fn run(self: Arc<LeasePorts>, proxy: Arc<Proxy>, shutdown: CancellationToken) {
        let mut changes = proxy.registry.subscribe();
        loop {
            changes.borrow_and_update();
            let started = Instant::now();
            let pass = {
                let (ports, proxy, shutdown) = (self.clone(), proxy.clone(), shutdown.clone());
                tokio::task::spawn_blocking(move || ports.reconcile(&proxy, &shutdown))
            };
            let due = match pass.await {
                Ok(due) => due,
                Err(failed) => match failed.try_into_panic() {
                    Ok(panic) => std::panic::resume_unwind(panic),
                    // The runtime is shutting down.
                    Err(_) => return,
                },
            };
            let gap = MIN_GAP.max(started.elapsed() * 4);
            let at_least = tokio::time::Instant::now() + RECONCILE_AT_LEAST;
            let next = due.map_or(at_least, |due| due.min(at_least));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    tokio::time::sleep(gap).await;
                }
                _ = tokio::time::sleep_until(next) => {}
            }
        }
    }

    /// One pass: closes the ports of leases that open nothing now, opens one for each open
    /// lease without one. Returns when the clock alone may change that (a lease or an ancestor
    /// becoming valid, a lease with a port reaching its chain's expiry, a resting port becoming
    /// free for a lease still without one), if ever.
    ///
    /// Linear in the leases of the ledger (and the range, once): with an exhausted range every
    /// lease without a port is counted, not searched for one again.
    fn reconcile(
        &self,
        proxy: &Arc<Proxy>,
        shutdown: &CancellationToken,
    ) -> Option<tokio::time::Instant> {
        let snapshot = proxy.registry.snapshot();
        let now = Timestamp::now();
        let mut due = Due::new(now);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            by_lease,
            resting,
            warned,
            exhausted,
        } = &mut *state;
        by_lease.retain(|lease_id, (port, stop)| {
            let open = snapshot.ledger.check_chain(lease_id, now).is_ok();
            if !open {
                stop.cancel();
                resting.insert(*port, Instant::now());
                tracing::info!(lease = %lease_id, port = *port, "lease port closed");
            }
            open
        });
        resting.retain(|_, since| since.elapsed() < REUSE_AFTER);
        // A lease that opens nothing any more will never be warned about again.
        warned.retain(|lease_id| snapshot.ledger.check_chain(lease_id, now).is_ok());
        let mut used: HashSet<u16> = by_lease.values().map(|(p, _)| *p).collect();
        // Set once a search finds no port (no port frees up within a pass): the ports of the
        // range another process holds.
        let mut held_elsewhere: Option<Vec<u16>> = None;
        let mut without_port = 0;
        let mut summary = None;
        for lease in snapshot.ledger.leases() {
            let chain = match snapshot.ledger.check_chain(&lease.id, now) {
                Ok(chain) => chain,
                Err(error) => {
                    due.opening(&snapshot.ledger, &error);
                    continue;
                }
            };
            due.closing(&chain);
            if by_lease.contains_key(&lease.id) {
                continue;
            }
            let bound = match held_elsewhere {
                Some(_) => None,
                None => match self.free_port(&used, resting) {
                    Ok(found) => Some(found),
                    Err(held) => {
                        held_elsewhere = Some(held);
                        None
                    }
                },
            };
            match bound {
                Some((port, listener)) => {
                    let stop = shutdown.child_token();
                    tokio::spawn(serve(
                        listener,
                        proxy.clone(),
                        Some(lease.id.clone()),
                        stop.clone(),
                    ));
                    tracing::info!(lease = %lease.id, port, "lease port open");
                    used.insert(port);
                    by_lease.insert(lease.id.clone(), (port, stop));
                }
                None => {
                    without_port += 1;
                    if !warned.insert(lease.id.clone()) {
                        continue;
                    }
                    let range = format!("{}-{}", self.range.start(), self.range.end());
                    let held = held_elsewhere.as_deref().unwrap_or_default();
                    match exhausted.occurred(1, Instant::now()) {
                        Say::Start => tracing::warn!(
                            lease = %lease.id,
                            "{}: this lease is reachable by credentials only",
                            no_port_reason(&range, held, used.len(), resting.len())
                        ),
                        Say::Summary(s) => summary = Some(s),
                        Say::Quiet => {}
                    }
                }
            }
        }
        let instant = Instant::now();
        if without_port > 0 {
            if let Some(s) = summary.or_else(|| exhausted.due(instant)) {
                tracing::warn!(
                    leases = s.repeats,
                    since_first = s.total,
                    without_port,
                    "more leases found no free lease port: they are reachable by credentials only"
                );
            }
            // A resting port that frees up can go to one of them.
            if let Some(since) = resting.values().min() {
                due.at_instant(*since + REUSE_AFTER);
            }
        } else if let Some(s) = exhausted.end(instant) {
            tracing::info!(
                leases = s.total,
                lasted = ?s.lasted,
                "every open lease has its lease port again"
            );
        }
        due.next
    }
}

impl LeasePorts {
    /// The lowest port of the range that is neither leased nor resting and can be bound, or the
    /// ports of the range another process holds (said as such, not as an exhausted range).
    fn free_port(
        &self,
        used: &HashSet<u16>,
        resting: &HashMap<u16, Instant>,
    ) -> Result<(u16, tokio::net::TcpListener), Vec<u16>> {
        let mut held = Vec::new();
        self.range
            .clone()
            .filter(|p| !used.contains(p) && !resting.contains_key(p))
            .find_map(|p| match bind(SocketAddr::new(self.bind, p)) {
                Ok(listener) => Some((p, listener)),
                Err(e) => {
                    if e.kind() == std::io::ErrorKind::AddrInUse {
                        held.push(p);
                    }
                    None
                }
            })
            .ok_or(held)
    }
}

/// When the next pass is due by the clock alone.
struct Due {
    now: Timestamp,
    next: Option<tokio::time::Instant>,
}

impl Due {
    fn new(now: Timestamp) -> Due {
        Due { now, next: None }
    }

    fn at_instant(&mut self, at: Instant) {
        let at = tokio::time::Instant::from_std(at);
        self.next = Some(self.next.map_or(at, |next| next.min(at)));
    }

    /// At wall-clock `at` (just after it: statuses change once `now` reaches it).
    fn at(&mut self, at: Timestamp) {
        let wait = at.as_millis().saturating_sub(self.now.as_millis()).max(0) as u64 + 1;
        self.at_instant(Instant::now() + Duration::from_millis(wait));
    }

    /// A lease that opens now: its port closes when the first of its chain expires.
    fn closing(&mut self, chain: &[Arc<Lease>]) {
        if let Some(first) = chain.iter().map(|lease| lease.expires_at).min() {
            self.at(first);
        }
    }

    /// A lease that opens nothing now: it may open later only if it, or the ancestor that
    /// keeps it closed, is not valid yet (every other reason is final).
    fn opening(&mut self, ledger: &Ledger, error: &ChainError) {
        let waiting = match error {
            ChainError::NotYetValid(id) | ChainError::AncestorClosed { ancestor: id, .. } => {
                ledger.lease(id)
            }
            _ => None,
        };
        if let Some(lease) = waiting.filter(|lease| lease.issued_at > self.now) {
            self.at(lease.issued_at);
        }
    }
}

/// Why no port of `range` was free, in words: ports held by other processes first.
fn no_port_reason(range: &str, held: &[u16], leased: usize, resting: usize) -> String {
    let mut parts = Vec::new();
    if !held.is_empty() {
        let mut ports: Vec<String> = held.iter().take(5).map(u16::to_string).collect();
        if held.len() > 5 {
            ports.push(format!("{} more", held.len() - 5));
        }
        let what = if held.len() == 1 { "port" } else { "ports" };
        parts.push(format!(
            "{what} {} held by another process",
            ports.join(", ")
        ));
    }
    if leased > 0 {
        parts.push(format!("{leased} serving other leases"));
    }
    if resting > 0 {
        parts.push(format!("{resting} resting after their lease closed"));
    }
    if parts.is_empty() {
        parts.push("none could be bound".to_owned());
    }
    format!("no free lease port in {range}: {}", parts.join("; "))
}

fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(listener)
}

#[cfg(test)]
mod tests {
    use super::no_port_reason;

    #[test]
    fn a_port_held_elsewhere_is_not_an_exhausted_range() {
        assert_eq!(
            no_port_reason("40000-40000", &[40000], 0, 0),
            "no free lease port in 40000-40000: port 40000 held by another process"
        );
        assert_eq!(
            no_port_reason("1-9", &[1, 2, 3, 4, 5, 6, 7], 1, 1),
            "no free lease port in 1-9: ports 1, 2, 3, 4, 5, 2 more held by another process; \
             1 serving other leases; 1 resting after their lease closed"
        );
        assert_eq!(
            no_port_reason("1-2", &[], 2, 0),
            "no free lease port in 1-2: 2 serving other leases"
        );
    }
}
