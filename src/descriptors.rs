//! File descriptors: the process's limit, raised at start to what the system allows; the
//! budget the connection limits need, fitted under it; the line the proxy's accept loops stop
//! at; and a spare descriptor the journal and the admin API fall back on.
//!
//! Invariant: a proxy connection never keeps one of the last [`HEADROOM`] descriptors under the
//! limit. POSIX hands out the lowest free number, so a connection accepted on a descriptor
//! numbered within [`HEADROOM`] of the limit means at least that many are in use: it is answered
//! 429 and closed at once. With the budget fitted at start ([`fit`]), connections, their
//! upstreams and pipes, idle upstream connections and lease ports leave [`HEADROOM`] and the
//! fixed descriptors free, so the journal follower, appends and the admin API find one; one
//! that finds none falls back on the spare ([`with_spare`]).

use crate::log_gate::{Flood, Say};
use std::fs::File;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Descriptors one client connection may hold: its socket, its upstream's, and a pipe (two
/// descriptors) per direction of a spliced tunnel.
pub const PER_CONNECTION: u64 = 6;
/// Idle upstream connections kept for reuse, at most one per `--max-connections` (each is one
/// descriptor).
pub const IDLE_UPSTREAMS_PER_CONNECTION: u64 = 1;
/// Descriptors held whatever the load: standard streams, the listeners, the journal, the egress
/// log, the pending queue, NATS connections, the control runtime's event loop, admin API
/// connections.
pub const FIXED: u64 = 96;
/// Each connection worker's event loop and wakers, and its copy of the proxy listener.
pub const PER_WORKER: u64 = 4;
/// Kept free of proxy connections at any time: the accept loops stop this far below the limit.
pub const HEADROOM: u64 = 64;

/// How long after the last connection refused for want of descriptors `/readyz` still says so.
const SHORT_FOR: Duration = Duration::from_secs(2);

/// RLIMIT_NOFILE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub soft: u64,
    pub hard: u64,
}

impl Limit {
    /// The process's limit now (`None` where it cannot be read).
    pub fn current() -> Option<Limit> {
        use nix::sys::resource::{getrlimit, Resource};
        let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).ok()?;
        Some(Limit { soft, hard })
    }
}

/// Raises the soft descriptor limit to the hard one (a limit of 1,024 is common, and far below
/// what the connection limits need), saying so. Returns the limit in force.
pub fn raise_limit() -> Option<Limit> {
    use nix::sys::resource::{setrlimit, Resource};
    let before = Limit::current()?;
    if before.soft >= before.hard {
        tracing::info!(limit = before.soft, "file descriptor limit");
        return Some(before);
    }
    match setrlimit(Resource::RLIMIT_NOFILE, before.hard, before.hard) {
        Ok(()) => {
            let after = Limit::current().unwrap_or(before);
            tracing::info!(
                from = before.soft,
                to = after.soft,
                "file descriptor limit raised to the hard limit"
            );
            Some(after)
        }
        Err(error) => {
            // Some systems cap the soft limit below an unlimited hard one: keep what we have.
            tracing::warn!(%error, soft = before.soft, hard = before.hard, "the file descriptor limit cannot be raised");
            Some(before)
        }
    }
}

/// What the configuration asks of the descriptor limit, besides the connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// Connection workers (each with its event loop and listener copy).
    pub workers: u64,
    /// Ports of the `--lease-ports` range (one listener each).
    pub lease_ports: u64,
}

impl Needs {
    /// Descriptors needed whatever the number of connections, [`HEADROOM`] included.
    pub fn fixed(&self) -> u64 {
        FIXED + PER_WORKER * self.workers + self.lease_ports + HEADROOM
    }

    /// Descriptors `connections` at once need in all.
    pub fn descriptors(&self, connections: u64) -> u64 {
        self.fixed() + connections * (PER_CONNECTION + IDLE_UPSTREAMS_PER_CONNECTION)
    }

    /// The most connections that fit under `soft`.
    pub fn fitting(&self, soft: u64) -> u64 {
        soft.saturating_sub(self.fixed()) / (PER_CONNECTION + IDLE_UPSTREAMS_PER_CONNECTION)
    }
}

