//! The starvation budget: revocation to teardown under each load that once held revocations
//! back. A lease has a streaming tunnel open; a signed `revoked` line is appended to the journal
//! (as `leasegate revoke` from another process does) and the time until the tunnel closes is
//! measured: p50 and p99 over `TRIALS` trials per load (target: p99 ≤ 250 ms). The loads:
//!
//! - `admin-flood`: the journal holds 20,000 leases and 2,000 clients ask
//!   `/leases?limit=1000&counts=true` and `/metrics` over and over; also the process's RSS
//!   before the flood, at its end, and a few seconds after it;
//! - `descriptors`: a `serve` process under `ulimit -n 4096`, one lease holder's 250 tunnels and
//!   300 connections that never finish their head holding every connection it accepts;
//! - `bridge`: the issuer's file is mirrored (`journal mirror`) to a stream whose server takes
//!   at most 64 KiB a message, each revocation behind a line the stream can never take; the
//!   proxy follows the stream;
//! - `blocking`: every thread of the runtime's blocking pool (tokio's 512) held by 250 ms jobs,
//!   with three times as many queued (what is queued now waits about 1 s).
//!
//! `cargo bench --bench starvation` (`LOADS=admin-flood,descriptors,bridge,blocking`,
//! `TRIALS=N`, `LEASES=N`, `CLIENTS=N` to choose and scale). Not criterion: long measurements
//! with their own setup. In-process servers run on a runtime like `serve`'s control runtime;
//! tunnels' clients and the origin are plain threads. `bridge` needs `nats-server`.

mod common;

