//! Compaction: which lines of a journal a compacted journal keeps, and `journal compact` for a
//! file (read, choose, swap in under a running follower) or a stream (read, choose, publish as
//! the snapshot new replicas start from, and with `--purge` remove what it covers).
//!
//! Invariant: kept lines are the original bytes, in their original order, and folding them
//! gives every kept lease the status and chain check that folding the whole journal gives. A
//! lease is kept until `retention` has passed since both its expiry and its latest closing
//! record (a closing record is what keeps a signed grant closed should it ever be appended
//! again, so it stays while the grant could still open); a kept lease keeps its first grant and
//! every closing record of it that applied or waits for its grant, and so does each of its
//! ancestors. Closing records of leases never granted are all kept (their grant may still
//! come). Dropped: leases past the retention, duplicate grants, records that change no status
//! (refused, narrowed, heartbeat, attached), and lines the fold skips (counted by reason).

use super::journal::split_lines;
use super::ledger::{Applied, InvalidReason, Ledger};
use super::store::file::swap::{self, SwapError, Swapped};
use super::store::snapshot::{self, Marker};
use super::store::whole::{self, Prefer};
use super::store::NatsLocation;
use crate::contract::record::Record;
use crate::contract::{Keyring, Timestamp};
use crate::nats::{NatsError, NatsOptions, NatsStream, StreamSpec, REQUEST_TIMEOUT};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

/// `--retention` when none is given: a day, as `serve --closed-lease-retention`.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// What a compaction kept and dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Indexes of the kept lines among the complete lines, ascending.
    pub kept: Vec<usize>,
    /// Complete lines read (blank ones included).
    pub lines: usize,
    /// Leases kept (past the retention themselves, some are kept as an ancestor).
    pub leases_kept: usize,
    /// Leases dropped, past the retention.
    pub leases_dropped: usize,
    /// Closing records kept for leases never granted.
    pub orphan_closings: usize,
    pub duplicate_grants: usize,
    /// Records that change no status (refused, narrowed, heartbeat, attached).
    pub notes_dropped: usize,
    /// Lines the fold skips, by reason, indexed as [`InvalidReason::ALL`].
    pub invalid: [usize; InvalidReason::ALL.len()],
}

/// What one lease has in the journal.
#[derive(Debug, Default)]
struct Lines {
    grant: Option<usize>,
    closings: Vec<usize>,
    /// The latest `at` among its closing records.
    last_closed: Option<Timestamp>,
}

/// Chooses the lines of `lines` (complete lines, without newline) to keep at `now`. The fold
/// never requires record signatures here: an unsigned closing record is kept, and a journal
/// folded with them required skips it, as it did before. A line longer than `max_line` is
/// dropped, as the fold skips it.
pub fn select<'a>(
    lines: impl IntoIterator<Item = &'a [u8]>,
    keyring: Keyring,
    now: Timestamp,
    retention: Duration,
    max_line: usize,
) -> Selection {
    let mut ledger =
        Ledger::new(keyring.requiring_record_signatures(false)).limiting_lines(max_line);
    let mut selection = Selection::default();
    let mut by_lease: HashMap<String, Lines> = HashMap::new();
    for (i, line) in lines.into_iter().enumerate() {
        selection.lines += 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match ledger.apply_line_bytes(line) {
            Ok(Applied::Granted(id)) => by_lease.entry(id).or_default().grant = Some(i),
            Ok(Applied::DuplicateGrant(_)) => selection.duplicate_grants += 1,
            Ok(Applied::Closed(id) | Applied::Held(id)) => {
                let at = std::str::from_utf8(line)
                    .ok()
                    .and_then(|text| Record::parse(text).ok())
                    .map(|record| record.at);
                let entry = by_lease.entry(id).or_default();
                entry.closings.push(i);
                entry.last_closed = entry.last_closed.max(at);
            }
            Ok(Applied::Noted(_)) => selection.notes_dropped += 1,
            Err(error) => {
                let reason = error.reason();
                if let Some(r) = InvalidReason::ALL.iter().position(|x| *x == reason) {
                    selection.invalid[r] += 1;
                }
            }
        }
    }
    let cutoff = Timestamp::from_millis(
        now.as_millis()
            .saturating_sub(i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)),
    );
    let mut keep: BTreeSet<&str> = BTreeSet::new();
    for lease in ledger.leases() {
        let closed_recently = by_lease
            .get(&lease.id)
            .and_then(|l| l.last_closed)
            .is_some_and(|at| at >= cutoff);
        if lease.expires_at >= cutoff || closed_recently {
            keep.insert(&lease.id);
            keep.extend(ledger.ancestors(&lease.id).map(|a| a.id.as_str()));
        }
    }
    let mut kept = BTreeSet::new();
    for (id, lines) in &by_lease {
        match lines.grant {
            Some(grant) if keep.contains(id.as_str()) => {
                kept.insert(grant);
                kept.extend(&lines.closings);
            }
            Some(_) => {}
            None => {
                selection.orphan_closings += lines.closings.len();
                kept.extend(&lines.closings);
            }
        }
    }
    selection.leases_kept = keep.len();
    selection.leases_dropped = ledger.granted() - keep.len();
    selection.kept = kept.into_iter().collect();
    selection
}

