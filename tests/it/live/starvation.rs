//! The starvation budget: under each load that once held revocations back — descriptor
//! pressure, a flood of lease-walking admin requests, a bridge wedged on a line the stream
//! cannot take, a saturated blocking pool — every revocation appended to the journal closes
//! its lease's tunnel within [`BOUND`]. `cargo bench --bench starvation` measures the same loads
//! at full scale against the 250 ms p99 target; here the loads are scaled to a test and the
//! bound is one a loaded 2-core machine keeps (each load once held revocations for seconds).

use crate::admin::flood::{flood, many_leases, Answers, BLOCKING_THREADS, FLOODERS};
use crate::cluster::bridges::start_mirror;
use crate::proxy::descriptors::{echo_origin, pending, tunnel, tunnels, Served};
use crate::support::harness::AT_ONCE;
use crate::support::harness::{eventually, until_closed, Harness};
use crate::support::nats::{NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::Timestamp;
use serde_json::Map;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;

/// Revocations measured under each load, one after another.
const REVOCATIONS: usize = 8;

/// The median revocation closes its tunnel within this, and every one within [`AT_ONCE`] (a
/// loaded machine may stall one). Unloaded it takes one poll of the journal (50 ms); behind
/// each load it once took seconds, or forever, every time. The p99 is `benches/starvation.rs`'s.
const BOUND: Duration = Duration::from_millis(1500);

/// A lease with an echoing tunnel open through the proxy.
struct Watched {
    lease: String,
    tunnel: TcpStream,
}

/// A tunnel for each of `leases` through `proxy` to the echo origin on `port` (once the
/// proxy has their grants).
async fn watch(leases: Vec<String>, proxy: SocketAddr, port: u16) -> Vec<Watched> {
    let mut watched = Vec::new();
    for lease in leases {
        let opened = eventually(Duration::from_secs(10), || tunnel(proxy, &lease, port)).await;
        let tunnel = opened.unwrap_or_else(|| panic!("no tunnel for {lease}"));
        watched.push(Watched { lease, tunnel });
    }
    watched
}

fn watched_leases(h: &Harness) -> Vec<String> {
    (0..REVOCATIONS)
        .map(|_| h.lease(&["origin.test"], &[]))
        .collect()
}

/// Revokes each watched lease in turn by a signed line appended to `h`'s journal (as
/// `leasegate revoke` does from another process, after the line `before` makes, if any), and
/// times until its tunnel closes. The times, sorted.
async fn revoke_each(
    h: &Harness,
    watched: Vec<Watched>,
    before: Option<&dyn Fn(&str) -> String>,
) -> Vec<Duration> {
    let mut times = Vec::new();
    for Watched { lease, mut tunnel } in watched {
        if let Some(line) = before {
            h.append(&line(&lease)).await;
        }
        let revocation = record::revoked(
            &Revocation {
                lease_id: &lease,
                parent_lease_id: None,
                by: "issuer",
                reason: "starvation budget",
                extra: Map::new(),
            },
            &h.key,
            Timestamp::now(),
        )
        .unwrap();
        h.append(&revocation.to_string()).await;
        times.push(until_closed(&mut tunnel, Duration::from_secs(60)).await);
    }
    times.sort();
    times
}

/// Asserts that every revocation under `load` kept the budget; says the figures either way.
fn assert_within_budget(load: &str, times: &[Duration], logs: impl FnOnce() -> String) {
    let (median, worst) = (times[times.len() / 2], times[times.len() - 1]);
    eprintln!("{load}: revocation to teardown median {median:?}, worst {worst:?}");
    if median > BOUND || worst > AT_ONCE {
        panic!(
            "{load}: revocations took {median:?} (median) and {worst:?} (worst) to close their \
             tunnels (all: {times:?})\n{}",
            logs()
        );
    }
}

/// A runtime like `serve`'s control runtime, scaled down: 2 workers and a small blocking pool
/// (what the flood and the blocking load fill).
fn small_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(BLOCKING_THREADS)
        .enable_all()
        .build()
        .unwrap()
}

