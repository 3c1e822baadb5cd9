//! Bridges between a journal file and a journal stream: `journal import`, `journal export` and
//! `journal mirror`, for issuers that only write files.
//!
//! Invariant: the stream never holds a line of the file more times than the file does, and the
//! lines it gains from us arrive in file order, byte for byte. A line is published only while
//! the stream holds fewer copies of it than the file has shown so far (a multiset of sha256s,
//! read from the stream at start: the snapshot's lines and the messages after it once the
//! stream is purged, see [`whole`]); many at once, but never two lines of one lease in flight
//! (`window`); under a `Nats-Msg-Id` (its sha256 and its occurrence in the file) that makes a
//! retry after a lost ack, or a second bridge on the same file, a no-op within the duplicate
//! window. A line that a compaction dropped from the snapshot (a record that changes no status,
//! a duplicate grant, a lease past the retention) is no longer counted once its message is
//! purged: a bridge started after the purge publishes it again, and the fold ignores it as it
//! did the first time.
//! A line that can never be published ([`Unpublishable`]: larger than the server takes) is a
//! permanent error of that line alone: logged, counted, and the lines after it go on, so one
//! line never wedges the revocations behind it.

mod window;

pub use window::WINDOW;

use crate::contract::Keyring;
use crate::nats::{NatsError, NatsOptions, NatsStream, StreamSpec};
use crate::registry::journal;
use crate::registry::store::whole::{self, Prefer, StartError};
use crate::registry::store::{FileStore, NatsLocation, Store};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::future::Future;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use window::{Landed, Window};

/// How many times `import` tries one line before it gives up (about half a minute in all:
/// enough for a JetStream cluster to elect a new stream leader).
pub const IMPORT_ATTEMPTS: usize = 8;

/// The first wait between two attempts; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// After failing this long on one line, `mirror` reads the stream again before each attempt:
/// an earlier attempt whose ack was lost may be about to leave the duplicate window (15
/// minutes), after which a retry would no longer be recognised as a duplicate.
const RESYNC_AFTER: Duration = Duration::from_secs(5 * 60);

/// Why a bridge stopped. The I/O error is part of the message (`cause`, not a `source`), so
/// that `main`'s chain prints it once.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("reading {path}: {cause}")]
    File { path: String, cause: io::Error },
    #[error("writing {path}: {cause}")]
    Write { path: String, cause: io::Error },
    #[error("reading the stream {location}: {cause}")]
    Stream { location: String, cause: io::Error },
    #[error("reading the stream {location}: {cause}")]
    Purged { location: String, cause: StartError },
    #[error("line {line} of {path}: not acknowledged by {location} after {attempts} attempts (lines before it are in the stream but for those of other leases still in flight; run the import again to resume): {cause}")]
    Publish {
        path: String,
        line: usize,
        location: String,
        attempts: usize,
        cause: io::Error,
    },
}

/// Room left in a message for our headers (`Nats-Msg-Id` and framing), which count against
/// the server's `max_payload` with the line.
const HEADER_ROOM: usize = 256;

/// Why a line can never be published, however often it is tried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unpublishable {
    #[error("{len} bytes, more than the {max} a message may carry on this NATS server (max_payload, less {HEADER_ROOM} for headers)")]
    TooLarge { len: usize, max: usize },
}

/// Whether `line` can never be published to a server whose `max_payload` is `max_payload`.
pub fn unpublishable(line: &[u8], max_payload: usize) -> Option<Unpublishable> {
    let max = max_payload.saturating_sub(HEADER_ROOM);
    (line.len() > max).then_some(Unpublishable::TooLarge {
        len: line.len(),
        max,
    })
}

/// A line skipped for good: its 1-based number in the file, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub line: usize,
    pub why: Unpublishable,
}

/// A line's identity in the tally: its sha256.
pub type LineHash = [u8; 32];

/// How many copies of each line the stream holds, and how many the file has shown so far.
#[derive(Debug, Default)]
pub struct Tally {
    stream: HashMap<LineHash, u64>,
    file: HashMap<LineHash, u64>,
}

