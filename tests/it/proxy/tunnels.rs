//! Plain TCP tunnels end to end (spliced on Linux): bulk bytes both ways arrive exact and in
//! order, including what the client sent before the 200; the egress line counts them exactly;
//! half-close passes through; a busy tunnel closes at once when its lease is revoked, and a
//! quiet one at its idle timeout.

use crate::support::harness::AT_ONCE;
use crate::support::harness::{eventually, open_tunnel, raw, read_head, until_closed, Harness};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A seeded stream of pseudo-random bytes (xorshift64*), generated and checked a word at a
/// time so that tens of MiB cost little in a debug build.
struct Noise(u64);

impl Noise {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            let word = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
}

/// Client → origin seed: its first bytes open no TLS record, so the tunnel's first-bytes
/// check passes them through as not-TLS.
const UP_SEED: u64 = 0x5eed_0001;
const DOWN_SEED: u64 = 0x5eed_0002;
const CHUNK: usize = 64 * 1024;

/// Writes `total` bytes of `Noise(seed)` to `to`, in chunks of CHUNK.
async fn send_noise(to: &mut (impl AsyncWriteExt + Unpin), seed: u64, total: usize) {
    let (mut noise, mut buf, mut sent) = (Noise(seed), vec![0u8; CHUNK], 0);
    while sent < total {
        let n = (total - sent).min(CHUNK);
        noise.fill(&mut buf[..n]);
        to.write_all(&buf[..n]).await.unwrap();
        sent += n;
    }
}

/// Reads exactly `total` bytes and checks them against `Noise(seed)`; panics at the first
/// difference or an early end.
async fn expect_noise(from: &mut (impl AsyncReadExt + Unpin), seed: u64, total: usize) {
    let (mut noise, mut want, mut got, mut seen) =
        (Noise(seed), vec![0u8; CHUNK], vec![0u8; CHUNK], 0usize);
    while seen < total {
        let n = (total - seen).min(CHUNK);
        from.read_exact(&mut got[..n])
            .await
            .unwrap_or_else(|e| panic!("ended after {seen} of {total} bytes: {e}"));
        noise.fill(&mut want[..n]);
        assert!(
            got[..n] == want[..n],
            "bytes differ within {seen}..{}",
            seen + n
        );
        seen += n;
    }
}

/// An origin that, per connection, sends `total` bytes of `DOWN_SEED` while checking that it
/// receives `total` of `UP_SEED` and then the client's end of stream; it then sends the
/// 8-byte count it received and closes.
async fn noise_origin(total: usize) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = stream.into_split();
                let receiving = tokio::spawn(async move {
                    expect_noise(&mut read, UP_SEED, total).await;
                    // Half-close: the client's end of stream reaches us while we still send.
                    assert_eq!(read.read(&mut [0u8; 1]).await.unwrap(), 0);
                    total as u64
                });
                send_noise(&mut write, DOWN_SEED, total).await;
                let received = receiving.await.unwrap();
                let _ = write.write_all(&received.to_le_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_bytes_cross_a_tunnel_exact_both_ways_with_half_close_and_exact_counts() {
    const TOTAL: usize = 64 * 1024 * 1024;
    let mut first = [0u8; 8];
    Noise(UP_SEED).fill(&mut first);
    assert_eq!(
        leasegate::proxy::hello::opening(&first),
        leasegate::proxy::hello::Opening::NotTls,
        "the seed must not look like TLS"
    );
    let h = Harness::new();
    let origin = noise_origin(TOTAL).await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let stream = TcpStream::connect(server.addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let connect = format!(
        "CONNECT origin.test:{} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n",
        origin.port()
    );
    // The head and the first 64 KiB in one write, before the 200: the proxy reads some of
    // them with the head and must send those first, in order.
    let sending = tokio::spawn(async move {
        let mut buf = connect.into_bytes();
        let mut noise = Noise(UP_SEED);
        let at = buf.len();
        buf.resize(at + CHUNK, 0);
        noise.fill(&mut buf[at..]);
        write.write_all(&buf).await.unwrap();
        let (mut sent, mut chunk) = (CHUNK, vec![0u8; CHUNK]);
        while sent < TOTAL {
            noise.fill(&mut chunk);
            write.write_all(&chunk).await.unwrap();
            sent += CHUNK;
        }
        write.shutdown().await.unwrap();
        write
    });
    let head = read_head(&mut read).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    expect_noise(&mut read, DOWN_SEED, TOTAL).await;
    let mut trailer = [0u8; 8];
    read.read_exact(&mut trailer).await.unwrap();
    assert_eq!(
        u64::from_le_bytes(trailer),
        TOTAL as u64,
        "the origin's count"
    );
    assert_eq!(
        read.read(&mut [0u8; 1]).await.unwrap(),
        0,
        "the origin closed"
    );
    let _write = sending.await.unwrap();
    let line = h.egress_line(1).await;
    assert_eq!(line["kind"], "connect", "{line}");
    assert_eq!(line["status"], 200, "{line}");
    assert_eq!(line["bytes_up"], TOTAL as u64, "{line}");
    assert_eq!(line["bytes_down"], TOTAL as u64 + 8, "{line}");
    assert!(line["error"].is_null(), "{line}");
}

/// An origin that floods every connection with bytes and discards what it reads, until the
/// connection fails.
async fn flood_origin() -> (SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let uploaded = Arc::new(AtomicU64::new(0));
    let counted = uploaded.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (mut read, mut write) = stream.into_split();
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; CHUNK];
                while let Ok(n @ 1..) = read.read(&mut buf).await {
                    counted.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
            tokio::spawn(async move {
                let buf = vec![b'x'; CHUNK];
                while write.write_all(&buf).await.is_ok() {}
            });
        }
    });
    (addr, uploaded)
}

