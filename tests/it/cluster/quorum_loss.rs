//! A replica (`leasegate serve`, a child process) on a three-node JetStream cluster that has
//! lost its quorum: a revocation is on disk before its append is tried, so a `kill -9` while
//! the append waits loses nothing; a replica started during the loss waits for the cluster for
//! `--store-start-timeout`, whatever the error, and names the last one when it gives up.

use crate::cluster::scale_out::replica;
use crate::support::harness::{eventually, raw, Harness};
use crate::support::leasegate_command;
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use futures_util::StreamExt;
use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};
use leasegate::server::Server;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// `leasegate serve` as a replica of `cluster`'s stream `LG`, its queue under `data`, its
/// admin API on loopback, its log in `<data>.log`.
struct ChildReplica {
    child: Child,
    data: PathBuf,
    log: PathBuf,
}

impl ChildReplica {
    fn spawn(h: &Harness, cluster: &NatsCluster, data: &Path, more: &[&str]) -> ChildReplica {
        let log = data.with_extension("log");
        let url = cluster.url_as(Role::Replica, "LG");
        let mut args = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--egress-log",
            "off",
            "--journal",
            &url,
            "--nats-replicas",
            "3",
            "--key-file",
            h.key_path.to_str().unwrap(),
            "--data-dir",
            data.to_str().unwrap(),
        ];
        args.extend_from_slice(more);
        let child = leasegate_command(&args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        ChildReplica {
            child,
            data: data.to_owned(),
            log,
        }
    }

    /// The proxy's address, once it listens (`None`: it exited, or not within `limit`).
    async fn listening(&mut self, limit: Duration) -> Option<std::net::SocketAddr> {
        let stdout = self.child.stdout.take().unwrap();
        let line = tokio::task::spawn_blocking(move || {
            BufReader::new(stdout).lines().next().and_then(Result::ok)
        });
        let line = tokio::time::timeout(limit, line).await.ok()?.unwrap()?;
        line.rsplit(' ').next()?.parse().ok()
    }