/// What to do with the file's next line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The stream already holds this occurrence.
    Already,
    /// Publish it under this `Nats-Msg-Id`, then call [`Tally::published`].
    Publish {
        id: String,
        hash: LineHash,
        /// Which copy of the line in the file this is (1 for the first).
        occurrence: u64,
    },
}

impl Tally {
    /// The stream's lines counted; nothing of the file seen yet.
    pub fn of_stream<'a>(lines: impl IntoIterator<Item = &'a [u8]>) -> Tally {
        let mut tally = Tally::default();
        tally.recount_stream(lines);
        tally
    }

    /// Counts the stream again (what the file has shown is kept).
    pub fn recount_stream<'a>(&mut self, lines: impl IntoIterator<Item = &'a [u8]>) {
        self.stream.clear();
        for line in lines {
            *self.stream.entry(hash(line)).or_default() += 1;
        }
    }

    /// The file is read again from its start (replaced or truncated): its lines are matched
    /// against the stream, which holds what was published from the old one, afresh.
    pub fn restart_file(&mut self) {
        self.file.clear();
    }

    /// Takes the file's next line into account and says whether it must be published.
    pub fn next(&mut self, line: &[u8]) -> Step {
        let hash = hash(line);
        let seen = self.file.entry(hash).or_default();
        *seen += 1;
        if *seen <= self.stream.get(&hash).copied().unwrap_or(0) {
            return Step::Already;
        }
        Step::Publish {
            id: message_id(&hash, *seen),
            hash,
            occurrence: *seen,
        }
    }

    /// Whether the stream holds every occurrence of `hash` the file has shown.
    pub fn is_accounted(&self, hash: &LineHash) -> bool {
        self.file.get(hash).copied().unwrap_or(0) <= self.stream.get(hash).copied().unwrap_or(0)
    }

    /// How many copies of `hash` the stream holds, as counted.
    pub fn stream_copies(&self, hash: &LineHash) -> u64 {
        self.stream.get(hash).copied().unwrap_or(0)
    }

    /// The stream acknowledged one more copy of `hash`.
    pub fn published(&mut self, hash: LineHash) {
        *self.stream.entry(hash).or_default() += 1;
    }
}

/// Every line the journal in the stream holds: the messages, or once the stream is purged, the
/// snapshot's lines (its marker verified under `keyring`) and the messages after it.
pub async fn journal_lines(
    stream: &NatsStream,
    keyring: Option<&Keyring>,
) -> Result<Vec<bytes::Bytes>, BridgeError> {
    let location = stream.location.to_string();
    let start = whole::start(stream, keyring, Prefer::Stream)
        .await
        .map_err(|cause| BridgeError::Purged {
            location: location.clone(),
            cause,
        })?;
    let held = stream
        .read_all_from(start.next)
        .await
        .map_err(|cause| BridgeError::Stream { location, cause })?;
    let snapshot = start.snapshot.map(|(_, lines)| lines).unwrap_or_default();
    Ok(snapshot
        .into_iter()
        .map(bytes::Bytes::from)
        .chain(held.into_iter().map(|(_, line)| line))
        .collect())
}

fn hash(line: &[u8]) -> LineHash {
    Sha256::digest(line).into()
}

/// `<sha256 hex>#<occurrence>`: the same line's k-th copy gets the same id from every bridge.
pub fn message_id(hash: &LineHash, occurrence: u64) -> String {
    format!("{}#{occurrence}", hex::encode(hash))
}

/// The subject a journal line goes to: its record's lease (`_` when it has none or is not a
/// record; such a line is still carried, byte for byte, for the fold to report).
fn subject_of(stream: &NatsStream, line: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Record {
        lease_id: Option<String>,
    }
    let lease_id = serde_json::from_slice::<Record>(line)
        .ok()
        .and_then(|r| r.lease_id);
    stream.subject(lease_id.as_deref())
}

fn next_backoff(delay: Duration) -> Duration {
    (delay * 2).min(MAX_BACKOFF)
}

/// What `import` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Imported {
    /// Lines published now.
    pub published: usize,
    /// Lines the stream already held.
    pub already: usize,
    /// A last line without its newline (still being written?), left out.
    pub unterminated: bool,
    /// Lines that can never be published, skipped (the lines after them were published).
    pub skipped: Vec<Skipped>,
}

