//! The journal as a NATS JetStream stream: one message per journal line (byte-identical to the
//! file's line, subject `leasegate.journal.<lease_id>`), folded from the first message and then
//! followed by an ordered push consumer.
//!
//! Invariants:
//! - Every message is handed out once, in stream order; a [`Position`]'s offset is a stream
//!   sequence, so the position an append returns is reached once its message is handed out.
//! - The store settles once everything the stream held at connect has been handed out;
//!   until then a read waits for something new, so the initial fold goes batch by batch.
//! - A closing record counts as appended only once the stream holds a line that stands for it
//!   ([`ClosingCheck`]: our own bytes, or a closing of the same lease on its subject, signed
//!   under the lease's key). It is published under `Nats-Msg-Id: leasegate-close-<lease_id>`,
//!   the same from every replica, so replicas that refuse one lease at the same instant leave
//!   exactly one closing record (JetStream stages the id when the publish is proposed, which a
//!   cluster's subject-sequence check does not do for in-flight proposals), and by
//!   compare-and-set on its lease's subject (`Nats-Expected-Last-Subject-Sequence`): when the
//!   subject's last message already stands for it (another replica's revocation, or our own
//!   whose ack was lost) nothing is published. A duplicate ack is never taken on trust: the
//!   message it names is fetched and checked, and when it does not stand for our record
//!   (something else was published under the shared id first) the record is published again
//!   under an id of its own bytes. A message's `event` alone proves nothing.
//! - A replica starts from the latest snapshot ([`super::snapshot`]) that applies, then follows
//!   from the sequence after the one it covers: the same fold, without reading what it covers.
//!   A stream purged below what a verified snapshot covers is refused ([`super::whole`]).
//! - A replica opens its journal stream patiently: every step of the open is retried for
//!   `--store-start-timeout` whatever the error (a cluster without quorum answers 10008 or
//!   nothing), except those waiting cannot mend; giving up names the last error. A command
//!   that only reads ([`IfMissing::Refuse`]) never creates a stream.
//! - Contact is known, not assumed: a probe asks for the stream's state every
//!   [`PROBE_EVERY`]; without an answer for `stale_after` the store reports a problem
//!   (`/readyz` 503) while the last folded state stays in force. When the stream holds
//!   messages beyond the last one delivered and nothing arrives for [`STALLED_CONSUMER`] (its
//!   consumer died with a stream leader), the consumer is replaced then, not after the client's
//!   ten seconds of missed heartbeats.
//! - Our closing records are also broadcast on core NATS ([`super::nats_broadcast`]), and the
//!   other replicas' are heard there, for the registry to verify.
//! - Lag is the stream's, not ours: once an answer names a last sequence not handed out yet,
//!   the store is behind from that answer until it hands that sequence out; behind longer
//!   than [`LAG_GRACE`] is a problem.
//! - Only an answer that names the stream's leader is its current state: a cluster member
//!   without a leader (lost quorum, cut off) answers from its own copy, perhaps behind. Such an
//!   answer is contact, nothing more: no lag, no replacement, no head for a catch-up to reach.
//! - A stream deleted and created again (another creation time said by two answers in a row)
//!   is a new store; a last sequence below one delivered is not (a leader just elected answers
//!   below what was delivered until it has applied what its group committed): its first read
//!   is a [`Batch::replaced`] generation from its first message, nothing of the old one is
//!   handed out after it, and the store is not settled (a problem) until it has handed out
//!   what the new stream held when it was found. Within a generation no sequence is handed
//!   out twice, so each line is folded once per generation.

use super::location::NatsLocation;
use super::nats_broadcast::Broadcaster;
use super::whole::{self, Prefer};
use super::{Batch, BoxFuture, Broadcast, Position, Store, StoreHealth};
use crate::contract::keys::sha256_hex;
use crate::contract::Keyring;
use crate::log_gate::{Flood, Say};
use crate::nats::connect::patiently;
use crate::nats::stream::Published;
use crate::nats::{
    subject_token, IfMissing, Incarnation, NatsError, NatsOptions, NatsStream, StreamSpec,
    REQUEST_TIMEOUT,
};
use crate::registry::closing::ClosingCheck;
use async_nats::jetstream::{consumer, stream};
use futures_util::StreamExt;
use serde_json::Value;
use std::io;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How often the stream's state is asked for (contact and lag).
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// How long the stream may hold a message that a probe saw and we have not handed out before
/// the store reports itself behind (a probe's answer can come before the message does).
pub const LAG_GRACE: Duration = Duration::from_millis(250);

