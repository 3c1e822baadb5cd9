//! The replicated journal as an attacker who can publish to the stream sees it: a message
//! planted under the id closing records share, a forged last message on a lease's subject, and
//! forged, unauthenticated or incomplete snapshots. None may keep a revoked lease open.

use crate::cluster::scale_out::{admin_revoke, refuse, replica};
use crate::support::harness::AT_ONCE;
use crate::support::harness::{admin_get, eventually, raw, Harness};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use futures_util::StreamExt;
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::{Key, Timestamp};
use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};
use leasegate::registry::closing::ClosingCheck;
use leasegate::registry::store::snapshot::{self, LinesDigest, Marker};
use leasegate::server::Server;
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};

/// A revocation on one replica closes the lease on every other within this on a loaded machine
/// (the 250 ms target is measured by `benches/scale_out.rs` and `benches/failover.rs`).
const EVERYWHERE_WITHIN: Duration = AT_ONCE;

/// A lease's status on `server` (`None`: not known there).
async fn status_on(server: &Server, lease: &str) -> Option<String> {
    let (status, view) = admin_get(server, &format!("/leases/{lease}")).await;
    (status == 200).then(|| view["status"].as_str().unwrap_or_default().to_owned())
}

/// How long until `lease` is revoked on `server`, if within `limit`.
async fn revoked_within(server: &Server, lease: &str, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    eventually(limit, || async {
        (status_on(server, lease).await.as_deref() == Some("revoked")).then(|| started.elapsed())
    })
    .await
}

/// Records on `lease`'s subject that stand for a closing of it (signed under `key`).
async fn valid_closings(stream: &NatsStream, key: &Key, lease: &str) -> usize {
    let check = ClosingCheck::new(lease, Some(key.clone()), b"");
    let subject = stream.subject(Some(lease));
    let mut found = 0;
    for (sequence, payload) in stream.read_all().await.unwrap() {
        let message = stream.stream.get_raw_message(sequence).await.unwrap();
        if message.subject.as_str() == subject && check.accepts(lease, &payload) {
            found += 1;
        }
    }
    found
}

/// A `revoked` record of `lease` as a stream writer without the key would forge it: signed
/// under a key of its own, naming the lease's key.
fn forged_revocation(lease: &str, h: &Harness) -> Vec<u8> {
    let mut value = record::revoked(
        &Revocation {
            lease_id: lease,
            parent_lease_id: None,
            by: "issuer",
            reason: "forged",
            extra: Map::new(),
        },
        &Key::generate(),
        Timestamp::now(),
    )
    .unwrap();
    value["key_fingerprint"] = h.key.fingerprint().into();
    serde_json::to_vec(&value).unwrap()
}

/// Two replicas of a stream with leases `refused` and `revoked` open on both, after `planted`
/// was published on each lease's subject (under `leasegate-close-<lease>` with `shared_id`);
/// then `refused` is refused on A and `revoked` revoked through A's admin API, and both must
/// be revoked on B within [`EVERYWHERE_WITHIN`] and held by the stream as a record every fold
/// accepts.
async fn closes_everywhere_despite(planted: fn(&str, &Harness) -> Vec<u8>, shared_id: bool) {
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let refused = h.lease(&["origin.test"], &[]);
    let revoked = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    for lease in [&refused, &revoked] {
        let id = shared_id.then(|| format!("leasegate-close-{lease}"));
        let subject = stream.subject(Some(lease));
        let payload = planted(lease, &h);
        stream
            .publish(subject, &payload, id.as_deref())
            .await
            .unwrap();
    }
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    for lease in [&refused, &revoked] {
        for server in [&a, &b] {
            assert_eq!(status_on(server, lease).await.as_deref(), Some("open"));
        }
    }
    refuse(&a, &refused).await;
    admin_revoke(&a, &revoked).await;
    for lease in [&refused, &revoked] {
        let took = revoked_within(&b, lease, AT_ONCE * 2).await;
        assert!(
            took.is_some_and(|took| took <= EVERYWHERE_WITHIN),
            "{lease} on the other replica: {took:?}"
        );
        assert_eq!(valid_closings(&stream, &h.key, lease).await, 1, "{lease}");
    }
    let (status, ready) = admin_get(&a, "/readyz").await;
    assert_eq!(status, 200, "nothing pending: {ready}");
    // A restart of either replica keeps them closed.
    drop(b);
    let c = replica(&h, &cluster, "LG", "c").await;
    for lease in [&refused, &revoked] {
        assert_eq!(status_on(&c, lease).await.as_deref(), Some("revoked"));
    }
}

/// A heartbeat of `lease`: a valid line that closes nothing.
fn heartbeat(lease: &str, _: &Harness) -> Vec<u8> {
    let heartbeat = json!({
        "schema_version": "1.2", "at": Timestamp::now().to_string(),
        "event": "heartbeat", "lease_id": lease,
    });
    serde_json::to_vec(&heartbeat).unwrap()
}

