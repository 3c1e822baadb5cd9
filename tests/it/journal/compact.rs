//! `journal compact`: the compacted journal folds the same for every lease within the
//! retention, nothing is deleted, and a running proxy follows the swap without folding again.

use crate::admin::operate::sample;
use crate::cluster::scale_out::{admin_revoke, replica};
use crate::live::follow::{issue_cli, revoke_cli};
use crate::support::harness::answer_through;
use crate::support::harness::{admin_get, admin_text, eventually, http_origin, Harness};
use crate::support::leasegate_ok;
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use crate::support::{event_line, granted_line, id, key, lease, signed_line};
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::registry::compact::{select, DEFAULT_RETENTION};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::Ledger;
use leasegate::server::Server;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Duration;

const HOUR: i64 = 3600 * 1000;

/// Noon, the instant the compaction runs at.
fn noon() -> Timestamp {
    Timestamp::parse("2026-12-01T12:00:00.000Z").unwrap()
}

/// `hours` from noon, in the contract's form.
fn at(hours: i64) -> String {
    noon().saturating_add_millis(hours * HOUR).to_string()
}

fn ring(key: &Key) -> Keyring {
    let mut ring = Keyring::new(false);
    ring.insert(key.clone());
    ring
}

fn fold(ring: Keyring, lines: &[&str]) -> Ledger {
    let mut ledger = Ledger::new(ring);
    fold_bytes(&mut ledger, (lines.join("\n") + "\n").as_bytes());
    ledger
}

/// A journal with every kind of lease and line a compaction meets, around noon.
fn journal(k: &Key) -> (Vec<String>, BTreeSet<String>) {
    let grant = |n: u32, parent: Option<u32>, from: i64, to: i64| {
        let parent = parent.map(id);
        let lease = lease(
            k,
            &id(n),
            parent.as_deref(),
            (&at(from), &at(to)),
            &["a.test"],
            &[],
        );
        granted_line(&lease, &at(from))
    };
    let closing = |event: &str, n: u32, hours: i64| {
        event_line(
            event,
            &id(n),
            &at(hours),
            json!({"by": "issuer", "reason": "test"}),
        )
    };
    let stranger = lease(&key(99), &id(50), None, (&at(-1), &at(1)), &["a.test"], &[]);
    let lines = vec![
        grant(1, None, -1, 1),     // open
        grant(2, None, 1, 2),      // not yet valid
        grant(3, None, -120, -72), // expired three days ago: dropped
        grant(4, None, -30, -2),   // expired two hours ago
        grant(5, None, -120, -96), // revoked and expired long ago: dropped
        closing("revoked", 5, -100),
        grant(6, None, -2, 5), // revoked an hour ago
        closing("revoked", 6, -1),
        grant(7, None, -120, 120), // revoked long ago, its grant still valid
        closing("stopped", 7, -100),
        grant(8, None, -120, -72), // expired long ago, parent of an open lease
        grant(9, Some(8), -1, 1),  // open, ancestor closed
        grant(10, None, -120, -72), // a chain expired long ago whose leaf closed
        grant(11, Some(10), -120, -72), //   an hour ago: all three kept
        grant(12, Some(11), -120, -72),
        closing("completed", 12, -1),
        signed_line(&closing("revoked", 13, -3), k), // signed, before its grant: held
        grant(13, None, -2, 2),
        closing("revoked", 14, -5), // a closing whose grant never came
        grant(1, None, -1, 1),      // duplicate grant
        event_line("heartbeat", &id(1), &at(0), json!({})),
        "not json".to_owned(),
        granted_line(&stranger, &at(-1)), // a key we do not know
        grant(15, None, -120, -72),       // expired long ago, closed twice, last
        closing("revoked", 15, -100),     //   within the retention
        closing("stopped", 15, -3),
        grant(16, None, -3, 3), // open, a forged signed revocation
        {
            let mut forged: serde_json::Value =
                serde_json::from_str(&signed_line(&closing("revoked", 16, -1), k)).unwrap();
            forged["reason"] = "changed after signing".into();
            forged.to_string()
        },
    ];
    let dropped = [3, 5].map(id).into_iter().collect();
    (lines, dropped)
}

