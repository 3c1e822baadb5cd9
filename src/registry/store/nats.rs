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
//! - A replica opens its journal stream patiently: every step of the open is retried for
//!   `--store-start-timeout` whatever the error (a cluster without quorum answers 10008 or
//!   nothing), except those waiting cannot mend; giving up names the last error. A command
//!   that only reads ([`IfMissing::Refuse`]) never creates a stream.
//! - Contact is known, not assumed: a probe asks for the stream's state every
//!   [`PROBE_EVERY`]; without an answer for `stale_after` the store reports a problem
//!   (`/readyz` 503) while the last folded state stays in force.

use super::location::{NatsAuth, NatsLocation};
use super::{Batch, BoxFuture, Position, Store, StoreHealth};
use crate::contract::keys::sha256_hex;
use crate::contract::Keyring;
use crate::log_gate::{Flood, Say};
use crate::registry::closing::ClosingCheck;
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use serde_json::Value;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Journal subjects: `leasegate.journal.<lease_id>`.
pub const JOURNAL_SUBJECTS: &str = "leasegate.journal";

/// How long JetStream remembers a `Nats-Msg-Id` (the bridges' retries within it are dropped
/// as duplicates).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(15 * 60);

/// How often the stream's state is asked for (contact and lag).
pub const PROBE_EVERY: Duration = Duration::from_millis(500);

/// How long one NATS request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How many times a compare-and-set append retries after another writer moved the subject.
const APPEND_ATTEMPTS: usize = 8;

/// Every stream handed out here starts generation 1 (0 is "nothing read").
const GENERATION: u64 = 1;

/// Connection settings shared by every NATS user (`--nats-*`).
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// `--nats-creds`: a credentials file (JWT and NKey seed).
    pub creds: Option<PathBuf>,
    /// `--nats-tls-ca`: trust these roots for the servers' certificates (TLS required).
    pub tls_ca: Option<PathBuf>,
    /// `--nats-replicas`: replicas of a stream we create.
    pub replicas: usize,
    /// `--store-stale-after`: without contact this long, the store reports a problem.
    pub stale_after: Duration,
    /// `--store-start-timeout`: how long a replica keeps trying to open its journal stream at
    /// start.
    pub start_timeout: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            creds: None,
            tls_ca: None,
            replicas: 1,
            stale_after: Duration::from_secs(5),
            start_timeout: START_TIMEOUT,
        }
    }
}

/// What a stream we create holds.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// Subject prefix: the stream holds `<prefix>.>`.
    pub prefix: &'static str,
    /// Messages older than this are dropped (`None`: kept forever).
    pub max_age: Option<Duration>,
}

impl StreamSpec {
    /// The journal: kept forever.
    pub const JOURNAL: StreamSpec = StreamSpec {
        prefix: JOURNAL_SUBJECTS,
        max_age: None,
    };
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error("reading {path}: {error}")]
    Creds { path: String, error: io::Error },
    #[error("cannot reach NATS at {location}: {reason}")]
    Connect { location: String, reason: String },
    #[error("{location}: {reason}")]
    Stream { location: String, reason: String },
    /// The stream exists but is not one leasegate may use.
    #[error("{location}: {reason}")]
    Foreign { location: String, reason: String },
    /// The stream does not exist, and a command that only reads does not create it.
    #[error("{location}: the stream {stream} does not exist (a command that only reads does not create it)")]
    Missing { location: String, stream: String },
    /// The stream could not be opened within `--store-start-timeout`.
    #[error("{location}: not open after {waited:.1?} of retries (--store-start-timeout); the last error: {last}")]
    GaveUp {
        location: String,
        waited: Duration,
        last: Box<NatsError>,
    },
}

/// Whether opening a stream that does not exist creates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IfMissing {
    /// `serve`, `issue`, `journal import` and `mirror`: the stream is made, per its spec.
    Create,
    /// The commands that only read: [`NatsError::Missing`].
    Refuse,
}