/// Behind the stream's last sequence with nothing delivered this long: the consumer is
/// replaced.
pub const STALLED_CONSUMER: Duration = Duration::from_secs(1);

/// The longest wait between two attempts to replace the journal consumer.
const MAX_REPLACE_BACKOFF: Duration = Duration::from_secs(1);

/// How many times a compare-and-set append retries after another writer moved the subject.
const APPEND_ATTEMPTS: usize = 8;

/// A stream opened here starts at generation 1 (0 is "nothing read"); each replacement of
/// the stream found while following it is the next one.
const GENERATION: u64 = 1;

/// What one answer says of the stream followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// The stream followed, as it stands.
    Same,
    /// Another stream: another creation time.
    Other,
    /// Nothing to go by: no leader named, or the store moved on to another generation while the
    /// question was out.
    Unsure,
}

/// What the stream followed was when a question was asked of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Asked {
    generation: u64,
}

/// Compares `answer` with the stream followed (created at `created`, in `generation` now)
/// as it was when the question was `asked`. Only a creation time tells another stream: a last
/// sequence below what was delivered is a member answering from what it has applied (a leader
/// just elected, under load, for seconds), and taking it for another stream would fold every
/// line again and drop every grant until then.
fn compare(created: i128, generation: u64, asked: Asked, answer: Incarnation) -> Seen {
    if !answer.led || asked.generation != generation {
        Seen::Unsure
    } else if answer.created != created {
        Seen::Other
    } else {
        Seen::Same
    }
}

fn at(sequence: u64) -> Position {
    Position {
        generation: GENERATION,
        offset: sequence,
    }
}

/// Appends `record`: a closing record as the module invariants say (it counts as done only
/// once the stream holds a line that [`ClosingCheck::accepts`]), anything else published as
/// it is. Returns the position of the message that holds it (or that already closed the
/// lease).
async fn append_record(
    stream: &NatsStream,
    record: Value,
    keyring: &Keyring,
) -> io::Result<Position> {
    let line = serde_json::to_vec(&record)?;
    let lease_id = record.get("lease_id").and_then(Value::as_str);
    let subject = stream.subject(lease_id);
    let Some(check) = ClosingCheck::of(&record, &line, Some(keyring)) else {
        return Ok(at(stream.publish(subject, &line, None).await?));
    };
    let token = subject_token(lease_id);
    // One closing record per lease from every replica: JetStream stages the id when the
    // publish is proposed, so concurrent duplicates are caught even in a cluster (where the
    // subject-sequence check alone misses in-flight proposals).
    let shared_id = format!("leasegate-close-{token}");
    for _ in 0..APPEND_ATTEMPTS {
        let last = match stream
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(message) => Some(message),
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => None,
            Err(e) => return Err(io::Error::other(e)),
        };
        if let Some(last) = &last {
            if check.accepts(token, &last.payload) {
                return Ok(at(last.sequence));
            }
        }
        let expected = last.map_or(0, |m| m.sequence);
        match stream
            .publish_once(&subject, &line, &shared_id, Some(expected))
            .await?
        {
            Published::Stored(sequence) => return Ok(at(sequence)),
            Published::Duplicate(sequence) => {
                if holds(stream, &subject, &check, sequence).await? {
                    return Ok(at(sequence));
                }
                tracing::warn!(lease = check.lease_id(), sequence, store = %stream.location, "the stream answers a closing record as a duplicate of a message that does not close the lease (planted under {shared_id}): publishing it under its own id");
                break;
            }
            Published::Moved => continue,
        }
    }
    // The shared id is taken by something else, or the subject kept moving: an id of our
    // record's own bytes, which nobody can take before they exist, and no expectation.
    let own_id = format!("{shared_id}-{}", &sha256_hex(&line)[..32]);
    match stream.publish_once(&subject, &line, &own_id, None).await? {
        Published::Stored(sequence) => Ok(at(sequence)),
        Published::Duplicate(sequence) if holds(stream, &subject, &check, sequence).await? => {
            Ok(at(sequence))
        }
        _ => Err(io::Error::other(format!(
            "{subject}: the stream does not hold the closing record and refuses it under {own_id}"
        ))),
    }
}

