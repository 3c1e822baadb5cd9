//! The egress log: one JSON line per forwarded request or CONNECT tunnel.
//!
//! Invariant: requests never wait on the disk. Lines go through a bounded channel to one
//! writer task; when the channel is full the line is dropped and counted, never stalled on.
//! Each line validates against `schemas/egress-event.schema.json`.

use crate::contract::Timestamp;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// CONNECT tunnel or forwarded request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Connect,
    Http,
}

/// The verdict as logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoggedVerdict {
    Allow,
    Refuse,
    /// `--mode report`: would have been refused, let through.
    Report,
}

/// One egress log line.
#[derive(Debug, Clone, Serialize)]
pub struct EgressEvent {
    pub time: Timestamp,
    pub lease_id: Option<String>,
    pub label: Option<String>,
    pub client: String,
    pub listener: String,
    pub kind: Kind,
    pub method: String,
    pub host: Option<String>,
    pub port: Option<u16>,
    pub dialed: Option<String>,
    pub verdict: LoggedVerdict,
    pub code: Option<&'static str>,
    pub status: Option<u16>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked: Option<bool>,
}

/// Where lines go.
#[derive(Debug, Clone)]
pub enum Destination {
    File(PathBuf),
    Stdout,
}

/// Lines waiting for the writer before new ones are dropped.
const CAPACITY: usize = 8192;

/// The sending side of the egress log (cheap to clone).
#[derive(Debug, Clone)]
pub struct EgressLog {
    tx: Option<mpsc::Sender<EgressEvent>>,
    dropped: Arc<AtomicU64>,
}

impl EgressLog {
    /// A log that writes nothing.
    pub fn disabled() -> EgressLog {
        EgressLog {
            tx: None,
            dropped: Arc::default(),
        }
    }

    /// Opens the destination and spawns its writer on the current runtime.
    pub async fn open(destination: Destination) -> std::io::Result<EgressLog> {
        let mut sink: Box<dyn tokio::io::AsyncWrite + Send + Unpin> = match &destination {
            Destination::Stdout => Box::new(tokio::io::stdout()),
            Destination::File(path) => Box::new(
                tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .await?,
            ),
        };
        let (tx, mut rx) = mpsc::channel::<EgressEvent>(CAPACITY);
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(64);
            let mut buf = Vec::with_capacity(64 * 1024);
            while rx.recv_many(&mut batch, 256).await > 0 {
                buf.clear();
                for event in batch.drain(..) {
                    if serde_json::to_writer(&mut buf, &event).is_ok() {
                        buf.push(b'\n');
                    }
                }
                let written = async {
                    sink.write_all(&buf).await?;
                    sink.flush().await
                };
                if let Err(error) = written.await {
                    tracing::error!(%error, "egress log write failed");
                }
            }
        });
        Ok(EgressLog {
            tx: Some(tx),
            dropped: Arc::default(),
        })
    }

    /// Queues a line; drops and counts it if the writer is behind.
    pub fn record(&self, event: EgressEvent) {
        if let Some(tx) = &self.tx {
            if tx.try_send(event).is_err() {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Lines dropped because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
