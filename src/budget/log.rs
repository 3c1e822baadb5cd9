//! The spend log: what this proxy's model calls reserved and spent, kept beside the journal
//! (`<journal>.spent`, `<data-dir>/<stream>.spent`) so that a restart — or `kill -9` —
//! forgets nothing a budget counts.
//!
//! Invariant: a budgeted call's reservation is on disk (fsynced) before [`SpendLog::reserve`]
//! returns, so before the call goes out; a reservation the log holds unsettled at the next
//! start is charged its bound; the file is compacted by an atomic rewrite
//! ([`crate::durable::rewrite`]) into per-chain totals, so what it folds to never changes by
//! compaction; a write that fails is cut back off the file, so no torn line is left between
//! two whole ones.

use super::{Bound, Charge, Spent};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

/// Lines written in one batch at most (one write, one fsync).
const MOST_IN_A_BATCH: usize = 1024;
/// The log is compacted once it holds this many lines more than twice its compacted size.
const COMPACT_AFTER: usize = 16_384;

/// One line of the log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Line {
    /// A run of this proxy that publishes on the egress stream as `publisher`: its calls there
    /// are counted from this log, not from the stream.
    Run { publisher: String },
    /// A budgeted call about to go out, and the most it may spend.
    Reserve {
        id: u64,
        chain: Vec<String>,
        bound: Bound,
    },
    /// A call that ended: what it is charged; `id`, the reservation it settles (none: a call
    /// under no budget, written without waiting for the disk).
    Settle {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u64>,
        chain: Vec<String>,
        charge: Charge,
    },
    /// What the calls of `chain`'s first lease spent, as a compaction summed them.
    Total { chain: Vec<String>, spent: Spent },
}

/// What the log's lines come to.
#[derive(Debug, Default)]
struct Folded {
    totals: HashMap<Vec<String>, Spent>,
    open: BTreeMap<u64, (Vec<String>, Bound)>,
    runs: Vec<String>,
    /// Lines in the file.
    lines: usize,
}

impl Folded {
    fn apply(&mut self, line: Line) {
        self.lines += 1;
        match line {
            Line::Run { publisher } => {
                if !self.runs.contains(&publisher) {
                    self.runs.push(publisher);
                }
            }
            Line::Reserve { id, chain, bound } => {
                self.open.insert(id, (chain, bound));
            }
            Line::Settle { id, chain, charge } => {
                if let Some(id) = id {
                    self.open.remove(&id);
                }
                self.totals.entry(chain).or_default().add(&charge);
            }
            Line::Total { chain, spent } => self.totals.entry(chain).or_default().merge(&spent),
        }
    }

    /// Every reservation still open is charged its bound; how many there were.
    fn close_open(&mut self) -> u64 {
        let open = std::mem::take(&mut self.open);
        for (chain, bound) in open.values() {
            self.totals
                .entry(chain.clone())
                .or_default()
                .add(&bound.charge());
        }
        open.len() as u64
    }

    /// The lines of a compacted log that folds to the same.
    fn compacted(&self) -> Vec<Vec<u8>> {
        let runs = self.runs.iter().map(|publisher| Line::Run {
            publisher: publisher.clone(),
        });
        let totals = self.totals.iter().map(|(chain, spent)| Line::Total {
            chain: chain.clone(),
            spent: *spent,
        });
        let open = self.open.iter().map(|(id, (chain, bound))| Line::Reserve {
            id: *id,
            chain: chain.clone(),
            bound: *bound,
        });
        runs.chain(totals)
            .chain(open)
            .map(|line| serde_json::to_vec(&line).expect("a line serialises"))
            .collect()
    }
}

/// What an earlier run left in the log, read at the start.
#[derive(Debug, Default)]
pub struct Restored {
    /// What each chain's first lease spent (chain: the lease, then its ancestors).
    pub totals: Vec<(Vec<String>, Spent)>,
    /// The egress-stream publisher ids of earlier runs.
    pub runs: Vec<String>,
    /// Calls in flight when the last run ended without settling them: charged their bound.
    pub charged_at_bound: u64,
    /// Lines that did not read (a line torn by a crash, at most one).
    pub unreadable: u64,
}

/// A message to the writer thread.
struct Message {
    line: Line,
    /// Answered once the line is on disk (fsynced), or with why it is not.
    ack: Option<tokio::sync::oneshot::Sender<Result<(), String>>>,
}

/// The writer of the spend log (a thread of its own: appends are batched, one fsync each).
#[derive(Debug)]
pub struct SpendLog {
    to_writer: mpsc::Sender<Message>,
    next_id: AtomicU64,
}

const STOPPED: &str = "the spend log's writer has stopped";