/// Whether the message at `sequence` is on `subject` and stands for the record `check`
/// appends.
async fn holds(
    stream: &NatsStream,
    subject: &str,
    check: &ClosingCheck,
    sequence: u64,
) -> io::Result<bool> {
    let message = tokio::time::timeout(REQUEST_TIMEOUT, stream.stream.get_raw_message(sequence))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "message get timed out"))?
        .map_err(io::Error::other)?;
    Ok(message.subject.as_str() == subject
        && check.accepts(subject_token(Some(check.lease_id())), &message.payload))
}

/// What opening the journal stream yields: the stream, its last sequence then, the sequence
/// the snapshot covers and its lines, and the consumer of what follows.
struct Opened {
    stream: NatsStream,
    /// The stream's last sequence when it was opened: the first read waits for it.
    initial_head: u64,
    /// The stream's creation time (a stream created again under the same name differs).
    created: i128,
    /// The sequence the snapshot's `lines` cover (0: none).
    covers: u64,
    lines: Vec<Vec<u8>>,
    messages: consumer::push::Ordered,
}

/// The journal stream, followed: what [`Store`] needs.
pub struct NatsStore {
    stream: NatsStream,
    /// The keys our closing records are signed with: what a line already in the stream must
    /// verify under to stand for one of them, and what a snapshot's MAC must verify under.
    keyring: Keyring,
    shared: Arc<Shared>,
    stale_after: Duration,
    /// Our closing records out, the other replicas' in; `None` if the subscription failed.
    broadcaster: Option<Broadcaster>,
    /// The follower and the probe; aborted when the store is dropped.
    tasks: Vec<tokio::task::AbortHandle>,
}

/// What the follower and the probe tell the readers.
struct Shared {
    /// Messages delivered and not yet handed out.
    received: Mutex<Received>,
    /// The last sequence delivered (readers wait on it).
    delivered: watch::Sender<u64>,
    contact: Mutex<Contact>,
    /// Wakes the follower to replace a consumer that stopped delivering.
    stalled: tokio::sync::Notify,
    /// Bumped when the stream is found replaced: the follower starts over from its first
    /// message.
    replaced: watch::Sender<u64>,
}

struct Received {
    lines: Vec<Vec<u8>>,
    /// Messages longer than `--max-journal-line` skipped since the last read.
    too_long: u64,
    /// Sequence of the last message in `lines` (or handed out before).
    last: u64,
    /// Sequence of the last message handed out.
    handed: u64,
    /// What the stream held when it was opened (or found replaced): reads wait for new
    /// messages until it is handed out, and the store is settled once it is.
    settle_at: u64,
    /// The generation of the stream being handed out; messages of an earlier one are dropped.
    generation: u64,
    /// The stream was found replaced and the next read begins its generation.
    restarted: bool,
}

struct Contact {
    /// The last answer from the stream (a probe or a message).
    last: Instant,
    /// The stream's last sequence as last seen.
    head: u64,
    /// Since when the stream has held a message not handed out, and that message's sequence:
    /// the first answer that named a last sequence beyond what was handed out, kept until
    /// that sequence is handed out.
    behind: Option<(Instant, u64)>,
    /// The creation time of the stream followed.
    created: i128,
    /// An answer said another stream (its creation time, and when it arrived): a second one
    /// asked after it must say the same before the stream is folded afresh.
    suspect: Option<(i128, Instant)>,
}

