//! A CONNECT to a port open to forwarded requests only (`--forward-ports`, not
//! `--connect-ports`): plain HTTP inside, each request served as the forwarded request it
//! stands for, under the CONNECT's lease and to the CONNECT's host only, whatever it carries.

use crate::support::harness::{http_origin, raw, raw_to_close, Harness};
use leasegate::policy::Ports;
use leasegate::proxy::OnRefusal;

/// A proxy with the origin's port open to forwarded requests and not to tunnels, refusals
/// logged (so one lease serves every case), two leases for `origin.test`, and the origin's
/// port.
async fn setup() -> (Harness, leasegate::server::Server, String, String, u16) {
    let h = Harness::new();
    let (lease, other) = (
        h.lease(&["origin.test"], &[]),
        h.lease(&["origin.test", "other.test"], &[]),
    );
    let origin = http_origin().await;
    let port = origin.addr.port();
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]);
    config.on_refusal = OnRefusal::Log;
    config.connect_ports = Ports::only(443);
    config.forward_ports = Ports::only(port);
    let server = h.start(config).await;
    (h, server, lease, other, port)
}

fn connect(port: u16, lease: &str, inside: &str) -> Vec<u8> {
    format!(
        "CONNECT origin.test:{port} HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {lease}\r\n\r\n{inside}"
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_inside_are_forwarded_under_the_connects_lease_to_its_host_only() {
    let (h, server, lease, other, port) = setup().await;

    // Another lease's credentials inside are dropped: the request is the CONNECT's lease's.
    let inside = format!(
        "GET / HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {other}\r\n\
         Proxy-Authorization: Bearer {other}\r\nConnection: close\r\n\r\n"
    );
    let answer = raw_to_close(server.addr, &connect(port, &lease, &inside)).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    let inner = &answer[answer.find("\r\n\r\n").unwrap() + 4..];
    assert!(inner.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(inner.ends_with("hello from origin\n"), "{answer}");
    let lines = h.egress_lines(2).await;
    assert_eq!(lines[0]["kind"], "http", "{lines:#?}");
    assert_eq!(lines[0]["lease_id"], lease.as_str(), "{lines:#?}");
    assert_eq!(lines[0]["status"], 200);
    assert_eq!(lines[1]["kind"], "connect");
    assert_eq!(lines[1]["lease_id"], lease.as_str());

    // An absolute URI naming another host, a Host naming another, a CONNECT inside: refused.
    let cases = [
        (
            format!("GET http://other.test:{port}/ HTTP/1.1\r\nHost: other.test:{port}\r\nConnection: close\r\n\r\n"),
            "HTTP/1.1 400 bad-target",
        ),
        (
            format!("GET / HTTP/1.1\r\nHost: other.test:{port}\r\nConnection: close\r\n\r\n"),
            "HTTP/1.1 421 host-mismatch",
        ),
        (
            format!("CONNECT other.test:{port} HTTP/1.1\r\nHost: other.test:{port}\r\nConnection: close\r\n\r\n"),
            "HTTP/1.1 400 bad-target",
        ),
    ];
    for (inside, refused) in cases {
        let answer = raw_to_close(server.addr, &connect(port, &other, &inside)).await;
        let inner = &answer[answer.find("\r\n\r\n").map_or(0, |at| at + 4)..];
        assert!(
            answer.starts_with("HTTP/1.1 200 ") && inner.starts_with(refused),
            "{inside:?}: {answer}"
        );
        assert!(!inner.contains("hello from origin"), "{answer}");
    }
}

/// The CONNECT itself is judged as a forwarded request to its host: a host the lease may not
/// reach is refused before any 200, and a port open to neither list stays `port-not-allowed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connect_is_refused_as_its_forwarded_requests_would_be() {
    let (_h, server, lease, _other, port) = setup().await;
    let denied = format!(
        "CONNECT other.test:{port} HTTP/1.1\r\nHost: other.test:{port}\r\nX-Lease-Id: {lease}\r\n\r\n"
    );
    let answer = raw(server.addr, denied.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 403 host-not-allowed"),
        "{answer}"
    );
    let closed = format!("CONNECT origin.test:25 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
    let answer = raw(server.addr, closed.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 403 port-not-allowed"),
        "{answer}"
    );
}

/// Revoking the lease closes a plain tunnel kept open between requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_the_lease_closes_a_plain_tunnel() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_h, server, lease, _other, port) = setup().await;
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let inside = format!("GET / HTTP/1.1\r\nHost: origin.test:{port}\r\n\r\n");
    stream
        .write_all(&connect(port, &lease, &inside))
        .await
        .unwrap();
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&read).contains("hello from origin") {
        let n = stream.read(&mut buf).await.unwrap();
        assert_ne!(n, 0, "closed early: {}", String::from_utf8_lossy(&read));
        read.extend_from_slice(&buf[..n]);
    }
    let body = r#"{"reason":"operator"}"#;
    let revoke = format!(
        "POST /leases/{lease}/revoke HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = raw(server.admin_addr.unwrap(), revoke.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read(&mut buf)).await;
    assert!(matches!(end, Ok(Ok(0)) | Ok(Err(_))), "still open: {end:?}");
}