/// A connection to one stream.
#[derive(Clone)]
pub struct NatsStream {
    pub location: NatsLocation,
    pub client: async_nats::Client,
    pub jetstream: jetstream::Context,
    pub stream: stream::Stream,
    prefix: &'static str,
    /// Reconnections since connect (`leasegate_store_reconnects_total`).
    reconnects: Arc<AtomicU64>,
}

impl std::fmt::Debug for NatsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsStream")
            .field("location", &self.location.to_string())
            .finish()
    }
}

/// The subject token for a lease id: the id when it is a safe token (every valid lease id, a
/// UUID, is), `_` otherwise.
pub fn subject_token(lease_id: Option<&str>) -> &str {
    match lease_id {
        Some(id)
            if !id.is_empty()
                && id.len() <= 64
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') =>
        {
            id
        }
        _ => "_",
    }
}

impl NatsStream {
    /// Connects to `location` and opens its stream, creating it (per `spec`, with
    /// `options.replicas`) when it is missing. An existing stream must hold exactly
    /// `<prefix>.>`.
    pub async fn connect(
        location: &NatsLocation,
        options: &NatsOptions,
        spec: &StreamSpec,
    ) -> Result<NatsStream, NatsError> {
        NatsStream::open(location, options, spec, IfMissing::Create).await
    }

    /// [`NatsStream::connect`] for a command that only reads: a missing stream is
    /// [`NatsError::Missing`], and stays missing.
    pub async fn connect_existing(
        location: &NatsLocation,
        options: &NatsOptions,
        spec: &StreamSpec,
    ) -> Result<NatsStream, NatsError> {
        NatsStream::open(location, options, spec, IfMissing::Refuse).await
    }

