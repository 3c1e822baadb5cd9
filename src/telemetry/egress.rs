//! The egress log: one JSON line per forwarded request or CONNECT tunnel.
//!
//! Invariant: requests never wait on the disk. Lines go through a bounded channel to one
//! writer thread (blocking writes, batched: no hand-off to a blocking pool per line); when the
//! channel is full the line is dropped and counted, never stalled on.
//! [`EgressLog::close`] returns only once every line queued before it is written and synced,
//! so a process that closes its log before exiting loses none. Each line validates against
//! `schemas/egress-event.schema.json`.

use crate::contract::Timestamp;
use crate::policy::Rule;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// CONNECT tunnel or forwarded request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Connect,
    Http,
    /// A request inside a terminated tunnel.
    Https,
}

impl Kind {
    /// As the egress line and the metrics' labels spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Connect => "connect",
            Kind::Http => "http",
            Kind::Https => "https",
        }
    }
}

/// The verdict as logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoggedVerdict {
    Allow,
    Refuse,
    /// `--mode report`: would have been refused, let through.
    Report,
    /// A 407 asking for credentials not sent yet (`lease-missing`): not a refusal.
    Challenge,
}

impl LoggedVerdict {
    /// As the egress line and the metrics' labels spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            LoggedVerdict::Allow => "allow",
            LoggedVerdict::Refuse => "refuse",
            LoggedVerdict::Report => "report",
            LoggedVerdict::Challenge => "challenge",
        }
    }
}

/// One egress log line. Addresses and the method stay values until the line is written
/// (by the writer thread, straight into the line): no `String` per field per request.
#[derive(Debug, Clone, Serialize)]
pub struct EgressEvent {
    /// When the exchange started (its request head was read).
    pub time: Timestamp,
    /// When it ended and its line was written.
    pub ended: Timestamp,
    pub lease_id: Option<String>,
    pub label: Option<String>,
    #[serde(serialize_with = "as_text")]
    pub client: SocketAddr,
    #[serde(serialize_with = "as_text")]
    pub listener: SocketAddr,
    pub kind: Kind,
    #[serde(serialize_with = "as_text")]
    pub method: http::Method,
    pub host: Option<String>,
    pub port: Option<u16>,
    #[serde(serialize_with = "as_text_or_null")]
    pub dialed: Option<SocketAddr>,
    pub verdict: LoggedVerdict,
    pub code: Option<&'static str>,
    /// What decided: `allow <pattern>`, `deny <pattern>`, `not in allow`, `guard: <range>`,
    /// `not in --connect-ports`; null when no pattern, range or port list did.
    #[serde(serialize_with = "as_text_or_null")]
    pub rule: Option<Rule>,
    pub status: Option<u16>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    pub duration_ms: f64,
    /// A request inside a terminated tunnel: its path, query values redacted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The secrets the proxy put into the request (ids).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    /// A model call to a metered host: its model and usage, or why it could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<Box<ModelCall>>,
    /// A request to an MCP server: its messages, their verdicts and the steps it counted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mcp: Option<Box<McpCall>>,
    /// A request a route of the lease's `approvals` held: the approval it went on with.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked: Option<bool>,
}

/// The `mcp` object of a request to an MCP server's line: the server, each message's method
/// (and a `tools/call`'s tool) with its verdict, the `tools/call` requests that went out
/// (`steps`, what `budget.steps` counts), and the tools taken out of `tools/list` answers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McpCall {
    pub server: String,
    pub messages: Vec<McpMessage>,
    pub steps: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools_hidden: Option<u64>,
}

/// One message of an MCP request as its line shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct McpMessage {
    /// `null` for a response (the client answering the server).
    pub method: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// `allowed`, `approved` (it waited for a human, who let it go on), or `refused` (the
    /// request was refused: this message's tool, or another's).
    pub verdict: &'static str,
    /// The approval it waited for (`GET /approvals/{id}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub approval: Option<String>,
}

/// The `model` object of a metered call's line: the token fields and `cost_usd` when its
/// usage was read (`cost_usd` null and `unpriced` when the price table has no such model),
/// `unmetered` with the reason when it was not, and what it was charged in its place
/// (`charged_tokens`, `charged_cost_usd`: its bound) — never zeros in place of an unread usage.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCall {
    pub api: &'static str,
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u64>,
    /// `Some(None)`: metered but unpriced (written as null).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<Option<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unpriced: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unmetered: Option<&'static str>,
    /// An unmetered call is charged its bound: the tokens (input and output) and, when its
    /// model is priced, the cost it may have spent at most.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged_cost_usd: Option<f64>,
}

/// Serialises `value` as the string its `Display` writes.
fn as_text<S: serde::Serializer, T: std::fmt::Display>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(value)
}