impl NatsStore {
    /// Opens the journal stream at `location` and starts following it: from the latest
    /// snapshot's lines (one whose MAC verifies under `keyring`) and the message after the
    /// sequence it covers, or from the first message. Closing records appended through it are
    /// checked against what the stream holds under `keyring` (see the module invariants). A
    /// message longer than `max_line` bytes is skipped, counted and logged, never held.
    /// Retried as `patiently` says, for `--store-start-timeout`; with [`IfMissing::Refuse`]
    /// a missing stream is an error at once.
    pub async fn open(
        location: &NatsLocation,
        options: &NatsOptions,
        keyring: &Keyring,
        max_line: usize,
        missing: IfMissing,
    ) -> Result<NatsStore, NatsError> {
        let Opened {
            stream,
            initial_head,
            created,
            covers,
            lines,
            messages,
        } = patiently(location, options, || {
            NatsStore::open_once(location, options, keyring, missing)
        })
        .await?;
        let shared = Arc::new(Shared {
            received: Mutex::new(Received {
                lines,
                too_long: 0,
                last: covers,
                handed: 0,
                settle_at: initial_head,
                generation: GENERATION,
                restarted: false,
            }),
            delivered: watch::channel(covers).0,
            contact: Mutex::new(Contact {
                last: Instant::now(),
                head: initial_head,
                behind: None,
                created,
                suspect: None,
            }),
            stalled: tokio::sync::Notify::new(),
            replaced: watch::channel(0).0,
        });
        let broadcaster = match Broadcaster::subscribe(&stream).await {
            Ok(broadcaster) => Some(broadcaster),
            Err(error) => {
                tracing::warn!(store = %location, %error, "cannot subscribe to the other replicas' closing broadcasts: their revocations arrive through the stream only");
                None
            }
        };
        let follower = tokio::spawn(follow(stream.clone(), messages, shared.clone(), max_line));
        let probe = tokio::spawn(probe(stream.clone(), shared.clone()));
        Ok(NatsStore {
            stream,
            keyring: keyring.clone(),
            shared,
            stale_after: options.stale_after,
            broadcaster,
            tasks: vec![follower.abort_handle(), probe.abort_handle()],
        })
    }

    /// One attempt at everything [`NatsStore::open`] asks of the cluster.
    async fn open_once(
        location: &NatsLocation,
        options: &NatsOptions,
        keyring: &Keyring,
        missing: IfMissing,
    ) -> Result<Opened, NatsError> {
        let stream = NatsStream::open(location, options, &StreamSpec::JOURNAL, missing).await?;
        let stream_error = |e: io::Error| NatsError::Stream {
            location: location.to_string(),
            reason: e.to_string(),
        };
        let incarnation = stream.incarnation().await.map_err(stream_error)?;
        if !incarnation.led {
            // Its last sequence would be a member's own, perhaps far behind: the fold would
            // settle short of the stream.
            return Err(NatsError::Stream {
                location: location.to_string(),
                reason: "the stream has no leader yet".into(),
            });
        }
        // A snapshot that cannot be read is not used while the journal holds everything; once
        // it is purged, nothing partial is folded.
        // Waiting mends a failed read, not a purged stream without its snapshot.
        let start = whole::start(&stream, Some(keyring), Prefer::Snapshot)
            .await
            .map_err(|e| match e {
                whole::StartError::Io(e) => stream_error(e),
                purged => NatsError::Foreign {
                    location: location.to_string(),
                    reason: purged.to_string(),
                },
            })?;
        let initial_head = incarnation.head;
        let (covers, lines) = match start.snapshot {
            Some((marker, lines)) => {
                tracing::info!(store = %location, covers = marker.covers, lines = lines.len(), "starting from the journal's snapshot");
                (marker.covers, lines)
            }
            None => (0, Vec::new()),
        };
        let messages = stream
            .ordered_from(covers + 1)
            .await
            .map_err(stream_error)?;
        Ok(Opened {
            stream,
            initial_head,
            created: incarnation.created,
            covers,
            lines,
            messages,
        })
    }

    /// The stream this store follows.
    pub fn stream(&self) -> &NatsStream {
        &self.stream
    }
}

