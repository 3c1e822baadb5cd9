//! Revocations through a stream leader's failover, on a three-node `nats-server` cluster
//! (Debian's package) on loopback with the users of `deploy/nats/`: replicas A and C each
//! follow the R3 journal stream through a node that stays up; a refusal (a revocation) on A
//! → the lease's token cancelled on C, p50 and p99, in two phases:
//!
//! - leader kill: the stream leader is killed (-9) and the refusals start at once, paced over
//!   the election;
//! - step-down: `$JS.API.STREAM.LEADER.STEPDOWN.<stream>` while refusals go on.
//!
//! `cargo bench --bench failover` (`TRIALS=N` refusals per phase, 150 by default). Not
//! criterion: each figure is one measurement with its own fault.

mod common;
#[allow(dead_code)] // the tests' helpers, shared
#[path = "../tests/it/support/nats.rs"]
mod nats_support;

use common::{keyring, lease_id, percentiles, setting, signed_lease};
use leasegate::contract::{Key, Timestamp};
use leasegate::nats::NatsStream;
use leasegate::registry::open::open_registry;
use leasegate::registry::{JournalLocation, Registry, StoreOptions};
use nats_support::{NatsCluster, Role};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Between two refusals: a phase's refusals span the election that follows its fault.
const PACE: Duration = Duration::from_millis(40);

/// A replica's registry on `node`'s view of the stream, followed until `shutdown`.
async fn replica(
    cluster: &NatsCluster,
    node: usize,
    key: &Key,
    dir: &std::path::Path,
    shutdown: &CancellationToken,
) -> Arc<Registry> {
    let location = JournalLocation::Nats(NatsCluster::location_of(
        Role::Replica,
        &cluster.nodes[node],
        "LG",
    ));
    let mut options = StoreOptions {
        data_dir: dir.join(format!("replica-{node}")),
        ..StoreOptions::default()
    };
    options.nats.replicas = 3;
    let registry = Arc::new(
        open_registry(&location, keyring(key), &options, false)
            .await
            .unwrap(),
    );
    tokio::spawn(registry.clone().follow(shutdown.clone()));
    registry
}

/// The stream's leader (by node name), once it has one.
async fn leader(stream: &NatsStream) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Ok(info)) =
            tokio::time::timeout(Duration::from_secs(2), stream.stream.get_info()).await
        {
            if let Some(leader) = info.cluster.and_then(|c| c.leader) {
                return leader;
            }
        }
        assert!(Instant::now() < deadline, "the stream has no leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Revokes leases `leases` on `a`, one every [`PACE`], each measured until its token on `c` is
/// cancelled.
async fn refusals(
    a: &Arc<Registry>,
    c: &Arc<Registry>,
    leases: std::ops::Range<u64>,
) -> Vec<Duration> {
    let mut samples = Vec::new();
    for n in leases {
        let token = c.token(&lease_id(n), Timestamp::now());
        assert!(!token.is_cancelled(), "lease {n} is not open on C");
        let started = Instant::now();
        let a = a.clone();
        // Not awaited: without a stream leader the append waits, the teardown does not.
        tokio::spawn(async move {
            a.revoke(&lease_id(n), "benchmark", Default::default())
                .await
        });
        tokio::time::timeout(Duration::from_secs(30), token.cancelled())
            .await
            .expect("the revocation never reached the other replica");
        samples.push(started.elapsed());
        tokio::time::sleep(PACE).await;
    }
    samples
}

fn report(phase: &str, samples: Vec<Duration>) {
    println!(
        "{phase}: refusal on A -> token cancelled on C: {} refusals",
        percentiles(samples)
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let trials = setting("TRIALS", 150);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let key = Key::from_bytes([7; 32]);
    runtime.block_on(async {
        let mut cluster = NatsCluster::start(3);
        let stream = cluster.journal("LG").await;
        let dir = tempfile::tempdir().unwrap();
        let now = Timestamp::now();
        let expires = Timestamp::from_millis(now.as_millis() + 86_400_000);
        for n in 0..2 * trials {
            let lease = signed_lease(
                &key,
                n,
                (&now.to_string(), &expires.to_string()),
                &["origin.test"],
            );
            let line = json!({"schema_version": "1.2", "at": now.to_string(), "event": "granted",
                              "lease_id": lease_id(n), "lease": lease});
            stream
                .publish(
                    stream.subject(Some(&lease_id(n))),
                    &serde_json::to_vec(&line).unwrap(),
                    None,
                )
                .await
                .unwrap();
        }
        let killed = leader(&stream).await;
        let killed = cluster.nodes.iter().position(|n| n.name == killed).unwrap();
        let alive: Vec<usize> = (0..3).filter(|&i| i != killed).collect();
        let shutdown = CancellationToken::new();
        let a = replica(&cluster, alive[0], &key, dir.path(), &shutdown).await;
        let c = replica(&cluster, alive[1], &key, dir.path(), &shutdown).await;

        cluster.nodes[killed].kill();
        let started = Instant::now();
        report("leader kill", refusals(&a, &c, 0..trials).await);
        let elected = leader(&stream).await;
        println!(
            "  (new leader {elected} {:.1} s after the kill)",
            started.elapsed().as_secs_f64()
        );

        let operator = NatsCluster::location_of(Role::Operator, &cluster.nodes[alive[0]], "LG");
        let operator = NatsStream::connect(
            &operator,
            &Default::default(),
            &leasegate::nats::StreamSpec::JOURNAL,
        )
        .await
        .unwrap();
        let stepdown = operator
            .client
            .request("$JS.API.STREAM.LEADER.STEPDOWN.LG", "".into())
            .await
            .unwrap();
        println!(
            "  (step-down: {})",
            String::from_utf8_lossy(&stepdown.payload)
        );
        report("step-down", refusals(&a, &c, trials..2 * trials).await);
        shutdown.cancel();
    });
}