    /// Connects to `location` and opens its stream; what a missing one does is `missing`'s.
    pub async fn open(
        location: &NatsLocation,
        options: &NatsOptions,
        spec: &StreamSpec,
        missing: IfMissing,
    ) -> Result<NatsStream, NatsError> {
        let reconnects = Arc::new(AtomicU64::new(0));
        let client = connect_client(location, options, reconnects.clone()).await?;
        let jetstream = jetstream::new(client.clone());
        let stream_error = |reason: String| NatsError::Stream {
            location: location.to_string(),
            reason,
        };
        let subjects = format!("{}.>", spec.prefix);
        let config = stream::Config {
            name: location.stream.clone(),
            subjects: vec![subjects.clone()],
            storage: stream::StorageType::File,
            num_replicas: options.replicas,
            duplicate_window: DUPLICATE_WINDOW,
            max_age: spec.max_age.unwrap_or_default(),
            ..Default::default()
        };
        let patience = options.stale_after.max(REQUEST_TIMEOUT);
        let no_answer = |_| stream_error("JetStream did not answer (is it enabled?)".into());
        let mut stream = match missing {
            IfMissing::Create => {
                tokio::time::timeout(patience, jetstream.get_or_create_stream(config))
                    .await
                    .map_err(no_answer)?
                    .map_err(|e| stream_error(format!("cannot open or create the stream: {e}")))?
            }
            IfMissing::Refuse => tokio::time::timeout(patience, jetstream.get_stream(&config.name))
                .await
                .map_err(no_answer)?
                .map_err(|e| match e.kind() {
                    jetstream::context::GetStreamErrorKind::JetStream(e)
                        if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        NatsError::Missing {
                            location: location.to_string(),
                            stream: location.stream.clone(),
                        }
                    }
                    _ => stream_error(format!("cannot open the stream: {e}")),
                })?,
        };
        let held = stream
            .info()
            .await
            .map_err(|e| stream_error(e.to_string()))?
            .config
            .subjects
            .clone();
        if held != [subjects.clone()] {
            return Err(NatsError::Foreign {
                location: location.to_string(),
                reason: format!(
                "the stream holds subjects {held:?}; leasegate needs a stream of its own holding exactly [{subjects:?}]"
            ),
            });
        }
        Ok(NatsStream {
            location: location.clone(),
            client,
            jetstream,
            stream,
            prefix: spec.prefix,
            reconnects,
        })
    }

    /// The subject for a record of `lease_id`.
    pub fn subject(&self, lease_id: Option<&str>) -> String {
        format!("{}.{}", self.prefix, subject_token(lease_id))
    }

    /// The stream's last sequence now (0 when empty).
    pub async fn last_sequence(&self) -> io::Result<u64> {
        let info = tokio::time::timeout(REQUEST_TIMEOUT, self.stream.get_info())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "stream info timed out"))?
            .map_err(io::Error::other)?;
        Ok(info.state.last_sequence)
    }

    /// Publishes `line` to `subject` and waits for the stream's ack; `id` (when given) is the
    /// `Nats-Msg-Id`, so a retry within [`DUPLICATE_WINDOW`] is not stored twice. Returns the
    /// message's sequence (the first one's, for a duplicate).
    pub async fn publish(&self, subject: String, line: &[u8], id: Option<&str>) -> io::Result<u64> {
        let mut message = jetstream::message::PublishMessage::build()
            .payload(bytes::Bytes::copy_from_slice(line));
        if let Some(id) = id {
            message = message.message_id(id);
        }
        let ack = self
            .jetstream
            .send_publish(subject, message)
            .await
            .map_err(io::Error::other)?;
        let ack = tokio::time::timeout(REQUEST_TIMEOUT, ack)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no ack from JetStream"))?
            .map_err(io::Error::other)?;
        Ok(ack.sequence)
    }

    /// Appends `record`: a closing record as the module invariants say (it counts as done only
    /// once the stream holds a line that [`ClosingCheck::accepts`]), anything else published as
    /// it is. Returns the position of the message that holds it (or that already closed the
    /// lease).
    async fn append_record(&self, record: Value, keyring: &Keyring) -> io::Result<Position> {
        let line = serde_json::to_vec(&record)?;
        let lease_id = record.get("lease_id").and_then(Value::as_str);
        let subject = self.subject(lease_id);
        let Some(check) = ClosingCheck::of(&record, &line, Some(keyring)) else {
            return Ok(at(self.publish(subject, &line, None).await?));
        };
        let token = subject_token(lease_id);
        // One closing record per lease from every replica: JetStream stages the id when the
        // publish is proposed, so concurrent duplicates are caught even in a cluster (where the
        // subject-sequence check alone misses in-flight proposals).
        let shared_id = format!("leasegate-close-{token}");
        for _ in 0..APPEND_ATTEMPTS {
            let last = match self.stream.get_last_raw_message_by_subject(&subject).await {
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
            match self
                .publish_once(&subject, &line, &shared_id, Some(expected))
                .await?
            {
                Published::Stored(sequence) => return Ok(at(sequence)),
                Published::Duplicate(sequence) => {
                    if self.holds(&subject, &check, sequence).await? {
                        return Ok(at(sequence));
                    }
                    tracing::warn!(lease = check.lease_id(), sequence, store = %self.location, "the stream answers a closing record as a duplicate of a message that does not close the lease (planted under {shared_id}): publishing it under its own id");
                    break;
                }
                Published::Moved => continue,
            }
        }
        // The shared id is taken by something else, or the subject kept moving: an id of our
        // record's own bytes, which nobody can take before they exist, and no expectation.
        let own_id = format!("{shared_id}-{}", &sha256_hex(&line)[..32]);
        match self.publish_once(&subject, &line, &own_id, None).await? {
            Published::Stored(sequence) => Ok(at(sequence)),
            Published::Duplicate(sequence) if self.holds(&subject, &check, sequence).await? => {
                Ok(at(sequence))
            }
            _ => Err(io::Error::other(format!(
                "{subject}: the stream does not hold the closing record and refuses it under {own_id}"
            ))),
        }
    }

    /// Publishes `line` once under `id` (and `expected`, the subject's last sequence, when
    /// given) and says what the stream did with it.
    async fn publish_once(
        &self,
        subject: &str,
        line: &[u8],
        id: &str,
        expected: Option<u64>,
    ) -> io::Result<Published> {
        let mut message = jetstream::message::PublishMessage::build()
            .payload(bytes::Bytes::copy_from_slice(line))
            .message_id(id);
        if let Some(expected) = expected {
            message = message.expected_last_subject_sequence(expected);
        }
        let ack = self
            .jetstream
            .send_publish(subject.to_owned(), message)
            .await
            .map_err(io::Error::other)?;
        match tokio::time::timeout(REQUEST_TIMEOUT, ack).await {
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no ack from JetStream",
            )),
            Ok(Ok(ack)) if ack.duplicate => Ok(Published::Duplicate(ack.sequence)),
            Ok(Ok(ack)) => Ok(Published::Stored(ack.sequence)),
            Ok(Err(e)) if e.kind() == jetstream::context::PublishErrorKind::WrongLastSequence => {
                Ok(Published::Moved)
            }
            Ok(Err(e)) => Err(io::Error::other(e)),
        }
    }

    /// Whether the message at `sequence` is on `subject` and stands for the record `check`
    /// appends.
    async fn holds(&self, subject: &str, check: &ClosingCheck, sequence: u64) -> io::Result<bool> {
        let message = tokio::time::timeout(REQUEST_TIMEOUT, self.stream.get_raw_message(sequence))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "message get timed out"))?
            .map_err(io::Error::other)?;
        Ok(message.subject.as_str() == subject
            && check.accepts(subject_token(Some(check.lease_id())), &message.payload))
    }

    /// Every message of the stream, from the first, up to its last sequence at the call.
    pub async fn read_all(&self) -> io::Result<Vec<(u64, bytes::Bytes)>> {
        let mut out = Vec::new();
        self.read_each(|sequence, payload| {
            out.push((sequence, payload));
            Ok::<_, io::Error>(())
        })
        .await?;
        Ok(out)
    }

    /// Hands every message of the stream, from the first up to its last sequence at the call,
    /// to `each` in order; stops at `each`'s first error. Returns how many were handed out.
    pub async fn read_each<E: From<io::Error>>(
        &self,
        mut each: impl FnMut(u64, bytes::Bytes) -> Result<(), E>,
    ) -> Result<usize, E> {
        let head = self.last_sequence().await?;
        if head == 0 {
            return Ok(0);
        }
        let mut messages = self.ordered_from(1).await?;
        let mut handed = 0;
        while let Some(message) = messages.next().await {
            let message = match message {
                Ok(message) => message,
                Err(e) => {
                    tracing::debug!(error = %e, "ordered consumer");
                    continue;
                }
            };
            let sequence = message.info().map_err(io::Error::other)?.stream_sequence;
            each(sequence, message.payload.clone())?;
            handed += 1;
            if sequence >= head {
                break;
            }
        }
        Ok(handed)
    }

    /// An ordered push consumer delivering every message from `start`.
    pub async fn ordered_from(&self, start: u64) -> io::Result<consumer::push::Ordered> {
        let deliver_policy = match start {
            0 | 1 => consumer::DeliverPolicy::All,
            start => consumer::DeliverPolicy::ByStartSequence {
                start_sequence: start,
            },
        };
        let consumer = self
            .stream
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                filter_subject: format!("{}.>", self.prefix),
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(io::Error::other)?;
        consumer.messages().await.map_err(io::Error::other)
    }

    /// The largest message (headers and payload) the server we are connected to takes.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// Reconnections since connect.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }
}

