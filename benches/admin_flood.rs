//! Revocation to teardown under an admin flood: a proxy whose journal file holds 20,000 leases,
//! 2,000 clients asking `/leases?limit=1000&counts=true` and `/metrics` over and over, and a
//! lease with a streaming tunnel open. A signed `revoked` line is appended to the journal (as
//! `leasegate revoke` from another process does) and the time until the tunnel closes is
//! measured: p50 and p99 over `TRIALS` trials (target: p99 ≤ 250 ms). Also the process's RSS
//! before the flood, at its end, and a few seconds after it.
//!
//! `cargo bench --bench admin_flood` (`LEASES=N`, `CLIENTS=N`, `TRIALS=N` to scale it). Not
//! criterion: one long measurement with its own setup. The server runs in this process on a
//! runtime like `serve`'s control runtime; the tunnels' clients and the origin are plain
//! threads, the flood a runtime of its own.

mod common;

use common::{lease_id, serve_config, signed_lease};
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::{Key, Timestamp};
use leasegate::registry::JournalLocation;
use leasegate::server::Server;
use serde_json::{json, Map};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The journal: `leases` leases allowing `api.example.com`, then `trials` allowing the origin.
fn journal(path: &Path, key: &Key, leases: u64, trials: u64) {
    let now = Timestamp::now();
    let window = (
        Timestamp::from_millis(now.as_millis() - 60_000).to_string(),
        Timestamp::from_millis(now.as_millis() + 86_400_000).to_string(),
    );
    let mut text = String::new();
    for n in 0..leases + trials {
        let hosts: &[&str] = match n < leases {
            true => &["api.example.com", "*.github.com"],
            false => &["origin.test"],
        };
        let lease = signed_lease(key, n, (&window.0, &window.1), hosts);
        let line = json!({"schema_version": "1.2", "at": window.0, "event": "granted",
                          "lease_id": lease_id(n), "lease": lease});
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// An origin answering every request with a chunk every 20 ms, until the client goes.
fn streaming_origin() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut head = [0u8; 1024];
                let _ = stream.read(&mut head);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
                while stream.write_all(b"4\r\ntick\r\n").is_ok() {
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
        }
    });
    addr
}

/// A CONNECT tunnel through `proxy` for `lease` to the origin, streaming (a first tick read).
fn streaming_tunnel(proxy: SocketAddr, origin: SocketAddr, lease: &str) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).unwrap();
    stream
        .write_all(
            format!(
                "CONNECT origin.test:{} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n",
                origin.port()
            )
            .as_bytes(),
        )
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the proxy closed the CONNECT");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
        .write_all(b"GET /slow HTTP/1.1\r\nHost: origin.test\r\n\r\n")
        .unwrap();
    seen.clear();
    while !seen.windows(4).any(|w| w == b"tick") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "the tunnel closed before a tick");
        seen.extend_from_slice(&buf[..n]);
    }
    stream
}

/// Reads until the peer closes.
fn until_closed(stream: &mut TcpStream) {
    let mut buf = [0u8; 4096];
    while matches!(stream.read(&mut buf), Ok(n) if n > 0) {}
}

/// What the flood was answered.
#[derive(Default)]
struct Answers {
    ok: AtomicU64,
    busy: AtomicU64,
    /// Connections turned away or dropped.
    closed: AtomicU64,
}

/// One request on a kept-alive connection; its status, `None` if the connection is gone.
async fn ask(stream: &mut tokio::net::TcpStream, path: &str) -> Option<u16> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    let end = loop {
        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        seen.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
    let status = head.get(9..12)?.parse().ok()?;
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))?
        .trim()
        .parse()
        .ok()?;
    let mut left = (end + length).saturating_sub(seen.len());
    while left > 0 {
        let n = stream.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        left = left.saturating_sub(n);
    }
    Some(status)
}

/// `clients` clients on a runtime of their own, each asking for one path over and over on a
/// kept-alive connection (a new one when it is turned away), until `stop`.
fn flood(
    admin: SocketAddr,
    clients: u64,
    stop: Arc<AtomicBool>,
    answers: Arc<Answers>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let mut tasks = Vec::new();
            for i in 0..clients {
                let (stop, answers) = (stop.clone(), answers.clone());
                tasks.push(tokio::spawn(async move {
                    let path = match i % 4 {
                        0 => "/metrics",
                        _ => "/leases?limit=1000&counts=true",
                    };
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(mut stream) = tokio::net::TcpStream::connect(admin).await else {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        };
                        while !stop.load(Ordering::Relaxed) {
                            match ask(&mut stream, path).await {
                                Some(200) => answers.ok.fetch_add(1, Ordering::Relaxed),
                                Some(_) => answers.busy.fetch_add(1, Ordering::Relaxed),
                                None => break,
                            };
                        }
                        answers.closed.fetch_add(1, Ordering::Relaxed);
                        // Turned away: back a little, as a client told `Retry-After` would not.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }));
            }
            for task in tasks {
                let _ = task.await;
            }
        });
    })
}

/// This process's resident set, in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    leasegate::memory::configure();
    let leases = setting("LEASES", 20_000);
    let clients = setting("CLIENTS", 2_000);
    let trials = setting("TRIALS", 100);
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("journal.jsonl");
    let key = Key::from_bytes([7; 32]);
    journal(&journal_path, &key, leases, trials);
    let origin = streaming_origin();

    // As `serve` builds its control runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut config = serve_config(
        JournalLocation::File(journal_path.clone()),
        dir.path(),
        &key,
    );
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    let server = runtime.block_on(Server::start(config)).unwrap();
    let admin = server.admin_addr.unwrap();
    let before = rss_mib();

    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(Answers::default());
    let flooding = flood(admin, clients, stop.clone(), answers.clone());
    std::thread::sleep(Duration::from_secs(2));

    let mut samples = Vec::new();
    for n in leases..leases + trials {
        let lease = lease_id(n);
        let mut tunnel = streaming_tunnel(server.addr, origin, &lease);
        let revocation = record::revoked(
            &Revocation {
                lease_id: &lease,
                parent_lease_id: None,
                by: "issuer",
                reason: "bench",
                extra: Map::new(),
            },
            &key,
            Timestamp::now(),
        )
        .unwrap();
        leasegate::registry::store::file::append(&journal_path, &revocation, false).unwrap();
        let appended = Instant::now();
        until_closed(&mut tunnel);
        samples.push(appended.elapsed());
    }
    let during = rss_mib();
    stop.store(true, Ordering::SeqCst);
    flooding.join().unwrap();
    // The walks' heap goes back once they have been idle a moment.
    std::thread::sleep(Duration::from_secs(3));
    let after = rss_mib();

    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    println!(
        "revocation appended -> tunnel closed, under the flood: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms over {trials} trials",
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        samples.last().unwrap().as_secs_f64() * 1e3,
    );
    println!(
        "flood: {clients} clients, {leases} leases: {} answered 200, {} answered 503, {} connections closed or turned away",
        answers.ok.load(Ordering::Relaxed),
        answers.busy.load(Ordering::Relaxed),
        answers.closed.load(Ordering::Relaxed),
    );
    println!("RSS: {before:.0} MiB before the flood, {during:.0} MiB at its end, {after:.0} MiB 3 s after it");
    drop(server);
}
