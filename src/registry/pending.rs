//! Revocation records the journal has not taken yet: a durable queue beside the journal
//! (`<journal>.pending`, JSON Lines, one record per line, exactly the line the store will hold).
//!
//! Invariants: a record is queued from the moment its append failed or timed out until a read
//! of the store hands out its exact line or an append of it succeeds, and then it leaves the
//! queue once; the queue keeps the order records were queued in; the file, once written, holds
//! every queued record (each change is fsynced, and a rewrite is a rename of a complete file),
//! and it is removed when the queue empties. The queue's own file is read at start and its
//! closures applied before anything is served, so a restart never reopens a lease whose record
//! was still waiting. If the file cannot be written either, the record waits in memory and the
//! error is returned for the caller to log: it is still appended once the store is back, but a
//! restart before then would not know it.

use crate::durable;
use serde_json::Value;
use std::collections::VecDeque;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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
    /// Serialized records, oldest first.
    queued: VecDeque<Vec<u8>>,
    /// Records whose append is under way: if a read hands one out before its append is given
    /// up on, it landed and must not be queued.
    in_flight: Vec<Vec<u8>>,
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
        let mut lines = VecDeque::new();
        for line in complete.chain((!rest.is_empty()).then_some(rest)) {
            match serde_json::from_slice::<Value>(line) {
                Ok(_) => lines.push_back(line.to_vec()),
                Err(error) => {
                    tracing::warn!(%error, file = %path.display(), "pending revocation line skipped")
                }
            }
        }
        Ok(Pending {
            inner: Arc::new(Inner {
                path: Some(path),
                state: Mutex::new(State {
                    queued: lines,
                    in_flight: Vec::new(),
                }),
            }),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes that `record`'s append is starting (memory only).
    pub fn begin(&self, record: &Value) {
        if let Ok(line) = serde_json::to_vec(record) {
            self.state().in_flight.push(line);
        }
    }

    /// Notes that `record`'s append succeeded.
    pub fn end(&self, record: &Value) {
        if let Ok(line) = serde_json::to_vec(record) {
            let mut state = self.state();
            if let Some(i) = state.in_flight.iter().position(|l| *l == line) {
                state.in_flight.swap_remove(i);
            }
        }
    }

    /// Queues `record`, whose append failed or was given up on, unless a read has handed it
    /// out meanwhile (it landed). Returns whether it was queued. Blocking, like [`Pending::push`].
    pub fn give_up(&self, record: &Value) -> io::Result<bool> {
        let line = serde_json::to_vec(record)?;
        let mut state = self.state();
        let Some(i) = state.in_flight.iter().position(|l| *l == line) else {
            return Ok(false);
        };
        state.in_flight.swap_remove(i);
        Self::push_locked(&self.inner, &mut state, line).map(|()| true)
    }

    pub fn len(&self) -> usize {
        self.state().queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state().queued.is_empty()
    }

    /// Nothing queued and no append under way: a read has nothing to match.
    pub fn is_idle(&self) -> bool {
        let state = self.state();
        state.queued.is_empty() && state.in_flight.is_empty()
    }

    /// Every queued record, oldest first.
    pub fn records(&self) -> Vec<Value> {
        self.state()
            .queued
            .iter()
            .filter_map(|l| serde_json::from_slice(l).ok())
            .collect()
    }

    /// The oldest queued record.
    pub fn front(&self) -> Option<Value> {
        self.state()
            .queued
            .front()
            .and_then(|l| serde_json::from_slice(l).ok())
    }

    /// Queues `record` behind the others. In memory first, whatever the file does; the error
    /// says the record is not durable. Blocking (one append and fsync).
    pub fn push(&self, record: &Value) -> io::Result<()> {
        let line = serde_json::to_vec(record)?;
        Self::push_locked(&self.inner, &mut self.state(), line)
    }

    fn push_locked(inner: &Inner, state: &mut State, line: Vec<u8>) -> io::Result<()> {
        state.queued.push_back(line.clone());
        match &inner.path {
            Some(path) => durable::append_lines(path, [line.as_slice()]),
            None => Ok(()),
        }
    }

    /// Removes `record` (its first copy) once the store holds it. Returns whether it was
    /// queued. Blocking (a rewrite of the file).
    pub fn remove(&self, record: &Value) -> io::Result<bool> {
        let line = serde_json::to_vec(record)?;
        let mut found = false;
        self.remove_where(|l| {
            let first = !found && *l == line;
            found |= first;
            first
        })
        .map(|n| n > 0)
    }

    /// Removes every queued record whose exact line a read of the store handed out (a record
    /// whose append timed out may still have landed). Returns how many. Blocking when any is
    /// removed.
    pub fn remove_seen(&self, seen: &[Vec<u8>]) -> io::Result<usize> {
        {
            let mut state = self.state();
            if !state.in_flight.is_empty() {
                state.in_flight.retain(|l| !seen.contains(l));
            }
            if state.queued.is_empty() {
                return Ok(0);
            }
        }
        let mut found: Vec<&[u8]> = seen.iter().map(Vec::as_slice).collect();
        self.remove_where(|l| match found.iter().position(|s| *s == l.as_slice()) {
            Some(i) => {
                found.swap_remove(i);
                true
            }
            None => false,
        })
    }

    fn remove_where(&self, mut gone: impl FnMut(&Vec<u8>) -> bool) -> io::Result<usize> {
        let mut state = self.state();
        let before = state.queued.len();
        state.queued.retain(|l| !gone(l));
        let removed = before - state.queued.len();
        if removed > 0 {
            if let Some(path) = &self.inner.path {
                durable::rewrite(path, state.queued.iter().map(Vec::as_slice))?;
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