impl SpendLog {
    /// Opens the log at `path` (made if missing): folds what is there, charges the
    /// reservations an earlier run left open their bound, rewrites it compacted, and starts
    /// the writer.
    pub fn open(path: PathBuf) -> io::Result<(SpendLog, Restored)> {
        let text = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let mut folded = Folded::default();
        let mut unreadable = 0;
        for line in text.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            match serde_json::from_slice::<Line>(line) {
                Ok(line) => folded.apply(line),
                Err(_) => unreadable += 1,
            }
        }
        let charged_at_bound = folded.close_open();
        let lines = folded.compacted();
        crate::durable::rewrite(&path, lines.iter().map(Vec::as_slice))?;
        folded.lines = lines.len();
        let restored = Restored {
            totals: folded
                .totals
                .iter()
                .map(|(chain, spent)| (chain.clone(), *spent))
                .collect(),
            runs: folded.runs.clone(),
            charged_at_bound,
            unreadable,
        };
        let file = append_to(&path)?;
        let (to_writer, from_callers) = mpsc::channel();
        let writer = Writer {
            good_len: file.metadata()?.len(),
            file,
            path,
            folded,
            compacted: lines.len(),
        };
        std::thread::Builder::new()
            .name("leasegate-spend-log".into())
            .spawn(move || writer.run(from_callers))?;
        let log = SpendLog {
            to_writer,
            next_id: AtomicU64::new(0),
        };
        Ok((log, restored))
    }

    /// Writes a budgeted call's reservation down; returns its id once it is on disk.
    pub async fn reserve(
        &self,
        chain: &[std::sync::Arc<str>],
        bound: &Bound,
    ) -> Result<u64, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let line = Line::Reserve {
            id,
            chain: chain.iter().map(|id| id.to_string()).collect(),
            bound: *bound,
        };
        self.written(line).await?;
        Ok(id)
    }

    /// Writes a call's charge down (settling reservation `id`, if it had one), without waiting
    /// for the disk: a settle lost to a crash leaves its reservation open, charged its bound.
    pub fn settle(&self, id: Option<u64>, chain: &[std::sync::Arc<str>], charge: &Charge) {
        let line = Line::Settle {
            id,
            chain: chain.iter().map(|id| id.to_string()).collect(),
            charge: *charge,
        };
        let _ = self.to_writer.send(Message { line, ack: None });
    }

    /// Writes down that this run publishes on the egress stream as `publisher`.
    pub async fn run(&self, publisher: &str) -> Result<(), String> {
        let line = Line::Run {
            publisher: publisher.to_owned(),
        };
        self.written(line).await
    }

    async fn written(&self, line: Line) -> Result<(), String> {
        let (ack, written) = tokio::sync::oneshot::channel();
        let message = Message {
            line,
            ack: Some(ack),
        };
        self.to_writer
            .send(message)
            .map_err(|_| STOPPED.to_owned())?;
        written.await.map_err(|_| STOPPED.to_owned())?
    }
}

fn append_to(path: &Path) -> io::Result<File> {
    crate::descriptors::with_spare(|| OpenOptions::new().create(true).append(true).open(path))
}

struct Writer {
    file: File,
    path: PathBuf,
    /// The file's length after the last whole write: a failed write is cut back to it.
    good_len: u64,
    folded: Folded,
    /// Lines after the last compaction.
    compacted: usize,
}

impl Writer {
    fn run(mut self, from_callers: mpsc::Receiver<Message>) {
        while let Ok(first) = from_callers.recv() {
            let mut batch = vec![first];
            while batch.len() < MOST_IN_A_BATCH {
                match from_callers.try_recv() {
                    Ok(message) => batch.push(message),
                    Err(_) => break,
                }
            }
            let result = self.write(&batch).map_err(|e| {
                tracing::error!(path = %self.path.display(), error = %e, "the spend log cannot be written: budgeted model calls are refused until it can");
                format!("{}: {e}", self.path.display())
            });
            for message in batch {
                if result.is_ok() {
                    self.folded.apply(message.line);
                }
                if let Some(ack) = message.ack {
                    let _ = ack.send(result.clone());
                }
            }
            if result.is_ok() && self.folded.lines > 2 * self.compacted + COMPACT_AFTER {
                if let Err(e) = self.compact() {
                    tracing::warn!(path = %self.path.display(), error = %e, "the spend log could not be compacted; it is appended to as it is");
                }
            }
        }
    }