#[test]
fn a_compacted_journal_folds_the_same_for_every_kept_lease() {
    let k = key(7);
    let (lines, dropped) = journal(&k);
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let selection = select(
        refs.iter().map(|l| l.as_bytes()),
        ring(&k),
        noon(),
        DEFAULT_RETENTION,
        leasegate::registry::journal::MAX_LINE,
    );
    let kept: Vec<&str> = selection.kept.iter().map(|&i| refs[i]).collect();
    assert_eq!(selection.duplicate_grants, 1);
    assert_eq!(selection.notes_dropped, 1);
    assert_eq!(
        selection.invalid.iter().sum::<usize>(),
        3,
        "parse, lease, signature"
    );
    assert_eq!(selection.orphan_closings, 1);
    assert!(
        kept.contains(&refs[18]),
        "the closing without a grant is kept"
    );
    assert_eq!(selection.leases_dropped, 2);

    for required in [false, true] {
        let ring = ring(&k).requiring_record_signatures(required);
        let whole = fold(ring.clone(), &refs);
        let compacted = fold(ring, &kept);
        let mut gone = BTreeSet::new();
        for lease in whole.leases() {
            let id = &lease.id;
            if compacted.lease(id).is_none() {
                gone.insert(id.clone());
                continue;
            }
            for now in [noon(), noon().saturating_add_millis(HOUR + 1)] {
                assert_eq!(compacted.status(id, now), whole.status(id, now), "{id}");
                let chain = |l: &Ledger| {
                    l.check_chain(id, now)
                        .map(|c| c.iter().map(|l| l.id.clone()).collect::<Vec<_>>())
                };
                assert_eq!(chain(&compacted), chain(&whole), "{id}");
            }
        }
        assert_eq!(
            gone, dropped,
            "exactly the leases past the retention are dropped"
        );
        assert_eq!(
            compacted.leases().count() + gone.len(),
            whole.leases().count()
        );
    }
    // A grant of a closed lease appended again stays closed: the closing record was kept.
    let mut again = kept.clone();
    again.push(refs[8]);
    let folded = fold(ring(&k), &again);
    assert_eq!(
        folded.status(&id(7), noon()),
        fold(ring(&k), &refs).status(&id(7), noon())
    );
}

/// Issues a lease that expired three days ago and one open for an hour.
fn expired_and_open(h: &Harness) -> (String, String) {
    let three_days_ago = Timestamp::now().saturating_add_millis(-72 * HOUR);
    let hour = Duration::from_secs(3600);
    let old = h.lease_with(&["origin.test"], &[], None, three_days_ago, hour);
    (old, h.lease(&["origin.test"], &[]))
}

/// `journal compact` of the harness's journal under its key.
fn compact_args(h: &Harness) -> [&str; 6] {
    let (journal, key) = (h.journal.to_str().unwrap(), h.key_path.to_str().unwrap());
    [
        "journal",
        "compact",
        "--journal",
        journal,
        "--key-file",
        key,
    ]
}