/// The connection limit cannot fit under the descriptor limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Shortfall {
    #[error(
        "--max-connections {asked} needs {needed} file descriptors ({per} per connection, \
         {fixed} besides) but the limit is {soft} (hard {hard}): raise it (`ulimit -n`, \
         LimitNOFILE= in a systemd unit, --ulimit nofile= for a container) or lower \
         --max-connections to {fitting} at most"
    )]
    Explicit {
        asked: u64,
        needed: u64,
        per: u64,
        fixed: u64,
        soft: u64,
        hard: u64,
        fitting: u64,
    },
    #[error(
        "the file descriptor limit {soft} (hard {hard}) leaves no room for a connection: \
         {fixed} are kept for the listeners, lease ports, the journal and the admin API; raise \
         it (`ulimit -n`, LimitNOFILE= in a systemd unit, --ulimit nofile= for a container)"
    )]
    NoRoom { soft: u64, hard: u64, fixed: u64 },
}

/// Below this many connections, a default lowered to fit the descriptor limit is a warning.
pub const FEW_CONNECTIONS: u64 = 1024;

/// The connection limit to serve with: `asked` where it fits under `limit`; else, when it is
/// the default (`given` false), the most that fits (said in a warning below
/// [`FEW_CONNECTIONS`], else in an info line); an operator's own
/// number that does not fit refuses the start, as does a limit with no room for one.
pub fn fit(asked: usize, given: bool, needs: Needs, limit: Limit) -> Result<usize, Shortfall> {
    let asked_n = asked as u64;
    let fitting = needs.fitting(limit.soft);
    if asked_n <= fitting {
        return Ok(asked);
    }
    if fitting == 0 {
        return Err(Shortfall::NoRoom {
            soft: limit.soft,
            hard: limit.hard,
            fixed: needs.fixed(),
        });
    }
    if given {
        return Err(Shortfall::Explicit {
            asked: asked_n,
            needed: needs.descriptors(asked_n),
            per: PER_CONNECTION + IDLE_UPSTREAMS_PER_CONNECTION,
            fixed: needs.fixed(),
            soft: limit.soft,
            hard: limit.hard,
            fitting,
        });
    }
    // Nobody asked for the default: lowering it is news only where what is left could be the
    // bottleneck of a fleet of agents.
    if fitting < FEW_CONNECTIONS {
        tracing::warn!(
            default = asked,
            max_connections = fitting,
            limit = limit.soft,
            hard = limit.hard,
            "the file descriptor limit is too low for the default --max-connections: serving at \
             most {fitting} connections (raise the limit, or set --max-connections to silence this)"
        );
    } else {
        tracing::info!(
            default = asked,
            max_connections = fitting,
            limit = limit.soft,
            hard = limit.hard,
            "serving at most {fitting} connections, what the file descriptor limit fits"
        );
    }
    Ok(usize::try_from(fitting).unwrap_or(usize::MAX))
}

/// Whether `error` says the process (or the system) is out of descriptors.
pub fn is_exhausted(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE)
    )
}

/// A listener that accepts connections, as metrics and logs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Proxy,
    LeasePort,
    Admin,
}

impl Listener {
    pub const ALL: [Listener; 3] = [Listener::Proxy, Listener::LeasePort, Listener::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Listener::Proxy => "proxy",
            Listener::LeasePort => "lease-port",
            Listener::Admin => "admin",
        }
    }
}

/// The running proxy's descriptor line and what happened at it.
#[derive(Debug)]
pub struct Descriptors {
    /// The soft limit the line is drawn under: read at start, read again whenever an accept
    /// finds no descriptor (someone may have lowered it).
    limit: AtomicU64,
    /// Accepts that failed, by [`Listener`].
    accept_errors: [AtomicU64; 3],
    /// Connections refused at the line.
    refused: AtomicU64,
    /// When descriptors last ran short (ms after `born`; 0: never).
    short_at: AtomicU64,
    /// An episode of failures is going on (so an accept checks whether it ended).
    failing: AtomicBool,
    born: Instant,
    /// The log of accept failures and refusals at the line: said once, then counted.
    flood: Mutex<Flood>,
}

impl Descriptors {
    pub fn new(limit: u64) -> Descriptors {
        Descriptors {
            limit: AtomicU64::new(limit),
            accept_errors: Default::default(),
            refused: AtomicU64::new(0),
            short_at: AtomicU64::new(0),
            failing: AtomicBool::new(false),
            born: Instant::now(),
            flood: Mutex::new(Flood::default()),
        }
    }

