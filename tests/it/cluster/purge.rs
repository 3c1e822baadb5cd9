//! `journal compact --purge` against real nats-server processes: every reader of a purged
//! stream starts from its verified snapshot, or refuses; the bridges count the snapshot's
//! lines, and publish many lines at once with each lease's lines in file order.

use crate::cluster::scale_out::{admin_revoke, replica};
use crate::support::harness::{admin_get, eventually, Harness};
use crate::support::leasegate;
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::contract::Timestamp;
use leasegate::nats::{NatsOptions, NatsStream};
use leasegate::registry::store::nats::NatsStore;
use serde_json::Value;
use std::collections::HashMap;
use std::process::Output;
use std::time::Duration;

const HOUR: i64 = 3600 * 1000;

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `leases --json` on the stream as the reader: each lease's status.
async fn statuses(cluster: &NatsCluster, h: &Harness) -> Result<HashMap<String, String>, String> {
    let url = cluster.url_as(Role::Reader, "LEASES");
    let key = h.key_path.to_str().unwrap();
    let out = leasegate(&["leases", "--journal", &url, "--key-file", key, "--json"]).await;
    if !out.status.success() {
        return Err(text(&out));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| {
            let row: Value = serde_json::from_str(line).unwrap();
            (
                row["lease_id"].as_str().unwrap().to_owned(),
                row["status"].as_str().unwrap().to_owned(),
            )
        })
        .collect())
}

/// A lease's status on a replica's admin API (`None`: not known there).
async fn status_on(server: &leasegate::server::Server, lease: &str) -> Option<String> {
    let (status, view) = admin_get(server, &format!("/leases/{lease}")).await;
    (status == 200).then(|| view["status"].as_str().unwrap_or_default().to_owned())
}

/// The harness journal's lines that grant or close `leases`.
fn lines_of(h: &Harness, leases: &[&str]) -> Vec<String> {
    std::fs::read_to_string(&h.journal)
        .unwrap()
        .lines()
        .filter(|line| leases.iter().any(|lease| line.contains(lease)))
        .map(str::to_owned)
        .collect()
}

/// Compacted with `--purge` under a running replica: the running replica goes on following,
/// a replica started afterwards, `leases` and `journal export` read the snapshot and what
/// follows it (a lease revoked before the purge point stays revoked), and an import of the
/// kept leases' lines publishes nothing. Before purging was read behind the snapshot, a new
/// replica and `leases` folded only the messages left, and the import published them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_stream_is_read_from_its_verified_snapshot_by_every_reader() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LEASES").await;
    let h = Harness::new();
    let three_days_ago = Timestamp::now().saturating_add_millis(-72 * HOUR);
    let old = h.lease_with(
        &["origin.test"],
        &[],
        None,
        three_days_ago,
        Duration::from_secs(3600),
    );
    let (kept, revoked) = (
        h.lease(&["origin.test"], &[]),
        h.lease(&["origin.test"], &[]),
    );
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, "LEASES", "a").await;
    admin_revoke(&a, &revoked).await;
    assert_eq!(stream.last_sequence().await.unwrap(), 4);

    let url = cluster.url_as(Role::Compactor, "LEASES");
    let key = h.key_path.to_str().unwrap();
    let out = leasegate(&[
        "journal",
        "compact",
        "--journal",
        &url,
        "--key-file",
        key,
        "--purge",
    ])
    .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("verified and purged behind: 4 journal messages up to sequence 4"),
        "{}",
        text(&out)
    );
    let span = stream.span().await.unwrap();
    assert_eq!(
        (span.first, span.last),
        (5, 4),
        "every covered message is gone"
    );

    // After the purge: a lease granted, the running replica follows it.
    let fresh = h.lease(&["origin.test"], &[]);
    let last = lines_of(&h, &[&fresh]).pop().unwrap();
    stream
        .publish(stream.subject(Some(&fresh)), last.as_bytes(), None)
        .await
        .unwrap();
    let followed = eventually(Duration::from_secs(10), || async {
        (status_on(&a, &fresh).await.as_deref() == Some("open")).then_some(())
    })
    .await;
    assert!(
        followed.is_some(),
        "the running replica follows past a purge"
    );

    let b = replica(&h, &cluster, "LEASES", "b").await;
    assert_eq!(status_on(&b, &revoked).await.as_deref(), Some("revoked"));
    assert_eq!(status_on(&b, &kept).await.as_deref(), Some("open"));
    assert_eq!(status_on(&b, &fresh).await.as_deref(), Some("open"));
    assert_eq!(status_on(&b, &old).await, None, "dropped by the compaction");

    let listed = statuses(&cluster, &h).await.unwrap();
    assert_eq!(listed.get(&revoked).map(String::as_str), Some("revoked"));
    assert_eq!(listed.get(&kept).map(String::as_str), Some("open"));
    assert_eq!(listed.get(&fresh).map(String::as_str), Some("open"));
    assert_eq!(listed.len(), 3, "{listed:?}");

    let reader = cluster.url_as(Role::Reader, "LEASES");
    let out = leasegate(&["journal", "export", &reader, "--key-file", key]).await;
    assert!(out.status.success(), "{}", text(&out));
    let exported = String::from_utf8(out.stdout).unwrap();
    let exported: Vec<&str> = exported.lines().collect();
    assert_eq!(
        exported.len(),
        4,
        "three kept lines, one after: {exported:?}"
    );
    assert!(exported[2].contains("\"revoked\"") && exported[2].contains(&revoked));
    assert_eq!(exported[3], last);
    let out = leasegate(&["journal", "export", &reader]).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("purged below sequence 5") && text(&out).contains("--key-file"),
        "{}",
        text(&out)
    );

    // The kept leases' lines, as an issuer's file holds them: all in the snapshot.
    let file = h.dir.path().join("kept.jsonl");
    let mut kept_lines = lines_of(&h, &[&kept, &revoked, &fresh]).join("\n");
    kept_lines.push('\n');
    std::fs::write(&file, kept_lines).unwrap();
    let issuer = cluster.url_as(Role::Issuer, "LEASES");
    let out = leasegate(&[
        "journal",
        "import",
        file.to_str().unwrap(),
        "--to",
        &issuer,
        "--key-file",
        key,
    ])
    .await;
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("imported 0 lines, 3 already in the stream"),
        "{}",
        text(&out)
    );
    assert_eq!(stream.last_sequence().await.unwrap(), 5);
}

