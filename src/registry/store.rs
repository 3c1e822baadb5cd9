//! Where journal lines live, behind one small trait: the file today, a NATS JetStream stream
//! later. The fold and the live registry only see [`Store`].
//!
//! Invariant: a store hands out every complete line exactly once per generation, in append
//! order, and a [`Position`] it returns for an append is one its reads reach once that line has
//! been handed out.

pub mod file;
pub mod location;
pub mod nats;
pub mod nats_broadcast;
pub mod snapshot;
pub mod whole;

pub use file::FileStore;
pub use location::{JournalLocation, NatsAuth, NatsLocation};
pub use nats::NatsStore;

use serde_json::Value;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::time::{Duration, Instant};

/// A boxed future, so that [`Store`] stays object-safe without a macro crate.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A place in a store: after the lines before it. Ordered within the life of one store
/// handle: a higher generation (the journal was replaced or truncated and read again from its
/// start, or replaced by a compaction of what was read and followed from what it covers) is
/// later than any offset of a lower one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// How many times the store restarted (the file: replaced, truncated or compacted; a
    /// stream: a new incarnation). 0 before anything was read.
    pub generation: u64,
    /// Within the generation: the file's byte offset, a stream's sequence number.
    pub offset: u64,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.generation, self.offset)
    }
}

/// What one read returned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    /// The store restarted before these lines: they begin its new generation.
    pub restarted: bool,
    /// With `restarted`: the store is another one now (a stream deleted and created again), so
    /// its lines are folded afresh ([`crate::registry::Ledger::refolded`]) instead of on top
    /// of what was folded.
    pub replaced: bool,
    /// Complete lines, without their newline, in append order.
    pub lines: Vec<Vec<u8>>,
    /// Lines longer than the store's `--max-journal-line`, skipped without being held (not in
    /// `lines`).
    pub too_long: u64,
    /// Just after the last line handed out so far (this batch's, or an earlier one's).
    pub position: Position,
}

impl Batch {
    /// Lines read: handed out, and skipped as too long.
    pub fn len(&self) -> usize {
        self.lines.len() + self.too_long as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where journal lines live. Implementations: the file (now), NATS JetStream (later).
pub trait Store: Send + Sync + 'static {
    /// Complete lines appended since the last call; a partial last line waits for its end, and
    /// a line longer than the store's cap is counted in [`Batch::too_long`], never held.
    /// Cancel-safe: if the future is dropped, the lines it had read come with the next call.
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>>;

    /// Appends `record` as one line; returns the position just after it. Once polled, the
    /// append goes through even if the future is then dropped.
    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>>;

    /// Resolves when there may be more to read (the file: a poll interval; a push store: a
    /// notification). May resolve early: a spurious wake only costs an empty read.
    fn wait_for_more(&self) -> BoxFuture<'_, ()>;

    /// The position just after everything the store holds now, asked of the store itself (a
    /// read reaching it has folded all of it). The default, nothing: one read reaches it.
    fn head(&self) -> BoxFuture<'_, io::Result<Position>> {
        Box::pin(async { Ok(Position::default()) })
    }

    /// For logs: "journal /path".
    fn describe(&self) -> String;

    /// Whether everything the store held when it was opened has been handed out: the initial
    /// fold reads until this holds. A file hands out what it holds in reads of a bounded size.
    fn settled(&self) -> bool {
        true
    }

    /// Whether the store is followed (`/readyz`, metrics). A file is always followed: a read
    /// that fails is retried on the next poll and logged there.
    fn health(&self) -> StoreHealth {
        StoreHealth::default()
    }

    /// Tells the other replicas at once that `record`, a closing record we are about to
    /// append, closes its lease (a stream: a core NATS message, which needs no stream leader).
    /// Best effort and never waited for: the append still carries the record. A store others
    /// do not follow live does nothing.
    fn broadcast(&self, _record: &Value) {}

    /// The next closing record another replica broadcast, unverified (see
    /// [`crate::registry::broadcast`]). Never resolves for a store without broadcasts.
    fn heard(&self) -> BoxFuture<'_, Broadcast> {
        Box::pin(std::future::pending())
    }

    /// How long the follower may go without completing a read (a few of its waits) before
    /// `/readyz` reports it stalled.
    fn stalled_after(&self) -> Duration {
        STALLED_AFTER
    }

    /// When the store last answered (a stream: a probe or a message), for the catch-up after a
    /// gap in contact ([`crate::registry::catch_up`]); `None`: a store always at hand (a file).
    fn last_contact(&self) -> Option<Instant> {
        None
    }
}

/// [`Store::stalled_after`] unless the store says otherwise: twenty of the file's polls.
pub const STALLED_AFTER: Duration = Duration::from_secs(1);

/// A closing record heard from another replica, as it came.
#[derive(Debug, Clone)]
pub struct Broadcast {
    /// The lease token of its subject.
    pub lease: String,
    pub payload: bytes::Bytes,
}

/// How a store's following stands.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreHealth {
    /// Why the store is not followed now (`/readyz` 503), or `None`.
    pub problem: Option<String>,
    /// How far behind the store we are: how long it has held something not folded yet, as
    /// its last answer says (`leasegate_store_lag_seconds`).
    pub lag: std::time::Duration,
    /// Reconnections to the store since start (`leasegate_store_reconnects_total`).
    pub reconnects: u64,
    /// Times the store was found replaced and folded afresh (`leasegate_store_replaced_total`).
    pub replaced: u64,
}
