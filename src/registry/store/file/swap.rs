//! Swapping a compacted journal file in under a running follower: the write side (lock, copy
//! what was appended meanwhile, archive the old file, publish a note, rename) and the note the
//! follower reads to carry on from where it was rather than fold the new file again.
//!
//! Invariant: no line is lost and nothing is deleted. Appends take a shared `flock` on the file
//! the path names and write only to a file the path still names once they hold it; the swap
//! holds the exclusive lock from the moment it copies the lines appended since its read until
//! the new file has the path, so every append lands either in the old file before the copy or in
//! the new one. The old file stays, hard-linked as `<path>.<timestamp>`. The note
//! (`<path>.compacted`) is written before the rename and names both files by (device, inode):
//! a follower that cannot match it reads the new file from its start, as after any rotation.

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Bytes compared at the start of the journal, and just before the end of what was read, to
/// notice a journal rewritten in place between the read and the swap.
const WITNESS_BYTES: u64 = 128;

/// A file's (device, inode).
pub type Identity = (u64, u64);

fn identity(meta: &std::fs::Metadata) -> Identity {
    (meta.dev(), meta.ino())
}

/// `<path>.compacted`: what the last swap did, for a follower of the old file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Note {
    /// The old file: its identity, and its name now (in the journal's directory).
    pub old: Identity,
    pub archive: String,
    /// How many bytes of the old file the new one covers (the whole old file: the swap held
    /// the lock, so nothing was appended to it after).
    pub covered: u64,
    /// The new file's identity and its length at the swap: a follower that had read the old
    /// file up to `covered` goes on from `length` in the new one.
    pub new: Identity,
    pub length: u64,
}

/// Where the note of the last swap of `journal` lives.
pub fn note_path(journal: &Path) -> PathBuf {
    suffixed(journal, "compacted")
}

fn suffixed(journal: &Path, suffix: &str) -> PathBuf {
    let mut name = journal.as_os_str().to_owned();
    name.push(".");
    name.push(suffix);
    PathBuf::from(name)
}

