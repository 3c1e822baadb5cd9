//! The JetStream stream handle every user of NATS holds: one stream of subjects `<prefix>.>`,
//! opened (created per its [`StreamSpec`], or refused when missing for a command that only
//! reads), published to, read from a sequence, and asked for its state.
//!
//! Invariants:
//! - A stream is used only if it holds exactly `<prefix>.>`: a stream of other subjects is
//!   [`NatsError::Foreign`], never written.
//! - [`IfMissing::Refuse`] never creates a stream.
//! - Every request to the stream is bounded by [`REQUEST_TIMEOUT`].

use super::connect::{self, NatsError, NatsOptions, REQUEST_TIMEOUT};
use crate::registry::store::location::NatsLocation;
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Journal subjects: `leasegate.journal.<lease_id>`.
pub const JOURNAL_SUBJECTS: &str = "leasegate.journal";

/// How long JetStream remembers a `Nats-Msg-Id` (the bridges' retries within it are dropped
/// as duplicates).
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(15 * 60);

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
        let client = connect::connect(location, options, reconnects.clone()).await?;
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
        // A server without a cluster answers as the stream's leader; in a cluster, a member of
        // a group without a leader (lost quorum, cut off from the others) answers
        // from its own state, with no leader named.
        let led = info
            .cluster
            .as_ref()
            .is_none_or(|c| c.leader.as_deref().is_some_and(|l| !l.is_empty()));
        Ok(Incarnation {
            created: info.created.unix_timestamp_nanos(),
            head: info.state.last_sequence,
            led,
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

    /// Publishes `line` once under `id` (and `expected`, the subject's last sequence, when
    /// given) and says what the stream did with it.
    pub(crate) async fn publish_once(
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
    /// is not the whole journal: readers start with [`crate::registry::store::whole::start`].
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
    /// The answer names the stream's leader (or comes from a server without a cluster): it is
    /// the stream's current state. Without a leader, a member answers from its own copy, which
    /// can be behind (a lower last sequence, even 0).
    pub led: bool,
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
pub(crate) enum Published {
    /// Stored at this sequence.
    Stored(u64),
    /// Answered as a duplicate of the message at this sequence (its id was seen before).
    Duplicate(u64),
    /// The subject's last sequence was not the one expected.
    Moved,
}