/// A `serve` process under 512 descriptors, one lease holder's 150 tunnels and 300 connections
/// that never finish their head taking what it has.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_pressure_delays_no_revocation() {
    let h = Harness::new();
    let leases = watched_leases(&h);
    let holder = h.lease(&["origin.test"], &[]);
    let port = echo_origin().await;
    let served = Served::start(&h, "-n 512", &[]);
    let watched = watch(leases, served.proxy, port).await;
    let pressure = tunnels(served.proxy, &holder, port, 150).await;
    let _pending = pending(served.proxy, 300).await;
    assert!(pressure.len() >= 20, "{} tunnels", pressure.len());

    let times = revoke_each(&h, watched, None).await;
    assert_within_budget("descriptor pressure", &times, || served.logs());
}

/// 64 clients asking `/leases?limit=1000&counts=true` and `/metrics` over 5,000 leases, in a
/// loop, for as long as the revocations take.
#[test]
fn an_admin_flood_delays_no_revocation() {
    small_runtime().block_on(async {
        let h = Harness::new();
        many_leases(&h);
        let leases = watched_leases(&h);
        let port = echo_origin().await;
        let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
        let watched = watch(leases, server.addr, port).await;

        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let answers = Arc::new(Answers::default());
        let admin = server.admin_addr.unwrap();
        let flooders = flood(admin, stop.clone(), started.clone(), answers.clone());
        let flooding = eventually(Duration::from_secs(30), || async {
            (started.load(Ordering::SeqCst) == FLOODERS && answers.ok.load(Ordering::SeqCst) > 0)
                .then_some(())
        })
        .await;
        assert!(flooding.is_some(), "the flood never got going");

        let times = revoke_each(&h, watched, None).await;
        stop.store(true, Ordering::SeqCst);
        let answered = answers.ok.load(Ordering::SeqCst);
        tokio::task::spawn_blocking(move || flooders.into_iter().for_each(|f| f.join().unwrap()))
            .await
            .unwrap();
        assert_within_budget("admin flood", &times, || {
            format!("{answered} lease walks answered during the revocations")
        });
    });
}

/// The issuer's journal is mirrored to a stream whose server takes at most 64 KiB a message,
/// and before each revocation the file gets a line the stream can never take; the replica
/// follows the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_bridge_line_delays_no_revocation() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start_with(1, "max_payload: 65536\n");
    let _stream = cluster.journal("LG").await;
    let h = Harness::new();
    let leases = watched_leases(&h);
    let (mut mirror, _) = start_mirror(&h.journal, &cluster.url_as(Role::Issuer, "LG")).await;
    let replica = crate::cluster::scale_out::replica(&h, &cluster, "LG", "replica").await;
    let port = echo_origin().await;
    let watched = watch(leases, replica.addr, port).await;

    let oversized = |lease: &str| {
        format!(
            r#"{{"lease_id":"{lease}","event":"heartbeat","pad":"{}"}}"#,
            "x".repeat(100 * 1024)
        )
    };
    let times = revoke_each(&h, watched, Some(&oversized)).await;
    mirror.kill().await.unwrap();
    assert_within_budget("wedged bridge line", &times, String::new);
}

/// Every thread of the runtime's blocking pool held by work that takes 250 ms, with seven
/// times as much queued behind it (what is queued now waits about 2 s), for as long as the
/// revocations take.
#[test]
fn a_saturated_blocking_pool_delays_no_revocation() {
    small_runtime().block_on(async {
        let h = Harness::new();
        let leases = watched_leases(&h);
        let port = echo_origin().await;
        let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
        let watched = watch(leases, server.addr, port).await;

        let stop = Arc::new(AtomicBool::new(false));
        let load = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut held = tokio::task::JoinSet::new();
                while !stop.load(Ordering::SeqCst) {
                    while held.len() < 8 * BLOCKING_THREADS {
                        held.spawn_blocking(|| std::thread::sleep(Duration::from_millis(250)));
                    }
                    held.join_next().await;
                }
                held.len()
            })
        };
        // Queued work behind busy threads: the pool is saturated.
        tokio::time::sleep(Duration::from_millis(500)).await;

        let times = revoke_each(&h, watched, None).await;
        stop.store(true, Ordering::SeqCst);
        let queued = load.await.unwrap();
        assert!(queued > BLOCKING_THREADS, "the pool was never saturated");
        assert_within_budget("saturated blocking pool", &times, String::new);
    });
}
