//! Files that survive a crash: the revocation queue beside a journal, the per-lease port
//! assignments under `--data-dir`, and new key files (a signing key, the interception CA).
//!
//! Invariant: an append returns only once its line is on disk (fsynced), and a rewrite is a
//! rename of a complete, fsynced file followed by a sync of its directory, so a reader after a
//! crash finds the old file or the new one, never a mix; at most the last line of an append
//! cut short is torn, and readers skip it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Creates `path` with `mode` (failing if anything is there, so no link is followed and
/// nothing is overwritten; never written wider and narrowed after), writes `bytes` and fsyncs.
pub fn create_new(path: &Path, mode: u32, bytes: &[u8]) -> io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Appends `lines` (each without its newline) in one write and fsyncs them. Nothing to
/// append writes nothing.
pub fn append_lines<'a>(path: &Path, lines: impl IntoIterator<Item = &'a [u8]>) -> io::Result<()> {
    let mut bytes = Vec::new();
    for line in lines {
        bytes.extend_from_slice(line);
        bytes.push(b'\n');
    }
    if bytes.is_empty() {
        return Ok(());
    }
    let mut file =
        crate::descriptors::with_spare(|| OpenOptions::new().create(true).append(true).open(path))?;
    file.write_all(&bytes)?;
    file.sync_data()
}

/// Replaces the file by one holding `lines` (removes it when there are none), atomically: a
/// complete temporary file, fsynced, renamed over it, and the directory fsynced.
pub fn rewrite<'a>(path: &Path, lines: impl IntoIterator<Item = &'a [u8]>) -> io::Result<()> {
    let mut lines = lines.into_iter().peekable();
    if lines.peek().is_none() {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    } else {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut file = io::BufWriter::new(File::create(&tmp)?);
        for line in lines {
            file.write_all(line)?;
            file.write_all(b"\n")?;
        }
        file.into_inner().map_err(|e| e.into_error())?.sync_data()?;
        std::fs::rename(&tmp, path)?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}