/// Publishes every line of the file at `path` the stream does not hold yet, each lease's lines
/// in file order, up to [`WINDOW`] acknowledgements awaited at once. Empty lines carry no record
/// and are skipped; so is a last line without a newline. `keyring`: what a purged stream's
/// snapshot must verify under.
pub async fn import(
    path: &Path,
    location: &NatsLocation,
    options: &NatsOptions,
    keyring: Option<&Keyring>,
) -> Result<Imported, BridgeError> {
    import_windowed(path, location, options, keyring, WINDOW).await
}

/// [`import`] with at most `window` lines in flight.
pub async fn import_windowed(
    path: &Path,
    location: &NatsLocation,
    options: &NatsOptions,
    keyring: Option<&Keyring>,
    window: usize,
) -> Result<Imported, BridgeError> {
    let file_error = |cause| BridgeError::File {
        path: path.display().to_string(),
        cause,
    };
    let owned = path.to_path_buf();
    let bytes = tokio::task::spawn_blocking(move || std::fs::read(owned))
        .await
        .map_err(io::Error::other)
        .and_then(|r| r)
        .map_err(file_error)?;
    let stream = NatsStream::connect(location, options, &StreamSpec::JOURNAL).await?;
    let held = journal_lines(&stream, keyring).await?;
    let mut tally = Tally::of_stream(held.iter().map(|line| &line[..]));
    drop(held);
    let (lines, rest) = journal::split_lines(&bytes);
    let mut imported = Imported {
        unterminated: !rest.is_empty(),
        ..Imported::default()
    };
    let max_payload = stream.max_payload();
    let mut window = Window::new(window);
    // The first line given up on: nothing more is sent after it.
    let mut failed: Option<(usize, io::Error)> = None;
    let landed = |tally: &mut Tally,
                  imported: &mut Imported,
                  failed: &mut Option<(usize, io::Error)>,
                  done: Landed<(LineHash, usize)>| {
        let (hash, line) = done.tag;
        match done.result {
            Ok(()) => {
                tally.published(hash);
                imported.published += 1;
            }
            Err(cause) => {
                if failed.as_ref().is_none_or(|(first, _)| line < *first) {
                    *failed = Some((line, cause));
                }
            }
        }
    };
    for (index, line) in lines.enumerate() {
        if line.is_empty() {
            continue;
        }
        if let Some(why) = unpublishable(line, max_payload) {
            tracing::error!(file = %path.display(), line = index + 1, %why, "this line can never be published: skipped; the lines after it are published");
            imported.skipped.push(Skipped {
                line: index + 1,
                why,
            });
            continue;
        }
        let Step::Publish { id, hash, .. } = tally.next(line) else {
            imported.already += 1;
            continue;
        };
        let subject = subject_of(&stream, line);
        let mut settled = Vec::new();
        window.ready(&subject, |done| settled.push(done)).await;
        for done in settled {
            landed(&mut tally, &mut imported, &mut failed, done);
        }
        if failed.is_some() {
            break;
        }
        let stream = &stream;
        let sent = subject.clone();
        window.send(subject, async move {
            let result = publish_attempts(stream, &sent, line, &id, IMPORT_ATTEMPTS)
                .await
                .map(drop);
            Landed {
                subject: sent,
                tag: (hash, index + 1),
                result,
            }
        });
    }
    let mut settled = Vec::new();
    window.drain(|done| settled.push(done)).await;
    for done in settled {
        landed(&mut tally, &mut imported, &mut failed, done);
    }
    if let Some((line, cause)) = failed {
        return Err(BridgeError::Publish {
            path: path.display().to_string(),
            line,
            location: location.to_string(),
            attempts: IMPORT_ATTEMPTS,
            cause,
        });
    }
    if imported.unterminated {
        tracing::warn!(file = %path.display(), "the last line has no newline (still being written?): not imported");
    }
    Ok(imported)
}

