//! The journal as one file: held open and followed by polling (a poll is a `stat` of its path,
//! so it needs no descriptor), appended to with O_APPEND.
//!
//! Invariant: every complete line of at most `max_line` bytes is handed out exactly once per
//! file generation; a partial last line is held until its newline arrives, grown in place read
//! after read (never copied whole again), and never beyond `max_line` bytes: a longer line is
//! skipped to its newline, counted once and logged with its offset, its bytes dropped as they
//! are read; a replaced file (new inode), a truncated one
//! (shorter than what we read) or a rewritten one (its first bytes or the bytes just before our
//! offset differ from what we read there: truncated and rewritten past the old length between
//! two polls) starts a new generation, read from its start, unless a compaction's note
//! ([`swap`]) shows the new file is a compaction of the one we read: then the rest of the old
//! file is read and the new one followed from what it covers, a new generation that re-reads
//! nothing. An append is one complete line in one `write`, under a shared lock on the file the
//! path names, after a newline if the file ends in a torn line, so our record never fuses with
//! another writer's and never lands in a file a compaction has replaced. Nothing here rewrites
//! the file, and no file I/O runs on a
//! runtime worker thread (it all goes through `spawn_blocking`). Reads are cancel-safe: lines
//! of a read whose caller went away are handed out by the next one.

pub mod swap;

use super::{Batch, BoxFuture, Position, Store};
use serde_json::Value;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the file is polled (new lines apply within this, well under 250 ms).
pub const POLL_EVERY: Duration = Duration::from_millis(50);

/// How many bytes at the start of the file, and just before the read offset, are kept and
/// compared on every poll to notice a file truncated and rewritten in place between two polls
/// (same inode, not shorter). Records carry millisecond timestamps, lease ids and signatures,
/// so a rewrite that keeps both windows byte for byte rewrote nothing that matters.
const WITNESS_BYTES: usize = 128;

/// The most one read takes from the file: a long journal is handed out in batches of about
/// this size, so what a fold holds of it at once (the bytes and their lines) stays small and
/// its memory is reused batch after batch rather than left behind fragmented.
const READ_AT_MOST: u64 = 4 << 20;

/// The journal file, followed and appended to.
#[derive(Debug, Clone)]
pub struct FileStore {
    /// Shared with the blocking tasks that do the I/O.
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    path: PathBuf,
    /// fsync every append.
    fsync: bool,
    /// Held across a read so each line is handed out once; never across an append's write.
    cursor: Mutex<Cursor>,
    /// Lines read but not yet handed out: a read's future dropped before its blocking task
    /// finished leaves them here for the next read, so no line is lost to cancellation.
    undelivered: Mutex<Batch>,
}

/// How far the file has been read.
#[derive(Debug)]
struct Cursor {
    /// The longest line handed out; a longer one is skipped.
    max_line: usize,
    /// Inside a line longer than `max_line`: the offset it began at. Its bytes are dropped as
    /// they are read, up to its newline.
    skipping: Option<u64>,
    /// Lines longer than `max_line` skipped since the last batch.
    too_long: u64,
    /// (device, inode) of the file being followed; `None` before it existed.
    identity: Option<(u64, u64)>,
    /// The file being followed, held open between polls: a poll costs a `stat` of the path,
    /// not a descriptor, so a process out of descriptors still reads the journal. Dropped
    /// once the path names no file, so a deleted journal is not held (nor read) forever.
    file: Option<File>,
    /// Bumped each time the file is read again from its start.
    generation: u64,
    /// Bytes consumed from the current file, `partial` included.
    offset: u64,
    /// An unterminated last line, waiting for its newline (at most `max_line` bytes); it holds
    /// no newline, and reads append to it in place.
    partial: Vec<u8>,
    /// The file's first bytes as we read them (up to [`WITNESS_BYTES`]).
    head: Vec<u8>,
    /// The bytes just before `offset` as we read them (up to [`WITNESS_BYTES`]).
    tail: Vec<u8>,
    /// The last read reached the end the file had when it began.
    caught_up: bool,
}

impl Cursor {
    fn new(max_line: usize) -> Cursor {
        Cursor {
            max_line,
            skipping: None,
            too_long: 0,
            identity: None,
            file: None,
            generation: 0,
            offset: 0,
            partial: Vec::new(),
            head: Vec::new(),
            tail: Vec::new(),
            caught_up: false,
        }
    }

    /// Just after the last complete line handed out (or skipped).
    fn position(&self) -> Position {
        Position {
            generation: self.generation,
            offset: self
                .skipping
                .unwrap_or(self.offset - self.partial.len() as u64),
        }
    }

