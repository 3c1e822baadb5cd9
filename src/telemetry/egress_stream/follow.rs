//! Following the egress stream: every replica's verified lines from an instant on, as they
//! are stored, for as long as the follower is held (budgets fold other replicas' usage so).
//!
//! Invariants: only lines [`verify`] accepts are yielded, each once and in stream order; what
//! it sets aside is counted by reason. NATS going away never ends the follower: it reconnects
//! and resumes after the last stream sequence it saw, so nothing is skipped or repeated.

use super::key::EgressKey;
use super::seal::{verify, SetAside};
use super::{spec, DEFAULT_MAX_AGE, EGRESS_SUBJECTS};
use crate::contract::Timestamp;
use crate::nats::{NatsOptions, NatsStream};
use crate::registry::store::NatsLocation;
use crate::telemetry::egress::LoggedLine;
use async_nats::jetstream::consumer;
use bytes::Bytes;
use futures_util::StreamExt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Verified lines waiting for the holder before the follower stops reading.
const BUFFER: usize = 1024;

/// Waits between attempts while NATS is away: doubling from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_LAST: Duration = Duration::from_secs(5);

/// One verified line of the stream.
#[derive(Debug, Clone)]
pub struct Followed {
    /// The replica that published it ([`super::EgressStream::publisher_id`]).
    pub publisher: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// The line's own time.
    pub time: Timestamp,
    pub line: LoggedLine,
    /// The line as published, byte for byte (fields [`LoggedLine`] leaves out are in it).
    pub payload: Bytes,
}

/// The verified lines of every replica, as a `Stream` that never ends while held; dropping
/// it stops the reading.
pub struct Follower {
    rx: mpsc::Receiver<Followed>,
    set_aside: Arc<Mutex<SetAside>>,
    live: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl Follower {
    /// What was set aside so far, by reason.
    pub fn set_aside(&self) -> SetAside {
        *self.set_aside.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether it is connected and has read every line stored when its consumer started (or
    /// restarted): what it has handed over is then the stream's whole content but for the
    /// lines in flight.
    pub fn live(&self) -> Arc<AtomicBool> {
        self.live.clone()
    }
}

impl futures_util::Stream for Follower {
    type Item = Followed;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Followed>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Follows the egress stream at `location` from messages stored at or after `since`, on the
/// current runtime. A stream that does not exist yet is waited for (the replicas make it).
pub fn follow(
    location: NatsLocation,
    options: NatsOptions,
    key: EgressKey,
    since: Timestamp,
) -> Follower {
    let (tx, rx) = mpsc::channel(BUFFER);
    let set_aside = Arc::new(Mutex::new(SetAside::default()));
    let live = Arc::new(AtomicBool::new(false));
    let reader = Reader {
        live: live.clone(),
        location,
        options,
        key,
        since,
        next: None,
        tx,
        set_aside: set_aside.clone(),
    };
    Follower {
        rx,
        set_aside,
        live,
        task: tokio::spawn(reader.run()),
    }
}

struct Reader {
    location: NatsLocation,
    options: NatsOptions,
    key: EgressKey,
    since: Timestamp,
    /// The stream sequence to resume at: after the last one seen (`None`: none seen yet).
    next: Option<u64>,
    tx: mpsc::Sender<Followed>,
    set_aside: Arc<Mutex<SetAside>>,
    /// See [`Follower::live`].
    live: Arc<AtomicBool>,
}

/// Why one consumer stopped.
enum Stop {
    /// The holder dropped the follower.
    Dropped,
    /// NATS: try again.
    Failed(String),
}

impl Reader {
    async fn run(mut self) {
        let described = self.location.to_string();
        let mut stream = None;
        let mut retry = RETRY_FIRST;
        let mut down = false;
        loop {
            let before = self.next;
            let stopped = self.read(&mut stream).await;
            self.live.store(false, Ordering::Release);
            match stopped {
                Stop::Dropped => return,
                Stop::Failed(error) => {
                    if self.next != before {
                        // It read something: this is a new outage, not the last one going on.
                        retry = RETRY_FIRST;
                        down = false;
                    }
                    if !down {
                        tracing::warn!(stream = %described, %error, "egress stream follower: NATS is unreachable; retrying");
                        down = true;
                    }
                }
            }
            if self.tx.is_closed() {
                return;
            }
            tokio::time::sleep(retry).await;
            retry = (retry * 2).min(RETRY_LAST);
        }
    }

    /// One ordered consumer from where the last one stopped, read until it fails.
    async fn read(&mut self, stream: &mut Option<NatsStream>) -> Stop {
        if stream.is_none() {
            let spec = spec(DEFAULT_MAX_AGE);
            match NatsStream::connect_existing(&self.location, &self.options, &spec).await {
                Ok(connected) => *stream = Some(connected),
                Err(e) => return Stop::Failed(e.to_string()),
            }
        }
        let Some(stream) = stream.as_ref() else {
            return Stop::Failed("not connected".into());
        };
        let deliver_policy = match self.next {
            Some(start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
            None => match start_time(self.since) {
                Some(start_time) => consumer::DeliverPolicy::ByStartTime { start_time },
                None => consumer::DeliverPolicy::All,
            },
        };
        let created = stream
            .stream
            .create_consumer(consumer::push::OrderedConfig {
                deliver_subject: stream.client.new_inbox(),
                filter_subject: format!("{EGRESS_SUBJECTS}.>"),
                deliver_policy,
                ..Default::default()
            })
            .await;
        let mut messages = match created {
            Ok(consumer) => {
                if consumer.cached_info().num_pending == 0 {
                    self.live.store(true, Ordering::Release);
                }
                match consumer.messages().await {
                    Ok(messages) => messages,
                    Err(e) => return Stop::Failed(e.to_string()),
                }
            }
            Err(e) => return Stop::Failed(e.to_string()),
        };
        loop {
            let message = match messages.next().await {
                Some(Ok(message)) => message,
                Some(Err(e)) => return Stop::Failed(e.to_string()),
                None => return Stop::Failed("the consumer ended".into()),
            };
            let (sequence, pending) = match message.info() {
                Ok(info) => (info.stream_sequence, info.pending),
                Err(e) => return Stop::Failed(e.to_string()),
            };
            if self.next.is_some_and(|next| sequence < next) {
                continue;
            }
            self.next = Some(sequence + 1);
            let verified = verify(
                &self.key,
                message.subject.as_str(),
                message.headers.as_ref(),
                &message.payload,
            );
            match verified {
                Ok(v) => {
                    let followed = Followed {
                        publisher: v.publisher,
                        sequence,
                        time: v.time,
                        line: v.line,
                        payload: message.payload.clone(),
                    };
                    if self.tx.send(followed).await.is_err() {
                        return Stop::Dropped;
                    }
                }
                Err(reason) => self
                    .set_aside
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .count(reason),
            }
            if pending == 0 {
                self.live.store(true, Ordering::Release);
            }
        }
    }
}

/// `since` as JetStream takes it; `None` before the Unix epoch's representable range.
pub fn start_time(since: Timestamp) -> Option<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(since.as_millis()) * 1_000_000).ok()
}
