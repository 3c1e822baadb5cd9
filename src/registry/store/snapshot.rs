//! A stream journal's compacted state: the lines a compaction kept, published to the stream
//! `<STREAM>_SNAPSHOT` with the journal sequence they cover. A replica that starts folds the
//! latest snapshot, then follows the journal from the sequence after it.
//!
//! Invariant: a snapshot is used whole or not at all, and only if a key of the keyring vouches
//! for it. Its lines (original bytes, in journal order) go to `leasegate.snapshot.lines.<covers>`
//! first; then one marker on `leasegate.snapshot.done` names the journal stream (its name and
//! creation time), the covered sequence, the snapshot stream's sequences of its first and last
//! line, their count and a SHA-256 over every line, with an HMAC-SHA256 over all of that under
//! a key of the keyring ([`Marker::mac_input`]). A replica takes the last marker's lines only if
//! the MAC verifies, the journal is the one (and the incarnation) the marker names and reaches
//! its sequence, and the lines read are exactly the ones the digest names; otherwise it folds
//! the journal from its first message, which it does only while the journal was never purged
//! ([`super::whole`]). Anyone who can publish to the snapshot stream can only make a replica
//! fold from the start, or refuse a purged journal: they cannot make it skip or drop a journal
//! line without the key. `journal compact --purge` removes journal messages only up to what a
//! snapshot it has just read back and verified covers.

use super::location::NatsLocation;
use crate::contract::{Key, Keyring};
use crate::nats::{NatsError, NatsOptions, NatsStream, StreamSpec, REQUEST_TIMEOUT};
use async_nats::jetstream::consumer;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io;

/// Snapshot subjects: `leasegate.snapshot.lines.<covers>` and `leasegate.snapshot.done`.
pub const SNAPSHOT_SUBJECTS: &str = "leasegate.snapshot";

const DONE: &str = "leasegate.snapshot.done";

/// The largest marker read (a real one is a few hundred bytes).
const MAX_MARKER: usize = 4096;

/// What a snapshot stream holds: kept forever (one line per kept lease record).
pub const SNAPSHOT: StreamSpec = StreamSpec {
    prefix: SNAPSHOT_SUBJECTS,
    max_age: None,
};

/// The marker that completes a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Marker {
    /// The journal stream's name.
    pub journal: String,
    /// The journal stream's creation time (Unix nanoseconds): a journal deleted and created
    /// again restarts its sequences, and a snapshot of the old one must not apply.
    pub journal_created: i128,
    /// The last journal sequence the snapshot covers: a replica follows from the next.
    pub covers: u64,
    /// The snapshot stream's sequences of the first and last line, and how many lines.
    pub first: u64,
    pub last: u64,
    pub lines: u64,
    /// Lower-case hex SHA-256 over every line, each followed by a newline, in order.
    pub digest: String,
    /// The key the MAC is under.
    pub key_fingerprint: String,
    /// Lower-case hex HMAC-SHA256 of [`Marker::mac_input`].
    pub mac: String,
}

/// Why a snapshot is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("its marker does not parse: {0}")]
    Unreadable(String),
    #[error("its marker is made under key {0}, which is not in the keyring")]
    UnknownKey(String),
    #[error("its marker's MAC does not verify under key {0}")]
    BadMac(String),
    #[error("it holds {read} lines, its marker says {said}")]
    Count { read: u64, said: u64 },
    #[error("its lines are not the ones its marker's digest names")]
    Digest,
}

/// A running digest of snapshot lines, as [`Marker::digest`] names them.
#[derive(Default)]
pub struct LinesDigest {
    hasher: Sha256,
    count: u64,
}

