//! The journal file: reading complete lines and appending one record per line.
//!
//! Invariant: we never rewrite the journal. An append is one complete line in one `write` on
//! a file opened with O_APPEND; if the file ends in a torn line (a writer died mid-line), the
//! append starts with a newline so our record never fuses with it.

use super::ledger::{Ledger, LineError};
use serde_json::Value;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Appends `record` as one line. With `fsync`, the data is on disk when this returns.
pub fn append(path: &Path, record: &Value, fsync: bool) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .open(path)?;
    let len = file.metadata()?.len();
    let mut last = [b'\n'];
    if len > 0 {
        file.read_exact_at(&mut last, len - 1)?;
    }
    let mut line = Vec::with_capacity(1024);
    if last[0] != b'\n' {
        line.push(b'\n');
    }
    serde_json::to_writer(&mut line, record)?;
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
    if fsync {
        file.sync_data()?;
    }
    Ok(())
}

/// Splits journal bytes into complete lines (without their newline) and the unterminated
/// rest (empty if the bytes end in a newline).
pub fn split_lines(bytes: &[u8]) -> (impl Iterator<Item = &[u8]>, &[u8]) {
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let lines = bytes[..complete]
        .split_inclusive(|&b| b == b'\n')
        .map(|line| &line[..line.len() - 1]);
    (lines, &bytes[complete..])
}

/// One line the fold skipped.
#[derive(Debug)]
pub struct LineProblem {
    /// 1-based line number.
    pub line: usize,
    pub error: LineError,
}

/// Folds journal bytes. A final line without its newline is applied (a finished file,
/// not a live tail); blank lines are ignored. Skipped lines are returned and logged.
pub fn fold_bytes(ledger: &mut Ledger, bytes: &[u8]) -> Vec<LineProblem> {
    let (lines, rest) = split_lines(bytes);
    apply_lines(ledger, lines.chain((!rest.is_empty()).then_some(rest)))
}

/// Applies complete lines in order (blank ones ignored); the skipped ones are returned, with
/// their 1-based number among `lines`, and logged.
pub fn apply_lines<'a>(
    ledger: &mut Ledger,
    lines: impl Iterator<Item = &'a [u8]>,
) -> Vec<LineProblem> {
    let mut problems = Vec::new();
    for (i, raw) in lines.enumerate() {
        if raw.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if let Err(error) = ledger.apply_line_bytes(raw) {
            tracing::warn!(line = i + 1, %error, "journal line skipped");
            problems.push(LineProblem { line: i + 1, error });
        }
    }
    problems
}

/// Reads and folds a whole journal file. A missing file is an empty journal.
pub fn load(path: &Path, mut ledger: Ledger) -> io::Result<(Ledger, Vec<LineProblem>)> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e),
    };
    let problems = fold_bytes(&mut ledger, &bytes);
    Ok((ledger, problems))
}