impl Drop for NatsStore {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Hands every delivered message to `shared`, in order. The ordered consumer re-creates
/// itself after a reconnect or a gap, from the sequence after the last one delivered; when its
/// heartbeats stop while the connection stays up (the server holding the consumer went away),
/// it is replaced here, from the same place; when the stream is found replaced, from the new
/// stream's first message.
async fn follow(
    stream: NatsStream,
    mut messages: consumer::push::Ordered,
    shared: Arc<Shared>,
    max_line: usize,
) {
    let described = stream.location.to_string();
    // Said once, then counted (a summary at most once a minute), then said ended.
    let mut no_metadata = Flood::default();
    let mut not_replaced = Flood::default();
    let mut replaced = shared.replaced.subscribe();
    let mut consuming = GENERATION;
    loop {
        loop {
            let message = tokio::select! {
                biased;
                _ = replaced.changed() => break,
                _ = shared.stalled.notified() => {
                    tracing::info!(store = %described, "the journal consumer delivers nothing while the stream holds more: replacing it");
                    break;
                }
                message = messages.next() => match message {
                    Some(message) => message,
                    None => break,
                },
            };
            let message = match message {
                Ok(message) => message,
                Err(error)
                    if error.kind() == consumer::push::OrderedErrorKind::MissingHeartbeat =>
                {
                    tracing::warn!(store = %described, "the journal consumer's heartbeats stopped: replacing it");
                    break;
                }
                Err(error) => {
                    tracing::debug!(store = %described, %error, "journal stream follower");
                    continue;
                }
            };
            let sequence = match message.info() {
                Ok(info) => info.stream_sequence,
                Err(error) => {
                    match no_metadata.occurred(1, Instant::now()) {
                        Say::Start => {
                            tracing::warn!(store = %described, %error, "a journal message without stream metadata")
                        }
                        Say::Summary(s) => {
                            tracing::warn!(store = %described, %error, messages = s.repeats, since_first = s.total, "more journal messages without stream metadata")
                        }
                        Say::Quiet => {}
                    }
                    continue;
                }
            };
            if let Some(s) = no_metadata.end(Instant::now()) {
                tracing::info!(store = %described, messages = s.total, "journal messages carry stream metadata again");
            }
            {
                let mut received = shared.received();
                if received.generation != consuming {
                    // The stream was replaced under this consumer: nothing of it is handed out.
                    break;
                }
                if sequence <= received.last {
                    continue;
                }
                if message.payload.len() > max_line {
                    tracing::warn!(store = %described, sequence, bytes = message.payload.len(), max = max_line, "a journal message longer than --max-journal-line: skipped (counted as too-long)");
                    received.too_long += 1;
                } else {
                    received.lines.push(message.payload.to_vec());
                }
                received.last = sequence;
            }
            shared.touch(Some(sequence));
            shared.delivered.send_replace(sequence);
        }
        // Replaced from the message after the last one handed to us (the first, for a stream
        // found replaced), retried until it works.
        let mut backoff = Duration::from_millis(250);
        messages = loop {
            let (next, generation) = {
                let received = shared.received();
                (received.last + 1, received.generation)
            };
            replaced.mark_unchanged();
            match stream.ordered_from(next).await {
                Ok(messages) => {
                    if let Some(s) = not_replaced.end(Instant::now()) {
                        tracing::info!(store = %described, failed_tries = s.total, lasted = ?s.lasted, "the journal consumer is replaced");
                    }
                    consuming = generation;
                    break messages;
                }
                Err(error) => {
                    match not_replaced.occurred(1, Instant::now()) {
                        Say::Start => {
                            tracing::warn!(store = %described, %error, retry_in = ?backoff, "cannot replace the journal consumer yet")
                        }
                        Say::Summary(s) => {
                            tracing::warn!(store = %described, %error, failed_tries = s.repeats, since_first = s.total, "still cannot replace the journal consumer")
                        }
                        Say::Quiet => {}
                    }
                    // A replacement found meanwhile is tried at once.
                    let _ = tokio::time::timeout(backoff, replaced.changed()).await;
                    backoff = (backoff * 2).min(MAX_REPLACE_BACKOFF);
                }
            }
        };
    }
}

/// Asks the stream for its state every [`PROBE_EVERY`]: contact, lag, and whether it is still
/// the stream we follow.
async fn probe(stream: NatsStream, shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Behind the head: the sequence delivered when we saw it so, and since when.
    let mut behind: Option<(u64, Instant)> = None;
    loop {
        tick.tick().await;
        let (asked, asked_at) = (shared.asked(), Instant::now());
        if let Ok(incarnation) = stream.incarnation().await {
            let head = incarnation.head;
            if shared
                .observe(incarnation, asked, asked_at, &stream.location)
                .is_none()
            {
                continue;
            }
            let delivered = *shared.delivered.borrow();
            let now = Instant::now();
            behind = match behind {
                _ if delivered >= head => None,
                Some((seen, since)) if seen == delivered => {
                    if now.duration_since(since) < STALLED_CONSUMER {
                        Some((seen, since))
                    } else {
                        shared.stalled.notify_one();
                        Some((delivered, now))
                    }
                }
                _ => Some((delivered, now)),
            };
        }
    }
}

impl Shared {
    fn received(&self) -> std::sync::MutexGuard<'_, Received> {
        self.received.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn contact(&self) -> std::sync::MutexGuard<'_, Contact> {
        self.contact.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A message arrived: the stream is in contact.
    fn touch(&self, delivered: Option<u64>) {
        let mut contact = self.contact();
        contact.last = Instant::now();
        if let Some(delivered) = delivered {
            contact.head = contact.head.max(delivered);
        }
    }

