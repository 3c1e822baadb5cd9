//! Folding journal lines into a ledger, whatever store they came from; and loading a whole
//! journal file for the CLI.
//!
//! Invariant: lines apply in order, each once per call; a line that does not parse or validate
//! is skipped, counted by the ledger and reported, never fatal. Nothing here writes: appends go
//! through [`super::store`].

use super::ledger::{Ledger, LineError};
use crate::log_gate::{Flood, Say};
use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::time::Instant;

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
/// not a live tail); blank lines are ignored. Skipped lines are returned, not logged.
pub fn fold_bytes(ledger: &mut Ledger, bytes: &[u8]) -> Vec<LineProblem> {
    let (lines, rest) = split_lines(bytes);
    apply_lines(ledger, lines.chain((!rest.is_empty()).then_some(rest)))
}

/// Applies complete lines in order (blank ones ignored); the skipped ones are returned, with
/// their 1-based number among `lines` (the caller logs them: see [`warn_skipped`]).
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
            problems.push(LineProblem { line: i + 1, error });
        }
    }
    problems
}

/// Logs skipped lines, one warning per distinct reason (a wrong key would otherwise warn
/// once per lease in the journal), for at most [`SHOWN`] reasons: reasons that name their line's
/// own values (timestamps, ids) are each distinct, and the rest are said as one count.
pub fn warn_skipped(problems: &[LineProblem]) {
    // Reasons in the order first seen, with their lines.
    let mut reasons: Vec<(String, Vec<usize>)> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    for problem in problems {
        let text = problem.error.to_string();
        match index.get(&text) {
            Some(&i) => reasons[i].1.push(problem.line),
            None => {
                index.insert(text.clone(), reasons.len());
                reasons.push((text, vec![problem.line]));
            }
        }
    }
    for (error, lines) in reasons.iter().take(SHOWN) {
        let mut shown: Vec<String> = lines.iter().take(SHOWN).map(usize::to_string).collect();
        if lines.len() > SHOWN {
            shown.push(format!("{} more", lines.len() - SHOWN));
        }
        let lines = shown.join(", ");
        tracing::warn!(%lines, %error, "journal lines skipped");
    }
    if let Some(rest) = reasons.get(SHOWN..).filter(|rest| !rest.is_empty()) {
        let lines: usize = rest.iter().map(|(_, lines)| lines.len()).sum();
        let first = rest[0].1[0];
        tracing::warn!(
            lines,
            reasons = rest.len(),
            first,
            "more journal lines skipped, for other reasons (`leasegate verify` lists each)"
        );
    }
}

/// Reasons, and line numbers per reason, that [`warn_skipped`] names.
const SHOWN: usize = 5;

/// [`warn_skipped`] for a journal that is followed, batch by batch (call it for every batch,
/// an empty one included): the first batch with skipped lines is said in full, then a count at
/// most once a minute, and the end once no line has been skipped for a minute.
pub fn warn_skipped_gated(flood: &mut Flood, problems: &[LineProblem], now: Instant) {
    if problems.is_empty() {
        if let Some(s) = flood.end_if_quiet(now) {
            tracing::info!(lines = s.repeats, since_first = s.total, lasted = ?s.lasted, "no journal line skipped for a minute");
        } else if let Some(s) = flood.due(now) {
            tracing::warn!(lines = s.repeats, since_first = s.total, "journal lines are still being skipped (leasegate_journal_invalid_lines_total counts them by reason)");
        }
        return;
    }
    match flood.occurred(problems.len() as u64, now) {
        Say::Start => warn_skipped(problems),
        Say::Summary(s) => tracing::warn!(lines = s.repeats, since_first = s.total, "journal lines are still being skipped (leasegate_journal_invalid_lines_total counts them by reason)"),
        Say::Quiet => {}
    }
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
