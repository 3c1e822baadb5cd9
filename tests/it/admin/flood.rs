//! A busy admin API against the journal follower: a flood of lease-walking requests gets 503s
//! beyond a small limit, the admin API holds a bounded number of connections, and a revocation
//! appended to the journal still closes a lease's tunnel at once.

use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_text, eventually, exchange, http_origin, status_of, streaming_tunnel, until_closed,
    Harness,
};
use crate::support::{granted_line, id, lease};
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::Timestamp;
use serde_json::Map;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Leases in the journal besides the one under test: every lease-walking answer walks them.
const LEASES: u32 = 5_000;

/// Clients asking at once, each in a loop.
pub(crate) const FLOODERS: usize = 64;

/// Blocking threads of the runtime the server runs on: `serve`'s control runtime has tokio's
/// 512, and the flood that filled them was 2,000 clients; both are scaled down together.
pub(crate) const BLOCKING_THREADS: usize = 16;

/// How soon the revocation must close the tunnel, flood or not, on a loaded machine. Without a
/// flood it takes one poll (50 ms); behind the flood it took seconds, or forever. The p99 under
/// a flood is `benches/starvation.rs`'s.
const TEARDOWN_WITHIN: Duration = AT_ONCE;

/// Appends `LEASES` leases open for an hour, signed with the harness's key.
pub(crate) fn many_leases(h: &Harness) {
    let now = Timestamp::now();
    let window = (
        Timestamp::from_millis(now.as_millis() - 60_000).to_string(),
        Timestamp::from_millis(now.as_millis() + 3_600_000).to_string(),
    );
    let mut journal = String::new();
    for n in 0..LEASES {
        let lease = lease(
            &h.key,
            &id(n + 1),
            None,
            (&window.0, &window.1),
            &["api.example.com"],
            &[],
        );
        journal.push_str(&granted_line(&lease, &window.0));
        journal.push('\n');
    }
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&h.journal)
        .unwrap();
    file.write_all(journal.as_bytes()).unwrap();
}

/// One GET on the admin API with a blocking client: the status and the whole answer.
fn get(admin: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(admin).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .ok()?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).ok()?;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer.get(9..12)?.parse().ok()?;
    Some((status, answer))
}

/// What the flood was answered.
#[derive(Default)]
pub(crate) struct Answers {
    pub(crate) ok: AtomicUsize,
    busy: AtomicUsize,
    other: AtomicUsize,
    /// One 503 answer, as it came.
    busy_answer: Mutex<Option<String>>,
}

/// `FLOODERS` threads asking for `/leases?limit=1000&counts=true` and `/metrics` in a loop
/// until `stop`; `started` counts those that sent a first request.
pub(crate) fn flood(
    admin: SocketAddr,
    stop: Arc<AtomicBool>,
    started: Arc<AtomicUsize>,
    answers: Arc<Answers>,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..FLOODERS)
        .map(|i| {
            let (stop, started, answers) = (stop.clone(), started.clone(), answers.clone());
            std::thread::spawn(move || {
                let path = match i % 4 {
                    0 => "/metrics",
                    _ => "/leases?limit=1000&counts=true",
                };
                let mut first = true;
                while !stop.load(Ordering::SeqCst) {
                    if first {
                        started.fetch_add(1, Ordering::SeqCst);
                        first = false;
                    }
                    match get(admin, path) {
                        Some((200, _)) => answers.ok.fetch_add(1, Ordering::SeqCst),
                        Some((503, answer)) => {
                            answers.busy_answer.lock().unwrap().get_or_insert(answer);
                            // A client that retries at once; the pause only spares the machine.
                            std::thread::sleep(Duration::from_millis(5));
                            answers.busy.fetch_add(1, Ordering::SeqCst)
                        }
                        _ => answers.other.fetch_add(1, Ordering::SeqCst),
                    };
                }
            })
        })
        .collect()
}