    /// The file `path` names, and its metadata: the one held when the path still names it
    /// (by device and inode), else the path opened anew. `None`: no file there (any held one
    /// is let go).
    fn open(&mut self, path: &Path) -> io::Result<Option<(File, std::fs::Metadata)>> {
        let named = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.file = None;
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        if let Some(file) = self.file.take() {
            if Some((named.dev(), named.ino())) == self.identity {
                return Ok(Some((file, named)));
            }
        }
        // A new file, or the first: its own metadata, in case the path changed since the stat.
        let file = match crate::descriptors::with_spare(|| File::open(path)) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        Ok(Some((file, meta)))
    }

    /// Complete lines appended since the last call. A missing file is an empty journal.
    fn read_new(&mut self, path: &Path) -> io::Result<Batch> {
        let Some((mut file, meta)) = self.open(path)? else {
            self.caught_up = true;
            return Ok(self.batch(false, vec![]));
        };
        let batch = self.read_from(path, &mut file, &meta);
        // Held for the next poll: the identity now names this file (`read_from` took it).
        if self.identity == Some((meta.dev(), meta.ino())) {
            self.file = Some(file);
        }
        batch
    }

    /// [`Cursor::read_new`] on `file`, the file `path` names, whose metadata is `meta`.
    fn read_from(
        &mut self,
        path: &Path,
        file: &mut File,
        meta: &std::fs::Metadata,
    ) -> io::Result<Batch> {
        let identity = Some((meta.dev(), meta.ino()));
        let mut restarted = false;
        // Lines of the old file a compaction replaced, read before the new file's.
        let mut carried = Vec::new();
        if identity != self.identity && self.identity.is_some() {
            if let Some(lines) = self.follow_compaction(path, file, meta) {
                carried = lines;
            }
        }
        if identity != self.identity || meta.len() < self.offset || !self.is_same_content(file)? {
            if self.identity.is_some() {
                tracing::info!(journal = %path.display(), "journal replaced, truncated or rewritten: reading it from the start");
            }
            self.identity = identity;
            self.generation += 1;
            self.offset = 0;
            self.partial.clear();
            self.skipping = None;
            self.head.clear();
            self.tail.clear();
            restarted = true;
        }
        self.caught_up = meta.len() <= self.offset.saturating_add(READ_AT_MOST);
        if meta.len() == self.offset {
            return Ok(self.batch(restarted, carried));
        }
        file.seek(SeekFrom::Start(self.offset))?;
        // Read onto the end of the partial line, in place: `reserve` grows it geometrically, so
        // a long torn line is reallocated a logarithmic number of times, not copied every read.
        let mut bytes = std::mem::take(&mut self.partial);
        let kept = bytes.len();
        bytes.reserve((meta.len() - self.offset).min(READ_AT_MOST) as usize);
        // The file may grow while we read: whatever `read_to_end` returns is consumed.
        let read = file.take(READ_AT_MOST).read_to_end(&mut bytes)?;
        self.offset += read as u64;
        self.witness(&bytes[kept..]);
        self.partial = self.frame(bytes, kept, path, &mut carried);
        Ok(self.batch(restarted, carried))
    }

    /// Hands the complete lines of `bytes` to `lines` and returns what is left of it: the
    /// partial last line, in the same allocation. `bytes` ends at `offset`; its first `kept`
    /// bytes are the partial line held before (no newline among them). A line longer than
    /// `max_line` is counted in `too_long`, logged once, and dropped up to its newline.
    fn frame(
        &mut self,
        mut bytes: Vec<u8>,
        kept: usize,
        path: &Path,
        lines: &mut Vec<Vec<u8>>,
    ) -> Vec<u8> {
        let base = self.offset - bytes.len() as u64;
        let mut start = 0;
        let mut search = kept;
        if self.skipping.is_some() {
            match memchr(&bytes) {
                None => return Vec::new(),
                Some(newline) => {
                    self.skipping = None;
                    start = newline + 1;
                    search = start;
                }
            }
        }
        while let Some(newline) = memchr(&bytes[search..]).map(|i| search + i) {
            if newline - start > self.max_line {
                self.skip(base + start as u64, path);
                self.skipping = None;
            } else {
                lines.push(bytes[start..newline].to_vec());
            }
            start = newline + 1;
            search = start;
        }
        if bytes.len() - start > self.max_line {
            self.skip(base + start as u64, path);
            return Vec::new();
        }
        bytes.drain(..start);
        // Give back what a long line or a large read left, once the partial line is short.
        let room = READ_AT_MOST as usize;
        if bytes.capacity() > 2 * room && bytes.len() < room {
            bytes.shrink_to(room);
        }
        bytes
    }

    /// Starts skipping the line at `at`, longer than `max_line`.
    fn skip(&mut self, at: u64, path: &Path) {
        self.too_long += 1;
        self.skipping = Some(at);
        tracing::warn!(
            journal = %path.display(),
            offset = at,
            max = self.max_line,
            "a journal line longer than --max-journal-line: skipped to its newline, unread (counted as too-long)"
        );
    }

