//! Several replicas sharing one journal through NATS JetStream: grants open everywhere, a
//! refusal or an admin revocation on one replica closes the lease's tunnels on the others.

use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_get, eventually, http_origin, raw, readyz_turns, streaming_tunnel, until_closed, Harness,
};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::nats::NatsStream;
use leasegate::registry::store::NatsLocation;
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::server::Server;
use serde_json::Value;
use std::time::{Duration, Instant};

/// A replica of the proxy on `cluster`'s stream `stream`.
pub(crate) async fn replica(
    h: &Harness,
    cluster: &NatsCluster,
    stream: &str,
    data: &str,
) -> Server {
    let location = cluster.location_as(Role::Replica, stream);
    replica_at(h, location, cluster.nodes.len(), data).await
}

/// A replica of the proxy on the stream at `location` (of `replicas` replicas).
pub(crate) async fn replica_at(
    h: &Harness,
    location: NatsLocation,
    replicas: usize,
    data: &str,
) -> Server {
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(location);
    config.store = StoreOptions {
        data_dir: h.dir.path().join(data),
        ..StoreOptions::default()
    };
    config.store.nats.replicas = replicas;
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

pub(crate) fn proxy_revocations(records: &[Value], lease: &str) -> usize {
    records
        .iter()
        .filter(|r| r["event"] == "revoked" && r["lease_id"] == lease)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_on_one_replica_closes_the_tunnel_on_another() {
    if nats_missing() {
        return;
    }
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
        format!("CONNECT denied.example:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    let closed_after = until_closed(&mut tunnel, AT_ONCE * 2).await;
    assert!(closed_after < AT_ONCE, "closed after {closed_after:?}");
    let (status, view) = admin_get(&c, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "revoked", "{view}");
    assert_eq!(proxy_revocations(&records(&stream).await, &lease), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_published_while_running_opens_on_every_replica() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    let lease = h.lease(&["origin.test"], &[]);
    let published = Instant::now();
    publish_file(&stream, &h.journal).await;
    for server in [&a, &b] {
        let open = eventually(AT_ONCE * 2, || async {
            let (_, view) = admin_get(server, &format!("/leases/{lease}")).await;
            (view["status"] == "open").then_some(())
        })
        .await;
        assert!(open.is_some(), "the grant never opened");
    }
    assert!(published.elapsed() < AT_ONCE, "{:?}", published.elapsed());
    let (status, ready) = admin_get(&a, "/readyz").await;
    assert_eq!(status, 200, "{ready}");
}

/// A stream message longer than `--max-journal-line` is skipped and counted (`too-long`),
/// at start and while following; the messages around it are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_message_over_the_cap_is_skipped_and_counted() {
    if nats_missing() {
        return;
    }
    const CAP: usize = 4096;
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let first = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let huge = vec![b'x'; CAP + 1];
    stream
        .publish(stream.subject(None), &huge, None)
        .await
        .unwrap();
    let mut config = h.serve_config(h.config(&[]), None);
    config.journal = JournalLocation::Nats(cluster.location("LG"));
    config.store = StoreOptions {
        data_dir: h.dir.path().join("data"),
        max_line: CAP,
        ..StoreOptions::default()
    };
    let server = Server::start(config).await.unwrap();
    let too_long = || async {
        let (_, text) = crate::support::harness::admin_text(&server, "/metrics").await;
        crate::admin::operate::sample(
            &text,
            "leasegate_journal_invalid_lines_total{reason=\"too-long\"}",
        )
    };
    assert_eq!(too_long().await, Some(1.0));
    let (_, view) = admin_get(&server, &format!("/leases/{first}")).await;
    assert_eq!(view["status"], "open");

    // While following: another one, then a grant after it.
    stream
        .publish(stream.subject(None), &huge, None)
        .await
        .unwrap();
    std::fs::write(&h.journal, "").unwrap();
    let second = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let open = eventually(Duration::from_secs(5), || async {
        let (_, view) = admin_get(&server, &format!("/leases/{second}")).await;
        (view["status"] == "open").then_some(())
    })
    .await;
    assert!(open.is_some(), "the grant after the long message opens");
    // By the next `/metrics` render (one a second).
    let counted = eventually(Duration::from_secs(5), || async {
        (too_long().await == Some(2.0)).then_some(())
    })
    .await;
    assert!(counted.is_some(), "the second long message is counted");
    server.shutdown().await;
}

/// p50 and p99 of `samples`.
fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    (at(0.50), at(0.99))
}

/// Refuses `lease` on `server` (a denied CONNECT target).
pub(crate) async fn refuse(server: &Server, lease: &str) {
    let answer = raw(
        server.addr,
        format!("CONNECT denied.example:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
}

/// `POST /leases/{id}/revoke` on `server`'s admin API.
pub(crate) async fn admin_revoke(server: &Server, lease: &str) {
    let url = format!(
        "http://{}/leases/{lease}/revoke",
        server.admin_addr.unwrap()
    );
    let out = crate::support::harness::curl(
        &[
            "-X",
            "POST",
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"reason":"operator"}"#,
            &url,
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{}", out.body_text());
}

/// Waits until `lease` has `status` on `server`'s admin API.
pub(crate) async fn until_status(
    server: &Server,
    lease: &str,
    status: &str,
    limit: Duration,
) -> bool {
    eventually(limit, || async {
        let (_, view) = admin_get(server, &format!("/leases/{lease}")).await;
        (view["status"] == status).then_some(())
    })
    .await
    .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_on_a_three_node_cluster_close_tunnels_everywhere() {
    if nats_missing() {
        return;
    }
    const TRIALS: usize = 50;
    let cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let target = format!("origin.test:{}", origin.addr.port());
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    let c = replica(&h, &cluster, "LG", "c").await;

    // A grant published once opens on all three.
    let leases: Vec<String> = (0..TRIALS + 1)
        .map(|_| h.lease(&["origin.test"], &[]))
        .collect();
    let parent = h.lease(&["*.test"], &[]);
    let child = h.lease_with(
        &["origin.test"],
        &[],
        Some(&parent),
        leasegate::contract::Timestamp::now(),
        Duration::from_secs(600),
    );
    let published = Instant::now();
    publish_file(&stream, &h.journal).await;
    for server in [&a, &b, &c] {
        assert!(until_status(server, &child, "open", AT_ONCE).await);
    }
    eprintln!(
        "grants published -> open on three replicas in {:?}",
        published.elapsed()
    );

    // A refusal on A closes the lease's tunnel on C.
    let mut samples = Vec::new();
    for lease in &leases[..TRIALS] {
        let mut tunnel = streaming_tunnel(c.addr, &target, Some(lease)).await;
        let started = Instant::now();
        refuse(&a, lease).await;
        until_closed(&mut tunnel, AT_ONCE * 2).await;
        samples.push(started.elapsed());
    }
    let (p50, p99) = percentiles(samples);
    eprintln!("refusal on A -> tunnel on C closed: p50 {p50:?}, p99 {p99:?} over {TRIALS} trials");
    assert!(p99 <= AT_ONCE, "p99 {p99:?}");

    // An admin revocation on B does the same.
    let lease = &leases[TRIALS];
    let mut tunnel = streaming_tunnel(c.addr, &target, Some(lease)).await;
    admin_revoke(&b, lease).await;
    let closed = until_closed(&mut tunnel, AT_ONCE * 2).await;
    assert!(closed <= AT_ONCE, "{closed:?}");

    // A parent revoked on A closes its child's tunnel on C.
    let mut tunnel = streaming_tunnel(c.addr, &target, Some(&child)).await;
    refuse(&a, &parent).await;
    let closed = until_closed(&mut tunnel, AT_ONCE * 2).await;
    assert!(closed <= AT_ONCE, "{closed:?}");

    // One proxy-written record per revoked lease, whatever replica wrote it.
    let all = records(&stream).await;
    for lease in leases.iter().chain([&parent]) {
        assert_eq!(proxy_revocations(&all, lease), 1, "{lease}");
    }
    assert_eq!(proxy_revocations(&all, &child), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_refusing_one_lease_at_once_leave_one_record() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    let c = replica(&h, &cluster, "LG", "c").await;
    let leases: Vec<String> = (0..5).map(|_| h.lease(&["origin.test"], &[])).collect();
    publish_file(&stream, &h.journal).await;
    for lease in &leases {
        for server in [&a, &b, &c] {
            assert!(until_status(server, lease, "open", AT_ONCE).await);
        }
        tokio::join!(refuse(&a, lease), refuse(&b, lease), refuse(&c, lease));
    }
    for lease in &leases {
        for server in [&a, &b, &c] {
            assert!(until_status(server, lease, "revoked", AT_ONCE).await);
        }
    }
    let all = records(&stream).await;
    for lease in &leases {
        let mine: Vec<&Value> = all.iter().filter(|r| r["lease_id"] == *lease).collect();
        assert_eq!(proxy_revocations(&all, lease), 1, "{lease}: {mine:#?}");
    }
}

/// A CONNECT to the origin through `server` for `lease`: the refusal code, or `None` for 200.
async fn connect_code(server: &Server, target: &str, lease: &str) -> Option<String> {
    let answer = raw(
        server.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    if answer.starts_with("HTTP/1.1 200") {
        return None;
    }
    let code = answer
        .lines()
        .find_map(|l| l.strip_prefix("x-leasegate-refusal: "))
        .unwrap_or("(no code)");
    Some(code.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_whole_cluster_stopped_replicas_keep_enforcing_and_queue_revocations() {
    if nats_missing() {
        return;
    }
    let mut cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let target = format!("origin.test:{}", origin.addr.port());
    let open = h.lease(&["origin.test"], &[]);
    let revoked = h.lease(&["origin.test"], &[]);
    let refused_offline = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let stale = |mut s: StoreOptions| {
        s.nats.stale_after = Duration::from_secs(1);
        s
    };
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(cluster.location_as(Role::Replica, "LG"));
    config.store = stale(StoreOptions {
        data_dir: h.dir.path().join("a"),
        ..StoreOptions::default()
    });
    let a = Server::start(config.clone()).await.unwrap();
    config.store.data_dir = h.dir.path().join("b");
    let b = Server::start(config).await.unwrap();
    refuse(&a, &revoked).await;
    assert!(until_status(&b, &revoked, "revoked", AT_ONCE).await);
    assert!(until_status(&b, &refused_offline, "open", AT_ONCE).await);

    for node in &mut cluster.nodes {
        node.kill();
    }
    // The last known state is enforced.
    assert_eq!(
        connect_code(&b, &target, &revoked).await.as_deref(),
        Some("lease-revoked")
    );
    assert_eq!(connect_code(&b, &target, &open).await, None);
    // A refusal still revokes, here and now: the lease's open tunnel closes at once, not when
    // the append gives up (after its request timeout: the bound, so the order is what counts).
    let mut tunnel = streaming_tunnel(a.addr, &target, Some(&refused_offline)).await;
    let closing = tokio::spawn(async move { until_closed(&mut tunnel, AT_ONCE * 2).await });
    let started = Instant::now();
    refuse(&a, &refused_offline).await;
    let answered = started.elapsed();
    let closed = closing.await.unwrap();
    assert!(
        closed < leasegate::nats::REQUEST_TIMEOUT,
        "the tunnel closed after {closed:?}; the refusal was answered after {answered:?}"
    );
    assert_eq!(
        connect_code(&a, &target, &refused_offline).await.as_deref(),
        Some("lease-revoked")
    );
    // Both replicas say they are not following the store.
    for server in [&a, &b] {
        let unready = readyz_turns(server, 503, Duration::from_secs(5))
            .await
            .expect("/readyz stayed 200 without the store");
        assert!(
            unready["reason"].as_str().unwrap().contains("no contact"),
            "{unready}"
        );
    }
    let (_, metrics) = crate::support::harness::admin_text(&a, "/metrics").await;
    assert!(
        metrics.contains("leasegate_store_pending_appends 1"),
        "{metrics}"
    );

    for node in &mut cluster.nodes {
        node.start();
    }
    // The queued record is published once, and the other replica applies it.
    assert!(
        until_status(&b, &refused_offline, "revoked", Duration::from_secs(40)).await,
        "the queued revocation never reached B"
    );
    for server in [&a, &b] {
        let ready = readyz_turns(server, 200, Duration::from_secs(20)).await;
        assert!(ready.is_some(), "/readyz never came back");
    }
    let all = records(&stream).await;
    assert_eq!(proxy_revocations(&all, &refused_offline), 1);
    assert_eq!(proxy_revocations(&all, &revoked), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_replica_catches_up_and_converges() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let first = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, "LG", "a").await;
    let b = replica(&h, &cluster, "LG", "b").await;
    assert!(until_status(&b, &first, "open", AT_ONCE).await);
    b.shutdown().await;
    refuse(&a, &first).await;
    let journal_before = tokio::fs::read(&h.journal).await.unwrap();
    let second = h.lease(&["origin.test"], &[]);
    let journal_after = tokio::fs::read(&h.journal).await.unwrap();
    let new_line = &journal_after[journal_before.len()..];
    let granted: Value = serde_json::from_slice(new_line).unwrap();
    stream
        .publish(
            stream.subject(Some(&second)),
            new_line.trim_ascii_end(),
            None,
        )
        .await
        .unwrap();
    assert_eq!(granted["lease_id"], second.as_str());
    let b = replica(&h, &cluster, "LG", "b").await;
    let (status, _) = admin_get(&b, "/readyz").await;
    assert_eq!(status, 200);
    // The same leases in the same states (counters and proxy addresses are each replica's own).
    let states = |view: Value| -> Vec<(String, String)> {
        view["leases"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| (l["lease_id"].to_string(), l["status"].to_string()))
            .collect()
    };
    let on_a = states(admin_get(&a, "/leases").await.1);
    let on_b = states(admin_get(&b, "/leases").await.1);
    assert_eq!(on_a.len(), 2);
    assert_eq!(on_a, on_b);
    let (_, view) = admin_get(&b, &format!("/leases/{first}")).await;
    assert_eq!(view["status"], "revoked");
    let (_, view) = admin_get(&b, &format!("/leases/{second}")).await;
    assert_eq!(view["status"], "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_keeps_following_when_the_stream_leader_dies_under_it() {
    if nats_missing() {
        return;
    }
    let mut cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let leader = eventually(Duration::from_secs(10), || async {
        stream.stream.get_info().await.ok()?.cluster?.leader
    })
    .await
    .expect("the stream has no leader");
    let (dead, alive): (Vec<usize>, Vec<usize>) =
        (0..3).partition(|&i| cluster.nodes[i].name == leader);
    // The replica talks to a node that stays up; the stream's leader (and, as a rule, the
    // replica's consumer with it) goes away under it.
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(NatsCluster::location_of(
        Role::Replica,
        &cluster.nodes[alive[0]],
        "LG",
    ));
    config.store.data_dir = h.dir.path().join("a");
    let replica = Server::start(config).await.unwrap();
    let first = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    assert!(until_status(&replica, &first, "open", AT_ONCE).await);
    cluster.nodes[dead[0]].kill();
    // A grant published after the leader died still reaches the replica.
    let before = tokio::fs::read(&h.journal).await.unwrap().len();
    let second = h.lease(&["origin.test"], &[]);
    let after = tokio::fs::read(&h.journal).await.unwrap();
    let other = NatsCluster::location_of(Role::Operator, &cluster.nodes[alive[1]], "LG");
    let publisher = eventually(Duration::from_secs(20), || async {
        leasegate::nats::NatsStream::connect(
            &other,
            &Default::default(),
            &leasegate::nats::StreamSpec::JOURNAL,
        )
        .await
        .ok()
    })
    .await
    .expect("the stream never came back");
    let published = eventually(Duration::from_secs(20), || async {
        publisher
            .publish(
                publisher.subject(Some(&second)),
                after[before..].trim_ascii_end(),
                Some("second-grant"),
            )
            .await
            .ok()
    })
    .await;
    assert!(published.is_some(), "the new leader never took the grant");
    assert!(
        until_status(&replica, &second, "open", Duration::from_secs(30)).await,
        "the replica stopped following"
    );
}