/// A flood of lease-walking admin requests (the dashboard's `/leases?limit=1000&counts=true`
/// and `/metrics`, from many clients at once) did not delay any admin answer alone: the
/// follower's reads of the journal queued behind them on the blocking pool, and a revocation
/// appended to the journal took seconds to close the lease's tunnel.
#[test]
fn a_flood_of_lease_walks_does_not_delay_a_revocation() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(BLOCKING_THREADS)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let h = Harness::new();
        many_leases(&h);
        let origin = http_origin().await;
        let watched = h.lease(&["origin.test"], &[]);
        let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
        let admin = server.admin_addr.unwrap();
        let target = format!("origin.test:{}", origin.addr.port());
        let mut tunnel = streaming_tunnel(server.addr, &target, Some(&watched)).await;

        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicUsize::new(0));
        let answers = Arc::new(Answers::default());
        let flooders = flood(admin, stop.clone(), started.clone(), answers.clone());
        let flooding = eventually(Duration::from_secs(30), || async {
            (started.load(Ordering::SeqCst) == FLOODERS
                && answers.ok.load(Ordering::SeqCst) + answers.busy.load(Ordering::SeqCst) > 0)
                .then_some(())
        })
        .await;
        assert!(flooding.is_some(), "the flood never got going");

        // Another process revokes the lease: one signed line appended to the journal.
        let revocation = record::revoked(
            &Revocation {
                lease_id: &watched,
                parent_lease_id: None,
                by: "issuer",
                reason: "operator revoked",
                extra: Map::new(),
            },
            &h.key,
            Timestamp::now(),
        )
        .unwrap();
        leasegate::registry::store::file::append(&h.journal, &revocation, false).unwrap();
        let closed_after = until_closed(&mut tunnel, Duration::from_secs(120)).await;

        stop.store(true, Ordering::SeqCst);
        let answers = tokio::task::spawn_blocking(move || {
            for flooder in flooders {
                flooder.join().unwrap();
            }
            answers
        })
        .await
        .unwrap();
        let (ok, busy, other) = (
            answers.ok.load(Ordering::SeqCst),
            answers.busy.load(Ordering::SeqCst),
            answers.other.load(Ordering::SeqCst),
        );
        eprintln!("revocation closed the tunnel after {closed_after:?}; flood: {ok} answered, {busy} busy, {other} other");
        assert!(
            closed_after < TEARDOWN_WITHIN,
            "the revocation closed the tunnel after {closed_after:?} ({ok} answered, {busy} busy)"
        );
        assert!(ok > 0, "some lease walks are answered");
        assert!(busy > 0, "beyond the limit, lease walks are refused");
        assert_eq!(other, 0, "every request is answered 200 or 503");
        let busy_answer = answers.busy_answer.lock().unwrap().clone().unwrap();
        let (head, body) = busy_answer.split_once("\r\n\r\n").unwrap();
        assert!(head.to_ascii_lowercase().contains("\r\nretry-after: 1"), "{head}");
        let error: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(error["error"].as_str().unwrap().contains("busy"), "{body}");

        // The flood is over: a walk is answered again.
        let (status, _) = admin_text(&server, "/leases?limit=1").await;
        assert_eq!(status, 200);
    });
}

/// The admin API held any number of connections. Now one beyond [`MAX_CONNECTIONS`] is
/// answered 503 before it asks anything, and closed; once one closes, a request is served
/// again, and `/metrics` counts the one turned away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_connections_beyond_the_cap_are_answered_503() {
    use leasegate::admin::MAX_CONNECTIONS;
    use tokio::io::AsyncReadExt;
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let admin = server.admin_addr.unwrap();
    // Each held open after one answer (keep-alive), so each is known to be accepted.
    let mut held = Vec::new();
    for _ in 0..MAX_CONNECTIONS {
        let mut stream = tokio::net::TcpStream::connect(admin).await.unwrap();
        let answer = exchange(
            &mut stream,
            b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n",
        )
        .await;
        assert_eq!(status_of(&answer), 200, "{answer}");
        held.push(stream);
    }
    let mut extra = tokio::net::TcpStream::connect(admin).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), extra.read_to_string(&mut answer))
        .await
        .expect("one connection too many is answered at once, unasked")
        .unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert_eq!(status_of(head), 503, "{answer}");
    assert!(head.contains("\r\nretry-after: 1"), "{head}");
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(length, body.len(), "{answer}");
    let error: serde_json::Value = serde_json::from_str(body).unwrap();
    assert!(
        error["error"]
            .as_str()
            .unwrap()
            .contains("too many connections"),
        "{body}"
    );

    drop(held.pop());
    let counted = eventually(Duration::from_secs(10), || async {
        let (status, metrics) = admin_text(&server, "/metrics").await;
        (status == 200).then_some(metrics)
    })
    .await
    .expect("served again once a connection closed");
    // Tries of ours that came before the slot was free count too.
    let turned_away = crate::admin::operate::sample(
        &counted,
        "leasegate_admin_busy_total{limit=\"connections\"}",
    );
    assert!(turned_away >= Some(1.0), "{counted}");
}