/// What `journal compact` did to a file.
#[derive(Debug, Clone)]
pub struct Compacted {
    pub selection: Selection,
    pub swapped: Swapped,
}

#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    #[error("no journal at {0}")]
    Missing(String),
    #[error("reading {path}: {cause}")]
    Read { path: String, cause: std::io::Error },
    #[error("swapping the compacted journal in at {path}: {cause}")]
    Swap { path: String, cause: SwapError },
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("reading the stream {location}: {cause}")]
    Stream {
        location: String,
        cause: std::io::Error,
    },
    #[error("a stream's snapshot is vouched for by a key: give --key-file")]
    NoKey,
}

/// Compacts the journal file at `path`: keeps the old file as `<path>.<now>`, and swaps the
/// compacted one in so that a running `serve` follows it without folding anything again.
pub fn compact_file(
    path: &Path,
    keyring: Keyring,
    retention: Duration,
    now: Timestamp,
    max_line: usize,
) -> Result<Compacted, CompactError> {
    let shown = || path.display().to_string();
    let read = swap::read(path).map_err(|cause| match cause.kind() {
        std::io::ErrorKind::NotFound => CompactError::Missing(shown()),
        _ => CompactError::Read {
            path: shown(),
            cause,
        },
    })?;
    let (lines, _) = split_lines(&read.bytes);
    let lines: Vec<&[u8]> = lines.collect();
    let selection = select(lines.iter().copied(), keyring, now, retention, max_line);
    let kept = selection.kept.iter().map(|&i| lines[i]);
    let swapped =
        swap::swap_in(path, &read, kept, &now.to_string()).map_err(|cause| CompactError::Swap {
            path: shown(),
            cause,
        })?;
    Ok(Compacted { selection, swapped })
}

/// What `journal compact` did to a stream.
#[derive(Debug, Clone)]
pub struct Snapshotted {
    pub selection: Selection,
    pub marker: Marker,
    /// Where the snapshot went.
    pub location: NatsLocation,
    /// What `--purge` removed, when given.
    pub purged: Option<Purged>,
}

/// What `--purge` removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// Journal messages removed (every one up to the sequence the snapshot covers).
    pub journal: u64,
    /// Messages of older snapshots removed from the snapshot stream.
    pub snapshots: u64,
}