fn at(sequence: u64) -> Position {
    Position {
        generation: GENERATION,
        offset: sequence,
    }
}

/// What the stream did with one publish.
enum Published {
    /// Stored at this sequence.
    Stored(u64),
    /// Answered as a duplicate of the message at this sequence (its id was seen before).
    Duplicate(u64),
    /// The subject's last sequence was not the one expected.
    Moved,
}

async fn connect_client(
    location: &NatsLocation,
    options: &NatsOptions,
    reconnects: Arc<AtomicU64>,
) -> Result<async_nats::Client, NatsError> {
    let mut connect = async_nats::ConnectOptions::new();
    if let Some(path) = &options.creds {
        connect = connect
            .credentials_file(path)
            .await
            .map_err(|error| NatsError::Creds {
                path: path.display().to_string(),
                error,
            })?;
    }
    match &location.auth {
        Some(NatsAuth::UserPassword { user, password }) => {
            connect = connect.user_and_password(user.clone(), password.clone());
        }
        Some(NatsAuth::Token(token)) => connect = connect.token(token.clone()),
        None => {}
    }
    if let Some(ca) = &options.tls_ca {
        connect = connect.add_root_certificates(ca.clone()).require_tls(true);
    }
    if location.tls {
        connect = connect.require_tls(true);
    }
    let was_disconnected = Arc::new(AtomicBool::new(false));
    let described = location.to_string();
    connect = connect
        .connection_timeout(REQUEST_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT))
        .name("leasegate")
        .event_callback(move |event| {
            let (reconnects, was_disconnected) = (reconnects.clone(), was_disconnected.clone());
            let described = described.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        was_disconnected.store(true, Ordering::Relaxed);
                        tracing::warn!(store = %described, "disconnected from NATS; reconnecting");
                    }
                    async_nats::Event::Connected => {
                        if was_disconnected.swap(false, Ordering::Relaxed) {
                            reconnects.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(store = %described, "reconnected to NATS");
                        }
                    }
                    other => tracing::debug!(store = %described, event = %other, "NATS"),
                }
            }
        });
    let servers: Vec<async_nats::ServerAddr> = location
        .servers
        .iter()
        .map(|s| {
            let scheme = if location.tls { "tls" } else { "nats" };
            format!("{scheme}://{s}")
                .parse()
                .map_err(|e: io::Error| NatsError::Connect {
                    location: location.to_string(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    connect
        .connect(servers)
        .await
        .map_err(|e| NatsError::Connect {
            location: location.to_string(),
            reason: e.to_string(),
        })
}

/// How long a replica keeps trying to open its journal stream at start, by default (a cluster
/// that is itself starting, or that has lost its quorum, elects its leaders first).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `attempt` until it succeeds, with backoff, for `options.start_timeout` whatever the
/// error, except those that waiting cannot mend (credentials that cannot be read, a stream
/// leasegate may not use or is not to create): those are returned at once. Past the timeout
/// the error names the last attempt's.
async fn patiently<T, F, Fut>(
    location: &NatsLocation,
    options: &NatsOptions,
    mut attempt: F,
) -> Result<T, NatsError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, NatsError>>,
{
    let started = Instant::now();
    let deadline = started + options.start_timeout;
    let mut backoff = Duration::from_millis(250);
    loop {
        let error = match attempt().await {
            Ok(done) => return Ok(done),
            Err(
                error @ (NatsError::Creds { .. }
                | NatsError::Foreign { .. }
                | NatsError::Missing { .. }),
            ) => return Err(error),
            Err(error) => error,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NatsError::GaveUp {
                location: location.to_string(),
                waited: started.elapsed(),
                last: Box::new(error),
            });
        }
        let wait = backoff.min(left);
        tracing::warn!(%error, retry_in = ?wait, "the journal stream cannot be opened yet");
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(Duration::from_secs(4));
    }
}

/// What opening the journal stream yields: the stream, its last sequence then, the sequence
/// the snapshot covers and its lines, and the consumer of what follows.
type Opened = (NatsStream, u64, u64, Vec<Vec<u8>>, consumer::push::Ordered);

/// The journal stream, followed: what [`Store`] needs.
pub struct NatsStore {
    stream: NatsStream,
    /// The keys our closing records are signed with: what a line already in the stream must
    /// verify under to stand for one of them, and what a snapshot's MAC must verify under.
    keyring: Keyring,
    shared: Arc<Shared>,
    stale_after: Duration,
    /// The follower and the probe; aborted when the store is dropped.
    tasks: Vec<tokio::task::AbortHandle>,
}

/// What the follower and the probe tell the readers.
struct Shared {
    /// Messages delivered and not yet handed out.
    received: Mutex<Received>,
    /// The last sequence delivered (readers wait on it).
    delivered: watch::Sender<u64>,
    /// The stream's last sequence when we connected: the first read waits for it.
    initial_head: u64,
    contact: Mutex<Contact>,
}

#[derive(Default)]
struct Received {
    lines: Vec<Vec<u8>>,
    /// Messages longer than `--max-journal-line` skipped since the last read.
    too_long: u64,
    /// Sequence of the last message in `lines` (or handed out before).
    last: u64,
    /// Sequence of the last message handed out.
    handed: u64,
}

struct Contact {
    /// The last answer from the stream (a probe or a message).
    last: Instant,
    /// The stream's last sequence as last seen.
    head: u64,
    /// The last instant we had delivered everything the stream held.
    caught_up: Instant,
}

impl NatsStore {
    /// Opens the journal stream at `location` and starts following it: from the latest
    /// snapshot's lines (one whose MAC verifies under `keyring`) and the message after the
    /// sequence it covers, or from the first message. Closing records appended through it are
    /// checked against what the stream holds under `keyring` (see the module invariants). A
    /// message longer than `max_line` bytes is skipped, counted and logged, never held.
    /// Retried as [`patiently`] says, for `--store-start-timeout`; with [`IfMissing::Refuse`]
    /// a missing stream is an error at once.
    pub async fn open(
        location: &NatsLocation,
        options: &NatsOptions,
        keyring: &Keyring,
        max_line: usize,
        missing: IfMissing,
    ) -> Result<NatsStore, NatsError> {
        let (stream, initial_head, covers, lines, messages) = patiently(location, options, || {
            NatsStore::open_once(location, options, keyring, missing)
        })
        .await?;
        let now = Instant::now();
        let shared = Arc::new(Shared {
            received: Mutex::new(Received {
                lines,
                too_long: 0,
                last: covers,
                handed: 0,
            }),
            delivered: watch::channel(covers).0,
            initial_head,
            contact: Mutex::new(Contact {
                last: now,
                head: initial_head,
                caught_up: now,
            }),
        });
        let follower = tokio::spawn(follow(stream.clone(), messages, shared.clone(), max_line));
        let probe = tokio::spawn(probe(stream.clone(), shared.clone()));
        Ok(NatsStore {
            stream,
            keyring: keyring.clone(),
            shared,
            stale_after: options.stale_after,
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
        let initial_head = stream.last_sequence().await.map_err(stream_error)?;
        // A snapshot that cannot be read is not used: the journal holds everything.
        let (covers, lines) = match super::snapshot::latest(&stream, initial_head, keyring).await {
            Ok(Some((marker, lines))) => {
                tracing::info!(store = %location, covers = marker.covers, lines = lines.len(), "starting from the journal's snapshot");
                (marker.covers, lines)
            }
            Ok(None) => (0, Vec::new()),
            Err(error) => {
                tracing::warn!(store = %location, %error, "the journal's snapshot cannot be read: folding the journal from its start");
                (0, Vec::new())
            }
        };
        let messages = stream
            .ordered_from(covers + 1)
            .await
            .map_err(stream_error)?;
        Ok((stream, initial_head, covers, lines, messages))
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
/// it is replaced here, from the same place.
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
    loop {
        while let Some(message) = messages.next().await {
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
        // Replaced from the message after the last one handed to us, retried until it works.
        let mut backoff = Duration::from_millis(250);
        messages = loop {
            let next = shared.received().last + 1;
            match stream.ordered_from(next).await {
                Ok(messages) => {
                    if let Some(s) = not_replaced.end(Instant::now()) {
                        tracing::info!(store = %described, failed_tries = s.total, lasted = ?s.lasted, "the journal consumer is replaced");
                    }
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
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(4));
                }
            }
        };
    }
}

/// Asks the stream for its state every [`PROBE_EVERY`]: contact and lag.
async fn probe(stream: NatsStream, shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Ok(head) = stream.last_sequence().await {
            let delivered = *shared.delivered.borrow();
            let mut contact = shared.contact();
            contact.last = Instant::now();
            contact.head = head;
            if delivered >= head {
                contact.caught_up = contact.last;
            }
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

    /// A message arrived: the stream is in contact, and caught up if it was the head.
    fn touch(&self, delivered: Option<u64>) {
        let mut contact = self.contact();
        contact.last = Instant::now();
        if let Some(delivered) = delivered {
            contact.head = contact.head.max(delivered);
            if delivered >= contact.head {
                contact.caught_up = contact.last;
            }
        }
    }
}

impl Store for NatsStore {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        Box::pin(async move {
            // Until the store settles, a read waits for something new (the initial fold reads
            // batch by batch); after, it takes what is there. Cancel-safe: nothing is taken
            // before the await.
            let handed = self.shared.received().handed;
            if handed < self.shared.initial_head {
                let mut delivered = self.shared.delivered.subscribe();
                delivered
                    .wait_for(|d| *d > handed)
                    .await
                    .map_err(io::Error::other)?;
            }
            let mut received = self.shared.received();
            received.handed = received.last;
            Ok(Batch {
                restarted: false,
                lines: std::mem::take(&mut received.lines),
                too_long: std::mem::take(&mut received.too_long),
                position: at(received.last),
            })
        })
    }

    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        // Spawned, so that the append goes through even if the caller stops waiting.
        let (stream, record) = (self.stream.clone(), record.clone());
        let keyring = self.keyring.clone();
        let task = tokio::spawn(async move { stream.append_record(record, &keyring).await });
        Box::pin(async move { task.await.map_err(io::Error::other)? })
    }

    fn settled(&self) -> bool {
        self.shared.received().handed >= self.shared.initial_head
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let mut delivered = self.shared.delivered.subscribe();
            let seen = self.shared.received().handed;
            let _ = tokio::time::timeout(Duration::from_secs(1), delivered.wait_for(|d| *d > seen))
                .await;
        })
    }

    fn describe(&self) -> String {
        format!("stream {}", self.stream.location)
    }

    /// The follower's wait for more ends within a second; like contact with the stream, its
    /// reads may lapse for `--store-stale-after`.
    fn stalled_after(&self) -> Duration {
        self.stale_after
    }

    fn health(&self) -> StoreHealth {
        let folded = self.settled();
        let contact = self.shared.contact();
        let silent = contact.last.elapsed();
        let lag = contact.caught_up.elapsed().saturating_sub(PROBE_EVERY * 2);
        let problem = if !folded {
            Some(format!("{}: initial fold not done", self.describe()))
        } else if silent > self.stale_after {
            Some(format!(
                "{}: no contact for {:.1} s (--store-stale-after {:?}); the last known lease state is enforced",
                self.describe(),
                silent.as_secs_f64(),
                self.stale_after
            ))
        } else if lag > self.stale_after {
            Some(format!(
                "{}: {:.1} s behind the stream (--store-stale-after {:?}); the last known lease state is enforced",
                self.describe(),
                lag.as_secs_f64(),
                self.stale_after
            ))
        } else {
            None
        };
        StoreHealth {
            problem,
            lag,
            reconnects: self.stream.reconnects(),
        }
    }
}
