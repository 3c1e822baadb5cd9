//! Per-lease ports: every lease gets its own listening port, so clients that cannot send
//! credentials still belong to exactly one lease.
//!
//! Invariant: a lease holds one port of the range from its first pass in the ledger until the
//! ledger retires it (open, then closed within `--closed-lease-retention`), across restarts,
//! and no other lease is given that port meanwhile. The port is the one an earlier run wrote
//! in `<data-dir>/lease-ports` ([`persisted`]), else the one [`assignment`] derives (leases
//! taken in grant order, a home port from the id, then the next free port): replicas that
//! fold the same journal derive the same ports. A port opens only once its assignment is on
//! disk, only while its lease opens, and serves only that lease; a port that cannot be bound
//! leaves its lease without one here, never with another. A closed lease's listener answers
//! as that lease (its own refusal code) for [`LINGER`], at most [`MAX_LINGERING`] at once,
//! then closes; its port stays held. State is bounded by the range (what is held) and the
//! listeners. Leases without a port are logged as one episode ([`Flood`]): once when the first
//! open lease finds none, then a count at most once a minute, and once when every open lease
//! has its port.

pub mod assignment;
pub mod persisted;

use self::assignment::{Assignments, Held};
use self::persisted::Persisted;
use super::{serve, Proxy};
use crate::contract::{Lease, Timestamp};
use crate::log_gate::{Flood, Say};
use crate::registry::closed::Ending;
use crate::registry::{ChainError, Ledger};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub use self::assignment::home_port;

/// How long a closed lease's port goes on answering, as that lease, before it closes: long
/// enough for a client still at work to be told why (`lease-revoked`, `lease-expired`...),
/// short enough that closed leases do not hold descriptors for the whole retention.
pub const LINGER: Duration = Duration::from_secs(300);
/// Closed leases' listeners kept at once; beyond, the longest closed goes first.
pub const MAX_LINGERING: usize = 1024;
/// A port that could not be bound is tried again after this long.
const RETRY_BIND: Duration = Duration::from_secs(1);
/// Passes follow registry changes at most this often (and at most a fifth of the time: see
/// [`LeasePorts::run`]): a journal that changes all the time would otherwise keep a core
/// walking every lease.
const MIN_GAP: Duration = Duration::from_millis(50);
/// A pass runs at least this often, whatever the registry and the clock say.
const RECONCILE_AT_LEAST: Duration = Duration::from_secs(5);

/// A bound lease port.
struct Listening {
    port: u16,
    /// Stops its accept loop.
    stop: CancellationToken,
    /// When its lease was found closed: it lingers from then.
    closed_since: Option<Instant>,
}

struct State {
    /// The port each lease holds.
    assigned: Assignments,
    /// Where the assignments are kept.
    file: Persisted,
    /// Whether the last append to `file` failed (said once per run of failures).
    writes_failing: bool,
    /// Bound ports, by lease: open leases, and closed ones lingering.
    listening: HashMap<String, Listening>,
    /// Open leases whose port could not be bound here, and when it was last tried.
    unbound: HashMap<String, Instant>,
    /// Open leases found without a port (pruned when they close or get one): each counts once.
    warned: HashSet<String>,
    /// The episode of leases without a port, for the log.
    exhausted: Flood,
}

/// Why an open lease has no port here.
enum NoPort {
    /// Every port of the range is held.
    RangeFull,
    /// Its port could not be bound (another process holds it, most often).
    Unbound(u16, std::io::Error),
    /// Its assignment could not be written down.
    NotWritten(std::io::Error),
    /// Its port could not be bound a moment ago (said then); tried again soon.
    Retrying(u16),
}

/// The per-lease port range and its assignments.
pub struct LeasePorts {
    pub range: RangeInclusive<u16>,
    pub bind: IpAddr,
    /// `--closed-lease-retention`: how long a lease the journal no longer holds keeps its port
    /// after its expiry (`None`: for ever, as the ledger keeps every lease).
    retention: Option<Duration>,
    state: Mutex<State>,
}