/// Something else published first under `leasegate-close-<lease>`: JetStream answers the real
/// record as a duplicate of it, which must not count as the record being in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_planted_under_the_closing_id_does_not_suppress_a_revocation() {
    if nats_missing() {
        return;
    }
    closes_everywhere_despite(heartbeat, true).await;
}

/// A `revoked` line with a bad signature as the subject's last message: every fold skips it,
/// so it must not pass for "already closed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_last_message_does_not_pass_for_a_closing() {
    if nats_missing() {
        return;
    }
    closes_everywhere_despite(forged_revocation, false).await;
}

/// Both at once: a forged closing as the last message, published under the shared id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_closing_under_the_closing_id_does_not_suppress_a_revocation() {
    if nats_missing() {
        return;
    }
    closes_everywhere_despite(forged_revocation, true).await;
}

/// How a forged snapshot is made.
enum Forgery {
    /// The marker as it was before snapshots carried a MAC.
    NoMac,
    /// A marker whose MAC is made under a key the replicas do not hold, naming theirs.
    BadMac,
    /// A genuine snapshot of three lines (MAC under the replicas' key) whose marker is then
    /// made to name two: the revocation left out.
    LineRemoved,
    /// A genuine snapshot of three lines whose revocation line is deleted from the snapshot
    /// stream afterwards.
    LineDeleted,
}

