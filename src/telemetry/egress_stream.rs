//! The egress stream (`--egress-stream`): every egress line is also published to a NATS
//! JetStream stream, subject `leasegate.egress.<lease_id>` (`leasegate.egress._` without a
//! lease), so that `leasegate usage` measures every replica at once.
//!
//! Invariants:
//! - Requests never wait on NATS. Lines go through a bounded channel (the backlog) to one
//!   publisher task; when the channel is full the line is dropped and counted
//!   (`leasegate_egress_stream_dropped_total`), never stalled on.
//! - A message is byte-identical to the egress file's line (one serialisation,
//!   [`write_line`]), without its newline.
//! - Every message is sealed ([`seal`]): headers carry a nonce unique to it and a MAC under
//!   the replicas' shared key ([`EgressKey`]); its `Nats-Msg-Id` comes from the MAC, so nobody
//!   without the key can plant a message under an id a replica will use. Readers count only
//!   what [`verify`] accepts.
//! - A batch NATS did not acknowledge is kept and sent again, with the same `Nats-Msg-Id`s, so
//!   a message whose ack was lost is stored once (within the stream's duplicate window). While
//!   the publisher retries it takes nothing new: lines wait in the channel, up to its bound.
//!   A duplicate ack on a message's first send is not our retry: counted and warned about.
//! - Reachability is logged once per change, not once per line; so is the start of dropping.

mod follow;
mod key;
mod seal;

pub use follow::{follow, start_time, Followed, Follower};
pub use key::{EgressKey, KeyFileError, HOW_TO_MAKE, MIN_KEY_BYTES};
pub use seal::{seal, verify, Rejected, Sealed, SetAside, Verified, MAC_HEADER, NONCE_HEADER};

use super::egress::{write_line, EgressEvent};
use crate::nats::{subject_token, NatsOptions, NatsStream, StreamSpec};
use crate::registry::store::NatsLocation;
use async_nats::connection::State;
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Egress subjects: `leasegate.egress.<lease_id>`.
pub const EGRESS_SUBJECTS: &str = "leasegate.egress";

/// `--egress-max-age`: how long the stream keeps a line.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// `--egress-stream-backlog`: lines waiting for NATS before new ones are dropped.
pub const DEFAULT_BACKLOG: usize = 10_000;

/// Lines published before their acks are awaited together.
const BATCH: usize = 256;

/// How long one send or ack may take before the batch counts as failed.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// Waits between attempts while NATS is unreachable: doubling from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_LAST: Duration = Duration::from_secs(5);

/// On shutdown, how long the publisher may go on publishing what is queued.
const CLOSE_LIMIT: Duration = Duration::from_secs(5);

/// The stream's spec: what a stream created by `serve` holds.
pub fn spec(max_age: Duration) -> StreamSpec {
    StreamSpec {
        prefix: EGRESS_SUBJECTS,
        max_age: Some(max_age),
    }
}

/// `--egress-stream` and its settings, validated.
#[derive(Debug, Clone)]
pub struct EgressStreamConfig {
    pub location: NatsLocation,
    /// Credentials, TLS and replicas (the `--nats-*` flags the journal uses too).
    pub nats: NatsOptions,
    /// `--egress-max-age`: the stream drops lines older than this (when leasegate creates it).
    pub max_age: Duration,
    /// `--egress-stream-backlog`: the channel's bound (at least 1).
    pub backlog: usize,
    /// `--egress-stream-key`: what every message is sealed with.
    pub key: EgressKey,
}

/// The sending side of the egress stream (cheap to clone).
#[derive(Debug, Clone)]
pub struct EgressStream {
    /// `None`: no `--egress-stream`.
    tx: Option<mpsc::Sender<Arc<EgressEvent>>>,
    shared: Arc<Shared>,
    /// Asks the publisher to publish what is queued and stop.
    closing: CancellationToken,
    /// The publisher, awaited by [`EgressStream::close`].
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
    /// This process's publisher id, the first part of its nonces.
    publisher: Option<Arc<str>>,
}

/// What the publisher and the metrics share.
#[derive(Debug, Default)]
struct Shared {
    /// Lines lost: the backlog was full, or shutdown came before NATS took them.
    dropped: AtomicU64,
    /// The last attempt to publish succeeded.
    up: AtomicBool,
    /// Lines taken from the channel and not yet acknowledged.
    in_flight: AtomicUsize,
    /// Duplicate acks on a first send: a message of someone else held the line's id.
    duplicates: AtomicU64,
}