/// Compacted under a running proxy: it follows the new file from what it covers (its fold
/// counts no line twice), and a lease granted or revoked after the swap, by another process or
/// through the proxy's own admin API, is followed. The old file is kept byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_proxy_follows_a_compaction_without_folding_again() {
    let h = Harness::new();
    let origin = http_origin().await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let (old, kept) = expired_and_open(&h);
    let revoked_elsewhere = h.lease(&["origin.test"], &[]);
    let revoked_here = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    assert_eq!(answer_through(&server, &kept, &url).await.0, 200);
    let before = std::fs::read(&h.journal).unwrap();

    let stdout = leasegate_ok(&compact_args(&h)).await;
    assert!(stdout.contains("3 of 4 lines kept"), "{stdout}");
    assert!(stdout.contains("3 leases kept, 1 dropped"), "{stdout}");
    let archives: Vec<_> = std::fs::read_dir(h.dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("journal.jsonl.20"))
        .collect();
    assert_eq!(archives.len(), 1, "{archives:?}");
    assert_eq!(
        std::fs::read(&archives[0]).unwrap(),
        before,
        "the old journal is kept"
    );
    let compacted = std::fs::read_to_string(&h.journal).unwrap();
    assert!(!compacted.contains(&old) && compacted.contains(&kept));

    let fresh = issue_cli(&h, "origin.test", &[]).await;
    let opened = eventually(Duration::from_secs(5), || async {
        (answer_through(&server, &fresh, &url).await.0 == 200).then_some(())
    })
    .await;
    assert!(
        opened.is_some(),
        "a lease granted after the swap never opened"
    );
    revoke_cli(&h, &revoked_elsewhere).await;
    let refused = eventually(Duration::from_secs(5), || async {
        let answer = answer_through(&server, &revoked_elsewhere, &url).await;
        (answer.0 == 403).then_some(answer.1)
    })
    .await;
    assert_eq!(refused, Some(Some("lease-revoked".into())));
    admin_revoke(&server, &revoked_here).await;
    assert_eq!(
        answer_through(&server, &revoked_here, &url).await,
        (403, Some("lease-revoked".into()))
    );
    assert_eq!(answer_through(&server, &kept, &url).await.0, 200);
    assert_eq!(
        answer_through(&server, &old, &url).await.1.as_deref(),
        Some("lease-expired")
    );

    let (_, metrics) = admin_text(&server, "/metrics").await;
    let lines = |event: &str| {
        sample(
            &metrics,
            &format!("leasegate_journal_lines_total{{event=\"{event}\"}}"),
        )
    };
    assert_eq!(
        lines("granted"),
        Some(5.0),
        "each grant folded once: {metrics}"
    );
    assert_eq!(lines("revoked"), Some(2.0));
    let records = h.revocations().await;
    assert_eq!(
        records.len(),
        2,
        "both revocations are in the compacted journal"
    );
}

/// A mistyped path is a usage error (exit 2), and nothing is created.
#[test]
fn compacting_a_missing_journal_is_refused() {
    let h = Harness::new();
    let out = crate::support::leasegate_sync(&compact_args(&h));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no journal at"));
    assert_eq!(
        std::fs::read_dir(h.dir.path()).unwrap().count(),
        1,
        "only the key"
    );
}

/// A lease's status on `server`'s admin API (`None`: not known there).
async fn status_on(server: &Server, lease: &str) -> Option<String> {
    let (status, view) = admin_get(server, &format!("/leases/{lease}")).await;
    (status == 200).then(|| view["status"].as_str().unwrap_or_default().to_owned())
}

/// A stream journal compacts into a snapshot: a replica started afterwards folds the snapshot
/// (it never sees the lease the snapshot dropped), then follows the stream from the sequence
/// after it, as does one started after a revocation. The journal keeps every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_starts_from_the_snapshot_and_follows_the_stream() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LGC").await;
    let h = Harness::new();
    let (old, kept) = expired_and_open(&h);
    let revoked = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;

    let url = cluster.url_as(Role::Compactor, "LGC");
    let key = h.key_path.to_str().unwrap();
    let stdout = leasegate_ok(&["journal", "compact", "--journal", &url, "--key-file", key]).await;
    assert!(
        stdout.contains("up to sequence 3: 2 of 3 lines kept"),
        "{stdout}"
    );

    let fresh = h.lease(&["origin.test"], &[]);
    let text = std::fs::read_to_string(&h.journal).unwrap();
    let last = text.lines().last().unwrap();
    stream
        .publish(stream.subject(Some(&fresh)), last.as_bytes(), None)
        .await
        .unwrap();
    let a = replica(&h, &cluster, "LGC", "a").await;
    assert_eq!(
        status_on(&a, &old).await,
        None,
        "the dropped lease was never read"
    );
    assert_eq!(status_on(&a, &kept).await.as_deref(), Some("open"));
    assert_eq!(
        status_on(&a, &fresh).await.as_deref(),
        Some("open"),
        "after the snapshot"
    );
    admin_revoke(&a, &revoked).await;
    let b = replica(&h, &cluster, "LGC", "b").await;
    assert_eq!(status_on(&b, &revoked).await.as_deref(), Some("revoked"));
    assert_eq!(status_on(&b, &old).await, None);
    let (_, metrics) = admin_text(&b, "/metrics").await;
    assert_eq!(
        sample(&metrics, "leasegate_journal_lines_total{event=\"granted\"}"),
        Some(3.0),
        "two grants from the snapshot, one after it"
    );
    assert_eq!(
        stream.last_sequence().await.unwrap(),
        5,
        "the journal keeps every message"
    );
}
