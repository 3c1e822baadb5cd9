//! The floor against loopback origins: forwarding with a pooled upstream, CONNECT with early
//! bytes and half-close, refusals, and the socket options it shares with leasegate.

use super::{parse_names, sockets, start};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The one floor of this test process: two workers, `origin.test` at 127.0.0.1.
fn floor_addr() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let names = parse_names("origin.test=127.0.0.1").unwrap();
        start("127.0.0.1:0".parse().unwrap(), 2, names).unwrap().0
    })
}

/// Reads one response head and a `content-length` body; returns (status, head, body).
async fn read_response(s: &mut TcpStream) -> (u16, String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).await.unwrap(),
            1,
            "closed mid-head: {buf:?}"
        );
        buf.push(byte[0]);
    }
    let head = String::from_utf8(buf).unwrap();
    let status = head[9..12].parse().unwrap();
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(|n| n.trim().parse().unwrap())
        })
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    (status, head, body)
}

/// An origin that answers every request on every connection with `hello`, recording the heads
/// it got and counting its connections.
async fn origin() -> (SocketAddr, Arc<Mutex<Vec<String>>>, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let conns = Arc::new(AtomicUsize::new(0));
    let (h, c) = (heads.clone(), conns.clone());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            c.fetch_add(1, Ordering::SeqCst);
            let h = h.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = buf.drain(..end + 4).collect();
                        h.lock().unwrap().push(String::from_utf8(head).unwrap());
                        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
                        if s.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    (addr, heads, conns)
}

#[tokio::test]
async fn forwarded_requests_go_in_origin_form_over_one_pooled_connection() {
    let (origin, heads, conns) = origin().await;
    let mut client = TcpStream::connect(floor_addr()).await.unwrap();
    let port = origin.port();
    for i in 0..3 {
        let req = format!(
            "GET http://origin.test:{port}/small?i={i} HTTP/1.1\r\nHost: origin.test:{port}\r\n\
             Proxy-Authorization: Basic eDp5\r\nProxy-Connection: keep-alive\r\n\
             Connection: keep-alive, x-drop\r\nx-drop: 1\r\nx-keep: 2\r\n\r\n"
        );
        client.write_all(req.as_bytes()).await.unwrap();
        let (status, _, body) = read_response(&mut client).await;
        assert_eq!((status, &body[..]), (200, &b"hello"[..]), "request {i}");
        // The pooled connection goes back once hyper has seen its exchange end.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        conns.load(Ordering::SeqCst),
        1,
        "one upstream connection, reused"
    );
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 3);
    for (i, head) in heads.iter().enumerate() {
        let lower = head.to_ascii_lowercase();
        assert!(
            head.starts_with(&format!("GET /small?i={i} HTTP/1.1\r\n")),
            "{head}"
        );
        assert!(
            lower.contains(&format!("host: origin.test:{port}\r\n")),
            "{head}"
        );
        assert!(lower.contains("x-keep: 2\r\n"), "{head}");
        for gone in [
            "proxy-authorization",
            "proxy-connection",
            "x-drop",
            "connection:",
        ] {
            assert!(!lower.contains(gone), "{gone} forwarded: {head}");
        }
    }
}

#[tokio::test]
async fn a_tunnel_carries_early_bytes_and_a_megabyte_both_ways_then_half_closes() {
    // An echo upstream: everything back, then its own end once the client's has come.
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_addr = echo.local_addr().unwrap();
    tokio::spawn(async move {
        let (s, _) = echo.accept().await.unwrap();
        let (mut r, mut w) = s.into_split();
        tokio::io::copy(&mut r, &mut w).await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut client = TcpStream::connect(floor_addr()).await.unwrap();
    // Bytes right behind the CONNECT head, in the same write: hyper reads them with it.
    let head = format!("CONNECT {echo_addr} HTTP/1.1\r\nHost: {echo_addr}\r\n\r\nEARLY");
    client.write_all(head.as_bytes()).await.unwrap();
    let (status, _, _) = read_response(&mut client).await;
    assert_eq!(status, 200);
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut want = b"EARLY".to_vec();
    want.extend_from_slice(&payload);
    let (mut r, mut w) = client.into_split();
    let writer = tokio::spawn(async move {
        w.write_all(&payload).await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut got))
        .await
        .expect("the tunnel ends after the echo's end")
        .unwrap();
    writer.await.unwrap();
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the bytes came back changed");
}

#[tokio::test]
async fn what_cannot_be_relayed_is_answered_not_dropped() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    for (req, want) in [
        (
            "CONNECT unknown.test:443 HTTP/1.1\r\nHost: unknown.test:443\r\n\r\n".to_string(),
            502,
        ),
        (
            format!("CONNECT {closed} HTTP/1.1\r\nHost: {closed}\r\n\r\n"),
            502,
        ),
        (
            "GET /small HTTP/1.1\r\nHost: origin.test\r\n\r\n".into(),
            400,
        ),
        (
            "GET https://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n".into(),
            400,
        ),
        (
            "GET http://unknown.test/ HTTP/1.1\r\nHost: unknown.test\r\n\r\n".into(),
            502,
        ),
        (
            format!("GET http://{closed}/ HTTP/1.1\r\nHost: {closed}\r\n\r\n"),
            502,
        ),
    ] {
        let mut client = TcpStream::connect(floor_addr()).await.unwrap();
        client.write_all(req.as_bytes()).await.unwrap();
        let (status, _, body) = read_response(&mut client).await;
        assert_eq!(status, want, "{req:?}: {}", String::from_utf8_lossy(&body));
        assert!(!body.is_empty(), "a reason is given");
    }
}

#[test]
fn resolve_entries_are_host_equals_ip() {
    assert_eq!(
        parse_names("Origin.Test=127.0.0.1,,v6.test=::1").unwrap(),
        vec![
            ("origin.test".to_string(), "127.0.0.1".parse().unwrap()),
            ("v6.test".to_string(), "::1".parse().unwrap()),
        ]
    );
    assert!(parse_names("").unwrap().is_empty());
    for bad in ["origin.test", "origin.test=localhost", "=1.2.3"] {
        assert!(parse_names(bad).is_err(), "{bad}");
    }
}

/// The congestion control a socket uses.
fn congestion(socket: &impl std::os::fd::AsFd) -> String {
    let name =
        nix::sys::socket::getsockopt(socket, nix::sys::socket::sockopt::TcpCongestion).unwrap();
    name.to_string_lossy().trim_end_matches('\0').to_owned()
}

/// As leasegate: accepted and dialled loopback sockets have Nagle off and, where the system
/// paces (BBR), reno.
#[tokio::test]
async fn loopback_sockets_have_nodelay_and_no_pacing() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let default = congestion(&listener);
    let want = if default.starts_with("bbr") {
        "reno"
    } else {
        default.as_str()
    };
    assert!(sockets::set_inherited(&listener, addr));
    let dialled = sockets::dial(addr).await.unwrap();
    let (accepted, _) = listener.accept().await.unwrap();
    for (side, s) in [("dialled", &dialled), ("accepted", &accepted)] {
        assert!(s.nodelay().unwrap(), "{side}: Nagle on");
        assert_eq!(congestion(s), want, "{side}, system default {default}");
    }
}