/// How the egress stream stands, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamFigures {
    pub dropped: u64,
    pub up: bool,
    /// Lines waiting: in the channel, or sent and not yet acknowledged.
    pub backlog: u64,
    /// Lines NATS called duplicates on their first send (not our retries).
    pub duplicates: u64,
}

impl EgressStream {
    /// A stream that publishes nothing.
    pub fn disabled() -> EgressStream {
        EgressStream {
            tx: None,
            shared: Arc::default(),
            closing: CancellationToken::new(),
            task: Arc::default(),
            publisher: None,
        }
    }

    /// Spawns the publisher on the current runtime. It connects (and creates the stream when
    /// it is missing) in the background, retrying, so a proxy starts and serves while NATS
    /// is away.
    pub fn start(config: EgressStreamConfig) -> EgressStream {
        let (tx, rx) = mpsc::channel(config.backlog.max(1));
        let shared = Arc::new(Shared::default());
        let closing = CancellationToken::new();
        let publisher: Arc<str> = uuid::Uuid::new_v4().simple().to_string().into();
        let task = tokio::spawn(publish(
            config,
            publisher.clone(),
            rx,
            shared.clone(),
            closing.clone(),
        ));
        EgressStream {
            tx: Some(tx),
            shared,
            closing,
            task: Arc::new(Mutex::new(Some(task))),
            publisher: Some(publisher),
        }
    }

    /// This process's publisher id (in every nonce it writes, and in [`Followed::publisher`]):
    /// a follower skips the lines it counts itself. `None` when the stream is off.
    pub fn publisher_id(&self) -> Option<&str> {
        self.publisher.as_deref()
    }

    /// Whether `--egress-stream` is on.
    pub fn is_enabled(&self) -> bool {
        self.tx.is_some()
    }

