//! Issue 10's boundary items end to end over real sockets: the ClientHello read across TLS
//! records (`sni-mismatch`, `tls-unverifiable`), `--require-sni`, `Host` spellings that name
//! the URI's host, and the exact request-head limit.

use crate::support::harness::{http_origin, https_origin, raw, status_of, Harness};
use crate::support::tls_hello::{first_flight, reframe, tls_client};
use leasegate::server::Server;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A CONNECT tunnel to `target` for `lease`, answered 200.
async fn tunnel(proxy: SocketAddr, target: &str, lease: &str) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(stream.read(&mut byte).await.unwrap(), 1, "proxy closed");
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    stream
}

/// Sends `bytes` into the tunnel and reads until the proxy closes it (at most 5 s).
async fn send_until_closed(stream: &mut TcpStream, bytes: &[u8]) -> Vec<u8> {
    // The proxy may close before it has read everything: a reset is a close too.
    let _ = stream.write_all(bytes).await;
    let mut back = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        let mut buf = [0u8; 4096];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => back.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the tunnel was still open after 5 s");
    back
}

/// The refusal left its egress line, revoked the lease, and the lease opens nothing after.
async fn assert_closed_with(h: &Harness, server: &Server, lease: &str, target: &str, code: &str) {
    let line = h.egress_line(1).await;
    assert_eq!(line["code"], code, "{line}");
    assert_eq!(line["verdict"], "refuse", "{line}");
    assert_eq!(line["revoked"], true, "{line}");
    assert!(
        leasegate::contract::schema::Schema::EgressEvent.is_valid(&line),
        "{line}"
    );
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1, "{revocations:?}");
    assert_eq!(revocations[0]["egress"]["code"], code);
    let answer = raw(
        server.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(answer.contains("lease-revoked"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hellos_the_old_probe_gave_up_on_are_checked_and_close_the_tunnel() {
    let dir = tempfile::tempdir().unwrap();
    let (secure, _) = https_origin("secure.test", dir.path()).await;
    let target = format!("secure.test:{}", secure.addr.port());
    let denied = first_flight(&mut tls_client("denied.test", None, vec![]));
    let before = |record: &[u8]| [record, &denied[..]].concat();
    let empty_first = before(&[22, 3, 1, 0, 0]);
    // 80 ALPN names of 250 bytes: a ~20 KB hello, beyond one record.
    let big = first_flight(&mut tls_client(
        "denied.test",
        None,
        vec![vec![b'a'; 250]; 80],
    ));
    assert!(big.len() > 20_000);
    let mut alert_between = reframe(
        &first_flight(&mut tls_client("secure.test", None, vec![])),
        64,
    );
    alert_between.splice(69..69, [21, 3, 3, 0, 2, 1, 0]);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("zero-length record first", empty_first, "sni-mismatch"),
        ("20 KB hello", big, "sni-mismatch"),
        (
            "garbage after 0x16",
            b"\x16 certainly not TLS\r\n\r\n".to_vec(),
            "tls-unverifiable",
        ),
        (
            "an alert inside the hello",
            alert_between,
            "tls-unverifiable",
        ),
        // A record of another type first: Go's TLS stack drops a warning alert and reads
        // the hello after it, so these passed as not-TLS.
        (
            "a warning alert first",
            before(&[0x15, 3, 3, 0, 2, 1, 0]),
            "tls-unverifiable",
        ),
        (
            "an alert with version 0x0000 first",
            before(&[0x15, 0, 0, 0, 2, 1, 90]),
            "tls-unverifiable",
        ),
        (
            "a change_cipher_spec first",
            before(&[0x14, 3, 3, 0, 1, 1]),
            "tls-unverifiable",
        ),
        (
            "application data first",
            before(&[0x17, 3, 3, 0, 3, 1, 2, 3]),
            "tls-unverifiable",
        ),
        (
            "a heartbeat first",
            before(&[0x18, 3, 3, 0, 3, 1, 0, 0]),
            "tls-unverifiable",
        ),
        // A record header, then silence past the header-read timeout.
        (
            "a hello that never completes",
            vec![22, 3, 1, 0, 200, 1],
            "tls-unverifiable",
        ),
    ];
    for (what, bytes, code) in cases {
        let h = Harness::new();
        let lease = h.lease(&["secure.test"], &["denied.test"]);
        let mut config = h.config(&[("secure.test", "127.0.0.1")]);
        config.header_read_timeout = Duration::from_millis(500);
        let server = h.start(config).await;
        let mut stream = tunnel(server.addr, &target, &lease).await;
        let back = send_until_closed(&mut stream, &bytes).await;
        assert!(back.is_empty(), "{what}: the origin answered: {back:?}");
        assert_closed_with(&h, &server, &lease, &target, code).await;
    }
}

/// Plain protocols, one whose first byte is a TLS content type included, still pass a tunnel
/// (a record of another type before a ClientHello does not: see the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_bytes_pass_even_when_they_start_with_a_content_type_byte() {
    // An echo origin: plain bytes come back as sent.
    let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let echo_port = echo.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = echo.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    let h = Harness::new();
    let lease = h.lease(&["echo.test"], &[]);
    let server = h.start(h.config(&[("echo.test", "127.0.0.1")])).await;
    for plain in [
        &b"SSH-2.0-OpenSSH_9.6\r\n"[..],
        b"\x15A plain protocol line\r\n",
        b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
    ] {
        let mut stream = tunnel(server.addr, &format!("echo.test:{echo_port}"), &lease).await;
        stream.write_all(plain).await.unwrap();
        let mut back = vec![0u8; plain.len()];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut back))
            .await
            .expect("the echo came back")
            .unwrap();
        assert_eq!(back, plain);
    }
    assert!(h.revocations().await.is_empty());
}

