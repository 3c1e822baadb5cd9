//! Revocations through a stream leader's failover: a refusal on one replica closes the lease on
//! the others through the core NATS broadcast while the stream has no leader, the stream then
//! holds one record per lease, and the fold counts it once. Forged broadcasts close nothing.

use crate::cluster::scale_out::{proxy_revocations, refuse, replica_at, until_status};
use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_text, eventually, http_origin, streaming_tunnel, until_closed, Harness,
};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::{Key, Timestamp};
use leasegate::server::Server;
use serde_json::{Map, Value};
use std::time::Duration;

/// What the old path took through a leader kill: up to ~9 s. The broadcast takes milliseconds:
/// the median closing is within this, and every one within [`AT_ONCE`] (a loaded machine may
/// stall one).
const CLOSED_WITHIN: Duration = Duration::from_secs(2);

/// A metric's value on `server`'s `/metrics` (rendered once a second): `want` once it is, or
/// its value after a while (as long as the stream may take to have a leader again under load).
async fn metric_turns(server: &Server, name: &str, want: f64) -> Option<f64> {
    let value = || async {
        let (_, text) = admin_text(server, "/metrics").await;
        crate::admin::operate::sample(&text, name)
    };
    let reached = eventually(Duration::from_secs(40), || async {
        (value().await == Some(want)).then_some(want)
    })
    .await;
    match reached {
        Some(want) => Some(want),
        None => value().await,
    }
}