/// Reads the note of the last swap, if there is one that parses.
pub fn read_note(journal: &Path) -> Option<Note> {
    let bytes = std::fs::read(note_path(journal)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Takes `flock` on `file` (blocking), released when the result is dropped.
fn lock(file: File, how: FlockArg) -> io::Result<Flock<File>> {
    Flock::lock(file, how).map_err(|(_, errno)| io::Error::from(errno))
}

/// Opens the file `path` names for appending, holding a shared lock on it: retried while a
/// swap replaces it between our open and our lock.
pub fn open_locked_for_append(path: &Path) -> io::Result<Flock<File>> {
    const ATTEMPTS: usize = 8;
    for _ in 0..ATTEMPTS {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(path)?;
        let file = lock(file, FlockArg::LockShared)?;
        if names(path, &file)? {
            return Ok(file);
        }
    }
    Err(io::Error::other(format!(
        "{} was replaced {ATTEMPTS} times while opening it to append",
        path.display()
    )))
}

/// Whether `path` names `file` now.
fn names(path: &Path, file: &File) -> io::Result<bool> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(identity(&meta) == identity(&file.metadata()?)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// A journal as read for compaction, before its lines were chosen.
#[derive(Debug)]
pub struct Read {
    pub identity: Identity,
    /// The file's bytes up to the end of its last complete line.
    pub bytes: Vec<u8>,
}

/// Reads the whole journal (no lock: appends go on meanwhile; the swap copies them).
pub fn read(path: &Path) -> io::Result<Read> {
    let mut file = File::open(path)?;
    let identity = identity(&file.metadata()?);
    let mut bytes = Vec::new();
    io::Read::read_to_end(&mut file, &mut bytes)?;
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    bytes.truncate(complete);
    Ok(Read { identity, bytes })
}

/// What a swap did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Swapped {
    /// Where the old file is kept.
    pub archive: PathBuf,
    /// The old file's length.
    pub covered: u64,
    /// Complete lines appended after the read, copied as they were.
    pub appended_meanwhile: usize,
    /// Bytes of an unterminated last line of the old file, left out.
    pub torn_bytes: u64,
    /// The new file's length.
    pub length: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    #[error("{path} was replaced, truncated or rewritten while it was compacted; nothing changed (run it again)")]
    Changed { path: String },
    #[error("{archive} already exists; nothing changed (run it again)")]
    ArchiveExists { archive: String },
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Writes `kept` (lines without their newline, in order) as the new journal at `path`, copies
/// the complete lines appended to the old one since `read`, keeps the old file as
/// `<path>.<stamp>`, writes the note and renames the new file into place. On error the journal
/// is untouched (a temporary file of ours is removed).
pub fn swap_in<'a>(
    path: &Path,
    read: &Read,
    kept: impl Iterator<Item = &'a [u8]>,
    stamp: &str,
) -> Result<Swapped, SwapError> {
    let temp = suffixed(path, &format!("compacting-{}", std::process::id()));
    let outcome = write_and_swap(path, read, kept, stamp, &temp);
    if outcome.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    outcome
}

fn write_and_swap<'a>(
    path: &Path,
    read: &Read,
    kept: impl Iterator<Item = &'a [u8]>,
    stamp: &str,
    temp: &Path,
) -> Result<Swapped, SwapError> {
    let changed = || SwapError::Changed {
        path: path.display().to_string(),
    };
    let mut out = BufWriter::new(OpenOptions::new().write(true).create_new(true).open(temp)?);
    for line in kept {
        out.write_all(line)?;
        out.write_all(b"\n")?;
    }
    // From here until the rename, nothing is appended to the old file.
    let old = lock(File::open(path)?, FlockArg::LockExclusive)?;
    let meta = old.metadata()?;
    if identity(&meta) != read.identity || !names(path, &old)? || !is_unchanged(&old, read)? {
        return Err(changed());
    }
    let covered = meta.len();
    let mut fresh = vec![0; (covered - read.bytes.len() as u64) as usize];
    old.read_exact_at(&mut fresh, read.bytes.len() as u64)?;
    let complete = fresh.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    out.write_all(&fresh[..complete])?;
    let appended_meanwhile = fresh[..complete].iter().filter(|&&b| b == b'\n').count();
    let new = out.into_inner().map_err(io::IntoInnerError::into_error)?;
    new.set_permissions(meta.permissions())?;
    new.sync_all()?;
    let new_meta = new.metadata()?;
    let archive = suffixed(path, stamp);
    match std::fs::hard_link(path, &archive) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(SwapError::ArchiveExists {
                archive: archive.display().to_string(),
            })
        }
        other => other?,
    }
    let note = Note {
        old: read.identity,
        archive: archive
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        covered,
        new: identity(&new_meta),
        length: new_meta.len(),
    };
    write_note(path, &note)?;
    std::fs::rename(temp, path)?;
    sync_dir(path)?;
    drop(old);
    Ok(Swapped {
        archive,
        covered,
        appended_meanwhile,
        torn_bytes: (fresh.len() - complete) as u64,
        length: note.length,
    })
}

/// Whether the bytes `read` kept at the start and at its end are still in `file`.
fn is_unchanged(file: &File, read: &Read) -> io::Result<bool> {
    let len = read.bytes.len() as u64;
    if file.metadata()?.len() < len {
        return Ok(false);
    }
    let window = WITNESS_BYTES.min(len) as usize;
    let mut buf = vec![0; window];
    for start in [0, len as usize - window] {
        file.read_exact_at(&mut buf, start as u64)?;
        if buf != read.bytes[start..start + window] {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Writes the note atomically (a temporary file renamed), on disk before the swap's rename.
fn write_note(journal: &Path, note: &Note) -> io::Result<()> {
    let target = note_path(journal);
    let temp = suffixed(&target, "tmp");
    let mut file = File::create(&temp)?;
    serde_json::to_writer(&mut file, note)?;
    file.sync_all()?;
    std::fs::rename(&temp, &target)
}

fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}
