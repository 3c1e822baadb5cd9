//! Where a reader of a journal stream starts so that it reads the whole journal, once
//! `journal compact --purge` may have removed the stream's first messages.
//!
//! Invariant: a reader folds either the stream from its first message, which it does only
//! while the stream was never purged (its first sequence is 1, or it is empty and never held
//! anything), or the lines of a snapshot whose marker verifies under the keyring and whose
//! lines are the ones its digest names, followed by the stream from the sequence after the one
//! the snapshot covers, which the stream must still hold. Anything else is an error that names
//! what is missing: a partial journal is never folded.

use super::snapshot::{self, Marker};
use crate::contract::Keyring;
use crate::nats::{NatsStream, Span};
use std::io;

/// Whether a reader of a stream that was never purged starts from its snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefer {
    /// A replica: from the latest snapshot that applies (a faster start, the same fold).
    Snapshot,
    /// The commands that read (`leases`, `journal export`, the bridges): every message while
    /// the stream holds them all, the snapshot only once the stream is purged.
    Stream,
}

/// Where to read from.
#[derive(Debug)]
pub struct Start {
    /// The snapshot to fold first, and its lines.
    pub snapshot: Option<(Marker, Vec<Vec<u8>>)>,
    /// The first stream sequence to read after it.
    pub next: u64,
    /// The stream's sequences when it was asked.
    pub span: Span,
}

impl Start {
    /// The snapshot's lines (none without one).
    pub fn snapshot_lines(&self) -> &[Vec<u8>] {
        self.snapshot.as_ref().map_or(&[], |(_, lines)| lines)
    }
}

/// Why a stream cannot be read whole.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the stream's state: {0}")]
    Io(#[from] io::Error),
    #[error("the stream {stream} is purged below sequence {first}: its snapshot is needed, and it is vouched for by a key; give --key-file")]
    NeedKey { stream: String, first: u64 },
    #[error("the stream {stream} is purged below sequence {first} and no snapshot covers the purged messages ({why}): refusing to read a partial journal")]
    Uncovered {
        stream: String,
        first: u64,
        why: String,
    },
}

/// Where a reader of `journal` starts (see the module invariant). `keyring`: the keys a
/// snapshot's marker may be vouched for by (`None`: no snapshot can be used).
pub async fn start(
    journal: &NatsStream,
    keyring: Option<&Keyring>,
    prefer: Prefer,
) -> Result<Start, StartError> {
    let span = journal.span().await?;
    let from_first = Start {
        snapshot: None,
        next: 1,
        span,
    };
    if !span.is_purged() && prefer == Prefer::Stream {
        return Ok(from_first);
    }
    let uncovered = |why: String| StartError::Uncovered {
        stream: journal.location.stream.clone(),
        first: span.first,
        why,
    };
    let Some(keyring) = keyring else {
        return match span.is_purged() {
            true => Err(StartError::NeedKey {
                stream: journal.location.stream.clone(),
                first: span.first,
            }),
            false => Ok(from_first),
        };
    };
    let found = snapshot::latest(journal, span.last, keyring).await;
    match found {
        Ok(Some((marker, lines))) if marker.covers + 1 >= span.first => Ok(Start {
            next: marker.covers + 1,
            snapshot: Some((marker, lines)),
            span,
        }),
        Ok(Some((marker, _))) => Err(uncovered(format!(
            "the latest snapshot covers up to sequence {}",
            marker.covers
        ))),
        Ok(None) if span.is_purged() => Err(uncovered(
            "no snapshot of this stream, or none of this incarnation of it".into(),
        )),
        Err(error) if span.is_purged() => {
            Err(uncovered(format!("its snapshot cannot be used: {error}")))
        }
        Ok(None) => Ok(from_first),
        Err(error) => {
            tracing::warn!(store = %journal.location, %error, "the journal's snapshot cannot be read: folding the journal from its start");
            Ok(from_first)
        }
    }
}