    /// The file was replaced: if by a compaction of the one we followed (its note matches),
    /// reads what we had not read of the old file, then goes on in the new one after what it
    /// covers, as a new generation that is not a restart. `None`: read it from its start.
    fn follow_compaction(
        &mut self,
        path: &Path,
        file: &File,
        meta: &std::fs::Metadata,
    ) -> Option<Vec<Vec<u8>>> {
        let note = swap::read_note(path)?;
        let matches = Some(note.old) == self.identity
            && note.new == (meta.dev(), meta.ino())
            && meta.len() >= note.length
            && self.offset <= note.covered;
        if !matches {
            tracing::info!(journal = %path.display(), "journal replaced; its compaction note does not match what we read");
            return None;
        }
        let archive = path.with_file_name(&note.archive);
        let rest = File::open(&archive)
            .and_then(|old| {
                let old_meta = old.metadata()?;
                if (old_meta.dev(), old_meta.ino()) != note.old
                    || old_meta.len() < note.covered
                    || !self.is_same_content(&old)?
                {
                    return Err(io::Error::other("not the file we read"));
                }
                let mut rest = vec![0; (note.covered - self.offset) as usize];
                old.read_exact_at(&mut rest, self.offset)?;
                Ok(rest)
            })
            .inspect_err(|error| tracing::info!(journal = %path.display(), archive = %archive.display(), %error, "journal compacted, but its old file cannot be matched"))
            .ok()?;
        let mut witness = vec![0; (note.length.min(WITNESS_BYTES as u64)) as usize];
        let tail_from = note.length - witness.len() as u64;
        let mut head = vec![0; witness.len()];
        if file
            .read_exact_at(&mut head, 0)
            .and_then(|()| file.read_exact_at(&mut witness, tail_from))
            .is_err()
        {
            return None;
        }
        let mut bytes = std::mem::take(&mut self.partial);
        let kept = bytes.len();
        bytes.extend_from_slice(&rest);
        let mut lines = Vec::new();
        self.offset = note.covered;
        // An unterminated end of the old file is torn for good: the compaction left it out.
        let _torn = self.frame(bytes, kept, path, &mut lines);
        self.skipping = None;
        tracing::info!(journal = %path.display(), archive = %archive.display(), "journal compacted: following the new file from what it covers");
        self.identity = Some(note.new);
        self.generation += 1;
        self.offset = note.length;
        self.head = head;
        self.tail = witness;
        Some(lines)
    }

    /// Whether the bytes we kept from the start of the file and from just before our offset
    /// are still there. The file is at least `offset` long (checked before).
    fn is_same_content(&self, file: &File) -> io::Result<bool> {
        let mut buf = vec![0; self.head.len().max(self.tail.len())];
        let head = &mut buf[..self.head.len()];
        file.read_exact_at(head, 0)?;
        if *head != self.head[..] {
            return Ok(false);
        }
        let tail = &mut buf[..self.tail.len()];
        file.read_exact_at(tail, self.offset - self.tail.len() as u64)?;
        Ok(*tail == self.tail[..])
    }

    /// Keeps the witnesses up to date with `fresh`, the bytes just consumed.
    fn witness(&mut self, fresh: &[u8]) {
        let room = WITNESS_BYTES - self.head.len();
        self.head.extend_from_slice(&fresh[..room.min(fresh.len())]);
        if fresh.len() >= WITNESS_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&fresh[fresh.len() - WITNESS_BYTES..]);
        } else {
            self.tail.extend_from_slice(fresh);
            let excess = self.tail.len().saturating_sub(WITNESS_BYTES);
            self.tail.drain(..excess);
        }
    }

    fn batch(&mut self, restarted: bool, lines: Vec<Vec<u8>>) -> Batch {
        Batch {
            restarted,
            lines,
            too_long: std::mem::take(&mut self.too_long),
            position: self.position(),
            replaced: false,
        }
    }
}

/// Where one append landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// (device, inode) of the file written.
    pub identity: (u64, u64),
    /// Offset of the first byte of our line (after a separating newline, if one was needed).
    pub start: u64,
    /// Offset just after our line's newline.
    pub end: u64,
}

/// Appends `record` as one line to the file at `path` (created if missing). With `fsync`, the
/// data is on disk when this returns. Blocking: the CLI calls it directly, [`FileStore`] from a
/// blocking task. This is the only code that writes the journal.
pub fn append(path: &Path, record: &Value, fsync: bool) -> io::Result<Appended> {
    let mut line = Vec::with_capacity(1024);
    serde_json::to_writer(&mut line, record)?;
    append_line(path, line, fsync)
}

