//! Compaction figures: a journal of about `RECORDS` lines (per lease a grant and three
//! heartbeats; half the leases expired three days ago and carry a closing record, the other
//! half stay open for a day) compacted with the default retention; then the fold of the old
//! and the new file, as a restart would do it.
//!
//! `cargo bench --bench compact` (set `RECORDS=N`; default 100,000). Not criterion: one long
//! measurement with its own setup.

mod common;

use common::{keyring, lease_id, signed_lease};
use leasegate::contract::{Key, Timestamp};
use leasegate::registry::compact::{compact_file, DEFAULT_RETENTION};
use leasegate::registry::journal;
use leasegate::registry::Ledger;
use serde_json::json;
use std::io::Write;
use std::time::Instant;

const LINES_PER_LEASE: u64 = 5;
const DAY: i64 = 86_400_000;

/// The lines of lease `n`.
fn lines(key: &Key, n: u64, now: Timestamp, out: &mut impl Write) {
    let closed = n % 2 == 0;
    let (from, to) = match closed {
        true => (now.as_millis() - 4 * DAY, now.as_millis() - 3 * DAY),
        false => (now.as_millis() - DAY / 24, now.as_millis() + DAY),
    };
    let (from, to) = (Timestamp::from_millis(from), Timestamp::from_millis(to));
    let lease = signed_lease(
        key,
        n,
        (&from.to_string(), &to.to_string()),
        &["origin.test"],
    );
    let id = lease_id(n);
    let at = from.to_string();
    let mut records = vec![
        json!({"schema_version": "1.2", "at": at, "event": "granted",
                                  "lease_id": id, "lease": lease}),
    ];
    for _ in 0..LINES_PER_LEASE - 2 {
        records
            .push(json!({"schema_version": "1.2", "at": at, "event": "heartbeat", "lease_id": id}));
    }
    if closed {
        records.push(
            json!({"schema_version": "1.2", "at": at, "event": "stopped",
                            "lease_id": id, "reason": "done"}),
        );
    }
    for record in records {
        serde_json::to_writer(&mut *out, &record).unwrap();
        out.write_all(b"\n").unwrap();
    }
}

fn fold_seconds(path: &std::path::Path, key: &Key) -> (f64, usize) {
    let started = Instant::now();
    let (ledger, _) = journal::load(path, Ledger::new(keyring(key))).unwrap();
    (started.elapsed().as_secs_f64(), ledger.leases().count())
}

fn main() {
    let records: u64 = std::env::var("RECORDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(100_000);
    let key = Key::generate();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    let now = Timestamp::now();
    {
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        for n in 0..records.div_ceil(LINES_PER_LEASE) {
            lines(&key, n, now, &mut out);
        }
    }
    let (old_fold, old_leases) = fold_seconds(&path, &key);
    let started = Instant::now();
    let done = compact_file(
        &path,
        keyring(&key),
        DEFAULT_RETENTION,
        now,
        leasegate::registry::journal::MAX_LINE,
    )
    .unwrap();
    let took = started.elapsed().as_secs_f64();
    let (new_fold, new_leases) = fold_seconds(&path, &key);
    let s = &done.selection;
    println!(
        "| records | compaction | lines kept | bytes | leases kept | fold before | fold after |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {took:.2} s | {} of {} | {} of {} | {new_leases} of {old_leases} | {old_fold:.2} s | {new_fold:.2} s |",
        s.lines, s.kept.len(), s.lines, done.swapped.length, done.swapped.covered,
    );
}