    /// Where the stream followed stands before a question is asked of it.
    fn asked(&self) -> Asked {
        let received = self.received();
        Asked {
            generation: received.generation,
        }
    }

    /// The stream answered with `now` a question `asked` at `asked_at`: contact; then, if the
    /// answer names a leader, lag, and a replacement ([`compare`]: another creation time) that
    /// a second answer, asked after the first arrived, confirms starts a new generation from the new stream's first message. Returns the generation `now` is in, or `None` when the answer is not
    /// the stream's current state (no leader named, a replacement not yet confirmed).
    fn observe(
        &self,
        now: Incarnation,
        asked: Asked,
        asked_at: Instant,
        location: &NatsLocation,
    ) -> Option<u64> {
        // Lock order: received, then contact (as `health`).
        let mut received = self.received();
        let mut contact = self.contact();
        let answered = Instant::now();
        contact.last = answered;
        match compare(contact.created, received.generation, asked, now) {
            Seen::Unsure => return None,
            Seen::Same => contact.suspect = None,
            Seen::Other => match contact.suspect {
                Some((created, since)) if created == now.created && asked_at >= since => {
                    contact.suspect = None;
                }
                // Said again by an answer asked before the first arrived: still suspected.
                Some((created, _)) if created == now.created => return None,
                _ => {
                    tracing::info!(store = %location, created = now.created, holds = now.head, folded_up_to = received.last, "the journal stream answers as another stream: asking again before folding it afresh");
                    contact.suspect = Some((now.created, answered));
                    return None;
                }
            },
        }
        if contact.created != now.created {
            let (old_created, old_last) = (contact.created, received.last);
            *received = Received {
                lines: Vec::new(),
                too_long: 0,
                last: 0,
                handed: 0,
                settle_at: now.head,
                generation: received.generation + 1,
                restarted: true,
            };
            contact.created = now.created;
            contact.head = now.head;
            contact.behind = (now.head > 0).then_some((contact.last, now.head));
            tracing::warn!(store = %location, was_created = old_created, created = now.created, folded_up_to = old_last, holds = now.head, "the journal stream was deleted and created again: folding the new one from its start (leases only the old one granted are no longer admitted; closures already seen stay in force)");
            self.delivered.send_replace(0);
            self.replaced.send_modify(|n| *n += 1);
            return Some(received.generation);
        }
        contact.head = now.head;
        let handed = received.handed;
        match contact.behind {
            Some((_, target)) if handed < target => {}
            _ => contact.behind = (handed < now.head).then_some((contact.last, now.head)),
        }
        Some(received.generation)
    }
}

impl Store for NatsStore {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        Box::pin(async move {
            // Until the store settles, a read waits for something new (the initial fold reads
            // batch by batch); after, it takes what is there. Cancel-safe: nothing is taken
            // before the await.
            let (handed, settle_at, restarted) = {
                let received = self.shared.received();
                (received.handed, received.settle_at, received.restarted)
            };
            if handed < settle_at && !restarted {
                let mut delivered = self.shared.delivered.subscribe();
                delivered
                    .wait_for(|d| *d > handed)
                    .await
                    .map_err(io::Error::other)?;
            }
            let mut received = self.shared.received();
            received.handed = received.last;
            let restarted = std::mem::take(&mut received.restarted);
            Ok(Batch {
                restarted,
                replaced: restarted,
                lines: std::mem::take(&mut received.lines),
                too_long: std::mem::take(&mut received.too_long),
                position: Position {
                    generation: received.generation,
                    offset: received.last,
                },
            })
        })
    }

    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        // Spawned, so that the append goes through even if the caller stops waiting.
        let (stream, record) = (self.stream.clone(), record.clone());
        let keyring = self.keyring.clone();
        let task = tokio::spawn(async move { append_record(&stream, record, &keyring).await });
        Box::pin(async move {
            let at = task.await.map_err(io::Error::other)??;
            Ok(Position {
                generation: self.shared.received().generation,
                ..at
            })
        })
    }

    fn head(&self) -> BoxFuture<'_, io::Result<Position>> {
        Box::pin(async move {
            let (asked, asked_at) = (self.shared.asked(), Instant::now());
            let now = self.stream.incarnation().await?;
            let generation = self
                .shared
                .observe(now, asked, asked_at, &self.stream.location)
                .ok_or_else(|| {
                    io::Error::other(
                        "the stream's answer is not known to be current (no leader named, or it names another stream not yet confirmed)",
                    )
                })?;
            Ok(Position {
                generation,
                offset: now.head,
            })
        })
    }

    fn settled(&self) -> bool {
        let received = self.shared.received();
        !received.restarted && received.handed >= received.settle_at
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mut delivered = self.shared.delivered.subscribe();
            let mut replaced = self.shared.replaced.subscribe();
            let seen = self.shared.received().handed;
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                tokio::select! {
                    _ = delivered.wait_for(|d| *d > seen) => {}
                    _ = replaced.changed() => {}
                }
            })
            .await;
        })
    }

    fn describe(&self) -> String {
        format!("stream {}", self.stream.location)
    }

    fn broadcast(&self, record: &Value) {
        if let Some(broadcaster) = &self.broadcaster {
            broadcaster.publish(record);
        }
    }

    fn heard(&self) -> BoxFuture<'_, Broadcast> {
        Box::pin(async move {
            match &self.broadcaster {
                Some(broadcaster) => broadcaster.next().await,
                None => std::future::pending().await,
            }
        })
    }

    /// The follower's wait for more ends within a second; like contact with the stream, its
    /// reads may lapse for `--store-stale-after`.
    fn stalled_after(&self) -> Duration {
        self.stale_after
    }

    fn last_contact(&self) -> Option<Instant> {
        Some(self.shared.contact().last)
    }

    fn health(&self) -> StoreHealth {
        let settled = self.settled();
        let received = self.shared.received();
        let contact = self.shared.contact();
        let silent = contact.last.elapsed();
        let lag = match contact.behind {
            Some((since, target)) if received.handed < target => since.elapsed(),
            _ => Duration::ZERO,
        };
        let problem = if !settled && received.generation > GENERATION {
            Some(format!(
                "{}: the stream was deleted and created again; folding the new one from its start ({} of {} messages)",
                self.describe(),
                received.handed,
                received.settle_at
            ))
        } else if !settled {
            Some(format!("{}: initial fold not done", self.describe()))
        } else if silent > self.stale_after {
            Some(format!(
                "{}: no contact for {:.1} s (--store-stale-after {:?}); the last known lease state is enforced",
                self.describe(),
                silent.as_secs_f64(),
                self.stale_after
            ))
        } else if lag > LAG_GRACE {
            Some(format!(
                "{}: behind the stream for {:.1} s: folded up to sequence {}, the stream holds {}; the last known lease state is enforced",
                self.describe(),
                lag.as_secs_f64(),
                received.handed,
                contact.head
            ))
        } else {
            None
        };
        StoreHealth {
            problem,
            lag,
            reconnects: self.stream.reconnects(),
            replaced: received.generation - GENERATION,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREATED: i128 = 1_700_000_000_000_000_000;

    fn answer(created: i128, head: u64, led: bool) -> Incarnation {
        Incarnation { created, head, led }
    }

    fn asked() -> Asked {
        Asked {
            generation: GENERATION,
        }
    }

    #[test]
    fn only_a_led_answer_of_another_creation_time_is_another_stream() {
        let same = |asked_at: Asked, now| compare(CREATED, GENERATION, asked_at, now);
        assert_eq!(same(asked(), answer(CREATED, 5, true)), Seen::Same);
        assert_eq!(same(asked(), answer(CREATED, 9, true)), Seen::Same);
        // Below what was delivered: a leader just elected answering from what it has applied.
        assert_eq!(same(asked(), answer(CREATED, 4, true)), Seen::Same);
        assert_eq!(same(asked(), answer(CREATED, 0, true)), Seen::Same);
        assert_eq!(same(asked(), answer(CREATED + 1, 9, true)), Seen::Other);
        // A member without a leader answers from its own copy: nothing to go by, whatever it
        // says (0 messages, another creation time it was recovering).
        assert_eq!(same(asked(), answer(CREATED, 0, false)), Seen::Unsure);
        assert_eq!(same(asked(), answer(CREATED + 1, 0, false)), Seen::Unsure);
        // Asked of the generation before: the answer may be of the stream that replaced it.
        assert_eq!(
            compare(CREATED, GENERATION + 1, asked(), answer(CREATED, 0, true)),
            Seen::Unsure
        );
    }

    fn shared(created: i128, delivered: u64) -> Shared {
        Shared {
            received: Mutex::new(Received {
                lines: Vec::new(),
                too_long: 0,
                last: delivered,
                handed: delivered,
                settle_at: delivered,
                generation: GENERATION,
                restarted: false,
            }),
            delivered: watch::channel(delivered).0,
            contact: Mutex::new(Contact {
                last: Instant::now(),
                head: delivered,
                behind: None,
                created,
                suspect: None,
            }),
            stalled: tokio::sync::Notify::new(),
            replaced: watch::channel(0).0,
        }
    }

    #[test]
    fn a_replacement_is_folded_only_once_a_second_answer_asked_after_the_first_confirms_it() {
        let location: NatsLocation = "nats://127.0.0.1:4222/LG".parse().unwrap();
        let shared = shared(CREATED, 5);
        let ask = || (shared.asked(), Instant::now());

        // An odd answer (another creation time) once, then the stream as it is: no new generation.
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED + 2, 0, true), a, at, &location),
            None
        );
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED, 5, true), a, at, &location),
            Some(GENERATION)
        );
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED + 2, 0, true), a, at, &location),
            None
        );
        assert_eq!(shared.received().generation, GENERATION);
        assert_eq!(*shared.replaced.borrow(), 0);

        // Two answers asked at the same moment are not two looks.
        let (a, at) = (shared.asked(), Instant::now() - Duration::from_secs(1));
        assert_eq!(
            shared.observe(answer(CREATED + 2, 0, true), a, at, &location),
            None
        );
        assert_eq!(shared.received().generation, GENERATION);

        // Without a leader: contact, nothing else.
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED + 1, 0, false), a, at, &location),
            None
        );
        assert_eq!(shared.contact().suspect.map(|s| s.0), Some(CREATED + 2));

        // The same other stream twice in a row: folded afresh.
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED + 1, 2, true), a, at, &location),
            None
        );
        let (a, at) = ask();
        assert_eq!(
            shared.observe(answer(CREATED + 1, 2, true), a, at, &location),
            Some(GENERATION + 1)
        );
        let received = shared.received();
        assert!(received.restarted);
        assert_eq!((received.last, received.settle_at), (0, 2));
        assert_eq!(*shared.replaced.borrow(), 1);
    }

    #[test]
    fn a_lower_last_sequence_of_the_same_stream_is_never_another_stream() {
        let location: NatsLocation = "nats://127.0.0.1:4222/LG".parse().unwrap();
        let shared = shared(CREATED, 5);
        // A leader just elected answers from what it has applied (3) while 5 was delivered:
        // asked again and again (a catch-up asks every 100 ms), for however long, it is the
        // same stream, and nothing is handed out again.
        for after in [0, 1, 10, 60] {
            let (a, at) = (shared.asked(), Instant::now() + Duration::from_secs(after));
            assert_eq!(
                shared.observe(answer(CREATED, 3, true), a, at, &location),
                Some(GENERATION)
            );
        }
        assert_eq!(shared.received().generation, GENERATION);
        assert_eq!(*shared.replaced.borrow(), 0);
    }
}