/// Appends `line` (one serialized record, no newline) and its newline in one `write`.
fn append_line(path: &Path, mut line: Vec<u8>, fsync: bool) -> io::Result<Appended> {
    // Shared lock: a compaction's swap (exclusive) waits for it, and it for the swap.
    let mut file = crate::descriptors::with_spare(|| swap::open_locked_for_append(path))?;
    let meta = file.metadata()?;
    let len = meta.len();
    let mut last = [b'\n'];
    if len > 0 {
        file.read_exact_at(&mut last, len - 1)?;
    }
    let torn = last[0] != b'\n';
    if torn {
        line.insert(0, b'\n');
    }
    line.push(b'\n');
    let written = file.write(&line)?;
    if written != line.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!(
                "short write to the journal: {written} of {} bytes",
                line.len()
            ),
        ));
    }
    // With O_APPEND the write lands at the end as it is then, which may be past `len` if
    // another process appended meanwhile: the file offset after it is our line's end.
    let end = file.stream_position()?;
    if fsync {
        file.sync_data()?;
    }
    Ok(Appended {
        identity: (meta.dev(), meta.ino()),
        start: end - line.len() as u64 + u64::from(torn),
        end,
    })
}

/// The first newline in `bytes`.
fn memchr(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == b'\n')
}

impl FileStore {
    /// The file at `path`, not read yet, its lines up to [`journal::MAX_LINE`] bytes. With
    /// `fsync`, every append is on disk before it returns.
    ///
    /// [`journal::MAX_LINE`]: crate::registry::journal::MAX_LINE
    pub fn new(path: PathBuf, fsync: bool) -> FileStore {
        FileStore::limited(path, fsync, crate::registry::journal::MAX_LINE)
    }

    /// [`FileStore::new`], handing out lines of at most `max_line` bytes: a longer one is
    /// skipped without being held.
    pub fn limited(path: PathBuf, fsync: bool, max_line: usize) -> FileStore {
        FileStore {
            inner: Arc::new(Inner {
                path,
                fsync,
                cursor: Mutex::new(Cursor::new(max_line)),
                undelivered: Mutex::new(Batch::default()),
            }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }
}

impl Inner {
    fn cursor(&self) -> std::sync::MutexGuard<'_, Cursor> {
        self.cursor.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the file and adds what it found to `undelivered`.
    fn read_into_undelivered(&self) -> io::Result<()> {
        let mut cursor = self.cursor();
        let fresh = cursor.read_new(&self.path)?;
        let mut undelivered = self.undelivered.lock().unwrap_or_else(|e| e.into_inner());
        undelivered.restarted |= fresh.restarted;
        undelivered.lines.extend(fresh.lines);
        undelivered.too_long += fresh.too_long;
        undelivered.position = fresh.position;
        Ok(())
    }

    /// Hands out everything read so far.
    fn take_undelivered(&self) -> Batch {
        let mut undelivered = self.undelivered.lock().unwrap_or_else(|e| e.into_inner());
        Batch {
            restarted: std::mem::take(&mut undelivered.restarted),
            lines: std::mem::take(&mut undelivered.lines),
            too_long: std::mem::take(&mut undelivered.too_long),
            position: undelivered.position,
            replaced: false,
        }
    }

    #[cfg(test)]
    fn read_new(&self) -> io::Result<Batch> {
        self.read_into_undelivered()?;
        Ok(self.take_undelivered())
    }

    /// Appends, then names the position in the reader's generations: the current one if the
    /// line went to the file being followed at or past what was read, else the next one (the
    /// file was replaced or truncated, and the reader will start it over).
    fn append(&self, line: Vec<u8>) -> io::Result<Position> {
        let (identity, generation, offset) = {
            let cursor = self.cursor();
            (cursor.identity, cursor.generation, cursor.offset)
        };
        let appended = append_line(&self.path, line, self.fsync)?;
        let same = identity == Some(appended.identity) && appended.start >= offset;
        Ok(Position {
            generation: if same { generation } else { generation + 1 },
            offset: appended.end,
        })
    }
}

/// Runs blocking file I/O off the runtime's worker threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(io::Error::other)?
}

impl Store for FileStore {
    fn read_new(&self) -> BoxFuture<'_, io::Result<Batch>> {
        let inner = self.inner.clone();
        Box::pin(async move {
            let reader = inner.clone();
            blocking(move || reader.read_into_undelivered()).await?;
            Ok(inner.take_undelivered())
        })
    }

    fn append(&self, record: &Value) -> BoxFuture<'_, io::Result<Position>> {
        let line = serde_json::to_vec(record);
        let inner = self.inner.clone();
        Box::pin(async move {
            let line = line?;
            blocking(move || inner.append(line)).await
        })
    }

    fn wait_for_more(&self) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(POLL_EVERY))
    }

    fn settled(&self) -> bool {
        self.inner.cursor().caught_up
    }

    fn describe(&self) -> String {
        format!("journal {}", self.inner.path.display())
    }
}

#[cfg(test)]
mod tests;
