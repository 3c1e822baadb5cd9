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
//! - A stream deleted and created again (another creation time, or a last sequence below what
//!   was handed out) is a new store: its first read is a [`Batch::replaced`] generation from
//!   its first message, nothing of the old one is handed out after it, and the store is not
//!   settled (a problem) until it has handed out what the new stream held when it was found.

use super::location::{NatsAuth, NatsLocation};
use super::nats_broadcast::Broadcaster;
use super::whole::{self, Prefer};
use super::{Batch, BoxFuture, Broadcast, Position, Store, StoreHealth};
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

/// How long the stream may hold a message that a probe saw and we have not handed out before
/// the store reports itself behind (a probe's answer can come before the message does).
pub const LAG_GRACE: Duration = Duration::from_millis(250);

/// How long one NATS request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

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
    /// The stream exists but is not one leasegate may use (other subjects; purged with no
    /// snapshot covering what is gone).
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
        Ok(self.incarnation().await?.head)
    }

    /// Which stream answers under our stream's name now, and its last sequence.
    pub async fn incarnation(&self) -> io::Result<Incarnation> {
        let info = tokio::time::timeout(REQUEST_TIMEOUT, self.stream.get_info())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "stream info timed out"))?
            .map_err(io::Error::other)?;
        Ok(Incarnation {
            created: info.created.unix_timestamp_nanos(),
            head: info.state.last_sequence,
        })
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

    /// The sequences the stream holds now: a purge moves `first` past every message it
    /// removed (`first > last`: the stream holds none).
    pub async fn span(&self) -> io::Result<Span> {
        let info = tokio::time::timeout(REQUEST_TIMEOUT, self.stream.get_info())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "stream info timed out"))?
            .map_err(io::Error::other)?;
        let state = &info.state;
        Ok(Span {
            first: match state.messages {
                0 => state.last_sequence + 1,
                _ => state.first_sequence,
            },
            last: state.last_sequence,
        })
    }

    /// Every message of the stream from sequence `start`, up to its last sequence at the call.
    pub async fn read_all_from(&self, start: u64) -> io::Result<Vec<(u64, bytes::Bytes)>> {
        let mut out = Vec::new();
        self.read_each_from(start, |sequence, payload| {
            out.push((sequence, payload));
            Ok::<_, io::Error>(())
        })
        .await?;
        Ok(out)
    }

    /// Every message the stream holds, up to its last sequence at the call. After a purge that
    /// is not the whole journal: readers start with [`super::whole::start`].
    pub async fn read_all(&self) -> io::Result<Vec<(u64, bytes::Bytes)>> {
        self.read_all_from(1).await
    }

    /// Hands every message of the stream from sequence `start` up to its last sequence at the
    /// call to `each` in order; stops at `each`'s first error. Returns how many were handed out.
    pub async fn read_each_from<E: From<io::Error>>(
        &self,
        start: u64,
        mut each: impl FnMut(u64, bytes::Bytes) -> Result<(), E>,
    ) -> Result<usize, E> {
        let span = self.span().await?;
        let head = span.last;
        if span.first > head || start > head {
            return Ok(0);
        }
        let mut messages = self.ordered_from(start).await?;
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

/// One stream under a name, as a stream info answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Incarnation {
    /// Its creation time (Unix nanoseconds): another one is another stream.
    pub created: i128,
    /// Its last sequence (0 when empty).
    pub head: u64,
}

fn at(sequence: u64) -> Position {
    Position {
        generation: GENERATION,
        offset: sequence,
    }
}

/// The sequences a stream holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// The first sequence held (past the last when none is).
    pub first: u64,
    /// The last sequence stored (kept through a purge).
    pub last: u64,
}

impl Span {
    /// Whether messages were removed from the stream's start: what it holds is not the whole
    /// journal.
    pub fn is_purged(&self) -> bool {
        self.first > 1
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
        if let Ok(incarnation) = stream.incarnation().await {
            let head = incarnation.head;
            shared.observe(incarnation, &stream.location);
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

    /// The stream answered with `now`: contact, lag, and a replacement (another creation
    /// time, or a last sequence below what was delivered: a stream never goes back) starts a
    /// new generation from the new stream's first message. Returns the generation `now` is
    /// in.
    fn observe(&self, now: Incarnation, location: &NatsLocation) -> u64 {
        // Lock order: received, then contact (as `health`).
        let mut received = self.received();
        let mut contact = self.contact();
        contact.last = Instant::now();
        if now.created != contact.created || now.head < received.last {
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
            return received.generation;
        }
        contact.head = now.head;
        let handed = received.handed;
        match contact.behind {
            Some((_, target)) if handed < target => {}
            _ => contact.behind = (handed < now.head).then_some((contact.last, now.head)),
        }
        received.generation
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
        let task = tokio::spawn(async move { stream.append_record(record, &keyring).await });
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
            let now = self.stream.incarnation().await?;
            let generation = self.shared.observe(now, &self.stream.location);
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
