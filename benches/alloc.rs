//! Heap allocations per forwarded keep-alive request and per CONNECT tunnel setup, counted by
//! a counting global allocator around an in-process proxy, origin and client.
//!
//! Invariant: a figure is the proxy's own: the same client and origin exchange without the
//! proxy is counted too and subtracted, so what is printed is what the proxy added.
//!
//! `cargo bench --bench alloc` (REQUESTS=N to change the sample, 5,000 by default).

#[path = "common/mod.rs"]
mod common;

use bytes::Bytes;
use common::{keyring, lease_id, signed_lease};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use leasegate::config::ServeConfig;
use leasegate::contract::{Key, Timestamp};
use leasegate::proxy::upstream::Resolver;
use leasegate::proxy::ProxyConfig;
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::server::Server;
use leasegate::telemetry::egress::Destination;
use serde_json::json;
use std::alloc::{GlobalAlloc, Layout, System};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Counts every allocation (and reallocation) of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocations made while `f` runs, per one of its `n` operations.
async fn per_op<F: std::future::Future<Output = ()>>(n: u64, f: F) -> f64 {
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    f.await;
    (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / n as f64
}

async fn origin() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req: http::Request<Incoming>| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                        Bytes::from_static(&[b'x'; 64]),
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

/// `n` keep-alive GETs of the origin over one connection to `to` (the proxy, absolute-form
/// with the lease's credential; or the origin itself, origin-form).
async fn keep_alive(to: SocketAddr, origin: SocketAddr, lease: Option<&str>, n: u64) {
    let stream = tokio::net::TcpStream::connect(to).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let uri = match lease {
        Some(_) => format!("http://origin.test:{}/small", origin.port()),
        None => "/small".to_owned(),
    };
    for _ in 0..n {
        let mut request = http::Request::get(&uri)
            .header("host", format!("origin.test:{}", origin.port()))
            .body(Empty::<Bytes>::new())
            .unwrap();
        if let Some(lease) = lease {
            request
                .headers_mut()
                .insert("x-lease-id", lease.parse().unwrap());
        }
        sender.ready().await.unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        response.into_body().collect().await.unwrap();
    }
}

/// `n` tunnel setups through `proxy` (CONNECT, read the 200, close); with no proxy, `n`
/// plain connects to the origin and closes.
async fn setups(proxy: Option<SocketAddr>, origin: SocketAddr, lease: &str, n: u64) {
    let connect = format!(
        "CONNECT origin.test:{} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n",
        origin.port()
    );
    let mut head = [0u8; 19];
    for _ in 0..n {
        let Some(proxy) = proxy else {
            drop(tokio::net::TcpStream::connect(origin).await.unwrap());
            continue;
        };
        let mut stream = tokio::net::TcpStream::connect(proxy).await.unwrap();
        stream.write_all(connect.as_bytes()).await.unwrap();
        stream.read_exact(&mut head).await.unwrap();
        assert!(head.starts_with(b"HTTP/1.1 200"));
    }
    // The proxy's side of the last tunnels (their egress lines) ends after the client's.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n: u64 = std::env::var("REQUESTS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(5_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::from_bytes([7; 32]);
        let now = Timestamp::now();
        let expires = Timestamp::from_millis(now.as_millis() + 86_400_000);
        let lease = signed_lease(
            &key,
            0,
            (&now.to_string(), &expires.to_string()),
            &["origin.test"],
        );
        let granted = json!({"schema_version": "1.2", "at": now.to_string(), "event": "granted",
                             "lease_id": lease_id(0), "lease": lease});
        let journal = dir.path().join("journal.jsonl");
        std::fs::write(&journal, format!("{granted}\n")).unwrap();
        let mut resolver = Resolver::default();
        resolver
            .overrides
            .insert("origin.test".into(), vec!["127.0.0.1".parse().unwrap()]);
        let server = Server::start(ServeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            journal: JournalLocation::File(journal),
            store: StoreOptions {
                data_dir: dir.path().join("data"),
                ..StoreOptions::default()
            },
            keyring: keyring(&key),
            // As deployed (and in the compare run): one egress line per request, to a file.
            egress: Some(Destination::File(dir.path().join("egress.jsonl"))),
            egress_stream: None,
            proxy: ProxyConfig {
                resolver,
                guard: leasegate::policy::Guard {
                    allow_private: vec!["127.0.0.1/32".parse().unwrap()],
                    ..Default::default()
                },
                // The origin listens on a random port.
                connect_ports: leasegate::policy::Ports::all(),
                forward_ports: leasegate::policy::Ports::all(),
                ..ProxyConfig::default()
            },
            admin: None,
            admin_hosts: Vec::new(),
            lease_ports: None,
            tls: None,
            admin_token: None,
            admin_insecure: false,
            drain_timeout: Duration::from_secs(1),
            wall: Default::default(),
            max_connections_given: false,
        })
        .await
        .unwrap();
        let origin = origin().await;
        let lease = lease_id(0);
        // Warm up: the pool's connection, the lease's metric series, buffers grown once.
        keep_alive(server.addr, origin, Some(&lease), 200).await;
        setups(Some(server.addr), origin, &lease, 200).await;
        keep_alive(origin, origin, None, 200).await;

        let direct = per_op(n, keep_alive(origin, origin, None, n)).await;
        let proxied = per_op(n, keep_alive(server.addr, origin, Some(&lease), n)).await;
        println!(
            "forwarded keep-alive request: {:.1} allocations added by the proxy ({proxied:.1} through it, {direct:.1} direct; {n} requests)",
            proxied - direct
        );
        let m = n / 5;
        let direct = per_op(m, setups(None, origin, &lease, m)).await;
        let proxied = per_op(m, setups(Some(server.addr), origin, &lease, m)).await;
        println!(
            "CONNECT tunnel setup: {:.1} allocations added by the proxy ({proxied:.1} through it, {direct:.1} for a direct connect; {m} tunnels)",
            proxied - direct
        );
        server.shutdown().await;
    });
}
