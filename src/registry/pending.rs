//! Revocation records the journal does not hold yet: a durable queue beside the journal
//! (`<journal>.pending`, JSON Lines, one record per line, exactly the line the store will hold).
//!
//! Invariants: a record is on disk in the queue before its append is tried ([`Pending::stage`])
//! and stays there until a read of the store hands out its exact line or an append of it
//! succeeds; then it leaves the queue once. While its own append is under way a record is
//! claimed (the [`Staged`] guard lives) and the retry task leaves it alone; a claim that ends
//! without the append succeeding leaves the record queued where it stands. The queue keeps the
//! order records were staged or queued in; the file, once written, holds every record (each
//! change is fsynced, and a rewrite is a rename of a complete file), and it is removed when the
//! queue empties. The queue's own file is read at start and its closures applied before
//! anything is served, so a restart (even a `kill -9` while an append waits) never reopens a
//! lease whose record the store may lack. If the file cannot be written either, the record
//! waits in memory and the error is returned for the caller to log: it is still appended once
//! the store is back, but a restart before then would not know it.

use crate::durable;
use serde_json::Value;
use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

/// The queue's file for the journal at `journal`.
pub fn pending_path(journal: &Path) -> PathBuf {
    let mut name = journal.as_os_str().to_owned();
    name.push(".pending");
    PathBuf::from(name)
}

/// The queue. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Pending {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// `None`: kept in memory only (stores that are not a file, tests).
    path: Option<PathBuf>,
    /// Held across the file write that mirrors a change, so the file never lags behind in a
    /// different order, and so a read's lines and a failed append's record are matched in one
    /// order or the other, never lost between them.
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Serialized records, oldest first, as the file holds them.
    entries: VecDeque<Entry>,
}

#[derive(Debug)]
struct Entry {
    line: Vec<u8>,
    /// Live while the revocation that staged the record is appending it ([`Staged`]).
    claim: Weak<()>,
}

impl Entry {
    fn queued(line: Vec<u8>) -> Entry {
        Entry {
            line,
            claim: Weak::new(),
        }
    }

    /// Left to the retry task: no append of its own is under way.
    fn is_queued(&self) -> bool {
        self.claim.strong_count() == 0
    }
}

/// A record staged in the queue (on disk) whose append is under way. Dropped without
/// [`Staged::landed`] (the append failed, timed out, or its caller stopped waiting), the record
/// stays queued for the retry task.
#[derive(Debug)]
pub struct Staged {
    queue: Pending,
    claim: Arc<()>,
}

impl Staged {
    /// The store holds the record: it leaves the queue (unless a read took it out already).
    /// Blocking (a rewrite of the file).
    pub fn landed(self) -> io::Result<()> {
        let claim = Arc::downgrade(&self.claim);
        let mut found = false;
        self.queue
            .remove_where(|e| {
                let mine = !found && Weak::ptr_eq(&e.claim, &claim);
                found |= mine;
                mine
            })
            .map(drop)
    }
}

impl Pending {
    /// A queue that lives in memory only.
    pub fn in_memory() -> Pending {
        Pending::default()
    }