    /// The admin API's address, from the log.
    fn admin(&self) -> std::net::SocketAddr {
        let log = std::fs::read_to_string(&self.log).unwrap();
        let line = log
            .lines()
            .find(|l| l.contains("admin API listening"))
            .unwrap_or_else(|| panic!("no admin address in the log:\n{log}"));
        let at = line.find("admin_addr=").unwrap() + "admin_addr=".len();
        line[at..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    fn queue(&self) -> PathBuf {
        self.data.join("LG.pending")
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `kill -9`.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildReplica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The status `server` shows for `lease` on its admin API.
async fn status_on(admin: std::net::SocketAddr, lease: &str) -> Option<String> {
    let answer = raw(
        admin,
        format!("GET /leases/{lease} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    let body = answer.split("\r\n\r\n").nth(1)?;
    let view: Value = serde_json::from_str(body).ok()?;
    view["status"].as_str().map(str::to_owned)
}

fn admin_of(server: &Server) -> std::net::SocketAddr {
    server.admin_addr.unwrap()
}

/// How many closing records of `lease` the stream holds.
async fn closings(stream: &NatsStream, lease: &str) -> usize {
    stream
        .read_all()
        .await
        .unwrap()
        .iter()
        .filter_map(|(_, line)| serde_json::from_slice::<Value>(line).ok())
        .filter(|r| r["event"] == "revoked" && r["lease_id"] == lease)
        .count()
}

/// A three-node cluster with `LG` at three replicas holding one lease for `origin.test`.
async fn cluster_with_lease(h: &Harness) -> (NatsCluster, NatsStream, String) {
    let cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let lease = h.lease(&["origin.test"], &[]);
    publish_file(&stream, &h.journal).await;
    (cluster, stream, lease)
}

/// Brings the two stopped nodes back and waits until the stream answers again.
async fn restore_quorum(cluster: &mut NatsCluster, stream: &NatsStream) {
    cluster.nodes[1].start();
    cluster.nodes[2].start();
    let back = eventually(Duration::from_secs(60), || async {
        stream.last_sequence().await.ok()
    })
    .await;
    assert!(back.is_some(), "the stream never had a leader again");
}

#[derive(Debug, Clone, Copy)]
enum Revocation {
    /// A CONNECT to a host the lease does not allow.
    Refusal,
    /// `POST /leases/{id}/revoke` on the admin API.
    Admin,
}

/// A replica revokes while the stream has no leader and is killed (-9) as its append is tried;
/// after the quorum is back and the replica restarts, the lease is revoked on every replica and
/// the stream holds exactly one closing record.
async fn a_revocation_survives_a_kill_while_the_stream_has_no_leader(how: Revocation) {
    let h = Harness::new();
    let (mut cluster, stream, lease) = cluster_with_lease(&h).await;
    let data = h.dir.path().join("a");
    let mut a = ChildReplica::spawn(&h, &cluster, &data, &[]);
    let a_addr = a
        .listening(Duration::from_secs(60))
        .await
        .unwrap_or_else(|| panic!("the replica never listened:\n{}", a.log_text()));
    let b = replica(&h, &cluster, "LG", "b").await;
    assert_eq!(status_on(a.admin(), &lease).await.as_deref(), Some("open"));

    // Everything that tries an append: the subject's last message is asked for first (a
    // direct get where the stream allows it), then the record is published.
    let watcher = NatsStream::connect(
        &NatsCluster::location_of(Role::Operator, &cluster.nodes[0], "LG"),
        &NatsOptions::default(),
        &StreamSpec::JOURNAL,
    )
    .await
    .unwrap();
    let mut tried = futures_util::stream::select_all([
        watcher
            .client
            .subscribe("$JS.API.STREAM.MSG.GET.LG")
            .await
            .unwrap(),
        watcher
            .client
            .subscribe("$JS.API.DIRECT.GET.LG.>")
            .await
            .unwrap(),
        watcher
            .client
            .subscribe(format!("leasegate.journal.{lease}"))
            .await
            .unwrap(),
    ]);
    watcher.client.flush().await.unwrap();

    // No quorum: the stream has no leader, an append waits.
    cluster.nodes[1].kill();
    cluster.nodes[2].kill();
    let asked = tokio::spawn({
        let (admin, lease) = (a.admin(), lease.clone());
        async move {
            let request = match how {
                Revocation::Refusal => format!(
                    "CONNECT denied.example:443 HTTP/1.1\r\nHost: denied.example:443\r\nX-Lease-Id: {lease}\r\n\r\n"
                ),
                Revocation::Admin => {
                    let body = r#"{"reason": "operator: stop"}"#;
                    format!(
                        "POST /leases/{lease}/revoke HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    )
                }
            };
            let to = match how {
                Revocation::Refusal => a_addr,
                Revocation::Admin => admin,
            };
            raw(to, request.as_bytes()).await
        }
    });
    let first = tokio::time::timeout(Duration::from_secs(30), tried.next())
        .await
        .expect("the replica never tried its append")
        .unwrap();
    let queued = std::fs::read_to_string(a.queue()).unwrap_or_default();
    assert!(
        queued.contains(&lease) && queued.contains("\"event\":\"revoked\""),
        "when the append is tried ({}), the record is not on disk: {queued:?}",
        first.subject
    );
    a.kill();
    // Killed while its append waits: the client most likely never heard back; either way the
    // record is on disk.
    let _ = asked.await.unwrap();

    restore_quorum(&mut cluster, &stream).await;
    let mut a = ChildReplica::spawn(&h, &cluster, &data, &[]);
    a.listening(Duration::from_secs(60))
        .await
        .unwrap_or_else(|| panic!("the replica never restarted:\n{}", a.log_text()));
    assert_eq!(
        status_on(a.admin(), &lease).await.as_deref(),
        Some("revoked"),
        "the restarted replica keeps the lease closed"
    );
    let everywhere = eventually(Duration::from_secs(30), || async {
        (status_on(admin_of(&b), &lease).await.as_deref() == Some("revoked")).then_some(())
    })
    .await;
    assert!(
        everywhere.is_some(),
        "the other replica never saw the revocation:\n{}",
        a.log_text()
    );
    let drained = eventually(Duration::from_secs(30), || async {
        (!a.queue().exists()).then_some(())
    })
    .await;
    assert!(drained.is_some(), "the queue never drained");
    assert_eq!(closings(&stream, &lease).await, 1, "exactly one record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_survives_a_kill_while_the_stream_has_no_leader() {
    a_revocation_survives_a_kill_while_the_stream_has_no_leader(Revocation::Refusal).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_revoke_survives_a_kill_while_the_stream_has_no_leader() {
    a_revocation_survives_a_kill_while_the_stream_has_no_leader(Revocation::Admin).await;
}

/// A record the stream already holds but the queue still names (a kill after the append
/// landed, before the queue was rewritten) is not appended again at restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_record_the_stream_holds_is_not_appended_again() {
    if nats_missing() {
        return;
    }
    let h = Harness::new();
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let lease = h.lease(&["origin.test"], &[]);
    leasegate::commands::issue::revoke(
        &h.journal,
        &h.key,
        &lease,
        "operator: stop",
        leasegate::contract::Timestamp::now(),
    )
    .unwrap();
    publish_file(&stream, &h.journal).await;
    let record = std::fs::read_to_string(&h.journal)
        .unwrap()
        .lines()
        .find(|l| l.contains("\"event\":\"revoked\""))
        .unwrap()
        .to_owned();
    let data = h.dir.path().join("a");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("LG.pending"), format!("{record}\n")).unwrap();
    let a = replica(&h, &cluster, "LG", "a").await;
    assert_eq!(
        a.proxy.registry.pending(),
        0,
        "found in the stream at start"
    );
    assert!(!data.join("LG.pending").exists());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(closings(&stream, &lease).await, 1, "not appended again");
}

/// Started while two of three nodes are down, a replica waits for the quorum (longer than the
/// 5-11 s it used to give up after) and then serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_started_during_a_quorum_loss_comes_up_once_the_quorum_is_back() {
    if nats_missing() {
        return;
    }
    let h = Harness::new();
    let (mut cluster, stream, lease) = cluster_with_lease(&h).await;
    cluster.nodes[1].kill();
    cluster.nodes[2].kill();
    let data = h.dir.path().join("a");
    let started = Instant::now();
    let mut a = ChildReplica::spawn(&h, &cluster, &data, &[]);
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the replica gave up after {:?}:\n{}",
        started.elapsed(),
        a.log_text()
    );
    restore_quorum(&mut cluster, &stream).await;
    let addr = a.listening(Duration::from_secs(60)).await;
    assert!(
        addr.is_some(),
        "the replica never came up:\n{}",
        a.log_text()
    );
    // Said in full when it fails: whether the replica is still running, what its admin API
    // answered, and its log.
    let admin = a.admin();
    let status = match tokio::net::TcpStream::connect(admin).await {
        Ok(_) => status_on(admin, &lease).await,
        Err(e) => Some(format!("admin API unreachable: {e}")),
    };
    assert_eq!(
        status.as_deref(),
        Some("open"),
        "exited: {:?}\n{}",
        a.child.try_wait(),
        a.log_text()
    );
}

/// Past `--store-start-timeout`, `serve` exits non-zero and names the last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_gives_up_names_the_last_error() {
    if nats_missing() {
        return;
    }
    let h = Harness::new();
    let (mut cluster, _stream, _lease) = cluster_with_lease(&h).await;
    cluster.nodes[1].kill();
    cluster.nodes[2].kill();
    let data = h.dir.path().join("a");
    let started = Instant::now();
    let mut a = ChildReplica::spawn(&h, &cluster, &data, &["--store-start-timeout", "3s"]);
    let status = tokio::task::spawn_blocking(move || {
        let status = a.child.wait().unwrap();
        (status, a.log_text())
    });
    let (status, log) = tokio::time::timeout(Duration::from_secs(60), status)
        .await
        .expect("serve never gave up")
        .unwrap();
    assert!(!status.success());
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("/LG: not open after") && last.contains("the last error: "),
        "{log}"
    );
}