/// [`as_text`], or null.
fn as_text_or_null<S: serde::Serializer, T: std::fmt::Display>(
    value: &Option<T>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match value {
        Some(value) => s.collect_str(value),
        None => s.serialize_none(),
    }
}

pub use super::egress_line::write_line;

/// What a reader of egress lines needs (`leasegate usage`); fields it does not need are
/// ignored, so lines from newer versions still read.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct LoggedLine {
    pub time: String,
    pub lease_id: Option<String>,
    /// The user part of Basic proxy credentials (absent in lines that predate it).
    #[serde(default)]
    pub label: Option<String>,
    pub host: Option<String>,
    pub verdict: String,
    pub code: Option<String>,
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// `https` for a request inside a terminated tunnel (absent in older lines).
    #[serde(default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub method: Option<String>,
    /// A terminated request's path, query values redacted.
    #[serde(default)]
    pub path: Option<String>,
    /// A model call's usage (absent on other lines, and in lines that predate metering).
    #[serde(default, deserialize_with = "lenient_model")]
    pub model: Option<LoggedModel>,
    /// A request to an MCP server (absent on other lines).
    #[serde(default, deserialize_with = "lenient_mcp")]
    pub mcp: Option<LoggedMcp>,
}

/// The `mcp` object of an egress line, as a reader takes it: the steps its tool calls counted.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct LoggedMcp {
    pub server: Option<String>,
    /// `None`: the line does not say (or says something unreadable).
    pub steps: Option<u64>,
}

/// An `mcp` member that is there but does not read is kept, its steps unknown.
fn lenient_mcp<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<LoggedMcp>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(d)?;
    Ok(value.map(|value| serde_json::from_value(value).unwrap_or_default()))
}

/// The `model` object of a metered call's egress line, as a reader takes it (each member
/// optional: what a line leaves out is unknown, never zero).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct LoggedModel {
    pub api: Option<String>,
    pub name: Option<String>,
    /// Every input token, cached ones included.
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    /// The cached part of `input_tokens`.
    pub cached_tokens: Option<u64>,
    /// Null when the model is not in the price table.
    pub cost_usd: Option<f64>,
    pub unpriced: bool,
    /// Why the response's usage could not be read.
    pub unmetered: Option<String>,
    /// What an unmetered call was charged in its place: its bound.
    pub charged_tokens: Option<u64>,
    pub charged_cost_usd: Option<f64>,
}

impl LoggedModel {
    /// Input and output tokens, when the call was metered: `None` for an `unmetered` call
    /// or one whose line lacks either count (never read as zero).
    pub fn tokens(&self) -> Option<(u64, u64)> {
        match self.unmetered {
            Some(_) => None,
            None => Some((self.input_tokens?, self.output_tokens?)),
        }
    }

    /// The call's price in US dollars, when it was metered and priced.
    pub fn cost(&self) -> Option<f64> {
        self.tokens()?;
        let cost = self.cost_usd.filter(|c| c.is_finite() && *c >= 0.0)?;
        (!self.unpriced).then_some(cost)
    }
}

/// A `model` member that is present but does not read is an unmetered call (the call still
/// counts, its usage is not guessed); `null` is no model call.
fn lenient_model<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<LoggedModel>, D::Error> {
    let value = Option::<serde_json::Value>::deserialize(d)?;
    Ok(value.map(|value| {
        serde_json::from_value(value).unwrap_or_else(|_| LoggedModel {
            unmetered: Some("unreadable model object".into()),
            ..LoggedModel::default()
        })
    }))
}

/// A terminated request's route as `usage`, the admin API and the dashboard show it:
/// `GET api.example.com/repos/a`, the query left out.
pub fn route(method: &str, host: &str, path: &str) -> String {
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    format!("{method} {host}{path}")
}

/// One egress line as a reader takes it.
#[derive(Debug, Clone, PartialEq)]
pub enum ReadLine {
    /// Empty or whitespace: skipped silently.
    Blank,
    /// Not an egress line (or its time does not parse): counted by the reader.
    Unreadable,
    Line(crate::contract::Timestamp, Box<LoggedLine>),
}

impl LoggedLine {
    /// A 407 asking for credentials: `"verdict": "challenge"`, or, in lines written before
    /// challenges were told apart, a `lease-missing` refusal.
    /// A request inside a terminated tunnel as a route: `GET api.example.com/repos/a` (the
    /// path without its query).
    pub fn route(&self) -> Option<String> {
        if self.kind.as_deref() != Some("https") {
            return None;
        }
        Some(route(
            self.method.as_deref().unwrap_or("-"),
            self.host.as_deref().unwrap_or("-"),
            self.path.as_deref()?,
        ))
    }

    pub fn is_challenge(&self) -> bool {
        self.verdict == "challenge"
            || (self.verdict == "refuse" && self.code.as_deref() == Some("lease-missing"))
    }

