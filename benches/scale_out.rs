//! Scale-out figures with a real `nats-server` (Debian's package) on loopback:
//!
//! - catch-up: a fresh replica folds a 1,000,000-record stream (target ≤ 10 s);
//! - propagation: a revocation on replica A → the lease's token cancelled on replica C,
//!   p50 and p99 over 200 trials;
//! - request path: keep-alive forwarded requests per second through a proxy whose journal is a
//!   file and one whose journal is the stream, in one run (the store is not on that path).
//!
//! `cargo bench --bench scale_out` (set `RECORDS=N` for a smaller stream). Not criterion: each
//! figure is one long measurement with its own setup.

mod common;

use bytes::Bytes;
use common::nats::Nats;
use common::{keyring, lease_id, serve_config, setting, signed_lease};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use leasegate::contract::{Key, Timestamp};
use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};
use leasegate::registry::open::open_registry;
use leasegate::registry::store::NatsLocation;
use leasegate::registry::{JournalLocation, Registry, StoreOptions};
use leasegate::server::Server;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Lines per lease in the catch-up stream: a grant, heartbeats, and (for most) a closing.
const LINES_PER_LEASE: u64 = 10;

/// A granted line for lease `n`, open for a day from now.
fn granted(key: &Key, n: u64) -> Value {
    let now = Timestamp::now();
    let expires = Timestamp::from_millis(now.as_millis() + 86_400_000);
    let lease = signed_lease(
        key,
        n,
        (&now.to_string(), &expires.to_string()),
        &["origin.test", "*.github.com", "pypi.org"],
    );
    json!({"schema_version": "1.2", "at": now.to_string(), "event": "granted",
           "lease_id": lease_id(n), "lease": lease})
}

/// Line `i` of the catch-up stream: one grant in ten, the rest heartbeats, nine leases in ten
/// stopped at the end.
fn line(key: &Key, i: u64) -> Value {
    let (n, k) = (i / LINES_PER_LEASE, i % LINES_PER_LEASE);
    let at = Timestamp::now().to_string();
    match k {
        0 => granted(key, n),
        k if k == LINES_PER_LEASE - 1 && n % 10 != 0 => {
            json!({"schema_version": "1.2", "at": at, "event": "stopped",
                   "lease_id": lease_id(n), "reason": "done"})
        }
        _ => json!({"schema_version": "1.2", "at": at, "event": "heartbeat",
                    "lease_id": lease_id(n)}),
    }
}

/// The journal location of `stream` on `nats`.
fn location(nats: &Nats, stream: &str) -> NatsLocation {
    nats.url(stream).parse().unwrap()
}

async fn stream(nats: &Nats, name: &str) -> NatsStream {
    NatsStream::connect(
        &location(nats, name),
        &NatsOptions::default(),
        &StreamSpec::JOURNAL,
    )
    .await
    .unwrap()
}

/// Publishes `lines` with up to 4,096 acks in flight (one connection keeps their order).
async fn publish_all(stream: &NatsStream, lines: impl Iterator<Item = (String, Vec<u8>)>) {
    use futures_util::StreamExt;
    let mut acks = futures_util::stream::FuturesOrdered::new();
    for (subject, line) in lines {
        let ack = stream
            .jetstream
            .publish(subject, Bytes::from(line))
            .await
            .unwrap();
        acks.push_back(async move { ack.await });
        if acks.len() >= 4096 {
            acks.next().await.unwrap().unwrap();
        }
    }
    while let Some(ack) = acks.next().await {
        ack.unwrap();
    }
}