impl LeasePorts {
    /// The range's assignments as `<data_dir>/lease-ports` holds them (the directory and the
    /// file are made if missing: an unwritable place is an error here, at start). Blocking.
    pub fn open(
        range: RangeInclusive<u16>,
        bind: IpAddr,
        data_dir: &Path,
        retention: Option<Duration>,
    ) -> std::io::Result<LeasePorts> {
        let (mut file, read) = Persisted::open(data_dir)?;
        let mut assigned = Assignments::new(range.clone());
        let mut refused = 0;
        for (lease_id, held) in &read.entries {
            if !assigned.restore(lease_id, *held) {
                refused += 1;
            }
        }
        if read.skipped + refused > 0 {
            tracing::warn!(
                file = %file.path().display(),
                unreadable = read.skipped,
                outside_the_range_or_twice = refused,
                "lease port assignments skipped; the file is rewritten without them"
            );
            file.rewrite(assigned.iter())?;
        }
        if !assigned.is_empty() {
            tracing::info!(
                file = %file.path().display(),
                assignments = assigned.len(),
                "lease port assignments restored"
            );
        }
        Ok(LeasePorts {
            range,
            bind,
            retention,
            state: Mutex::new(State {
                assigned,
                file,
                writes_failing: false,
                listening: HashMap::new(),
                unbound: HashMap::new(),
                warned: HashSet::new(),
                exhausted: Flood::default(),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The port serving a lease here: it holds one, it is bound, and the lease opens.
    pub fn port_of(&self, lease_id: &str) -> Option<u16> {
        let state = self.state();
        let listening = state.listening.get(lease_id)?;
        listening.closed_since.is_none().then_some(listening.port)
    }

    /// The port a lease holds, bound here or not, open or closed.
    pub fn held_port(&self, lease_id: &str) -> Option<u16> {
        self.state().assigned.of(lease_id).map(|held| held.port)
    }

    /// Whether `lease_id` was warned about having no port and still opens (a lease is warned
    /// once while it stays open).
    pub fn is_warned(&self, lease_id: &str) -> bool {
        self.state().warned.contains(lease_id)
    }

    /// Keeps assignments in step with the registry until `shutdown`: a pass after each change
    /// of the registry (at most one per `MIN_GAP`) and when the clock alone may change what
    /// a pass does (see `LeasePorts::reconcile`), else every `RECONCILE_AT_LEAST`.
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

    /// Whether what `lease_id` holds is free again: the ledger retired the lease, or no longer
    /// knows it (a journal compacted past it, or another journal) and it expired longer than
    /// the retention ago.
    fn has_ended(&self, ledger: &Ledger, lease_id: &str, held: Held, now: Timestamp) -> bool {
        if ledger.lease(lease_id).is_some() {
            return false;
        }
        if ledger.retired(lease_id).is_some() {
            return true;
        }
        self.retention.is_some_and(|retention| {
            let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
            held.expires_at.as_millis().saturating_add(retention) <= now.as_millis()
        })
    }

    /// One pass: frees the ports of leases the ledger no longer holds, derives a port for each
    /// lease without one (in grant order) and writes the new ones down, opens the ports of
    /// open leases, lets closed leases' ports linger and then closes them. Returns when the
    /// clock alone may change that (a lease or an ancestor becoming valid, an open lease's
    /// chain reaching its expiry, a lingering port's end, a failed bind's retry), if ever.
    ///
    /// Linear in the leases of the ledger and in what the range holds; with a full range every
    /// lease without a port is counted, not searched for one again.
    fn reconcile(
        &self,
        proxy: &Arc<Proxy>,
        shutdown: &CancellationToken,
    ) -> Option<tokio::time::Instant> {
        let snapshot = proxy.registry.snapshot();
        let ledger = &snapshot.ledger;
        let now = proxy.registry.now();
        let instant = Instant::now();
        let mut due = Due::new(now);
        let mut state = self.state();
        let State {
            assigned,
            file,
            writes_failing,
            listening,
            unbound,
            warned,
            exhausted,
        } = &mut *state;

        let ended: Vec<String> = assigned
            .iter()
            .filter(|(id, held)| self.has_ended(ledger, id, *held, now))
            .map(|(id, _)| id.to_owned())
            .collect();
        // Ports whose listener is told to stop now: its socket closes in a moment, so another
        // lease binds it on a later pass (not reported as held by another process).
        let mut closing: HashSet<u16> = HashSet::new();
        for lease_id in &ended {
            assigned.release(lease_id);
            unbound.remove(lease_id);
            if let Some(gone) = listening.remove(lease_id) {
                gone.stop.cancel();
                closing.insert(gone.port);
            }
        }

        // Grant order: replicas folding the same journal derive the same ports.
        let mut fresh: Vec<(&str, Held)> = Vec::new();
        let mut to_open: Vec<(&str, u16)> = Vec::new();
        let mut without: Vec<(&str, NoPort)> = Vec::new();
        let mut open_leases: HashSet<&str> = HashSet::new();
        for lease in ledger.leases() {
            let opens = match ledger.check_chain(&lease.id, now) {
                Ok(chain) => {
                    due.closing(&chain);
                    true
                }
                Err(error) => {
                    due.opening(ledger, &error);
                    false
                }
            };
            let held = match assigned.of(&lease.id) {
                Some(held) => Some(held),
                None => assigned.assign(&lease.id, lease.expires_at).map(|port| {
                    let held = Held {
                        port,
                        expires_at: lease.expires_at,
                    };
                    fresh.push((&lease.id, held));
                    held
                }),
            };
            if !opens {
                if let Some(bound) = listening.get_mut(&lease.id) {
                    if bound.closed_since.is_none() {
                        bound.closed_since = Some(instant);
                        tracing::info!(lease = %lease.id, port = bound.port, linger = ?LINGER, "lease closed: its port answers as the closed lease, then closes");
                    }
                }
                continue;
            }
            open_leases.insert(&lease.id);
            match held {
                None => without.push((&lease.id, NoPort::RangeFull)),
                Some(held) if !listening.contains_key(&lease.id) => {
                    to_open.push((&lease.id, held.port))
                }
                Some(_) => {}
            }
        }

        // Written down before any of them opens: a restart finds every port that served.
        if !fresh.is_empty() {
            match file.append(fresh.iter().copied()) {
                Ok(()) => {
                    if std::mem::take(writes_failing) {
                        tracing::info!(file = %file.path().display(), "lease port assignments are written again");
                    }
                }
                Err(error) => {
                    // Not kept: the next pass derives them again, the same way.
                    for (lease_id, _) in &fresh {
                        assigned.release(lease_id);
                    }
                    let unwritten: HashSet<&str> = fresh.iter().map(|(id, _)| *id).collect();
                    to_open.retain(|(lease_id, _)| {
                        let kept = !unwritten.contains(lease_id);
                        if !kept {
                            without.push((lease_id, NoPort::NotWritten(copy_error(&error))));
                        }
                        kept
                    });
                    if !std::mem::replace(writes_failing, true) {
                        tracing::error!(file = %file.path().display(), %error, "writing lease port assignments failed: their ports stay closed until it succeeds");
                    }
                }
            }
        }

        for (lease_id, port) in to_open {
            if closing.contains(&port) {
                due.at_instant(instant + MIN_GAP);
                continue;
            }
            if let Some(tried) = unbound.get(lease_id) {
                if tried.elapsed() < RETRY_BIND {
                    due.at_instant(*tried + RETRY_BIND);
                    without.push((lease_id, NoPort::Retrying(port)));
                    continue;
                }
            }
            let stop = shutdown.child_token();
            let opened = bind(SocketAddr::new(self.bind, port)).and_then(|listener| {
                // Accepting on a worker, like the main listener: see `Workers::spawn_made`.
                proxy.workers.spawn_made(|| {
                    let listener = tokio::net::TcpListener::from_std(listener)?;
                    let serving = serve(
                        listener,
                        proxy.clone(),
                        Some(lease_id.to_owned()),
                        stop.clone(),
                    );
                    Ok::<_, std::io::Error>(async move {
                        if let Err(error) = serving.await {
                            tracing::warn!(port, %error, "a lease port stopped accepting");
                        }
                    })
                })
            });
            match opened {
                Ok(()) => {
                    tracing::info!(lease = %lease_id, port, "lease port open");
                    unbound.remove(lease_id);
                    warned.remove(lease_id);
                    listening.insert(
                        lease_id.to_owned(),
                        Listening {
                            port,
                            stop,
                            closed_since: None,
                        },
                    );
                }
                Err(error) => {
                    unbound.insert(lease_id.to_owned(), instant);
                    due.at_instant(instant + RETRY_BIND);
                    without.push((lease_id, NoPort::Unbound(port, error)));
                }
            }
        }

        for lease_id in lingering_to_close(
            listening
                .iter()
                .filter_map(|(id, l)| Some((id.as_str(), l.closed_since?))),
            instant,
        ) {
            if let Some(gone) = listening.remove(&lease_id) {
                gone.stop.cancel();
                tracing::info!(lease = %lease_id, port = gone.port, "lease port closed");
            }
        }
        if let Some(since) = listening.values().filter_map(|l| l.closed_since).min() {
            due.at_instant(since + LINGER);
        }
        // A lease that opens nothing any more is never warned about again.
        warned.retain(|lease_id| open_leases.contains(lease_id.as_str()));
        unbound.retain(|lease_id, _| open_leases.contains(lease_id.as_str()));

        self.say_without_port(without, warned, exhausted, instant);
        if !ended.is_empty() && file.is_worth_rewriting(assigned.len()) {
            if let Err(error) = file.rewrite(assigned.iter()) {
                tracing::warn!(file = %file.path().display(), %error, "rewriting lease port assignments failed; the file keeps ended ones, which a restart drops");
            }
        }
        due.next
    }

    /// Logs the open leases without a port: the first of an episode in full, then counts.
    fn say_without_port(
        &self,
        without: Vec<(&str, NoPort)>,
        warned: &mut HashSet<String>,
        exhausted: &mut Flood,
        instant: Instant,
    ) {
        let count = without.len();
        let mut summary = None;
        for (lease_id, why) in without {
            if !warned.insert(lease_id.to_owned()) {
                continue;
            }
            match exhausted.occurred(1, instant) {
                Say::Start => tracing::warn!(
                    lease = %lease_id,
                    "{}: this lease is reachable by credentials only",
                    self.no_port_reason(&why)
                ),
                Say::Summary(s) => summary = Some(s),
                Say::Quiet => {}
            }
        }
        if count > 0 {
            if let Some(s) = summary.or_else(|| exhausted.due(instant)) {
                tracing::warn!(
                    leases = s.repeats,
                    since_first = s.total,
                    without_port = count,
                    "more leases have no lease port: they are reachable by credentials only"
                );
            }
        } else if let Some(s) = exhausted.end(instant) {
            tracing::info!(
                leases = s.total,
                lasted = ?s.lasted,
                "every open lease has its lease port again"
            );
        }
    }

    /// Why a lease has no port, in words.
    fn no_port_reason(&self, why: &NoPort) -> String {
        match why {
            NoPort::RangeFull => format!(
                "no free lease port in {}-{}: every port is held by a lease (open, or closed \
                 within --closed-lease-retention)",
                self.range.start(),
                self.range.end()
            ),
            NoPort::Unbound(port, error) if error.kind() == std::io::ErrorKind::AddrInUse => {
                format!("its lease port {port} is held by another process")
            }
            NoPort::Unbound(port, error) => {
                format!(
                    "its lease port {}:{port} cannot be bound: {error}",
                    self.bind
                )
            }
            NoPort::Retrying(port) => format!("its lease port {port} could not be bound"),
            NoPort::NotWritten(error) => {
                format!("its lease port could not be written down: {error}")
            }
        }
    }
}

/// An I/O error for each lease it concerns (`io::Error` is not `Clone`).
fn copy_error(error: &std::io::Error) -> std::io::Error {
    std::io::Error::new(error.kind(), error.to_string())
}

/// The lingering listeners (lease, closed since) to close at `now`: those closed for
/// [`LINGER`], and beyond [`MAX_LINGERING`] the longest closed.
fn lingering_to_close<'a>(
    lingering: impl Iterator<Item = (&'a str, Instant)>,
    now: Instant,
) -> Vec<String> {
    let mut lingering: Vec<(&str, Instant)> = lingering.collect();
    lingering.sort_by_key(|(_, since)| *since);
    let over = lingering.len().saturating_sub(MAX_LINGERING);
    lingering
        .iter()
        .enumerate()
        .filter(|(i, (_, since))| *i < over || now.duration_since(*since) >= LINGER)
        .map(|(_, (id, _))| (*id).to_owned())
        .collect()
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
            ChainError::NotYetValid(id)
            | ChainError::AncestorClosed {
                ancestor: id,
                ending: Ending::NotYetValid,
                ..
            } => ledger.lease(id),
            _ => None,
        };
        if let Some(lease) = waiting.filter(|lease| lease.issued_at > self.now) {
            self.at(lease.issued_at);
        }
    }
}

/// A lease port's socket, bound and non-blocking, registered with no runtime yet.
fn bind(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_lease_lingers_for_a_while_and_never_beyond_the_cap() {
        let now = Instant::now() + LINGER * 2;
        let just = now - Duration::from_secs(1);
        let long = now - LINGER;
        let closed = [("just", just), ("long", long)];
        assert_eq!(lingering_to_close(closed.into_iter(), now), ["long"]);
        assert!(lingering_to_close(closed.into_iter(), just).is_empty());
        // Past the cap, the longest closed go first, however recently.
        let ids: Vec<String> = (0..MAX_LINGERING + 2).map(|i| i.to_string()).collect();
        let many = ids
            .iter()
            .enumerate()
            .map(|(i, id)| (id.as_str(), just + Duration::from_millis(i as u64)));
        assert_eq!(lingering_to_close(many, just + LINGER / 2), ["0", "1"]);
    }
}
