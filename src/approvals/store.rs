//! Where approval lines live, for every replica of one journal: a file beside a file journal
//! (`<journal>.approvals`), or the stream `<STREAM>_APPROVALS` beside a journal stream, on the
//! same NATS servers.
//!
//! Invariant: an append returns only once the line is durable (the file: written in one
//! `write` under the journal's append lock and fsynced; the stream: acknowledged by JetStream);
//! a reader hands out every complete line once, in the store's order, which is the same order
//! for every replica; a partial last line of the file waits for its end.

use crate::nats::{NatsError, NatsOptions, NatsStream, StreamSpec};
use crate::registry::store::NatsLocation;
use futures_util::StreamExt;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;
use tokio::sync::mpsc;

/// Subjects of an approvals stream: `leasegate.approvals.<kind>`.
pub const APPROVALS_SUBJECTS: &str = "leasegate.approvals";

/// An approvals stream keeps a week of lines: a held call waits an hour at most, and a
/// standing approval ("for the rest of the lease") lasts as long as its line is kept.
pub const APPROVALS: StreamSpec = StreamSpec {
    prefix: APPROVALS_SUBJECTS,
    max_age: Some(Duration::from_secs(7 * 24 * 3600)),
};

/// How often the file is read for new lines.
const FILE_POLL: Duration = Duration::from_millis(50);
/// Waits between attempts while NATS is away: doubling from the first to the last.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_LAST: Duration = Duration::from_secs(2);

/// The approvals stream of a journal stream: `<STREAM>_APPROVALS` on the same servers.
pub fn location_of(journal: &NatsLocation) -> NatsLocation {
    NatsLocation {
        stream: format!("{}_APPROVALS", journal.stream),
        ..journal.clone()
    }
}

/// One store's handle.
#[derive(Debug, Clone)]
pub enum ApprovalStore {
    File(PathBuf),
    Nats(Box<NatsStream>),
}

impl ApprovalStore {
    /// The approvals stream beside `journal`, made if missing; tried for `--store-start-timeout`
    /// as the journal's own stream is.
    pub async fn nats(
        journal: &NatsLocation,
        options: &NatsOptions,
    ) -> Result<ApprovalStore, NatsError> {
        // Retried like the journal's own stream: a cluster that has just regained its
        // quorum (or is starting) times requests out until it elects the stream's leader.
        let location = location_of(journal);
        let stream = crate::nats::connect::patiently(&location, options, || {
            NatsStream::connect(&location, options, &APPROVALS)
        })
        .await?;
        Ok(ApprovalStore::Nats(Box::new(stream)))
    }

    /// For logs.
    pub fn describe(&self) -> String {
        match self {
            ApprovalStore::File(path) => format!("approvals file {}", path.display()),
            ApprovalStore::Nats(stream) => format!("approvals stream {}", stream.location),
        }
    }

    /// Appends `line` (no newline), durably.
    pub async fn append(&self, line: Vec<u8>) -> io::Result<()> {
        match self {
            ApprovalStore::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || {
                    let value: serde_json::Value = serde_json::from_slice(&line)?;
                    crate::registry::store::file::append(&path, &value, true).map(|_| ())
                })
                .await
                .map_err(io::Error::other)?
            }
            ApprovalStore::Nats(stream) => {
                let subject = format!("{APPROVALS_SUBJECTS}.line");
                stream.publish(subject, &line, None).await.map(|_| ())
            }
        }
    }

    /// Every line the store holds now, in order, and where a follower resumes after them.
    pub async fn read_all(&self) -> io::Result<(Vec<Vec<u8>>, u64)> {
        match self {
            ApprovalStore::File(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || read_file_from(&path, 0))
                    .await
                    .map_err(io::Error::other)?
            }
            ApprovalStore::Nats(stream) => {
                let all = stream.read_all().await?;
                let next = all.last().map_or(1, |(sequence, _)| sequence + 1);
                Ok((all.into_iter().map(|(_, l)| l.to_vec()).collect(), next))
            }
        }
    }

    /// Hands every line after `from` (what [`ApprovalStore::read_all`] returned) to `tx`, as
    /// they are stored, until `tx` is closed. NATS going away never ends it: it reconnects and
    /// resumes after the last line it handed out.
    pub async fn follow(self, from: u64, tx: mpsc::Sender<Vec<u8>>) {
        match self {
            ApprovalStore::File(path) => follow_file(path, from, tx).await,
            ApprovalStore::Nats(stream) => follow_stream(*stream, from, tx).await,
        }
    }
}

/// The complete lines of the file from byte `offset`, and the offset after the last one (a
/// file shorter than `offset`, one replaced or truncated, is read from its start). A missing
/// file holds nothing.
fn read_file_from(path: &std::path::Path, offset: u64) -> io::Result<(Vec<Vec<u8>>, u64)> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    let offset = if len < offset { 0 } else { offset };
    let mut bytes = vec![0; (len - offset) as usize];
    file.read_exact_at(&mut bytes, offset)?;
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let lines = bytes[..complete]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    Ok((lines, offset + complete as u64))
}

async fn follow_file(path: PathBuf, mut offset: u64, tx: mpsc::Sender<Vec<u8>>) {
    let mut tick = tokio::time::interval(FILE_POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tx.closed() => return,
        }
        let at = path.clone();
        let read = tokio::task::spawn_blocking(move || read_file_from(&at, offset)).await;
        match read {
            Ok(Ok((lines, next))) => {
                offset = next;
                for line in lines {
                    if tx.send(line).await.is_err() {
                        return;
                    }
                }
            }
            Ok(Err(error)) => {
                tracing::warn!(path = %path.display(), %error, "the approvals file could not be read; trying again")
            }
            Err(_) => return,
        }
    }
}

async fn follow_stream(stream: NatsStream, mut next: u64, tx: mpsc::Sender<Vec<u8>>) {
    let mut wait = RETRY_FIRST;
    loop {
        match stream.ordered_from(next).await {
            Ok(mut messages) => loop {
                let message = tokio::select! {
                    m = messages.next() => m,
                    _ = tx.closed() => return,
                };
                match message {
                    Some(Ok(message)) => {
                        wait = RETRY_FIRST;
                        if let Ok(info) = message.info() {
                            next = info.stream_sequence + 1;
                        }
                        if tx.send(message.payload.to_vec()).await.is_err() {
                            return;
                        }
                    }
                    Some(Err(error)) => {
                        tracing::warn!(stream = %stream.location, %error, "following the approvals stream failed; resuming");
                        break;
                    }
                    None => break,
                }
            },
            Err(error) => {
                tracing::warn!(stream = %stream.location, %error, "the approvals stream cannot be followed now; trying again");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = tx.closed() => return,
        }
        wait = (wait * 2).min(RETRY_LAST);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_in_whole_lines_and_from_its_start_once_shorter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j.approvals");
        assert_eq!(read_file_from(&path, 0).unwrap(), (vec![], 0));
        std::fs::write(&path, b"{\"a\":1}\n{\"b\":").unwrap();
        let (lines, next) = read_file_from(&path, 0).unwrap();
        assert_eq!((lines, next), (vec![b"{\"a\":1}".to_vec()], 8));
        std::fs::write(&path, b"{\"a\":1}\n{\"b\":2}\n").unwrap();
        assert_eq!(
            read_file_from(&path, 8).unwrap(),
            (vec![b"{\"b\":2}".to_vec()], 16)
        );
        std::fs::write(&path, b"{\"c\":3}\n").unwrap();
        assert_eq!(
            read_file_from(&path, 16).unwrap(),
            (vec![b"{\"c\":3}".to_vec()], 8)
        );
    }
}
