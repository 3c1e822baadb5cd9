//! A stream journal's compacted state: the lines a compaction kept, published to the stream
//! `<STREAM>_SNAPSHOT` with the journal sequence they cover. A replica that starts folds the
//! latest snapshot, then follows the journal from the sequence after it.
//!
//! Invariant: a snapshot is used whole or not at all. Its lines (original bytes, in journal
//! order) go to `leasegate.snapshot.lines.<covers>` first; then one marker on
//! `leasegate.snapshot.done` names the covered sequence, the journal stream's creation time, and
//! the snapshot stream's sequences of its first and last line and their count. A replica takes
//! the last marker's lines only if they are all there and the journal is the incarnation the
//! marker names and reaches its sequence; otherwise it folds the journal from its first message
//! (the journal is never purged here, so that is always complete).

use super::location::NatsLocation;
use super::nats::{NatsError, NatsOptions, NatsStream, StreamSpec, REQUEST_TIMEOUT};
use async_nats::jetstream::consumer;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::io;

/// Snapshot subjects: `leasegate.snapshot.lines.<covers>` and `leasegate.snapshot.done`.
pub const SNAPSHOT_SUBJECTS: &str = "leasegate.snapshot";

const DONE: &str = "leasegate.snapshot.done";

/// What a snapshot stream holds: kept forever (one line per kept lease record).
pub const SNAPSHOT: StreamSpec = StreamSpec {
    prefix: SNAPSHOT_SUBJECTS,
    max_age: None,
};

/// The marker that completes a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    /// The last journal sequence the snapshot covers: a replica follows from the next.
    pub covers: u64,
    /// The journal stream's creation time (Unix nanoseconds): a journal deleted and created
    /// again restarts its sequences, and a snapshot of the old one must not apply.
    pub journal_created: i128,
    /// The snapshot stream's sequences of the first and last line, and how many lines.
    pub first: u64,
    pub last: u64,
    pub lines: u64,
}

/// The snapshot stream of a journal stream: `<STREAM>_SNAPSHOT` on the same servers.
pub fn location_of(journal: &NatsLocation) -> NatsLocation {
    NatsLocation {
        stream: format!("{}_SNAPSHOT", journal.stream),
        ..journal.clone()
    }
}

fn lines_subject(covers: u64) -> String {
    format!("{SNAPSHOT_SUBJECTS}.lines.{covers}")
}

/// The journal stream's creation time, as a marker names it.
pub async fn created(journal: &NatsStream) -> io::Result<i128> {
    let info = tokio::time::timeout(REQUEST_TIMEOUT, journal.stream.get_info())
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "stream info timed out"))?
        .map_err(io::Error::other)?;
    Ok(info.created.unix_timestamp_nanos())
}

/// Publishes `lines` as the snapshot of `journal` up to sequence `covers`, one acknowledged
/// message at a time, then its marker. Each message carries a `Nats-Msg-Id`, so running the
/// same compaction again within the duplicate window stores nothing twice.
pub async fn publish<'a>(
    journal: &NatsStream,
    options: &NatsOptions,
    covers: u64,
    lines: impl Iterator<Item = &'a [u8]>,
) -> Result<Marker, NatsError> {
    let location = location_of(&journal.location);
    let snapshot = NatsStream::connect(&location, options, &SNAPSHOT).await?;
    let failed = |e: io::Error| NatsError::Stream {
        location: location.to_string(),
        reason: e.to_string(),
    };
    let journal_created = created(journal).await.map_err(failed)?;
    let subject = lines_subject(covers);
    let (mut first, mut last, mut count) = (0, 0, 0);
    for (i, line) in lines.enumerate() {
        let id = format!("snapshot-{journal_created}-{covers}-{i}");
        let sequence = snapshot
            .publish(subject.clone(), line, Some(&id))
            .await
            .map_err(failed)?;
        if first == 0 {
            first = sequence;
        }
        last = sequence;
        count += 1;
    }
    let marker = Marker {
        covers,
        journal_created,
        first,
        last,
        lines: count,
    };
    let body = serde_json::to_vec(&marker).map_err(|e| failed(e.into()))?;
    let id = format!("snapshot-{journal_created}-{covers}-done");
    snapshot
        .publish(DONE.to_owned(), &body, Some(&id))
        .await
        .map_err(failed)?;
    Ok(marker)
}

/// The latest complete snapshot of `journal` that applies to it, with its lines; `None` when
/// there is none (no snapshot stream, no marker, another incarnation of the journal).
pub async fn latest(journal: &NatsStream, head: u64) -> io::Result<Option<(Marker, Vec<Vec<u8>>)>> {
    let name = location_of(&journal.location).stream;
    let Ok(stream) = journal.jetstream.get_stream(&name).await else {
        return Ok(None);
    };
    let done = match stream.get_last_raw_message_by_subject(DONE).await {
        Ok(done) => done,
        Err(e)
            if e.kind()
                == async_nats::jetstream::stream::LastRawMessageErrorKind::NoMessageFound =>
        {
            return Ok(None)
        }
        Err(e) => return Err(io::Error::other(e)),
    };
    let marker: Marker = serde_json::from_slice(&done.payload)?;
    if marker.covers > head || marker.journal_created != created(journal).await? {
        return Ok(None);
    }
    if marker.lines == 0 {
        return Ok(Some((marker, Vec::new())));
    }
    let consumer = stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: journal.client.new_inbox(),
            filter_subject: lines_subject(marker.covers),
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: marker.first,
            },
            ..Default::default()
        })
        .await
        .map_err(io::Error::other)?;
    let mut messages = consumer.messages().await.map_err(io::Error::other)?;
    let mut lines = Vec::with_capacity(marker.lines as usize);
    loop {
        let message = tokio::time::timeout(REQUEST_TIMEOUT * 5, messages.next())
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "snapshot lines stopped"))?
            .ok_or_else(|| io::Error::other("snapshot consumer ended"))?
            .map_err(io::Error::other)?;
        let sequence = message.info().map_err(io::Error::other)?.stream_sequence;
        if sequence > marker.last {
            break;
        }
        lines.push(message.payload.to_vec());
        if sequence == marker.last {
            break;
        }
    }
    if lines.len() as u64 != marker.lines {
        return Err(io::Error::other(format!(
            "snapshot at {} has {} of its {} lines",
            marker.covers,
            lines.len(),
            marker.lines
        )));
    }
    Ok(Some((marker, lines)))
}