    /// Reads one line (without its newline).
    pub fn read(bytes: &[u8]) -> ReadLine {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return ReadLine::Blank;
        }
        serde_json::from_slice::<LoggedLine>(bytes)
            .ok()
            .and_then(|l| {
                Some(ReadLine::Line(
                    crate::contract::Timestamp::parse(&l.time).ok()?,
                    Box::new(l),
                ))
            })
            .unwrap_or(ReadLine::Unreadable)
    }
}

/// Where lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    File(PathBuf),
    Stdout,
}

/// Lines waiting for the writer before new ones are dropped.
const CAPACITY: usize = 8192;

/// What the writer thread receives.
#[derive(Debug)]
enum Message {
    Line(Arc<EgressEvent>),
    /// Write what came before, flush and sync, answer, and stop.
    Close(oneshot::Sender<()>),
}

/// Where the writer writes; a file is synced on close.
enum Sink {
    File(std::fs::File),
    Stdout(std::io::Stdout),
}

impl Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Sink::File(file) => file.write_all(buf),
            Sink::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(buf)?;
                out.flush()
            }
        }
    }

    /// Makes what was written durable (a file's data on disk; stdout has nothing to sync).
    fn sync(&mut self) -> std::io::Result<()> {
        match self {
            Sink::File(file) => file.sync_all(),
            Sink::Stdout(out) => out.flush(),
        }
    }
}

/// How long the writer lets lines gather after a write before it looks again: under load one
/// wake-up and one `write` per this many milliseconds of lines, not one per line; an idle
/// writer sleeps on the channel.
const GATHER: std::time::Duration = std::time::Duration::from_millis(5);

/// Lines per `write` at most (a writer that falls behind writes on without pausing).
const BATCH: usize = 1024;

/// The writer thread: lines in batches until every sender is gone or a `Close` arrives.
fn write_lines(mut sink: Sink, mut rx: mpsc::Receiver<Message>) {
    let mut buf = Vec::with_capacity(64 * 1024);
    // Blocks while idle; a line wakes it.
    let mut next = rx.blocking_recv();
    while let Some(first) = next {
        buf.clear();
        let (mut taken, mut closing) = (0, None);
        let mut message = Some(first);
        while let Some(m) = message {
            match m {
                Message::Line(event) => write_line(&mut buf, &event),
                Message::Close(ack) => {
                    closing = Some(ack);
                    break;
                }
            }
            taken += 1;
            message = (taken < BATCH).then(|| rx.try_recv().ok()).flatten();
        }
        if let Err(error) = sink.write(&buf) {
            tracing::error!(%error, "egress log write failed");
        }
        if let Some(ack) = closing {
            if let Err(error) = sink.sync() {
                tracing::error!(%error, "egress log sync failed");
            }
            let _ = ack.send(());
            return;
        }
        if taken < BATCH {
            std::thread::sleep(GATHER);
        }
        next = match rx.try_recv() {
            Ok(message) => Some(message),
            Err(mpsc::error::TryRecvError::Empty) => rx.blocking_recv(),
            Err(mpsc::error::TryRecvError::Disconnected) => None,
        };
    }
}

/// The sending side of the egress log (cheap to clone).
#[derive(Debug, Clone)]
pub struct EgressLog {
    tx: Option<mpsc::Sender<Message>>,
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

    /// Opens the destination and starts its writer thread.
    pub async fn open(destination: Destination) -> std::io::Result<EgressLog> {
        let sink = match &destination {
            Destination::Stdout => Sink::Stdout(std::io::stdout()),
            Destination::File(path) => Sink::File(
                tokio::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .await?
                    .into_std()
                    .await,
            ),
        };
        let (tx, rx) = mpsc::channel::<Message>(CAPACITY);
        std::thread::Builder::new()
            .name("egress-log".into())
            .spawn(move || write_lines(sink, rx))?;
        Ok(EgressLog {
            tx: Some(tx),
            dropped: Arc::default(),
        })
    }

    /// Queues a line; drops and counts it if the writer is behind.
    pub fn record(&self, event: Arc<EgressEvent>) {
        if let Some(tx) = &self.tx {
            if tx.try_send(Message::Line(event)).is_err() {
                // Full, or closed already: either way the line is lost, and counted.
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Writes every line queued so far, syncs the file and stops the writer; returns once
    /// that is done. Lines recorded afterwards are dropped and counted. Call it last, after
    /// every exchange has ended (`Server::shutdown` does).
    pub async fn close(&self) {
        let Some(tx) = &self.tx else { return };
        let (ack, done) = oneshot::channel();
        // `send`, not `try_send`: closing waits for room rather than losing the close.
        if tx.send(Message::Close(ack)).await.is_ok() {
            let _ = done.await;
        }
    }

    /// Lines dropped because the writer was behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}