    /// Appends the batch in one write; fsyncs it when a caller waits for it.
    fn write(&mut self, batch: &[Message]) -> io::Result<()> {
        let mut bytes = Vec::new();
        for message in batch {
            serde_json::to_writer(&mut bytes, &message.line).map_err(io::Error::other)?;
            bytes.push(b'\n');
        }
        // A write that failed before may have left part of a line: cut it off first.
        if self.file.metadata()?.len() != self.good_len {
            self.file.set_len(self.good_len)?;
        }
        self.file.write_all(&bytes)?;
        if batch.iter().any(|m| m.ack.is_some()) {
            self.file.sync_data()?;
        }
        self.good_len += bytes.len() as u64;
        Ok(())
    }

    fn compact(&mut self) -> io::Result<()> {
        let lines = self.folded.compacted();
        crate::durable::rewrite(&self.path, lines.iter().map(Vec::as_slice))?;
        self.file = append_to(&self.path)?;
        self.good_len = self.file.metadata()?.len();
        self.folded.lines = lines.len();
        self.compacted = lines.len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn chain(ids: &[&str]) -> Vec<Arc<str>> {
        ids.iter().map(|id| Arc::from(*id)).collect()
    }

    fn bound(tokens: u64) -> Bound {
        Bound {
            input_tokens: tokens / 2,
            output_tokens: tokens - tokens / 2,
            cost_usd: Some(0.5),
            tool_calls: 0,
        }
    }

    fn metered(tokens: u64) -> Charge {
        Charge {
            metered: true,
            input_tokens: tokens,
            output_tokens: 0,
            cached_tokens: 0,
            cost_usd: Some(0.01),
            tool_calls: 0,
        }
    }

    fn total(restored: &Restored, first: &str) -> Spent {
        let mut spent = Spent::default();
        for (chain, s) in &restored.totals {
            if chain[0] == first {
                spent.merge(s);
            }
        }
        spent
    }

    #[tokio::test]
    async fn what_was_spent_and_reserved_is_there_after_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.spent");
        {
            let (log, restored) = SpendLog::open(path.clone()).unwrap();
            assert!(restored.totals.is_empty());
            log.run("publisher-1").await.unwrap();
            let settled = log.reserve(&chain(&["a", "p"]), &bound(100)).await.unwrap();
            log.settle(Some(settled), &chain(&["a", "p"]), &metered(7));
            // In flight when the process dies.
            log.reserve(&chain(&["b", "p"]), &bound(300)).await.unwrap();
            log.settle(None, &chain(&["c"]), &metered(5));
            // The settles are written without waiting: let the writer get to them.
            log.run("publisher-1").await.unwrap();
        }
        let (_, restored) = SpendLog::open(path.clone()).unwrap();
        assert_eq!(restored.runs, vec!["publisher-1".to_owned()]);
        assert_eq!(restored.charged_at_bound, 1);
        assert_eq!(
            (total(&restored, "a").tokens, total(&restored, "a").calls),
            (7, 1)
        );
        let b = total(&restored, "b");
        assert_eq!((b.tokens, b.unmetered, b.cost_usd), (300, 1, 0.5));
        assert_eq!(total(&restored, "c").tokens, 5);
        // Compacted at the start: totals only, and the same again after another restart.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(!text.contains("reserve"), "{text}");
        let (_, again) = SpendLog::open(path).unwrap();
        assert_eq!(again.charged_at_bound, 0);
        assert_eq!(total(&again, "b").tokens, 300);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_skipped_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.spent");
        {
            let (log, _) = SpendLog::open(path.clone()).unwrap();
            log.reserve(&chain(&["a"]), &bound(10)).await.unwrap();
        }
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(br#"{"kind":"settle","id":0,"chain":["a"],"cha"#)
            .unwrap();
        let (_, restored) = SpendLog::open(path).unwrap();
        assert_eq!(restored.unreadable, 1);
        assert_eq!(restored.charged_at_bound, 1, "the settle never landed");
        assert_eq!(total(&restored, "a").tokens, 10);
    }

    #[tokio::test]
    async fn a_log_that_cannot_be_written_refuses_the_reservation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("journal.spent");
        let (log, _) = SpendLog::open(path.clone()).unwrap();
        // /dev/full takes no byte: every write fails with ENOSPC.
        drop(log);
        let (to_writer, from_callers) = mpsc::channel();
        let writer = Writer {
            file: OpenOptions::new().write(true).open("/dev/full").unwrap(),
            path: PathBuf::from("/dev/full"),
            good_len: 0,
            folded: Folded::default(),
            compacted: 0,
        };
        std::thread::spawn(move || writer.run(from_callers));
        let log = SpendLog {
            to_writer,
            next_id: AtomicU64::new(0),
        };
        let refused = log.reserve(&chain(&["a"]), &bound(10)).await.unwrap_err();
        assert!(refused.contains("/dev/full"), "{refused}");
    }
}