/// A stream purged with no snapshot covering the purged messages (by hand): a replica does not start, `leases` and `journal export` and the
/// bridges refuse, each saying why, rather than fold what is left. Before, all of them read
/// the remaining messages as the whole journal: the revocation of a lease whose grant was
/// purged was folded as one waiting for its grant, and the lease vanished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_stream_without_a_covering_snapshot_is_refused_by_every_reader() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LEASES").await;
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, "LEASES", "a").await;
    admin_revoke(&a, &lease).await;
    drop(a);
    stream.stream.purge().sequence(2).await.unwrap();

    let listed = statuses(&cluster, &h).await;
    let error = listed.expect_err("a partial journal was listed");
    assert!(
        error.contains("purged below sequence 2")
            && error.contains("no snapshot covers the purged messages"),
        "{error}"
    );
    let key = h.key_path.to_str().unwrap();
    let reader = cluster.url_as(Role::Reader, "LEASES");
    let out = leasegate(&["journal", "export", &reader, "--key-file", key]).await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("refusing to read a partial journal"),
        "{}",
        text(&out)
    );

    let issuer = cluster.url_as(Role::Issuer, "LEASES");
    let out = leasegate(&[
        "journal",
        "import",
        h.journal.to_str().unwrap(),
        "--to",
        &issuer,
        "--key-file",
        key,
    ])
    .await;
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("purged below sequence 2"),
        "{}",
        text(&out)
    );
    assert_eq!(
        stream.last_sequence().await.unwrap(),
        2,
        "nothing republished"
    );

    let keyring = leasegate::contract::Keyring::load(&[&h.key_path], false).unwrap();
    let opened = NatsStore::open(
        &cluster.location_as(Role::Replica, "LEASES"),
        &NatsOptions::default(),
        &keyring,
        1 << 20,
        leasegate::nats::IfMissing::Create,
    )
    .await;
    let error = opened
        .err()
        .expect("a replica folded a partial journal")
        .to_string();
    assert!(
        error.contains("no snapshot covers the purged messages"),
        "{error}"
    );
}

/// `journal import` of many lines of many leases into a three-node R3 stream, with the stream
/// leader killed mid-import: every line lands once, and each lease's lines are in file order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelined_import_keeps_each_lease_in_file_order_through_a_leader_kill() {
    if nats_missing() {
        return;
    }
    let mut cluster = NatsCluster::start(3);
    let stream = cluster.journal("LEASES").await;
    let h = Harness::new();
    let (leases, per_lease) = (40usize, 100usize);
    let ids: Vec<String> = (0..leases)
        .map(|i| format!("00000000-0000-4000-8000-{i:012}"))
        .collect();
    let mut file = String::new();
    for n in 0..per_lease {
        for id in &ids {
            file.push_str(&format!("{{\"lease_id\":\"{id}\",\"n\":{n}}}\n"));
        }
    }
    let path = h.dir.path().join("many.jsonl");
    std::fs::write(&path, file).unwrap();
    let issuer = cluster.url_as(Role::Issuer, "LEASES");
    let import = {
        let (path, issuer) = (path.clone(), issuer.clone());
        tokio::spawn(async move {
            leasegate(&["journal", "import", path.to_str().unwrap(), "--to", &issuer]).await
        })
    };
    // Once the import is under way, the stream's leader goes.
    let started = eventually(Duration::from_secs(30), || async {
        stream.last_sequence().await.ok().filter(|n| *n >= 200)
    })
    .await;
    assert!(started.is_some(), "the import never started");
    let leader = stream
        .stream
        .get_info()
        .await
        .unwrap()
        .cluster
        .and_then(|c| c.leader)
        .unwrap();
    let node = cluster.nodes.iter().position(|n| n.name == leader).unwrap();
    cluster.nodes[node].kill();
    let out = import.await.unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let total = leases * per_lease;
    let reader = NatsStream::connect(
        &cluster.location("LEASES"),
        &NatsOptions::default(),
        &leasegate::nats::StreamSpec::JOURNAL,
    )
    .await
    .unwrap();
    // Just after the election a read can time out: it is asked again.
    let held = eventually(Duration::from_secs(30), || async {
        reader.read_all().await.ok()
    })
    .await
    .expect("the stream could not be read after the election");
    assert_eq!(held.len(), total, "every line once");
    let mut next: HashMap<String, u64> = HashMap::new();
    for (_, line) in &held {
        let record: Value = serde_json::from_slice(line).unwrap();
        let id = record["lease_id"].as_str().unwrap().to_owned();
        let n = record["n"].as_u64().unwrap();
        let expected = next.entry(id.clone()).or_default();
        assert_eq!(n, *expected, "lease {id} out of file order");
        *expected += 1;
    }
}