    /// The line under the process's limit now.
    pub fn current() -> Descriptors {
        Descriptors::new(Limit::current().map_or(u64::MAX, |l| l.soft))
    }

    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Whether a connection accepted on descriptor `fd` is past the line (at least
    /// `limit - HEADROOM` descriptors are in use).
    pub fn is_past_line(&self, fd: RawFd) -> bool {
        u64::try_from(fd).unwrap_or(0) + HEADROOM >= self.limit()
    }

    /// A connection accepted on `listener` was refused at the line.
    pub fn refused_at_line(&self, listener: Listener, fd: RawFd) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.ran_short();
        self.read_limit();
        self.say(|say| match say {
            Say::Start => tracing::error!(
                listener = listener.as_str(),
                descriptor = fd,
                limit = self.limit(),
                headroom = HEADROOM,
                "file descriptors nearly exhausted: new connections are refused (429) until some close"
            ),
            Say::Summary(s) => tracing::error!(
                listener = listener.as_str(),
                refused_or_failed = s.repeats,
                since_first = s.total,
                limit = self.limit(),
                "file descriptors still nearly exhausted"
            ),
            Say::Quiet => {}
        });
    }

    /// An accept on `listener` failed with `error`.
    pub fn accept_failed(&self, listener: Listener, error: &io::Error) {
        self.accept_errors[listener as usize].fetch_add(1, Ordering::Relaxed);
        if is_exhausted(error) {
            self.ran_short();
            self.read_limit();
        }
        self.say(|say| match say {
            Say::Start => {
                tracing::error!(listener = listener.as_str(), %error, limit = self.limit(), "accept failed")
            }
            Say::Summary(s) => tracing::error!(
                listener = listener.as_str(),
                %error,
                refused_or_failed = s.repeats,
                since_first = s.total,
                "accept still failing"
            ),
            Say::Quiet => {}
        });
    }

    /// A connection was accepted under the line: the episode of failures, if one is going on
    /// and has been quiet for a while, is over.
    pub fn accepted(&self) {
        if !self.failing.load(Ordering::Relaxed) {
            return;
        }
        let mut flood = self.flood.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(end) = flood.end_if_quiet(Instant::now()) {
            self.failing.store(false, Ordering::Relaxed);
            tracing::info!(
                refused_or_failed = end.total,
                lasted = ?end.lasted,
                "accepting connections again"
            );
        }
    }

    /// Draws the line under the limit as it is now: when descriptors run short, someone may
    /// have lowered it (or raised it again since).
    fn read_limit(&self) {
        if let Some(now) = Limit::current() {
            self.limit.store(now.soft, Ordering::Relaxed);
        }
    }

    fn say(&self, write: impl FnOnce(Say)) {
        self.failing.store(true, Ordering::Relaxed);
        let say = self
            .flood
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .occurred(1, Instant::now());
        write(say);
    }