/// Publishes `line` to `subject` until acknowledged, at most `attempts` times, with backoff.
async fn publish_attempts(
    stream: &NatsStream,
    subject: &str,
    line: &[u8],
    id: &str,
    attempts: usize,
) -> io::Result<u64> {
    let mut delay = MIN_BACKOFF;
    let mut attempt = 1;
    loop {
        match stream.publish(subject.to_owned(), line, Some(id)).await {
            Ok(sequence) => return Ok(sequence),
            Err(e) if attempt >= attempts => return Err(e),
            Err(e) => {
                tracing::debug!(attempt, error = %e, "publish failed; retrying");
                tokio::time::sleep(delay).await;
                delay = next_backoff(delay);
                attempt += 1;
            }
        }
    }
}

/// Writes the journal the stream holds, each line followed by a newline, in stream order, to
/// `out` (`None`: stdout, where a reader that goes away early ends the export quietly): every
/// message, or once the stream is purged, the snapshot's lines (verified under `keyring`) and
/// the messages after what it covers. A file is written beside its final name and renamed into
/// place, so it is never seen half-written. Returns how many lines were written.
pub async fn export(
    location: &NatsLocation,
    options: &NatsOptions,
    keyring: Option<&Keyring>,
    out: Option<&Path>,
) -> Result<usize, BridgeError> {
    let stream = NatsStream::connect_existing(location, options, &StreamSpec::JOURNAL).await?;
    let start = whole::start(&stream, keyring, Prefer::Stream)
        .await
        .map_err(|cause| BridgeError::Purged {
            location: location.to_string(),
            cause,
        })?;
    let Some(path) = out else {
        let mut stdout = io::BufWriter::new(io::stdout().lock());
        let copied = copy_journal(&stream, &start, &mut stdout)
            .await
            .and_then(|written| stdout.flush().map(|()| written).map_err(CopyError::Write));
        return match copied {
            Ok(written) => Ok(written),
            Err(CopyError::Write(e)) if e.kind() == io::ErrorKind::BrokenPipe => Ok(0),
            Err(e) => Err(e.naming(location, "stdout")),
        };
    };
    let write_error = |cause| BridgeError::Write {
        path: path.display().to_string(),
        cause,
    };
    let temp = temp_path(path);
    let written = async {
        let file = std::fs::File::create(&temp).map_err(write_error)?;
        let mut writer = io::BufWriter::new(file);
        let written = copy_journal(&stream, &start, &mut writer)
            .await
            .map_err(|e| e.naming(location, &path.display().to_string()))?;
        let file = writer
            .into_inner()
            .map_err(|e| write_error(e.into_error()))?;
        file.sync_all().map_err(write_error)?;
        std::fs::rename(&temp, path).map_err(write_error)?;
        Ok(written)
    }
    .await;
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written
}

/// `dir/.name.<pid>.tmp`: beside `path`, so the rename stays on one file system.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

/// Why a copy stopped: the stream (already named) or the output (named by the caller).
enum CopyError {
    /// Reading the stream failed.
    Read(io::Error),
    Write(io::Error),
}

impl From<io::Error> for CopyError {
    fn from(error: io::Error) -> CopyError {
        CopyError::Read(error)
    }
}

impl CopyError {
    fn naming(self, location: &NatsLocation, out: &str) -> BridgeError {
        match self {
            CopyError::Read(cause) => BridgeError::Stream {
                location: location.to_string(),
                cause,
            },
            CopyError::Write(cause) => BridgeError::Write {
                path: out.to_owned(),
                cause,
            },
        }
    }
}

/// Copies the snapshot's lines, then the stream's messages from where `start` says up to its
/// last sequence at the call.
async fn copy_journal(
    stream: &NatsStream,
    start: &whole::Start,
    out: &mut impl Write,
) -> Result<usize, CopyError> {
    let mut write = |line: &[u8]| {
        out.write_all(line)
            .and_then(|()| out.write_all(b"\n"))
            .map_err(CopyError::Write)
    };
    for line in start.snapshot_lines() {
        write(line)?;
    }
    let copied = stream
        .read_each_from(start.next, |_, payload| write(&payload))
        .await?;
    Ok(start.snapshot_lines().len() + copied)
}