/// The journal holds a lease's grant and its revocation; the latest snapshot covers both but
/// keeps only the grant. A replica that starts must not serve the lease.
async fn a_replica_ignores(forgery: Forgery) {
    let cluster = NatsCluster::start(1);
    let journal = cluster.journal("LGS").await;
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    publish_file(&journal, &h.journal).await;
    let a = replica(&h, &cluster, "LGS", "a").await;
    admin_revoke(&a, &lease).await;
    drop(a);
    let head = journal.last_sequence().await.unwrap();
    assert_eq!(head, 3, "two grants and a revocation");
    let messages = journal.read_all().await.unwrap();
    let grants: Vec<&[u8]> = messages[..2].iter().map(|(_, m)| &m[..]).collect();

    let options = NatsOptions::default();
    let location = snapshot::location_of(&journal.location);
    let store = NatsStream::connect(&location, &options, &snapshot::SNAPSHOT)
        .await
        .unwrap();
    let created = snapshot::created(&journal).await.unwrap();
    let lines_subject = format!("leasegate.snapshot.lines.{head}");
    let mut sequences = Vec::new();
    for line in &grants {
        sequences.push(
            store
                .publish(lines_subject.clone(), line, None)
                .await
                .unwrap(),
        );
    }
    let (first, last) = (sequences[0], sequences[1]);
    let mut digest = LinesDigest::default();
    grants.iter().for_each(|line| digest.push(line));
    let marker: Value = match forgery {
        Forgery::NoMac => json!({
            "covers": head, "journal_created": created, "first": first, "last": last, "lines": 2,
        }),
        Forgery::BadMac => {
            let mut marker = Marker::signed(
                "LGS",
                created,
                head,
                (first, last),
                digest,
                &Key::generate(),
            );
            marker.key_fingerprint = h.key.fingerprint().to_owned();
            serde_json::to_value(marker).unwrap()
        }
        Forgery::LineRemoved | Forgery::LineDeleted => {
            // The revocation was in the snapshot, genuinely.
            let closing = &messages[2].1;
            let third = store
                .publish(lines_subject.clone(), closing, None)
                .await
                .unwrap();
            digest.push(closing);
            let marker = Marker::signed("LGS", created, head, (first, third), digest, &h.key);
            let mut marker = serde_json::to_value(marker).unwrap();
            match forgery {
                Forgery::LineRemoved => {
                    marker["lines"] = 2.into();
                    marker["last"] = last.into();
                }
                _ => {
                    store.stream.delete_message(third).await.unwrap();
                }
            }
            marker
        }
    };
    store
        .publish(
            "leasegate.snapshot.done".to_owned(),
            &serde_json::to_vec(&marker).unwrap(),
            None,
        )
        .await
        .unwrap();

    let b = replica(&h, &cluster, "LGS", "b").await;
    assert_eq!(status_on(&b, &lease).await.as_deref(), Some("revoked"));
    assert_eq!(status_on(&b, &other).await.as_deref(), Some("open"));
    let answer = raw(
        b.addr,
        format!("CONNECT origin.test:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403 lease-revoked"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_without_a_mac_is_ignored() {
    if nats_missing() {
        return;
    }
    a_replica_ignores(Forgery::NoMac).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_with_a_bad_mac_is_ignored() {
    if nats_missing() {
        return;
    }
    a_replica_ignores(Forgery::BadMac).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_missing_a_line_is_ignored() {
    if nats_missing() {
        return;
    }
    a_replica_ignores(Forgery::LineRemoved).await;
    a_replica_ignores(Forgery::LineDeleted).await;
}

/// The users of `deploy/nats/` can do what their leasegate commands need (the rest of the
/// scale-out suite runs as them) and nothing destructive: no deletion of a stream or a message,
/// no configuration change, no publishing outside their subjects, and no purge but the
/// compactor's of the journal and its snapshot stream (`journal compact --purge`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_users_hold_only_what_their_commands_need() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let operator = cluster.journal("LEASES").await;
    let subject = operator.subject(Some("3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c"));
    operator
        .publish(subject.clone(), b"{}", None)
        .await
        .unwrap();
    let options = NatsOptions::default();
    let snapshots = snapshot::location_of(&cluster.location("LEASES"));
    NatsStream::connect(&snapshots, &options, &snapshot::SNAPSHOT)
        .await
        .unwrap();
    let as_role = |role| {
        let location = cluster.location_as(role, "LEASES");
        let options = options.clone();
        async move {
            NatsStream::connect(&location, &options, &StreamSpec::JOURNAL)
                .await
                .unwrap()
        }
    };
    // Each refused call waits for its request timeout: every role and call at once.
    let roles = [Role::Replica, Role::Issuer, Role::Compactor, Role::Reader];
    futures_util::future::join_all(roles.map(|role| {
        let (client, subject) = (as_role(role), subject.clone());
        async move {
            let client = client.await;
            let wider = async_nats::jetstream::stream::Config {
                name: "LEASES".into(),
                subjects: vec![">".into()],
                ..Default::default()
            };
            let snapshot = "leasegate.snapshot.done".to_owned();
            let snapshots = client
                .jetstream
                .get_stream("LEASES_SNAPSHOT")
                .await
                .unwrap();
            // Of a subject nothing is on: a purge that removes nothing, but is still a purge
            // to allow (one below sequence 1 would remove everything).
            let (purged, trimmed, deleted, dropped, widened, appended, marked) = tokio::join!(
                client.stream.purge().filter("leasegate.journal.nothing"),
                snapshots.purge().filter("leasegate.snapshot.nothing"),
                client.stream.delete_message(1),
                client.jetstream.delete_stream("LEASES"),
                client.jetstream.update_stream(wider),
                client.publish(subject.clone(), b"{}", None),
                client.publish(snapshot, b"{}", None),
            );
            let may_purge = role == Role::Compactor;
            assert_eq!(purged.is_ok(), may_purge, "{role:?} purging the journal");
            assert_eq!(
                trimmed.is_ok(),
                may_purge,
                "{role:?} purging the snapshot stream"
            );
            assert!(deleted.is_err(), "{role:?} deleted a message");
            assert!(dropped.is_err(), "{role:?} deleted the stream");
            assert!(widened.is_err(), "{role:?} changed the stream");
            let may_append = matches!(role, Role::Replica | Role::Issuer);
            assert_eq!(
                appended.is_ok(),
                may_append,
                "{role:?} appending a journal line"
            );
            let may_snapshot = role == Role::Compactor;
            assert_eq!(
                marked.is_ok(),
                may_snapshot,
                "{role:?} publishing a snapshot marker"
            );
        }
    }))
    .await;
    assert_eq!(
        operator.last_sequence().await.unwrap(),
        3,
        "the two appends"
    );
    // Closing broadcasts (core NATS, outside every stream): only a replica sends or hears them.
    let broadcast = format!(
        "leasegate.revoke.LG.{}",
        "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c"
    );
    let mut heard = operator
        .client
        .subscribe("leasegate.revoke.>")
        .await
        .unwrap();
    operator.client.flush().await.unwrap();
    for role in roles {
        let client = as_role(role).await.client;
        let mut listening = client.subscribe("leasegate.revoke.>").await.unwrap();
        client.flush().await.unwrap();
        client
            .publish(broadcast.clone(), format!("{role:?}").into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        operator
            .client
            .publish(broadcast.clone(), "operator".into())
            .await
            .unwrap();
        operator.client.flush().await.unwrap();
        // Heard at once where allowed; where not, half a second of silence says it.
        let wait = match role {
            Role::Replica => AT_ONCE,
            _ => Duration::from_millis(500),
        };
        let got = tokio::time::timeout(wait, listening.next()).await;
        assert_eq!(
            got.ok().flatten().is_some(),
            role == Role::Replica,
            "{role:?} hearing a broadcast"
        );
    }
    let mut senders = Vec::new();
    while let Ok(Some(message)) =
        tokio::time::timeout(Duration::from_millis(500), heard.next()).await
    {
        senders.push(String::from_utf8_lossy(&message.payload).into_owned());
    }
    senders.retain(|sender| sender != "operator");
    assert_eq!(senders, ["Replica"], "who may broadcast a closing");
    // Not vacuous: the operator may.
    operator.stream.delete_message(1).await.unwrap();
    operator.stream.purge().await.unwrap();
}