async fn catch_up(nats: &Nats, key: &Key, records: u64) {
    let stream = stream(nats, "CATCHUP").await;
    let started = Instant::now();
    let lines = (0..records).map(|i| {
        let value = line(key, i);
        (
            stream.subject(value["lease_id"].as_str()),
            serde_json::to_vec(&value).unwrap(),
        )
    });
    publish_all(&stream, lines).await;
    println!(
        "catch-up: published {records} records in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let started = Instant::now();
    let delivered = stream.read_all().await.unwrap().len();
    println!(
        "catch-up: delivery alone (ordered push consumer): {delivered} messages in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let options = StoreOptions::default();
    let started = Instant::now();
    let registry = open_registry(
        &JournalLocation::Nats(location(nats, "CATCHUP")),
        keyring(key),
        &options,
        false,
    )
    .await
    .unwrap();
    let took = started.elapsed();
    let snapshot = registry.snapshot();
    let stats = snapshot.ledger.stats();
    println!(
        "catch-up: a fresh replica folded {records} records in {:.2} s ({:.0} records/s; {} leases granted; target ≤ 10 s)",
        took.as_secs_f64(),
        records as f64 / took.as_secs_f64(),
        stats.events[leasegate::contract::record::Event::Granted as usize],
    );
}

async fn propagation(nats: &Nats, key: &Key, trials: u64) {
    let stream = stream(nats, "PROPAGATION").await;
    publish_all(
        &stream,
        (0..trials).map(|n| {
            let value = granted(key, n);
            (
                stream.subject(value["lease_id"].as_str()),
                serde_json::to_vec(&value).unwrap(),
            )
        }),
    )
    .await;
    let location = JournalLocation::Nats(location(nats, "PROPAGATION"));
    let options = StoreOptions::default();
    let shutdown = CancellationToken::new();
    let open = || async {
        let registry = Arc::new(
            open_registry(&location, keyring(key), &options, false)
                .await
                .unwrap(),
        );
        tokio::spawn(registry.clone().follow(shutdown.clone()));
        registry
    };
    let (a, c): (Arc<Registry>, Arc<Registry>) = (open().await, open().await);
    let mut samples = Vec::new();
    for n in 0..trials {
        let token = c.token(&lease_id(n), Timestamp::now());
        assert!(!token.is_cancelled());
        let started = Instant::now();
        a.revoke(&lease_id(n), "benchmark", Default::default())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), token.cancelled())
            .await
            .expect("the revocation never reached the other replica");
        samples.push(started.elapsed());
    }
    shutdown.cancel();
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    println!(
        "propagation: revocation on A -> token cancelled on C: p50 {:.2} ms, p99 {:.2} ms over {trials} trials",
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3
    );
}

/// A keep-alive origin answering `ok` to everything.
async fn origin() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req: http::Request<Incoming>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                        Bytes::from_static(b"ok"),
                    )))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// Forwarded keep-alive requests per second over `connections` connections for `secs`.
async fn requests_per_second(
    proxy: std::net::SocketAddr,
    origin: std::net::SocketAddr,
    lease: &str,
    connections: usize,
    secs: u64,
) -> f64 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut clients = Vec::new();
    for _ in 0..connections {
        let lease = lease.to_owned();
        clients.push(tokio::spawn(async move {
            let stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .unwrap();
            tokio::spawn(conn);
            let mut done = 0u64;
            while Instant::now() < deadline {
                let request = http::Request::get(format!("http://origin.test:{}/", origin.port()))
                    .header("host", format!("origin.test:{}", origin.port()))
                    .header("x-lease-id", &lease)
                    .body(Empty::<Bytes>::new())
                    .unwrap();
                let response = sender.send_request(request).await.unwrap();
                assert_eq!(response.status(), 200);
                response.into_body().collect().await.unwrap();
                done += 1;
            }
            done
        }));
    }
    let mut total = 0;
    for client in clients {
        total += client.await.unwrap();
    }
    total as f64 / secs as f64
}

async fn request_path(nats: &Nats, key: &Key) {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal.jsonl");
    let line = granted(key, 0);
    std::fs::write(&journal, format!("{line}\n")).unwrap();
    let stream = stream(nats, "REQUESTS").await;
    stream
        .publish(
            stream.subject(line["lease_id"].as_str()),
            &serde_json::to_vec(&line).unwrap(),
            None,
        )
        .await
        .unwrap();
    let origin = origin().await;
    let config = |journal: JournalLocation| serve_config(journal, dir.path(), key);
    let file = Server::start(config(JournalLocation::File(journal.clone())))
        .await
        .unwrap();
    let stream = Server::start(config(JournalLocation::Nats(location(nats, "REQUESTS"))))
        .await
        .unwrap();
    let lease = lease_id(0);
    for round in 0..2 {
        for (name, server) in [("file", &file), ("nats", &stream)] {
            let rate = requests_per_second(server.addr, origin, &lease, 8, 3).await;
            if round == 1 {
                println!(
                    "request path: {name} journal: {rate:.0} keep-alive req/s (8 connections, 3 s)"
                );
            }
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let records = setting("RECORDS", 1_000_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let key = Key::from_bytes([7; 32]);
    // One server each: journal streams share their subjects, so one account holds one.
    runtime.block_on(async {
        request_path(&Nats::start_with(""), &key).await;
        propagation(&Nats::start_with(""), &key, 200).await;
        catch_up(&Nats::start_with(""), &key, records).await;
    });
}