    fn ran_short(&self) {
        let at = self.born.elapsed().as_millis().max(1);
        self.short_at
            .store(u64::try_from(at).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Why `/readyz` is not ready for want of descriptors: one ran short in the last
    /// `SHORT_FOR`.
    pub fn problem(&self) -> Option<String> {
        let at = self.short_at.load(Ordering::Relaxed);
        let since = self
            .born
            .elapsed()
            .saturating_sub(Duration::from_millis(at));
        (at != 0 && since < SHORT_FOR).then(|| {
            format!(
                "out of file descriptors: connections refused or not accepted in the last {}s \
                 (limit {}; see process_open_fds)",
                SHORT_FOR.as_secs(),
                self.limit()
            )
        })
    }

    /// Failed accepts by listener, for `/metrics`.
    pub fn accept_errors(&self) -> Vec<(&'static str, u64)> {
        Listener::ALL
            .iter()
            .map(|l| {
                (
                    l.as_str(),
                    self.accept_errors[*l as usize].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Connections refused at the line, for `/metrics`.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// Descriptors the process holds now (Linux: entries of `/proc/self/fd`; `None` elsewhere or
/// when it cannot be read, out of descriptors say).
pub fn open_count() -> Option<u64> {
    let entries = std::fs::read_dir("/proc/self/fd").ok()?;
    // Less the one the listing itself holds.
    Some((entries.count() as u64).saturating_sub(1))
}

/// One descriptor held in reserve for the journal and the admin API, given up when they find
/// none, taken back as soon as one is free.
static SPARE: Mutex<Option<File>> = Mutex::new(None);

/// Holds the spare descriptor if it is not held (and one is free).
pub fn arm_spare() {
    let mut spare = SPARE.lock().unwrap_or_else(|e| e.into_inner());
    if spare.is_none() {
        *spare = File::open("/dev/null").ok();
    }
}

/// Gives the spare descriptor up, for the caller to take in its next call; whether one was held.
pub fn release_spare() -> bool {
    SPARE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .is_some()
}

/// `open`, tried again with the spare descriptor given up if it found the process out of
/// descriptors (and the spare taken back after).
pub fn with_spare<T>(mut open: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    match open() {
        Err(error) if is_exhausted(&error) && release_spare() => {
            tracing::warn!(%error, "out of file descriptors: using the spare one");
            let opened = open();
            arm_spare();
            opened
        }
        opened => opened,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEEDS: Needs = Needs {
        workers: 2,
        lease_ports: 0,
    };

    fn limit(soft: u64) -> Limit {
        Limit { soft, hard: soft }
    }

    #[test]
    fn connections_that_fit_are_kept_the_default_is_lowered_and_a_given_number_refused() {
        // 96 fixed + 8 for two workers + 64 headroom = 168; 7 per connection.
        assert_eq!(NEEDS.fixed(), 168);
        assert_eq!(NEEDS.descriptors(10_000), 70_168);
        assert_eq!(fit(10_000, true, NEEDS, limit(70_168)), Ok(10_000));
        assert_eq!(fit(10_000, false, NEEDS, limit(1024)), Ok(122));
        let refused = fit(10_000, true, NEEDS, limit(1024)).unwrap_err();
        assert_eq!(
            refused,
            Shortfall::Explicit {
                asked: 10_000,
                needed: 70_168,
                per: 7,
                fixed: 168,
                soft: 1024,
                hard: 1024,
                fitting: 122
            }
        );
        let message = refused.to_string();
        assert!(
            message.contains("needs 70168 file descriptors")
                && message.contains("the limit is 1024")
                && message.contains("--max-connections to 122 at most"),
            "{message}"
        );
        // Lease ports are listeners of their own.
        let ports = Needs {
            lease_ports: 1000,
            ..NEEDS
        };
        assert_eq!(
            fit(10_000, false, ports, limit(1024)),
            Err(Shortfall::NoRoom {
                soft: 1024,
                hard: 1024,
                fixed: 1168
            })
        );
        assert!(matches!(
            fit(1, false, NEEDS, limit(170)),
            Err(Shortfall::NoRoom { .. })
        ));
    }

    #[test]
    fn the_line_is_headroom_below_the_limit_and_moves_with_it() {
        let descriptors = Descriptors::new(1024);
        assert!(!descriptors.is_past_line(959));
        assert!(descriptors.is_past_line(960));
        assert_eq!(descriptors.problem(), None);
        descriptors.refused_at_line(Listener::Proxy, 960);
        assert_eq!(descriptors.refused(), 1);
        // Read again from the process: this test process's own limit.
        let limit = Limit::current().unwrap().soft;
        assert_eq!(descriptors.limit(), limit);
        let problem = descriptors.problem().unwrap();
        assert!(
            problem.starts_with("out of file descriptors")
                && problem.contains(&format!("limit {limit}")),
            "{problem}"
        );
        descriptors.accept_failed(Listener::Admin, &io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(
            descriptors.accept_errors(),
            [("proxy", 0), ("lease-port", 0), ("admin", 1)]
        );
    }

    #[test]
    fn the_spare_is_given_up_only_to_a_caller_out_of_descriptors() {
        arm_spare();
        let mut calls = 0;
        let opened = with_spare(|| {
            calls += 1;
            match calls {
                1 => Err(io::Error::from_raw_os_error(libc::EMFILE)),
                _ => Ok(calls),
            }
        });
        assert_eq!(opened.unwrap(), 2, "tried again with the spare");
        assert!(SPARE.lock().unwrap().is_some(), "taken back");
        let failed = with_spare::<()>(|| Err(io::Error::from_raw_os_error(libc::EACCES)));
        assert_eq!(failed.unwrap_err().raw_os_error(), Some(libc::EACCES));
    }
}