/// What `mirror` reports as it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorEvent {
    /// Everything the file held at start is in the stream, but for `skipped` lines that can
    /// never be published.
    CaughtUp {
        published: usize,
        already: usize,
        skipped: usize,
    },
}

/// What `mirror` has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Mirrored {
    published: usize,
    already: usize,
    skipped: usize,
}

/// Follows the file at `path` (which may not exist yet) and publishes each line the stream
/// lacks, up to [`WINDOW`] at once and each lease's lines in file order, until `shutdown`
/// resolves (a line cut off mid-publish is settled by the next start). While the stream is
/// unreachable it retries each line with backoff, never skipping or reordering one of a lease;
/// it gives up only on credentials it cannot read, or a purged stream it cannot read whole
/// (no snapshot that verifies under `keyring` covers the purged messages). A line longer than
/// `max_line` is skipped unheld, as `serve` skips it.
pub async fn mirror(
    path: &Path,
    location: &NatsLocation,
    options: &NatsOptions,
    keyring: Option<&Keyring>,
    max_line: usize,
    shutdown: impl Future<Output = ()>,
    mut report: impl FnMut(MirrorEvent),
) -> Result<(), BridgeError> {
    let mut shutdown = std::pin::pin!(shutdown);
    let run = async {
        let stream = connect_until_ready(location, options).await?;
        let mut tally = Tally::of_stream(
            lines_until_ready(&stream, keyring, location)
                .await?
                .iter()
                .map(|line| &line[..]),
        );
        let mut mirror = Mirror {
            path,
            location,
            stream,
            keyring,
            recount: tokio::sync::Mutex::new(None),
            mirrored: Mirrored::default(),
            line: 0,
        };
        let store = FileStore::limited(path.to_path_buf(), false, max_line);
        let mut caught_up = false;
        let mut unreadable = false;
        loop {
            let batch = match store.read_new().await {
                Ok(batch) => {
                    if std::mem::take(&mut unreadable) {
                        tracing::info!(file = %path.display(), "the file is readable again");
                    }
                    batch
                }
                Err(error) => {
                    if !std::mem::replace(&mut unreadable, true) {
                        tracing::warn!(file = %path.display(), %error, "cannot read the file; retrying");
                    }
                    store.wait_for_more().await;
                    continue;
                }
            };
            if batch.restarted && mirror.line > 0 {
                tracing::warn!(file = %path.display(), "the file was replaced or truncated: matching it against the stream from its start");
                tally.restart_file();
                mirror.line = 0;
            }
            mirror.carry(&mut tally, &batch.lines).await;
            if !caught_up {
                caught_up = true;
                report(MirrorEvent::CaughtUp {
                    published: mirror.mirrored.published,
                    already: mirror.mirrored.already,
                    skipped: mirror.mirrored.skipped,
                });
            }
            store.wait_for_more().await;
        }
    };
    tokio::select! {
        result = run => result,
        () = &mut shutdown => Ok(()),
    }
}

/// The mirror's state between lines.
struct Mirror<'a> {
    path: &'a Path,
    location: &'a NatsLocation,
    stream: NatsStream,
    /// What a purged stream's snapshot must verify under.
    keyring: Option<&'a Keyring>,
    /// The stream's lines counted again after a long failure, and when (shared by the lines in
    /// flight, so that an outage ends with one read of the stream, not one per line).
    recount: tokio::sync::Mutex<Option<(Instant, Arc<Tally>)>>,
    mirrored: Mirrored,
    /// 1-based number of the last file line taken.
    line: usize,
}

/// How a line in flight ended for the mirror.
enum Carried {
    Published,
    /// An earlier attempt had landed after all (found by counting the stream again).
    Already,
}