/// Opens a tunnel to `origin` and starts moving bytes both ways through it; returns the
/// client's read half once bytes flow down and the origin has some of the client's.
async fn busy_tunnel(
    proxy: SocketAddr,
    (origin, uploaded): (SocketAddr, Arc<AtomicU64>),
    lease: &str,
) -> tokio::net::tcp::OwnedReadHalf {
    let (mut read, mut write) = open_tunnel(
        proxy,
        &format!("origin.test:{}", origin.port()),
        Some(lease),
    )
    .await
    .into_split();
    tokio::spawn(async move {
        let buf = vec![b'y'; CHUNK];
        while write.write_all(&buf).await.is_ok() {}
    });
    let mut buf = vec![0u8; CHUNK];
    assert!(read.read(&mut buf).await.unwrap() > 0);
    let uploading = eventually(Duration::from_secs(5), || async {
        (uploaded.load(Ordering::Relaxed) > 0).then_some(())
    })
    .await;
    assert!(uploading.is_some(), "no upload reached the origin");
    read
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_the_lease_closes_a_busy_tunnel_at_once() {
    let h = Harness::new();
    let origin = flood_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let mut read = busy_tunnel(server.addr, origin, &lease).await;
    let body = r#"{"reason":"operator"}"#;
    let revoke = format!(
        "POST /leases/{lease}/revoke HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let started = Instant::now();
    let answer = raw(server.admin_addr.unwrap(), revoke.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let answered = started.elapsed();
    let closed = until_closed(&mut read, AT_ONCE * 2).await;
    assert!(
        closed < AT_ONCE,
        "the tunnel closed {closed:?} after the revoke was answered (in {answered:?})"
    );
    let line = h.egress_line(1).await;
    assert!(
        line["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no longer opens"),
        "{line}"
    );
    assert!(line["bytes_up"].as_u64().unwrap() > 0, "{line}");
    assert!(line["bytes_down"].as_u64().unwrap() > 0, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_that_moved_bytes_then_went_quiet_is_closed_at_its_idle_timeout() {
    let h = Harness::new();
    let origin = noise_origin(CHUNK).await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.tunnel_idle_timeout = Duration::from_millis(300);
    let server = h.start(config).await;
    let target = format!("origin.test:{}", origin.port());
    let mut stream = open_tunnel(server.addr, &target, Some(&lease)).await;
    // Both directions move, then nothing: the origin waits for an end that never comes.
    send_noise(&mut stream, UP_SEED, CHUNK).await;
    expect_noise(&mut stream, DOWN_SEED, CHUNK).await;
    let quiet = Instant::now();
    let mut rest = [0u8; 16];
    let n = tokio::time::timeout(AT_ONCE * 2, stream.read(&mut rest))
        .await
        .expect("the idle tunnel stayed open")
        .unwrap_or(0);
    assert_eq!(n, 0, "nothing more came down");
    let lived = quiet.elapsed();
    assert!(
        lived >= Duration::from_millis(250) && lived < AT_ONCE,
        "{lived:?}"
    );
    let line = h.egress_line(1).await;
    assert_eq!(line["error"], "closed: idle timeout", "{line}");
    assert_eq!(line["bytes_up"], CHUNK as u64, "{line}");
    assert_eq!(line["bytes_down"], CHUNK as u64, "{line}");
}