/// The leader of `stream`'s stream, by node name.
async fn leader_of(stream: &leasegate::nats::NatsStream) -> String {
    eventually(Duration::from_secs(10), || async {
        stream.stream.get_info().await.ok()?.cluster?.leader
    })
    .await
    .expect("the stream has no leader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_closes_the_lease_on_another_replica_while_the_stream_has_no_leader() {
    if nats_missing() {
        return;
    }
    const LEASES: usize = 4;
    let mut cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let target = format!("origin.test:{}", origin.addr.port());
    let leases: Vec<String> = (0..LEASES)
        .map(|_| h.lease(&["origin.test"], &[]))
        .collect();
    publish_file(&stream, &h.journal).await;
    let leader = leader_of(&stream).await;
    let alive: Vec<usize> = (0..3)
        .filter(|&i| cluster.nodes[i].name != leader)
        .collect();
    // Each replica talks to one node that stays up.
    let on = |i: usize| NatsCluster::location_of(Role::Replica, &cluster.nodes[i], "LG");
    let a = replica_at(&h, on(alive[0]), 3, "a").await;
    let b = replica_at(&h, on(alive[1]), 3, "b").await;
    for lease in &leases {
        for server in [&a, &b] {
            assert!(until_status(server, lease, "open", Duration::from_secs(5)).await);
        }
    }
    let mut tunnels = Vec::new();
    for lease in &leases {
        tunnels.push(streaming_tunnel(b.addr, &target, Some(lease)).await);
    }
    let killed = cluster.nodes.iter().position(|n| n.name == leader).unwrap();
    cluster.nodes[killed].kill();

    // Every lease refused on A during the election: each tunnel on B closes at once.
    let refusing = &a;
    let closed = futures_util::future::join_all(leases.iter().zip(tunnels.iter_mut()).map(
        |(lease, tunnel)| async move {
            let started = std::time::Instant::now();
            let (_, closed) = tokio::join!(refuse(refusing, lease), async {
                until_closed(tunnel, Duration::from_secs(15)).await;
                started.elapsed()
            });
            closed
        },
    ))
    .await;
    let all = &closed;
    for (lease, closed) in leases.iter().zip(all) {
        assert!(
            *closed < AT_ONCE,
            "{lease}: closed on B {closed:?} after its refusal on A (all: {all:?})"
        );
    }
    let mut sorted = closed.clone();
    sorted.sort();
    assert!(
        sorted[sorted.len() / 2] < CLOSED_WITHIN,
        "the median closing on B took {:?} (all: {all:?})",
        sorted[sorted.len() / 2]
    );
    for lease in &leases {
        assert!(until_status(&b, lease, "revoked", AT_ONCE).await);
    }

    // The stream, once it has a leader again, holds one record per lease, and B's fold counts
    // each revocation once although B heard it twice.
    let held = eventually(Duration::from_secs(40), || async {
        let all: Vec<Value> = tokio::time::timeout(Duration::from_secs(5), stream.read_all())
            .await
            .ok()?
            .ok()?
            .into_iter()
            .map(|(_, line)| serde_json::from_slice(&line).unwrap())
            .collect();
        leases
            .iter()
            .all(|lease| proxy_revocations(&all, lease) >= 1)
            .then_some(all)
    })
    .await
    .expect("the revocations never reached the stream");
    for lease in &leases {
        assert_eq!(proxy_revocations(&held, lease), 1, "{lease}");
    }
    let n = LEASES as f64;
    let folded = "leasegate_journal_lines_total{event=\"revoked\"}";
    let revoked = metric_turns(&b, folded, n).await;
    // No election makes another stream of this one (a replacement would fold every line again).
    let replaced = "leasegate_store_replaced_total";
    let (_, text) = admin_text(&b, "/metrics").await;
    assert_eq!(
        crate::admin::operate::sample(&text, replaced),
        Some(0.0),
        "{replaced} ({folded}: {revoked:?})"
    );
    assert_eq!(revoked, Some(n), "{folded}");
    let applied = "leasegate_revoke_broadcasts_total{outcome=\"applied\"}";
    assert_eq!(metric_turns(&b, applied, n).await, Some(n), "{applied}");
}

/// A `revoked` record of `lease` signed under `key`.
fn revocation(lease: &str, key: &Key) -> Value {
    record::revoked(
        &Revocation {
            lease_id: lease,
            parent_lease_id: None,
            by: "issuer",
            reason: "broadcast",
            extra: Map::new(),
        },
        key,
        Timestamp::now(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_misdirected_broadcasts_close_nothing() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let target_lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let sentinel = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let b = replica_at(&h, cluster.location_as(Role::Replica, "LG"), 1, "b").await;
    assert!(until_status(&b, &target_lease, "open", Duration::from_secs(5)).await);
    // An attacker who may publish on the subjects (a replica's credentials) without the key.
    let attacker = NatsCluster::location_of(Role::Replica, &cluster.nodes[0], "LG");
    let attacker = leasegate::nats::NatsStream::connect(
        &attacker,
        &Default::default(),
        &leasegate::nats::StreamSpec::JOURNAL,
    )
    .await
    .unwrap();
    let subject = |lease: &str| format!("leasegate.revoke.LG.{lease}");
    let send = |lease: String, value: Value| {
        let client = attacker.client.clone();
        let subject = subject(&lease);
        async move {
            let payload = serde_json::to_vec(&value).unwrap();
            client.publish(subject, payload.into()).await.unwrap();
        }
    };
    let mut unsigned = revocation(&target_lease, &h.key);
    unsigned.as_object_mut().unwrap().remove("signature");
    let mut tampered = revocation(&target_lease, &h.key);
    tampered["reason"] = "changed after signing".into();
    let forged = [
        // Signed under a key the replicas do not hold for it.
        revocation(&target_lease, &Key::generate()),
        unsigned,
        tampered,
        // Another lease's valid record, aimed at this lease's subject.
        revocation(&other, &h.key),
    ];
    let count = forged.len() as f64;
    for value in forged {
        send(target_lease.clone(), value).await;
    }
    // On another stream's subjects: not heard at all.
    let elsewhere = serde_json::to_vec(&revocation(&target_lease, &h.key)).unwrap();
    attacker
        .client
        .publish(
            format!("leasegate.revoke.OTHER.{target_lease}"),
            elsewhere.into(),
        )
        .await
        .unwrap();
    // A valid broadcast after them: once it has closed its lease, the others were heard.
    send(sentinel.clone(), revocation(&sentinel, &h.key)).await;
    assert!(until_status(&b, &sentinel, "revoked", Duration::from_secs(5)).await);
    for lease in [&target_lease, &other] {
        assert!(
            until_status(&b, lease, "open", Duration::from_secs(0)).await,
            "{lease}"
        );
    }
    let invalid = "leasegate_revoke_broadcasts_total{outcome=\"invalid\"}";
    assert_eq!(metric_turns(&b, invalid, count).await, Some(count));
    b.shutdown().await;
}