impl Mirror<'_> {
    /// Publishes each of `lines` the stream lacks, retrying each until it is acknowledged; a
    /// line that can never be published is skipped (logged and counted).
    async fn carry(&mut self, tally: &mut Tally, lines: &[Vec<u8>]) {
        let mut window = Window::new(WINDOW);
        let mut settled = Vec::new();
        let this = &*self;
        let mut first = self.line;
        let mut mirrored = Mirrored::default();
        for line in lines {
            first += 1;
            if line.is_empty() {
                continue;
            }
            if let Some(why) = unpublishable(line, this.stream.max_payload()) {
                mirrored.skipped += 1;
                tracing::error!(
                    file = %this.path.display(),
                    line = first,
                    stream = %this.location,
                    %why,
                    skipped = self.mirrored.skipped + mirrored.skipped,
                    "this line can never be published: skipped; the lines after it are published"
                );
                continue;
            }
            let Step::Publish {
                id,
                hash,
                occurrence,
            } = tally.next(line)
            else {
                mirrored.already += 1;
                continue;
            };
            let subject = subject_of(&this.stream, line);
            window.ready(&subject, |done| settled.push(done)).await;
            let number = first;
            let sent = subject.clone();
            window.send(subject, async move {
                let carried = this
                    .until_acked(&sent, line, &id, (hash, occurrence), number)
                    .await;
                Landed {
                    subject: sent,
                    tag: (hash, carried),
                    result: Ok(()),
                }
            });
        }
        window.drain(|done| settled.push(done)).await;
        drop(window);
        for done in settled {
            let (hash, carried) = done.tag;
            tally.published(hash);
            match carried {
                Carried::Published => mirrored.published += 1,
                Carried::Already => mirrored.already += 1,
            }
        }
        self.line = first;
        self.mirrored.published += mirrored.published;
        self.mirrored.already += mirrored.already;
        self.mirrored.skipped += mirrored.skipped;
    }

    /// Publishes `line` (the `occurrence`-th copy of `hash` in the file) until it is
    /// acknowledged. After failing for [`RESYNC_AFTER`], the stream is counted again before
    /// each attempt: an attempt whose ack was lost may be about to leave the duplicate window.
    async fn until_acked(
        &self,
        subject: &str,
        line: &[u8],
        id: &str,
        (hash, occurrence): (LineHash, u64),
        number: usize,
    ) -> Carried {
        let mut delay = MIN_BACKOFF;
        // When the first attempt whose outcome is unknown was made, and the latest.
        let mut failing_since: Option<Instant> = None;
        let mut attempted = Instant::now();
        loop {
            if failing_since.is_some_and(|since| since.elapsed() > RESYNC_AFTER) {
                match self.recounted(attempted).await {
                    Some(counted) if counted.stream_copies(&hash) >= occurrence => {
                        tracing::info!(line = number, "the stream holds the line after all");
                        return Carried::Already;
                    }
                    Some(_) => {}
                    None => {
                        tokio::time::sleep(delay).await;
                        delay = next_backoff(delay);
                        continue;
                    }
                }
            }
            attempted = Instant::now();
            match self
                .stream
                .publish(subject.to_owned(), line, Some(id))
                .await
            {
                Ok(_) => break,
                Err(error) => {
                    if failing_since.is_none() {
                        failing_since = Some(Instant::now());
                        tracing::warn!(
                            file = %self.path.display(),
                            line = number,
                            stream = %self.location,
                            %error,
                            "cannot publish; retrying this line until it is acknowledged"
                        );
                    } else {
                        tracing::debug!(line = number, %error, "publish failed again");
                    }
                    tokio::time::sleep(delay).await;
                    delay = next_backoff(delay);
                }
            }
        }
        if let Some(since) = failing_since {
            tracing::info!(
                line = number,
                stream = %self.location,
                after = ?since.elapsed(),
                "publishing again"
            );
        }
        Carried::Published
    }

    /// The stream's lines counted after `after` (read now unless a line in flight just did);
    /// `None` when the stream cannot be read.
    async fn recounted(&self, after: Instant) -> Option<Arc<Tally>> {
        let mut recount = self.recount.lock().await;
        if let Some((at, counted)) = recount.as_ref() {
            if *at > after {
                return Some(counted.clone());
            }
        }
        let read = Instant::now();
        match journal_lines(&self.stream, self.keyring).await {
            Ok(held) => {
                let counted = Arc::new(Tally::of_stream(held.iter().map(|line| &line[..])));
                *recount = Some((read, counted.clone()));
                Some(counted)
            }
            Err(error) => {
                tracing::debug!(%error, "reading the stream again");
                None
            }
        }
    }
}