use common::nats::Nats;
use common::{lease_id, percentiles, serve_config, setting, signed_lease};
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::{Key, Timestamp};
use leasegate::registry::JournalLocation;
use leasegate::server::Server;
use serde_json::{json, Map};
use std::io::{BufRead, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The journal: `leases` leases allowing `api.example.com`, then `trials` allowing the origin
/// (ids `leases..leases + trials`).
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

/// The revocation of `lease`, signed with `key`.
fn revocation(lease: &str, key: &Key) -> serde_json::Value {
    record::revoked(
        &Revocation {
            lease_id: lease,
            parent_lease_id: None,
            by: "issuer",
            reason: "bench",
            extra: Map::new(),
        },
        key,
        Timestamp::now(),
    )
    .unwrap()
}

/// Appends `record` to `journal` as one line, as `leasegate revoke` does.
fn append(journal: &Path, record: &serde_json::Value) {
    leasegate::registry::store::file::append(journal, record, false).unwrap();
}

/// Streaming tunnels through `proxy` for leases `ids`.
fn open_tunnels(
    proxy: SocketAddr,
    origin: SocketAddr,
    ids: Range<u64>,
) -> Vec<(String, TcpStream)> {
    ids.map(lease_id)
        .map(|lease| {
            let tunnel = streaming_tunnel(proxy, origin, &lease);
            (lease, tunnel)
        })
        .collect()
}

/// Revokes each tunnel's lease in turn by a line appended to `journal` (after the line
/// `before` makes of it, if any) and times until the tunnel closes.
fn revoke_each(
    tunnels: Vec<(String, TcpStream)>,
    journal: &Path,
    key: &Key,
    before: Option<&dyn Fn(&str) -> serde_json::Value>,
) -> Vec<Duration> {
    let mut samples = Vec::new();
    for (lease, mut tunnel) in tunnels {
        if let Some(line) = before {
            append(journal, &line(&lease));
        }
        append(journal, &revocation(&lease, key));
        let appended = Instant::now();
        until_closed(&mut tunnel);
        samples.push(appended.elapsed());
    }
    samples
}

fn report(load: &str, samples: Vec<Duration>) {
    println!(
        "{load}: revocation appended -> tunnel closed: {} trials",
        percentiles(samples)
    );
}

/// As `serve` builds its control runtime.
fn control_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn admin_flood(key: &Key, origin: SocketAddr, trials: u64) {
    let leases = setting("LEASES", 20_000);
    let clients = setting("CLIENTS", 2_000);
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("journal.jsonl");
    journal(&journal_path, key, leases, trials);
    let runtime = control_runtime();
    let mut config = serve_config(JournalLocation::File(journal_path.clone()), dir.path(), key);
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    let server = runtime.block_on(Server::start(config)).unwrap();
    let admin = server.admin_addr.unwrap();
    let tunnels = open_tunnels(server.addr, origin, leases..leases + trials);
    let before = rss_mib();

    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(Answers::default());
    let flooding = flood(admin, clients, stop.clone(), answers.clone());
    std::thread::sleep(Duration::from_secs(2));
    let samples = revoke_each(tunnels, &journal_path, key, None);
    let during = rss_mib();
    stop.store(true, Ordering::SeqCst);
    flooding.join().unwrap();
    // The walks' heap goes back once they have been idle a moment.
    std::thread::sleep(Duration::from_secs(3));
    let after = rss_mib();

    report("admin-flood", samples);
    println!(
        "  {clients} clients, {leases} leases: {} answered 200, {} answered 503, {} connections closed or turned away",
        answers.ok.load(Ordering::Relaxed),
        answers.busy.load(Ordering::Relaxed),
        answers.closed.load(Ordering::Relaxed),
    );
    println!("  RSS: {before:.0} MiB before the flood, {during:.0} MiB at its end, {after:.0} MiB 3 s after it");
    drop(server);
}

/// `leasegate serve` under `ulimit -n {limit}` with `args`, on a free port: the child and its
/// proxy address (from the banner).
fn serve_child(limit: u32, args: &[&str]) -> (Child, SocketAddr) {
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("ulimit -n {limit} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_leasegate"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", "leasegate=error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut banner = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut banner)
        .unwrap();
    let proxy = banner
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no banner: {banner:?}"));
    (child, proxy)
}

fn descriptors(key: &Key, origin: SocketAddr, trials: u64) {
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("journal.jsonl");
    // The watched leases, then the holder's.
    journal(&journal_path, key, 0, trials + 1);
    let key_path = dir.path().join("lease.key");
    std::fs::write(&key_path, key.to_file_text()).unwrap();
    let (mut child, proxy) = serve_child(
        4096,
        &[
            "--journal",
            journal_path.to_str().unwrap(),
            "--key-file",
            key_path.to_str().unwrap(),
            "--resolve",
            "origin.test=127.0.0.1",
            "--allow-private",
            "127.0.0.1/32",
            "--connect-ports",
            "1-65535",
            "--header-read-timeout",
            "600s",
        ],
    );
    let tunnels = open_tunnels(proxy, origin, 0..trials);
    // The holder's tunnels and half-sent heads, as many as the proxy takes.
    let holder = lease_id(trials);
    let mut pressure = Vec::new();
    for _ in 0..250 {
        if let Some(tunnel) = echo_tunnel(proxy, origin, &holder) {
            pressure.push(tunnel);
        }
    }
    for _ in 0..300 {
        if let Ok(mut stream) = TcpStream::connect(proxy) {
            let _ = stream.write_all(b"GET http://origin.test/ HTTP/1.1\r\n");
            pressure.push(stream);
        }
    }
    let samples = revoke_each(tunnels, &journal_path, key, None);
    report("descriptors", samples);
    println!("  the holder's connections: {} made", pressure.len());
    let _ = child.kill();
    let _ = child.wait();
}

/// A tunnel of `lease` through `proxy`, or `None` when it is not answered 200 within 2 s.
fn echo_tunnel(proxy: SocketAddr, origin: SocketAddr, lease: &str) -> Option<TcpStream> {
    let mut stream = TcpStream::connect(proxy).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!(
        "CONNECT origin.test:{} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n",
        origin.port()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    head.starts_with(b"HTTP/1.1 200").then_some(stream)
}

fn bridge(key: &Key, origin: SocketAddr, trials: u64) {
    let nats = Nats::start_with("max_payload: 65536\n");
    let url = nats.url("LG");
    let dir = tempfile::tempdir().unwrap();
    let issuer = dir.path().join("issuer.jsonl");
    journal(&issuer, key, 0, trials);
    let mut mirror = Command::new(env!("CARGO_BIN_EXE_leasegate"))
        .args(["journal", "mirror", issuer.to_str().unwrap(), "--to", &url])
        .env("RUST_LOG", "leasegate=error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut caught_up = String::new();
    std::io::BufReader::new(mirror.stdout.take().unwrap())
        .read_line(&mut caught_up)
        .unwrap();
    let runtime = control_runtime();
    let location = JournalLocation::Nats(url.parse().unwrap());
    let server = runtime
        .block_on(Server::start(serve_config(location, dir.path(), key)))
        .unwrap();
    let tunnels = open_tunnels(server.addr, origin, 0..trials);
    let oversized = |lease: &str| json!({"lease_id": lease, "event": "heartbeat", "pad": "x".repeat(100 * 1024)});
    let samples = revoke_each(tunnels, &issuer, key, Some(&oversized));
    report("bridge", samples);
    let _ = mirror.kill();
    let _ = mirror.wait();
    drop(server);
}

fn blocking(key: &Key, origin: SocketAddr, trials: u64) {
    let dir = tempfile::tempdir().unwrap();
    let journal_path = dir.path().join("journal.jsonl");
    journal(&journal_path, key, 0, trials);
    let runtime = control_runtime();
    let config = serve_config(JournalLocation::File(journal_path.clone()), dir.path(), key);
    let server = runtime.block_on(Server::start(config)).unwrap();
    let tunnels = open_tunnels(server.addr, origin, 0..trials);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        runtime.spawn(async move {
            let mut held = tokio::task::JoinSet::new();
            while !stop.load(Ordering::Relaxed) {
                while held.len() < 4 * 512 {
                    held.spawn_blocking(|| std::thread::sleep(Duration::from_millis(250)));
                }
                held.join_next().await;
            }
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let samples = revoke_each(tunnels, &journal_path, key, None);
    stop.store(true, Ordering::SeqCst);
    runtime.block_on(load).unwrap();
    report("blocking", samples);
    drop(server);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    leasegate::memory::configure();
    let trials = setting("TRIALS", 100);
    let loads =
        std::env::var("LOADS").unwrap_or_else(|_| "admin-flood,descriptors,bridge,blocking".into());
    let key = Key::from_bytes([7; 32]);
    let origin = streaming_origin();
    for load in loads.split(',') {
        match load {
            "admin-flood" => admin_flood(&key, origin, trials),
            "descriptors" => descriptors(&key, origin, trials),
            "bridge" => bridge(&key, origin, trials),
            "blocking" => blocking(&key, origin, trials),
            other => panic!("no load {other:?} (admin-flood, descriptors, bridge, blocking)"),
        }
    }
}
