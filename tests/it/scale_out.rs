//! Several replicas sharing one journal through NATS JetStream: grants open everywhere, a
//! refusal or an admin revocation on one replica closes the lease's tunnels on the others.

use crate::harness::{
    admin_get, eventually, http_origin, raw, streaming_tunnel, until_closed, Harness,
};
use crate::nats_support::{publish_file, NatsCluster};
use leasegate::registry::store::nats::NatsStream;
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::server::Server;
use serde_json::Value;
use std::time::{Duration, Instant};

/// A replica of the proxy on `cluster`'s stream `stream`.
async fn replica(h: &Harness, cluster: &NatsCluster, stream: &str, data: &str) -> Server {
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(cluster.location(stream));
    config.store = StoreOptions {
        data_dir: h.dir.path().join(data),
        ..StoreOptions::default()
    };
    config.store.nats.replicas = cluster.nodes.len();
    Server::start(config).await.unwrap()
}

/// Every record in the stream, parsed.
async fn records(stream: &NatsStream) -> Vec<Value> {
    stream
        .read_all()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, line)| serde_json::from_slice(&line).unwrap())
        .collect()
}

fn proxy_revocations(records: &[Value], lease: &str) -> usize {
    records
        .iter()
        .filter(|r| r["event"] == "revoked" && r["lease_id"] == lease)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_on_one_replica_closes_the_tunnel_on_another() {
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, "LG", "a").await;
    let c = replica(&h, &cluster, "LG", "c").await;
    let target = format!("origin.test:{}", origin.addr.port());
    let mut tunnel = streaming_tunnel(c.addr, &target, Some(&lease)).await;
    let answer = raw(
        a.addr,
        format!("CONNECT denied.test:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    let refused = Instant::now();
    let closed_after = until_closed(&mut tunnel, Duration::from_secs(5)).await;
    assert!(
        closed_after < Duration::from_secs(1),
        "closed after {closed_after:?}"
    );
    eprintln!(
        "refusal on A -> tunnel on C closed in {:?}",
        refused.elapsed()
    );
    let (status, view) = admin_get(&c, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "revoked", "{view}");
    assert_eq!(proxy_revocations(&records(&stream).await, &lease), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_published_while_running_opens_on_every_replica() {
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    let lease = h.lease(&["origin.test"], &[]);
    let published = Instant::now();
    publish_file(&stream, &h.journal).await;
    for server in [&a, &b] {
        let open = eventually(Duration::from_secs(2), || async {
            let (_, view) = admin_get(server, &format!("/leases/{lease}")).await;
            (view["status"] == "open").then_some(())
        })
        .await;
        assert!(open.is_some(), "the grant never opened");
    }
    assert!(
        published.elapsed() < Duration::from_millis(1000),
        "{:?}",
        published.elapsed()
    );
    let (status, ready) = admin_get(&a, "/readyz").await;
    assert_eq!(status, 200, "{ready}");
}