/// Drives `conn`'s handshake over `stream` (its first flight already sent), then a GET.
async fn finish_and_get(conn: &mut rustls::ClientConnection, stream: &mut TcpStream) -> String {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 16 * 1024];
    let mut sent_request = false;
    let mut plain = Vec::new();
    loop {
        let mut out = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut out).unwrap();
        }
        stream.write_all(&out).await.unwrap();
        if !conn.is_handshaking() && !sent_request {
            conn.writer()
                .write_all(b"GET / HTTP/1.1\r\nHost: secure.test\r\nConnection: close\r\n\r\n")
                .unwrap();
            sent_request = true;
            continue;
        }
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("the origin went silent")
            .unwrap();
        if n == 0 {
            break;
        }
        conn.read_tls(&mut &buf[..n]).unwrap();
        conn.process_new_packets().unwrap();
        let _ = conn.reader().read_to_end(&mut plain);
        if String::from_utf8_lossy(&plain).contains("hello from origin") {
            break;
        }
    }
    String::from_utf8_lossy(&plain).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_in_one_byte_records_with_an_allowed_sni_reaches_the_origin() {
    let h = Harness::new();
    let (secure, ca) = https_origin("secure.test", h.dir.path()).await;
    let lease = h.lease(&["secure.test"], &["denied.test"]);
    let server = h.start(h.config(&[("secure.test", "127.0.0.1")])).await;
    let target = format!("secure.test:{}", secure.addr.port());

    let mut conn = tls_client("secure.test", Some(&ca), vec![]);
    let mut stream = tunnel(server.addr, &target, &lease).await;
    // (No zero-length record here: the rustls origin refuses those, as RFC 8446 allows.)
    let first = reframe(&first_flight(&mut conn), 1);
    stream.write_all(&first).await.unwrap();
    let answer = finish_and_get(&mut conn, &mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("hello from origin\n"), "{answer}");
    drop(stream);
    let line = h.egress_line(1).await;
    assert_eq!(line["verdict"], "allow", "{line}");
    assert_eq!(line["code"], serde_json::Value::Null, "{line}");
    assert!(
        line["bytes_up"].as_u64().unwrap() > first.len() as u64,
        "{line}"
    );
    assert!(h.revocations().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_sni_closes_tunnels_without_a_named_hello() {
    let dir = tempfile::tempdir().unwrap();
    let origin = http_origin().await;
    let (secure, _) = https_origin("secure.test", dir.path()).await;
    let plain = b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n".to_vec();
    // rustls sends no SNI for an IP address.
    let nameless = first_flight(&mut tls_client("127.0.0.1", None, vec![]));
    let cases = [
        (format!("origin.test:{}", origin.addr.port()), plain),
        (format!("secure.test:{}", secure.addr.port()), nameless),
    ];
    for require_sni in [false, true] {
        for (target, bytes) in &cases {
            let h = Harness::new();
            let lease = h.lease(&["origin.test", "secure.test"], &[]);
            let mut config =
                h.config(&[("origin.test", "127.0.0.1"), ("secure.test", "127.0.0.1")]);
            config.require_sni = require_sni;
            let server = h.start(config).await;
            let mut stream = tunnel(server.addr, target, &lease).await;
            if require_sni {
                let back = send_until_closed(&mut stream, bytes).await;
                assert!(back.is_empty(), "{target}: {back:?}");
                assert_closed_with(&h, &server, &lease, target, "tls-unverifiable").await;
            } else {
                // Passed as before: the origin answers (HTTP text, or a TLS record).
                stream.write_all(bytes).await.unwrap();
                let mut buf = [0u8; 64];
                let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
                    .await
                    .unwrap()
                    .unwrap();
                assert!(n > 0, "{target}: the tunnel closed");
                assert!(
                    buf.starts_with(b"HTTP/1.1 200") || buf[0] == 22,
                    "{target}: {:?}",
                    &buf[..n]
                );
                assert!(h.revocations().await.is_empty());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_headers_are_compared_normalised() {
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease(&["*.test"], &[]);
    let server = h
        .start(h.config(&[
            ("xn--bcher-kva.test", "127.0.0.1"),
            ("origin.test", "127.0.0.1"),
        ]))
        .await;
    let request = |uri: &str, host: &[u8]| {
        let mut bytes = format!("GET {uri} HTTP/1.1\r\nX-Lease-Id: {lease}\r\nHost: ").into_bytes();
        bytes.extend_from_slice(host);
        bytes.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        bytes
    };
    let uri = format!("http://xn--bcher-kva.test:{port}/");
    // The Unicode spelling, sent raw (UTF-8), and with a different case and a trailing dot.
    for host in [
        format!("bücher.test:{port}"),
        format!("BÜCHER.test.:{port}"),
        format!("xn--bcher-kva.test:{port}"),
    ] {
        let answer = raw(server.addr, &request(&uri, host.as_bytes())).await;
        assert_eq!(status_of(&answer), 200, "{host}: {answer}");
    }
    // The default port, spelled or not, on either side: the host check passes (nothing
    // listens on port 80 here, so the dial may fail, but no 421).
    for (uri, host) in [
        ("http://origin.test/", "origin.test:80"),
        ("http://origin.test:80/", "origin.test"),
        ("http://origin.test/", "origin.test"),
        ("http://xn--bcher-kva.test:80/", "bücher.test"),
    ] {
        let answer = raw(server.addr, &request(uri, host.as_bytes())).await;
        assert_ne!(status_of(&answer), 421, "{uri} {host}: {answer}");
        assert!(!answer.contains("host-mismatch"), "{uri} {host}: {answer}");
    }
    assert!(h.revocations().await.is_empty(), "no false host-mismatch");
    // A real mismatch still is one.
    let answer = raw(
        server.addr,
        &request(&uri, format!("origin.test:{port}").as_bytes()),
    )
    .await;
    assert_eq!(status_of(&answer), 421, "{answer}");
    assert!(answer.contains("host-mismatch"), "{answer}");
}

/// A GET through the proxy whose head is exactly `len` bytes (padded with one header).
fn head_of_len(port: u16, lease: &str, len: usize) -> Vec<u8> {
    let start = format!(
        "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {lease}\r\nConnection: close\r\nX-Pad: "
    );
    let pad = len - start.len() - "\r\n\r\n".len();
    let head = format!("{start}{}\r\n\r\n", "a".repeat(pad));
    assert_eq!(head.len(), len);
    head.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_head_limit_is_exact() {
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let limit = 65536;
    let answer = raw(server.addr, &head_of_len(port, &lease, limit)).await;
    assert_eq!(
        status_of(&answer),
        200,
        "{}",
        &answer[..answer.len().min(300)]
    );
    for len in [limit + 1, 66 * 1024, 80_000, 100_000] {
        let answer = raw(server.addr, &head_of_len(port, &lease, len)).await;
        assert_eq!(
            status_of(&answer),
            431,
            "{len}: {}",
            &answer[..answer.len().min(300)]
        );
    }
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the head within the limit reached the origin"
    );
    // Each refused head leaves its egress line too.
    let lines = h.egress_lines(5).await;
    for line in &lines[1..] {
        assert_eq!(line["status"], 431, "{line}");
        assert_eq!(line["verdict"], "refuse", "{line}");
        assert!(
            leasegate::contract::schema::Schema::EgressEvent.is_valid(line),
            "{line}"
        );
    }
    assert!(h.revocations().await.is_empty());
}