impl LinesDigest {
    pub fn push(&mut self, line: &[u8]) {
        self.hasher.update(line);
        self.hasher.update(b"\n");
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Lower-case hex.
    pub fn finish(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

impl Marker {
    /// A marker for `journal`'s snapshot, its MAC made under `key`.
    pub fn signed(
        journal: &str,
        journal_created: i128,
        covers: u64,
        (first, last): (u64, u64),
        digest: LinesDigest,
        key: &Key,
    ) -> Marker {
        let mut marker = Marker {
            journal: journal.to_owned(),
            journal_created,
            covers,
            first,
            last,
            lines: digest.count(),
            digest: digest.finish(),
            key_fingerprint: key.fingerprint().to_owned(),
            mac: String::new(),
        };
        marker.mac = key.sign(marker.mac_input().as_bytes());
        marker
    }

    /// What the MAC covers: every member but the MAC, each on its own line after a line that
    /// names what this is (so the MAC can never be taken for a lease or record signature, which
    /// are over canonical JSON). Spelled out rather than canonical JSON: `journal_created` is
    /// beyond what a JSON number keeps exactly.
    pub fn mac_input(&self) -> String {
        format!(
            "leasegate-snapshot-marker v1\njournal {}\njournal_created {}\ncovers {}\nfirst {}\nlast {}\nlines {}\ndigest {}\nkey_fingerprint {}\n",
            self.journal,
            self.journal_created,
            self.covers,
            self.first,
            self.last,
            self.lines,
            self.digest,
            self.key_fingerprint
        )
    }

    /// Parses a marker and checks its MAC under `keyring`. Untrusted bytes: anything on the
    /// snapshot stream's `done` subject.
    pub fn verified(bytes: &[u8], keyring: &Keyring) -> Result<Marker, SnapshotError> {
        if bytes.len() > MAX_MARKER {
            return Err(SnapshotError::Unreadable(format!(
                "{} bytes, more than {MAX_MARKER}",
                bytes.len()
            )));
        }
        let marker: Marker =
            serde_json::from_slice(bytes).map_err(|e| SnapshotError::Unreadable(e.to_string()))?;
        if marker.journal.contains('\n') || marker.key_fingerprint.contains('\n') {
            return Err(SnapshotError::Unreadable("a member holds a newline".into()));
        }
        let key = keyring
            .get(&marker.key_fingerprint)
            .ok_or_else(|| SnapshotError::UnknownKey(marker.key_fingerprint.clone()))?;
        if !key.verify(marker.mac_input().as_bytes(), &marker.mac) {
            return Err(SnapshotError::BadMac(marker.key_fingerprint.clone()));
        }
        Ok(marker)
    }

    /// Whether `digest` (of the lines read) is what this marker names.
    pub fn check_lines(&self, digest: LinesDigest) -> Result<(), SnapshotError> {
        if digest.count() != self.lines {
            return Err(SnapshotError::Count {
                read: digest.count(),
                said: self.lines,
            });
        }
        if digest.finish() != self.digest {
            return Err(SnapshotError::Digest);
        }
        Ok(())
    }
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

/// A snapshot as published.
#[derive(Debug, Clone)]
pub struct Written {
    pub marker: Marker,
    /// The snapshot stream, and the sequence its marker went to.
    pub stream: NatsStream,
    pub marker_sequence: u64,
}

impl Written {
    /// The snapshot stream's first sequence of this snapshot: everything before it belongs to
    /// older snapshots.
    pub fn first_sequence(&self) -> u64 {
        match self.marker.lines {
            0 => self.marker_sequence,
            _ => self.marker.first,
        }
    }
}

/// Publishes `lines` as the snapshot of `journal` up to sequence `covers`, one acknowledged
/// message at a time, then its marker, its MAC under `key`. Each message carries a
/// `Nats-Msg-Id`, so running the same compaction again within the duplicate window stores
/// nothing twice.
pub async fn publish<'a>(
    journal: &NatsStream,
    options: &NatsOptions,
    covers: u64,
    lines: impl Iterator<Item = &'a [u8]>,
    key: &Key,
) -> Result<Written, NatsError> {
    let location = location_of(&journal.location);
    let snapshot = NatsStream::connect(&location, options, &SNAPSHOT).await?;
    let failed = |e: io::Error| NatsError::Stream {
        location: location.to_string(),
        reason: e.to_string(),
    };
    let journal_created = created(journal).await.map_err(failed)?;
    let subject = lines_subject(covers);
    let (mut first, mut last) = (0, 0);
    let mut digest = LinesDigest::default();
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
        digest.push(line);
    }
    let marker = Marker::signed(
        &journal.location.stream,
        journal_created,
        covers,
        (first, last),
        digest,
        key,
    );
    let body = serde_json::to_vec(&marker).map_err(|e| failed(e.into()))?;
    let id = format!(
        "snapshot-{journal_created}-{covers}-done-{}",
        &marker.mac[..16]
    );
    let marker_sequence = snapshot
        .publish(DONE.to_owned(), &body, Some(&id))
        .await
        .map_err(failed)?;
    Ok(Written {
        marker,
        stream: snapshot,
        marker_sequence,
    })
}

/// The latest snapshot of `journal` that applies to it, with its lines; `None` when there is
/// none (no snapshot stream, no marker, a snapshot of another journal or incarnation, or one
/// covering more than the journal holds). An error: there is a marker but it cannot be used
/// (unreadable, not vouched for by a key of `keyring`, lines missing or not the ones it names).
pub async fn latest(
    journal: &NatsStream,
    head: u64,
    keyring: &Keyring,
) -> io::Result<Option<(Marker, Vec<Vec<u8>>)>> {
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
    let marker = Marker::verified(&done.payload, keyring).map_err(io::Error::other)?;
    if marker.journal != journal.location.stream
        || marker.covers > head
        || marker.journal_created != created(journal).await?
    {
        return Ok(None);
    }
    let mut digest = LinesDigest::default();
    let mut lines = Vec::with_capacity(marker.lines.min(1 << 20) as usize);
    if marker.lines > 0 {
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
            digest.push(&message.payload);
            lines.push(message.payload.to_vec());
            if sequence == marker.last || digest.count() > marker.lines {
                break;
            }
        }
    }
    marker.check_lines(digest).map_err(io::Error::other)?;
    Ok(Some((marker, lines)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(lines: &[&[u8]]) -> LinesDigest {
        let mut digest = LinesDigest::default();
        for line in lines {
            digest.push(line);
        }
        digest
    }

    fn keyring(key: &Key) -> Keyring {
        let mut keyring = Keyring::new(false);
        keyring.insert(key.clone());
        keyring
    }

    #[test]
    fn a_marker_verifies_under_its_key_and_names_its_lines() {
        let key = Key::generate();
        let lines: [&[u8]; 2] = [b"{\"a\":1}", b"{\"b\":2}"];
        let marker = Marker::signed("LEASES", 1 << 62, 42, (3, 4), digest_of(&lines), &key);
        let bytes = serde_json::to_vec(&marker).unwrap();
        let read = Marker::verified(&bytes, &keyring(&key)).unwrap();
        assert_eq!(read, marker);
        assert_eq!(read.check_lines(digest_of(&lines)), Ok(()));
        // A line dropped, added, changed or moved.
        assert_eq!(
            read.check_lines(digest_of(&lines[..1])),
            Err(SnapshotError::Count { read: 1, said: 2 })
        );
        assert!(read
            .check_lines(digest_of(&[lines[0], lines[1], b"{}"]))
            .is_err());
        assert_eq!(
            read.check_lines(digest_of(&[lines[0], b"{\"b\":3}"])),
            Err(SnapshotError::Digest)
        );
        assert_eq!(
            read.check_lines(digest_of(&[lines[1], lines[0]])),
            Err(SnapshotError::Digest)
        );
    }

    #[test]
    fn forged_and_altered_markers_are_refused() {
        let key = Key::generate();
        let marker = Marker::signed("LEASES", 7, 42, (3, 4), digest_of(&[b"x"]), &key);
        let ring = keyring(&key);
        // Under another key.
        let other = Marker::signed(
            "LEASES",
            7,
            42,
            (3, 4),
            digest_of(&[b"x"]),
            &Key::generate(),
        );
        assert!(matches!(
            Marker::verified(&serde_json::to_vec(&other).unwrap(), &ring),
            Err(SnapshotError::UnknownKey(_))
        ));
        // Any member changed after the MAC was made.
        let mut value = serde_json::to_value(&marker).unwrap();
        for (member, changed) in [
            ("covers", serde_json::json!(43)),
            ("journal", serde_json::json!("OTHER")),
            ("journal_created", serde_json::json!(8)),
            ("lines", serde_json::json!(0)),
            ("digest", serde_json::json!(digest_of(&[]).finish())),
        ] {
            let saved = value[member].clone();
            value[member] = changed;
            assert!(
                matches!(
                    Marker::verified(&serde_json::to_vec(&value).unwrap(), &ring),
                    Err(SnapshotError::BadMac(_))
                ),
                "{member}"
            );
            value[member] = saved;
        }
        // The old, unauthenticated marker shape, and junk.
        let old = br#"{"covers":42,"journal_created":7,"first":3,"last":4,"lines":1}"#;
        assert!(matches!(
            Marker::verified(old, &ring),
            Err(SnapshotError::Unreadable(_))
        ));
        assert!(Marker::verified(b"\xff", &ring).is_err());
        assert!(Marker::verified(&vec![b' '; MAX_MARKER + 1], &ring).is_err());
    }
}
