//! A replica that is behind its journal stream says so and catches up before it admits: a
//! stream deleted and created again is folded from its start, readiness follows the stream's
//! last sequence, and a replica that was stopped does not admit before it has read what it
//! missed.

use crate::cluster::scale_out::{refuse, replica, replica_at};
use crate::support::bin;
use crate::support::harness::{
    admin_get, admin_text, eventually, http_origin, raw, readyz_turns, Harness, Origin,
};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::contract::Keyring;
use leasegate::nats::{NatsOptions, NatsStream};
use leasegate::registry::store::nats::NatsStore;
use leasegate::registry::{JournalLocation, Registry, StoreOptions};
use leasegate::server::Server;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The refusal code of `answer`, or `None` for a 200.
fn refusal_code(answer: &str) -> Option<String> {
    if answer.starts_with("HTTP/1.1 200") {
        return None;
    }
    Some(
        answer
            .lines()
            .find_map(|l| l.strip_prefix("x-leasegate-refusal: "))
            .unwrap_or("(no code)")
            .trim()
            .to_owned(),
    )
}

/// The journal lines of `h` that grant `lease`.
fn grant_of(h: &Harness, lease: &str) -> Vec<u8> {
    let journal = std::fs::read_to_string(&h.journal).unwrap();
    journal
        .lines()
        .find(|l| l.contains(lease) && l.contains("\"granted\""))
        .unwrap()
        .as_bytes()
        .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_and_created_again_is_folded_from_its_start() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let target = format!("origin.test:{}", origin.addr.port());
    let only_old = h.lease(&["origin.test"], &[]);
    let revoked = h.lease(&["origin.test"], &[]);
    let padding: Vec<String> = (0..4).map(|_| h.lease(&["origin.test"], &[])).collect();
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, "LG", "a").await;
    refuse(&a, &revoked).await;
    let fresh = h.lease(&["origin.test"], &[]);

    // The operator deletes the stream and creates it again; it then holds fewer messages than
    // the replica folded (today's replica skipped them all).
    stream
        .jetstream
        .delete_stream("LG")
        .await
        .expect("deleting the stream");
    let again = cluster.journal("LG").await;
    for (lease, line) in [
        (&fresh, grant_of(&h, &fresh)),
        (&revoked, grant_of(&h, &revoked)),
    ] {
        again
            .publish(again.subject(Some(lease)), &line, None)
            .await
            .unwrap();
    }
    assert!(again.last_sequence().await.unwrap() < 2 + padding.len() as u64);

    let opened = eventually(Duration::from_secs(10), || async {
        let (_, view) = admin_get(&a, &format!("/leases/{fresh}")).await;
        (view["status"] == "open").then_some(())
    })
    .await;
    assert!(
        opened.is_some(),
        "a grant of the new stream never opened: the replica skipped it"
    );
    // A closure already seen stays in force, though the new stream grants the lease again
    // and holds no closing for it.
    let answer = raw(
        a.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {revoked}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(
        refusal_code(&answer).as_deref(),
        Some("lease-revoked"),
        "{answer}"
    );
    // A lease only the old stream granted is no longer admitted.
    let answer = raw(
        a.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {only_old}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(
        refusal_code(&answer).as_deref(),
        Some("lease-unknown"),
        "{answer}"
    );
    let answer = raw(
        a.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {fresh}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(refusal_code(&answer), None, "{answer}");
    assert!(
        readyz_turns(&a, 200, Duration::from_secs(10))
            .await
            .is_some(),
        "not ready after folding the new stream"
    );
    let (_, metrics) = admin_text(&a, "/metrics").await;
    assert!(
        metrics.contains("leasegate_store_replaced_total 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_streams_last_sequence_not_the_last_message_received() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let mut keyring = Keyring::new(false);
    keyring.insert(h.key.clone());
    // Contact never lapses here: only the lag can make the store a problem.
    let options = NatsOptions {
        stale_after: Duration::from_secs(60),
        ..NatsOptions::default()
    };
    let store = NatsStore::open(
        &cluster.location_as(Role::Replica, "LG"),
        &options,
        &keyring,
        1 << 20,
        leasegate::nats::IfMissing::Create,
    )
    .await
    .unwrap();
    // No follower runs: nothing is folded until the test reads.
    let registry = Registry::open(Box::new(store), keyring).await.unwrap();
    assert_eq!(registry.journal_problem(), None);
    let lease = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;

    // The stream holds a message the fold has not reached: behind, and /readyz says so.
    let problem = eventually(Duration::from_secs(10), || async {
        registry.journal_problem()
    })
    .await
    .expect("ready while the stream holds a grant not folded");
    assert!(problem.contains("behind the stream"), "{problem}");
    assert!(problem.contains("folded up to sequence 0"), "{problem}");
    assert!(registry.store_health().lag > Duration::ZERO);
    assert!(registry.snapshot().ledger.lease(&lease).is_none());

    // Caught up: ready again.
    registry.refresh().await.unwrap();
    assert!(registry.snapshot().ledger.lease(&lease).is_some());
    assert_eq!(registry.journal_problem(), None);
    assert_eq!(registry.store_health().lag, Duration::ZERO);
}

/// A harness with `n` leases for `origin.test`, granted in `stream`; a loopback origin for
/// them (kept while it is held) and its `origin.test:PORT`.
async fn leased(stream: &NatsStream, n: usize) -> (Harness, Origin, String, Vec<String>) {
    let h = Harness::new();
    let origin = http_origin().await;
    let target = format!("origin.test:{}", origin.addr.port());
    let leases: Vec<String> = (0..n).map(|_| h.lease(&["origin.test"], &[])).collect();
    publish_file(stream, &h.journal).await;
    (h, origin, target, leases)
}

/// `serve` on `cluster`'s stream as a child process (so it can be stopped), on loopback
/// origins; its proxy address.
async fn child_replica(
    h: &Harness,
    cluster: &NatsCluster,
    data: &str,
) -> (tokio::process::Child, std::net::SocketAddr) {
    let url = cluster.url_as(Role::Replica, "LG");
    let data = h.dir.path().join(data);
    let log = std::fs::File::create(h.dir.path().join("child.log")).unwrap();
    let mut child = tokio::process::Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--admin", "off"])
        .args([
            "--journal",
            &url,
            "--key-file",
            h.key_path.to_str().unwrap(),
        ])
        .args(["--data-dir", data.to_str().unwrap()])
        .args([
            "--resolve",
            "origin.test=127.0.0.1",
            "--resolve",
            "denied.example=127.0.0.1",
        ])
        .args([
            "--allow-private",
            "127.0.0.1/32",
            "--forward-ports",
            "1-65535",
        ])
        .env_remove("RUST_LOG")
        .env("LEASEGATE_CONNECT_PORTS", "1-65535")
        .stdout(std::process::Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut banner),
    )
    .await
    .expect("the replica never started")
    .unwrap();
    let addr = banner.trim().rsplit(' ').next().unwrap().parse().unwrap();
    // Whatever it prints later must not block it.
    tokio::spawn(async move { tokio::io::copy(&mut stdout, &mut tokio::io::sink()).await });
    (child, addr)
}

fn signal(child: &tokio::process::Child, signal: nix::sys::signal::Signal) {
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, signal).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stopped_while_a_lease_is_revoked_refuses_it_as_soon_as_it_runs_again() {
    if nats_missing() {
        return;
    }
    const TRIALS: usize = 8;
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let (h, _origin, target, leases) = leased(&stream, TRIALS).await;
    let a = replica(&h, &cluster, "LG", "a").await;
    let (b, b_addr) = child_replica(&h, &cluster, "b").await;
    let connect = |lease: &str| format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
    let opened = eventually(Duration::from_secs(10), || async {
        refusal_code(&raw(b_addr, connect(&leases[TRIALS - 1]).as_bytes()).await)
            .is_none()
            .then_some(())
    })
    .await;
    assert!(opened.is_some(), "B never admitted the leases");

    let mut admitted = Vec::new();
    for lease in &leases {
        signal(&b, nix::sys::signal::Signal::SIGSTOP);
        // Longer than a pause B can miss (its heartbeat beats every 100 ms).
        tokio::time::sleep(Duration::from_millis(1500)).await;
        refuse(&a, lease).await;
        // The request waits in B's socket: B reads it the moment it runs again.
        let mut client = tokio::net::TcpStream::connect(b_addr).await.unwrap();
        client.write_all(connect(lease).as_bytes()).await.unwrap();
        signal(&b, nix::sys::signal::Signal::SIGCONT);
        let mut answer = vec![0; 4096];
        let n = tokio::time::timeout(Duration::from_secs(20), client.read(&mut answer))
            .await
            .expect("B never answered")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]).into_owned();
        match refusal_code(&answer).as_deref() {
            Some("lease-revoked") => {}
            None => admitted.push(lease.clone()),
            other => panic!("{other:?}: {answer}"),
        }
    }
    assert!(
        admitted.is_empty(),
        "B admitted {} of {TRIALS} leases revoked while it was stopped",
        admitted.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_the_stream_refuses_a_lease_revoked_meanwhile_once_contact_is_back()
{
    if nats_missing() {
        return;
    }
    const TRIALS: usize = 3;
    // B's --store-stale-after: the gap it notices, and the bound of its catch-up.
    const STALE: Duration = Duration::from_secs(4);
    let mut cluster = NatsCluster::start_unadvertised(3);
    let stream = cluster.journal("LG").await;
    let (h, _origin, target, leases) = leased(&stream, TRIALS).await;
    let a = replica_at(
        &h,
        NatsCluster::location_of(Role::Replica, &cluster.nodes[0], "LG"),
        3,
        "a",
    )
    .await;
    // B reaches the cluster through the third node only.
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(NatsCluster::location_of(
        Role::Replica,
        &cluster.nodes[2],
        "LG",
    ));
    config.store = StoreOptions {
        data_dir: h.dir.path().join("b"),
        ..StoreOptions::default()
    };
    config.store.nats.replicas = 3;
    config.store.nats.stale_after = STALE;
    let b = Server::start(config).await.unwrap();
    let connect = |lease: &str| format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
    let opened = eventually(Duration::from_secs(10), || async {
        refusal_code(&raw(b.addr, connect(&leases[TRIALS - 1]).as_bytes()).await)
            .is_none()
            .then_some(())
    })
    .await;
    assert!(opened.is_some(), "B never admitted the leases");
    let no_contact = || {
        b.proxy
            .registry
            .store_health()
            .problem
            .is_some_and(|p| p.contains("no contact"))
    };

    for lease in &leases {
        cluster.nodes[2].kill();
        let lost = eventually(Duration::from_secs(20), || async {
            no_contact().then_some(())
        })
        .await;
        assert!(
            lost.is_some(),
            "B never noticed it had lost contact: {:?}",
            b.proxy.registry.store_health().problem
        );
        // Revoked on A, through a node B cannot reach: B hears of it only through the stream
        // (the closing broadcast is gone by the time B is connected again).
        refuse(&a, lease).await;
        // The record is appended after the refusal is answered (and may wait for a new
        // stream leader): B is to find it in the stream.
        let appended = eventually(Duration::from_secs(30), || async {
            let lines = stream.read_all().await.ok()?;
            lines
                .iter()
                .any(|(_, line)| {
                    let record: serde_json::Value = serde_json::from_slice(line).unwrap();
                    record["event"] == "revoked" && record["lease_id"] == lease.as_str()
                })
                .then_some(())
        })
        .await;
        assert!(
            appended.is_some(),
            "A's revocation never reached the stream"
        );
        tokio::task::block_in_place(|| cluster.nodes[2].start());
        // The first request B reads once the stream answers it again is decided on what the
        // stream holds, not on the state B had before the gap.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while no_contact() {
            assert!(
                std::time::Instant::now() < deadline,
                "B never regained contact"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let asked = std::time::Instant::now();
        let answer = raw(b.addr, connect(lease).as_bytes()).await;
        let took = asked.elapsed();
        assert_eq!(
            refusal_code(&answer).as_deref(),
            Some("lease-revoked"),
            "B admitted a lease revoked while it had no contact with the stream (after {took:?}; {:?}): {answer}",
            b.proxy.registry.journal_problem()
        );
    }
    assert!(
        readyz_turns(&b, 200, Duration::from_secs(20))
            .await
            .is_some(),
        "B never ready again"
    );
}