    /// Queues a copy of a line; drops and counts it if the backlog is full.
    pub fn record(&self, event: &Arc<EgressEvent>) {
        if let Some(tx) = &self.tx {
            if tx.try_send(Arc::clone(event)).is_err() {
                // Full, or closed already: either way the line is lost, and counted.
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Publishes what is queued (for at most a few seconds: what NATS has not taken by then
    /// is dropped and counted) and stops the publisher. Lines recorded afterwards are dropped
    /// and counted. Call it after every exchange has ended (`Server::shutdown` does).
    pub async fn close(&self) {
        self.closing.cancel();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// For `/metrics`; `None` when the stream is off.
    pub fn figures(&self) -> Option<StreamFigures> {
        let tx = self.tx.as_ref()?;
        let queued = tx.max_capacity() - tx.capacity();
        Some(StreamFigures {
            dropped: self.shared.dropped.load(Ordering::Relaxed),
            up: self.shared.up.load(Ordering::Relaxed),
            backlog: (queued + self.shared.in_flight.load(Ordering::Relaxed)) as u64,
            duplicates: self.shared.duplicates.load(Ordering::Relaxed),
        })
    }
}

/// One line ready to publish.
struct Outgoing {
    subject: String,
    /// Its nonce (`<publisher>-<n>`, unique across replicas and restarts) and MAC.
    sealed: Sealed,
    payload: Bytes,
    /// Sends so far: a duplicate ack after one of them may be our own retry.
    sends: u32,
}

/// Whether a duplicate ack means a message that is not ours held the line's id: on the
/// line's first send it cannot be our retry (only a send before it could have been stored).
fn foreign_duplicate(duplicate: bool, earlier_sends: u32) -> bool {
    duplicate && earlier_sends == 0
}

/// The publisher: takes a batch, publishes it until NATS acknowledges every line, takes the
/// next. On `closing` it stops taking new lines and publishes what is queued, for at most
/// [`CLOSE_LIMIT`].
async fn publish(
    config: EgressStreamConfig,
    publisher: Arc<str>,
    mut rx: mpsc::Receiver<Arc<EgressEvent>>,
    shared: Arc<Shared>,
    closing: CancellationToken,
) {
    let described = config.location.to_string();
    let mut link = Link {
        config,
        stream: None,
        state: LinkState::Starting,
        dropping: false,
        duplicating: false,
    };
    // Connect before the first line, so that it does not wait for the connection and a
    // misconfigured stream shows in the log at start.
    let connected = link.connect().await.map(drop);
    shared.up.store(connected.is_ok(), Ordering::Relaxed);
    link.note(connected.as_ref().err(), &described);
    let mut sent = 0u64;
    let mut events = Vec::with_capacity(BATCH);
    let mut batch: Vec<Outgoing> = Vec::with_capacity(BATCH);
    let mut retry = RETRY_FIRST;
    let mut deadline = None;
    let mut dropped_seen = 0;
    loop {
        if batch.is_empty() {
            let taken = match deadline {
                Some(_) => take_now(&mut rx, &mut events),
                None => tokio::select! {
                    taken = rx.recv_many(&mut events, BATCH) => taken,
                    _ = closing.cancelled() => {
                        rx.close();
                        deadline = Some(tokio::time::Instant::now() + CLOSE_LIMIT);
                        continue;
                    }
                },
            };
            if taken == 0 {
                break;
            }
            let mut line = Vec::with_capacity(512);
            for event in events.drain(..) {
                line.clear();
                write_line(&mut line, &event);
                if line.pop().is_none() {
                    continue;
                }
                sent += 1;
                let subject = format!(
                    "{EGRESS_SUBJECTS}.{}",
                    subject_token(event.lease_id.as_deref())
                );
                let sealed = seal(
                    &link.config.key,
                    &subject,
                    format!("{publisher}-{sent}"),
                    &line,
                );
                batch.push(Outgoing {
                    subject,
                    sealed,
                    payload: Bytes::copy_from_slice(&line),
                    sends: 0,
                });
            }
            shared.in_flight.store(batch.len(), Ordering::Relaxed);
        }
        let mut foreign = 0;
        let outcome = link.publish(&mut batch, &mut foreign).await;
        link.note_duplicates(foreign, outcome.is_ok(), &shared, &described);
        shared.in_flight.store(batch.len(), Ordering::Relaxed);
        shared.up.store(outcome.is_ok(), Ordering::Relaxed);
        link.note(outcome.as_ref().err(), &described);
        let dropped = shared.dropped.load(Ordering::Relaxed);
        if dropped > dropped_seen && !link.dropping {
            tracing::warn!(stream = %described, dropped, "egress stream: the backlog is full; lines are dropped (leasegate_egress_stream_dropped_total)");
            link.dropping = true;
        }
        dropped_seen = dropped;
        if outcome.is_ok() {
            retry = RETRY_FIRST;
            continue;
        }
        let now = tokio::time::Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            let mut left = batch.len();
            while rx.try_recv().is_ok() {
                left += 1;
            }
            shared.dropped.fetch_add(left as u64, Ordering::Relaxed);
            tracing::error!(stream = %described, lines = left, "egress stream: NATS did not take these lines before shutdown; dropped");
            break;
        }
        let wait = deadline.map_or(retry, |d| retry.min(d - now));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            // A shutdown during the wait: try again at once, then until the deadline.
            _ = closing.cancelled(), if deadline.is_none() => {
                rx.close();
                deadline = Some(tokio::time::Instant::now() + CLOSE_LIMIT);
            }
        }
        retry = (retry * 2).min(RETRY_LAST);
    }
    shared.in_flight.store(0, Ordering::Relaxed);
}

/// Takes what is queued now without waiting (at most a batch); returns how many.
fn take_now(
    rx: &mut mpsc::Receiver<Arc<EgressEvent>>,
    events: &mut Vec<Arc<EgressEvent>>,
) -> usize {
    while events.len() < BATCH {
        match rx.try_recv() {
            Ok(event) => events.push(event),
            Err(_) => break,
        }
    }
    events.len()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkState {
    /// Nothing published or failed yet.
    Starting,
    Up,
    Down,
}

/// The connection to the stream, made on first use and kept (the client reconnects itself).
struct Link {
    config: EgressStreamConfig,
    stream: Option<NatsStream>,
    state: LinkState,
    /// Dropping was logged in this outage.
    dropping: bool,
    /// Foreign duplicates were logged in this burst.
    duplicating: bool,
}

impl Link {
    /// The stream, connecting (and creating it when missing) on first use.
    async fn connect(&mut self) -> Result<&NatsStream, String> {
        if self.stream.is_none() {
            let spec = spec(self.config.max_age);
            let connected = NatsStream::connect(&self.config.location, &self.config.nats, &spec)
                .await
                .map_err(|e| e.to_string())?;
            self.stream = Some(connected);
        }
        self.stream
            .as_ref()
            .ok_or_else(|| "not connected".to_owned())
    }

    /// Publishes `batch`, every send first and then every ack together; what is acknowledged
    /// leaves `batch`, and `foreign` counts the duplicate acks that were not our retries.
    /// `Err` when anything is left.
    async fn publish(
        &mut self,
        batch: &mut Vec<Outgoing>,
        foreign: &mut u64,
    ) -> Result<(), String> {
        let stream = self.connect().await?;
        if stream.client.connection_state() != State::Connected {
            // The client reconnects on its own; sending now would only fill its buffer.
            return Err("disconnected from NATS".into());
        }
        let mut acks = Vec::with_capacity(batch.len());
        let mut failure = None;
        for (i, line) in batch.iter_mut().enumerate() {
            let message = PublishMessage::build()
                .payload(line.payload.clone())
                .headers(line.sealed.headers());
            let earlier_sends = line.sends;
            // Counted before the send: a send that times out may still reach the stream.
            line.sends = line.sends.saturating_add(1);
            let send = stream.jetstream.send_publish(line.subject.clone(), message);
            match tokio::time::timeout(SEND_TIMEOUT, send).await {
                Ok(Ok(ack)) => acks.push(async move {
                    match tokio::time::timeout(SEND_TIMEOUT, ack).await {
                        Ok(Ok(ack)) => Ok((i, foreign_duplicate(ack.duplicate, earlier_sends))),
                        Ok(Err(e)) => Err(e.to_string()),
                        Err(_) => Err("no ack from JetStream".to_owned()),
                    }
                }),
                Ok(Err(e)) => {
                    failure = Some(e.to_string());
                    break;
                }
                Err(_) => {
                    failure = Some("sending to NATS timed out".to_owned());
                    break;
                }
            }
        }
        let mut taken = vec![false; batch.len()];
        for result in futures_util::future::join_all(acks).await {
            match result {
                Ok((i, duplicate)) => {
                    taken[i] = true;
                    *foreign += u64::from(duplicate);
                }
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        let mut taken = taken.into_iter();
        batch.retain(|_| !taken.next().unwrap_or(false));
        match failure {
            None if batch.is_empty() => Ok(()),
            None => Err("some lines were not acknowledged".into()),
            Some(e) => Err(e),
        }
    }

    /// Counts the duplicate acks of a batch that were not our retries and warns once per
    /// burst: a burst ends with a batch published without any.
    fn note_duplicates(&mut self, foreign: u64, published: bool, shared: &Shared, described: &str) {
        if foreign > 0 {
            let total = shared.duplicates.fetch_add(foreign, Ordering::Relaxed) + foreign;
            if !self.duplicating {
                tracing::warn!(
                    stream = %described,
                    duplicates = total,
                    "egress stream: NATS already held messages under the ids of new lines \
                     (not our retries): someone holding --egress-stream-key published them \
                     first (leasegate_egress_stream_duplicates_total)"
                );
                self.duplicating = true;
            }
        } else if published {
            self.duplicating = false;
        }
    }

    /// Logs a change of reachability.
    fn note(&mut self, failure: Option<&String>, described: &str) {
        match (failure, self.state) {
            (None, LinkState::Up) | (Some(_), LinkState::Down) => {}
            (None, previous) => {
                if previous == LinkState::Down {
                    tracing::info!(stream = %described, "egress stream: NATS takes lines again");
                }
                self.state = LinkState::Up;
                self.dropping = false;
            }
            (Some(error), _) => {
                tracing::warn!(
                    stream = %described,
                    %error,
                    backlog = self.config.backlog,
                    "egress stream: NATS is unreachable; keeping lines (up to the backlog) and retrying"
                );
                self.state = LinkState::Down;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::foreign_duplicate;

    #[test]
    fn only_a_duplicate_of_a_line_sent_before_can_be_our_retry() {
        assert!(foreign_duplicate(true, 0));
        assert!(!foreign_duplicate(true, 1));
        assert!(!foreign_duplicate(true, 5));
        assert!(!foreign_duplicate(false, 0));
        assert!(!foreign_duplicate(false, 3));
    }
}
