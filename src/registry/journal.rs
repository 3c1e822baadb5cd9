//! Folding journal lines into a ledger, whatever store they came from; and loading a whole
//! journal file for the CLI.
//!
//! Invariant: lines apply in order, each once per call (they may be prepared on several threads,
//! but the ledger changes only in journal order, on the caller's); a line that does not parse
//! or validate is skipped, counted by the ledger and reported, never fatal. Nothing here writes: appends go
//! through [`super::store`].

use super::ledger::{Ledger, LineError};
use super::prepared::Prepared;
use crate::contract::Keyring;
use crate::log_gate::{Flood, Say};
use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::time::Instant;

/// The longest journal line read by default (`--max-journal-line`): above the largest real
/// grant (a lease of 500,000 hosts is 21 MB), so only a line no issuer writes is skipped.
pub const MAX_LINE: usize = 32 << 20;

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

/// Lines read since a store's generation began, so that a skipped line is named by its place
/// in the journal, not in the read that brought it.
#[derive(Debug, Default)]
pub struct LineCount(usize);

impl LineCount {
    /// Counts a batch of `len` lines (the first of a new generation if `restarted`) and
    /// renumbers its `problems` (numbered within the batch) from the lines before it.
    pub fn count(&mut self, restarted: bool, len: usize, problems: &mut [LineProblem]) {
        if restarted {
            self.0 = 0;
        }
        for problem in problems {
            problem.line += self.0;
        }
        self.0 += len;
    }
}

/// Lines prepared per round: enough to keep every core busy for a while, few enough that the
/// prepared leases waiting for their turn stay a small part of memory.
const ROUND: usize = 4096;

/// A round shorter than this is prepared on the calling thread (a follower's few new lines).
const PARALLEL_FROM: usize = 256;

/// Applies complete lines in order (blank ones ignored); the skipped ones are returned, with
/// their 1-based number among `lines` (the caller logs them: see [`warn_skipped`]).
///
/// Each line is first prepared ([`Prepared::line`]: parse, schema, a grant's signature and
/// host lists), on every core for a long journal, then applied in journal order on this
/// thread while the next round is prepared: the ledger is exactly the one a line-by-line fold
/// ([`Ledger::apply_line_bytes`]) gives.
pub fn apply_lines<'a>(
    ledger: &mut Ledger,
    lines: impl Iterator<Item = &'a [u8]>,
) -> Vec<LineProblem> {
    let keyring = ledger.keyring().cloned();
    let keyring = keyring.as_ref();
    let max_line = ledger.max_line();
    let mut lines = lines
        .enumerate()
        .filter(|(_, raw)| !raw.iter().all(u8::is_ascii_whitespace))
        .map(|(i, raw)| (i + 1, raw));
    let mut problems = Vec::new();
    let mut current = prepare_round(
        keyring,
        max_line,
        &lines.by_ref().take(ROUND).collect::<Vec<_>>(),
    );
    while !current.is_empty() {
        let upcoming: Vec<(usize, &[u8])> = lines.by_ref().take(ROUND).collect();
        current = std::thread::scope(|scope| {
            let next = (!upcoming.is_empty())
                .then(|| scope.spawn(|| prepare_round(keyring, max_line, &upcoming)));
            for (line, prepared) in current {
                if let Err(error) = ledger.apply_prepared(prepared) {
                    problems.push(LineProblem { line, error });
                }
            }
            next.map_or_else(Vec::new, |next| {
                next.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
        });
    }
    problems
}

/// Prepares numbered lines, split over the machine's cores when there are enough of them.
fn prepare_round(
    keyring: Option<&Keyring>,
    max_line: usize,
    lines: &[(usize, &[u8])],
) -> Vec<(usize, Prepared)> {
    let prepare =
        |(line, raw): &(usize, &[u8])| (*line, Prepared::line_at_most(keyring, raw, max_line));
    let workers = cores();
    if lines.len() < PARALLEL_FROM || workers < 2 {
        return lines.iter().map(prepare).collect();
    }
    let share = lines.len().div_ceil(workers);
    std::thread::scope(|scope| {
        let parts: Vec<_> = lines
            .chunks(share)
            .map(|part| scope.spawn(move || part.iter().map(prepare).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|part| {
                part.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}

/// How many threads prepare lines (the machine's cores, read once).
fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Grants of `problems` that no key of the keyring verifies (signed with a key not in it, or
/// a signature that does not verify), and the fingerprints they name (the first few).
pub fn unverified(problems: &[LineProblem]) -> (usize, Vec<String>) {
    use crate::contract::lease::LeaseError;
    let mut keys: Vec<String> = Vec::new();
    let mut n = 0;
    for problem in problems {
        if let LineError::Lease(LeaseError::UnknownKey(key) | LeaseError::BadSignature(key)) =
            &problem.error
        {
            n += 1;
            if keys.len() < 3 && !keys.contains(key) {
                keys.push(key.clone());
            }
        }
    }
    (n, keys)
}

/// Why a fold cannot be served: it holds no lease, and some grants did not verify under the
/// keyring — the key file is almost certainly not the one that signs this journal.
pub fn nothing_verifies(ledger: &Ledger, problems: &[LineProblem]) -> Option<String> {
    let (n, keys) = unverified(problems);
    (n > 0 && ledger.leases().next().is_none()).then(|| nothing_verified(n, &keys))
}

/// The words of [`nothing_verifies`] for `n` grants signed with `keys`.
pub fn nothing_verified(n: usize, keys: &[String]) -> String {
    format!(
        "no lease of the journal verifies under the keyring: {n} grant(s) signed with {} \
         (is --key-file the key that signs this journal? `leasegate verify` lists each line)",
        keys.join(", ")
    )
}

/// Logs skipped lines, one warning per distinct reason (a wrong key would otherwise warn
/// once per lease in the journal), for at most `SHOWN` reasons: reasons that name their line's
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