/// Connects, retrying with backoff (logging once per distinct error) until the stream is open;
/// only unreadable credentials end it.
async fn connect_until_ready(
    location: &NatsLocation,
    options: &NatsOptions,
) -> Result<NatsStream, BridgeError> {
    let mut delay = MIN_BACKOFF;
    let mut last_error = String::new();
    loop {
        match NatsStream::connect(location, options, &StreamSpec::JOURNAL).await {
            Ok(stream) => {
                if !last_error.is_empty() {
                    tracing::info!(stream = %location, "connected");
                }
                return Ok(stream);
            }
            Err(e @ NatsError::Creds { .. }) => return Err(e.into()),
            Err(error) => {
                let text = error.to_string();
                if text != last_error {
                    tracing::warn!(%error, "cannot open the stream; retrying");
                    last_error = text;
                }
                tokio::time::sleep(delay).await;
                delay = next_backoff(delay);
            }
        }
    }
}

/// The journal's lines in the stream ([`journal_lines`]), retrying with backoff until they
/// could be read; a purged stream that cannot be read whole ends it.
async fn lines_until_ready(
    stream: &NatsStream,
    keyring: Option<&Keyring>,
    location: &NatsLocation,
) -> Result<Vec<bytes::Bytes>, BridgeError> {
    let mut delay = MIN_BACKOFF;
    let mut failing = false;
    loop {
        match journal_lines(stream, keyring).await {
            Ok(held) => return Ok(held),
            Err(
                error @ BridgeError::Purged {
                    cause: StartError::NeedKey { .. } | StartError::Uncovered { .. },
                    ..
                },
            ) => return Err(error),
            Err(error) => {
                if !std::mem::replace(&mut failing, true) {
                    tracing::warn!(stream = %location, %error, "cannot read the stream; retrying");
                }
                tokio::time::sleep(delay).await;
                delay = next_backoff(delay);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_is_published_only_past_the_copies_the_stream_holds() {
        let mut tally = Tally::of_stream([&b"a"[..], b"b", b"a"]);
        assert_eq!(tally.next(b"a"), Step::Already);
        assert_eq!(tally.next(b"b"), Step::Already);
        assert_eq!(tally.next(b"a"), Step::Already);
        let Step::Publish { id, hash, .. } = tally.next(b"a") else {
            panic!("the third a is not in the stream")
        };
        assert_eq!(
            id,
            "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb#3"
        );
        assert!(!tally.is_accounted(&hash));
        tally.published(hash);
        assert!(tally.is_accounted(&hash));
        assert!(matches!(tally.next(b"c"), Step::Publish { id, .. } if id.ends_with("#1")));
    }

    #[test]
    fn a_restarted_file_is_matched_against_everything_published() {
        let mut tally = Tally::of_stream([&b"a"[..]]);
        assert_eq!(tally.next(b"a"), Step::Already);
        let Step::Publish { hash, .. } = tally.next(b"b") else {
            panic!("b is not in the stream")
        };
        tally.published(hash);
        tally.restart_file();
        assert_eq!(tally.next(b"a"), Step::Already);
        assert_eq!(tally.next(b"b"), Step::Already);
        assert!(matches!(tally.next(b"b"), Step::Publish { id, .. } if id.ends_with("#2")));
    }

    #[test]
    fn a_line_larger_than_the_server_takes_is_unpublishable() {
        let max = 1024 * 1024;
        assert_eq!(unpublishable(&vec![b'x'; max - HEADER_ROOM], max), None);
        assert_eq!(
            unpublishable(&vec![b'x'; max], max),
            Some(Unpublishable::TooLarge {
                len: max,
                max: max - HEADER_ROOM
            })
        );
    }

    #[test]
    fn the_temp_file_sits_beside_the_output() {
        let temp = temp_path(Path::new("/x/out.jsonl"));
        assert_eq!(temp.parent(), Some(Path::new("/x")));
        assert_eq!(
            temp.file_name().unwrap().to_string_lossy(),
            format!(".out.jsonl.{}.tmp", std::process::id())
        );
    }
}