/// Compacts the journal stream at `location` into a snapshot of everything it holds now (from
/// the snapshot it was last purged behind, if it was), published to its snapshot stream, its
/// marker's MAC under the keyring's first key (every replica must hold that key to start from
/// it). With `purge`, the snapshot is read back and verified (MAC, digest, journal
/// incarnation) before the journal's messages up to the sequence it covers, and older
/// snapshots, are removed; without it, the journal is left as it is.
pub async fn compact_stream(
    location: &NatsLocation,
    options: &NatsOptions,
    keyring: Keyring,
    retention: Duration,
    now: Timestamp,
    max_line: usize,
    purge: bool,
) -> Result<Snapshotted, CompactError> {
    let key = keyring.keys().next().cloned().ok_or(CompactError::NoKey)?;
    let journal = NatsStream::connect(location, options, &StreamSpec::JOURNAL).await?;
    let stream_error = |cause: std::io::Error| CompactError::Stream {
        location: location.to_string(),
        cause,
    };
    let start = whole::start(&journal, Some(&keyring), Prefer::Stream)
        .await
        .map_err(|e| stream_error(std::io::Error::other(e)))?;
    let messages = journal
        .read_all_from(start.next)
        .await
        .map_err(stream_error)?;
    let covers = messages
        .last()
        .map_or(start.next - 1, |(sequence, _)| *sequence);
    let lines: Vec<&[u8]> = start
        .snapshot_lines()
        .iter()
        .map(Vec::as_slice)
        .chain(messages.iter().map(|(_, line)| &line[..]))
        .collect();
    let selection = select(
        lines.iter().copied(),
        keyring.clone(),
        now,
        retention,
        max_line,
    );
    let kept = selection.kept.iter().map(|&i| lines[i]);
    let written = snapshot::publish(&journal, options, covers, kept, &key).await?;
    let purged = match purge {
        true => Some(
            purge_behind(&journal, &written, &keyring)
                .await
                .map_err(stream_error)?,
        ),
        false => None,
    };
    Ok(Snapshotted {
        selection,
        marker: written.marker,
        location: snapshot::location_of(location),
        purged,
    })
}

/// Removes the journal's messages up to what `written` covers, and the older snapshots, once
/// the snapshot reads back as written: its marker is the latest, verifies under `keyring`,
/// names this journal's incarnation, and its lines are the ones its digest names. Never past
/// what it covers; nothing at all when another compaction purged the journal further.
async fn purge_behind(
    journal: &NatsStream,
    written: &snapshot::Written,
    keyring: &Keyring,
) -> std::io::Result<Purged> {
    let marker = &written.marker;
    let refuse = |why: String| {
        std::io::Error::other(format!(
            "not purged: {why}; the snapshot is published, the journal and older snapshots are unchanged"
        ))
    };
    match snapshot::latest(journal, marker.covers, keyring).await {
        Ok(Some((read, _))) if read == *marker => {}
        Ok(Some(_)) => return Err(refuse("another snapshot was published meanwhile".into())),
        Ok(None) => return Err(refuse("the snapshot does not read back".into())),
        Err(error) => return Err(refuse(format!("the snapshot does not verify: {error}"))),
    }
    let span = journal.span().await?;
    if span.first > marker.covers + 1 {
        return Err(refuse(format!(
            "the journal is already purged below sequence {}, past what this snapshot covers",
            span.first
        )));
    }
    let removed = purge_below(journal, marker.covers + 1).await?;
    let snapshots = purge_below(&written.stream, written.first_sequence()).await?;
    Ok(Purged {
        journal: removed,
        snapshots,
    })
}

/// Removes `stream`'s messages before sequence `below`; how many. Nothing is asked of the
/// server when there are none: JetStream takes a purge below sequence 1 for a purge of all.
async fn purge_below(stream: &NatsStream, below: u64) -> std::io::Result<u64> {
    if below <= 1 || below <= stream.span().await?.first {
        return Ok(0);
    }
    let purged = tokio::time::timeout(REQUEST_TIMEOUT, stream.stream.purge().sequence(below))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "purge timed out"))?
        .map_err(std::io::Error::other)?;
    Ok(purged.purged)
}