    /// The queue kept in `path`, with whatever it holds now (a missing file is an empty
    /// queue; a line that does not parse, a torn last write, is skipped with a warning).
    /// Blocking.
    pub fn open(path: PathBuf) -> io::Result<Pending> {
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e),
        };
        let (complete, rest) = super::journal::split_lines(&bytes);
        let mut entries = VecDeque::new();
        for line in complete.chain((!rest.is_empty()).then_some(rest)) {
            match serde_json::from_slice::<Value>(line) {
                Ok(_) => entries.push_back(Entry::queued(line.to_vec())),
                Err(error) => {
                    tracing::warn!(%error, file = %path.display(), "pending revocation line skipped")
                }
            }
        }
        Ok(Pending {
            inner: Arc::new(Inner {
                path: Some(path),
                state: Mutex::new(State { entries }),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stages `record`, whose append is about to be tried, behind the others: on disk before
    /// this returns, and claimed by the returned guard until its append ends. The error says
    /// the record is only in memory (the guard still holds it). Blocking (one append and fsync).
    pub fn stage(&self, record: &Value) -> (Staged, io::Result<()>) {
        let claim = Arc::new(());
        let staged = Staged {
            queue: self.clone(),
            claim: claim.clone(),
        };
        let written = serde_json::to_vec(record)
            .map_err(io::Error::from)
            .and_then(|line| {
                let entry = Entry {
                    line,
                    claim: Arc::downgrade(&claim),
                };
                Self::push_locked(&self.inner, &mut self.state(), entry)
            });
        (staged, written)
    }

    /// How many records are queued (not counting those whose own append is under way).
    pub fn len(&self) -> usize {
        self.state()
            .entries
            .iter()
            .filter(|e| e.is_queued())
            .count()
    }

    pub fn is_empty(&self) -> bool {
        !self.state().entries.iter().any(Entry::is_queued)
    }

    /// Nothing queued and no append under way: a read has nothing to match.
    pub fn is_idle(&self) -> bool {
        self.state().entries.is_empty()
    }

    /// Every queued record, oldest first.
    pub fn records(&self) -> Vec<Value> {
        self.state()
            .entries
            .iter()
            .filter(|e| e.is_queued())
            .filter_map(|e| serde_json::from_slice(&e.line).ok())
            .collect()
    }

    /// The oldest queued record.
    pub fn front(&self) -> Option<Value> {
        self.state()
            .entries
            .iter()
            .find(|e| e.is_queued())
            .and_then(|e| serde_json::from_slice(&e.line).ok())
    }

    /// Queues `record` behind the others. In memory first, whatever the file does; the error
    /// says the record is not durable. Blocking (one append and fsync).
    pub fn push(&self, record: &Value) -> io::Result<()> {
        let line = serde_json::to_vec(record)?;
        Self::push_locked(&self.inner, &mut self.state(), Entry::queued(line))
    }

    fn push_locked(inner: &Inner, state: &mut State, entry: Entry) -> io::Result<()> {
        let written = match &inner.path {
            Some(path) => durable::append_lines(path, [entry.line.as_slice()]),
            None => Ok(()),
        };
        state.entries.push_back(entry);
        written
    }

    /// Removes `record` (its first queued copy) once the store holds it. Returns whether it
    /// was queued. Blocking (a rewrite of the file).
    pub fn remove(&self, record: &Value) -> io::Result<bool> {
        let line = serde_json::to_vec(record)?;
        let mut found = false;
        self.remove_where(|e| {
            let first = !found && e.is_queued() && e.line == line;
            found |= first;
            first
        })
        .map(|n| n > 0)
    }

    /// Removes every record, queued or staged, whose exact line a read of the store handed out
    /// (a record whose append timed out, or was cut short by a restart, may still have landed).
    /// Returns how many. Blocking when any is removed.
    pub fn remove_seen(&self, seen: &[Vec<u8>]) -> io::Result<usize> {
        if self.is_idle() {
            return Ok(0);
        }
        let mut found: Vec<&[u8]> = seen.iter().map(Vec::as_slice).collect();
        self.remove_where(
            |e| match found.iter().position(|s| *s == e.line.as_slice()) {
                Some(i) => {
                    found.swap_remove(i);
                    true
                }
                None => false,
            },
        )
    }

    fn remove_where(&self, mut gone: impl FnMut(&Entry) -> bool) -> io::Result<usize> {
        let mut state = self.state();
        let before = state.entries.len();
        state.entries.retain(|e| !gone(e));
        let removed = before - state.entries.len();
        if removed > 0 {
            if let Some(path) = &self.inner.path {
                durable::rewrite(path, state.entries.iter().map(|e| e.line.as_slice()))?;
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn queued_records_survive_a_reopen_in_order_and_leave_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = pending_path(&dir.path().join("journal.jsonl"));
        assert!(path.ends_with("journal.jsonl.pending"));
        let queue = Pending::open(path.clone()).unwrap();
        assert!(queue.is_empty());
        let (a, b, c) = (json!({"n": 1}), json!({"n": 2}), json!({"n": 3}));
        for r in [&a, &b, &c] {
            queue.push(r).unwrap();
        }
        let reopened = Pending::open(path.clone()).unwrap();
        assert_eq!(reopened.records(), [a.clone(), b.clone(), c.clone()]);
        assert!(
            reopened
                .remove_seen(&[b"other".to_vec(), serde_json::to_vec(&b).unwrap()])
                .unwrap()
                == 1
        );
        assert_eq!(reopened.front(), Some(a.clone()));
        assert!(reopened.remove(&a).unwrap());
        assert!(!reopened.remove(&a).unwrap(), "once");
        assert_eq!(
            Pending::open(path.clone()).unwrap().records(),
            vec![c.clone()]
        );
        assert!(reopened.remove(&c).unwrap());
        assert!(!path.exists(), "an empty queue leaves no file");
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.pending");
        std::fs::write(&path, b"{\"n\":1}\n{\"n\":").unwrap();
        assert_eq!(Pending::open(path).unwrap().records(), [json!({"n": 1})]);
    }
}
