//! Terminated tunnels under load: a WebSocket through a terminated host, long and endless
//! streams (cut when the lease is revoked), keep-alive requests on one upstream connection,
//! concurrent HTTP/2 streams on one connection, an upload past the body scan window, a misuse
//! on one replica closing the lease on another.

use super::brokered::{received, Brokered, HOST, VALUE};
use crate::cluster::scale_out::{admin_revoke, proxy_revocations, until_status};
use crate::support::harness::*;
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use crate::support::tls_hello::client_config;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use leasegate::registry::JournalLocation;
use leasegate::server::Server;
use rustls::pki_types::ServerName;
use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A TLS connection to `HOST` through a CONNECT tunnel on `proxy` under `lease`, trusting only
/// the interception CA, offering `alpn`.
pub async fn tls_through(
    b: &Brokered,
    proxy: SocketAddr,
    lease: &str,
    alpn: &[&[u8]],
) -> TlsStream<TcpStream> {
    let target = format!("{HOST}:{}", b.origin.addr.port());
    let tunnel = open_tunnel(proxy, &target, Some(lease)).await;
    let alpn = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(client_config(Some(&b.ca_pem), alpn))
        .connect(ServerName::try_from(HOST).unwrap(), tunnel)
        .await
        .unwrap()
}

/// `GET path` over HTTP/1.1 on `tls`; what came until `until` did, the head answering 200.
async fn get_inside(
    b: &Brokered,
    tls: &mut TlsStream<TcpStream>,
    path: &str,
    until: &str,
) -> String {
    let port = b.origin.addr.port();
    let get = format!("GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n");
    tls.write_all(get.as_bytes()).await.unwrap();
    let seen = read_until_tls(tls, until).await;
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    seen
}

/// The egress lines of requests inside terminated tunnels, once there are `n` (10 s at most).
async fn https_lines(b: &Brokered, n: usize) -> Vec<Value> {
    let found = eventually(Duration::from_secs(10), || async {
        let text = tokio::fs::read_to_string(&b.h.egress)
            .await
            .unwrap_or_default();
        let inside: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|l| l["kind"] == "https")
            .collect();
        (inside.len() >= n).then_some(inside)
    })
    .await;
    found.unwrap_or_else(|| panic!("fewer than {n} https egress lines"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_through_a_terminated_host_gets_the_secret_and_echoes() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let tls = tls_through(&b, b.server.addr, &lease, &[b"http/1.1"]).await;
    let url = format!("ws://{HOST}:{}/ws", b.origin.addr.port());
    let mut request = url.into_client_request().unwrap();
    let bearer = format!("Bearer {}", b.placeholder(&lease));
    request
        .headers_mut()
        .insert("authorization", bearer.parse().unwrap());
    let (mut ws, response) = tokio_tungstenite::client_async(request, tls).await.unwrap();
    assert_eq!(response.status(), 101);
    for i in 0..5 {
        let text = format!("message {i}");
        ws.send(Message::text(text.clone())).await.unwrap();
        assert_eq!(ws.next().await.unwrap().unwrap(), Message::text(text));
    }
    let binary: Vec<u8> = (0..100_000).map(pattern_byte).collect();
    ws.send(Message::binary(binary.clone())).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::binary(binary));
    // Once the upgrade is answered the messages are relayed unread: a value inside one is not
    // caught (the documented limit of the exact checks).
    ws.send(Message::text(VALUE)).await.unwrap();
    assert_eq!(ws.next().await.unwrap().unwrap(), Message::text(VALUE));
    ws.close(None).await.unwrap();
    drop(ws);
    let lines = https_lines(&b, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], 101, "{}", lines[0]);
    assert_eq!(lines[0]["path"], "/ws");
    assert_eq!(lines[0]["secrets"], serde_json::json!(["github"]));
    assert_eq!(lines[0]["lease_id"], lease.as_str());
    assert_eq!(b.status(&lease).await, "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_stream_arrives_whole() {
    const SIZE: usize = 20_000_000;
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    for version in ["--http1.1", "--http2"] {
        let out = b
            .curl(&lease, &[version, &b.url(&format!("/big/{SIZE}"))])
            .await;
        assert_eq!(out.status, 200, "{version}: {}", out.stderr);
        assert_eq!(out.body.len(), SIZE, "{version}");
        let wrong = out
            .body
            .iter()
            .enumerate()
            .position(|(i, byte)| *byte != pattern_byte(i as u64));
        assert_eq!(wrong, None, "{version}: the first byte that differs");
    }
    let lines = https_lines(&b, 2).await;
    for line in &lines {
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["secrets"], serde_json::json!(["github"]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_stream_is_cut_when_the_lease_is_revoked() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let mut tls = tls_through(&b, b.server.addr, &lease, &[b"http/1.1"]).await;
    get_inside(&b, &mut tls, "/slow", "tick\n").await;
    admin_revoke(&b.server, &lease).await;
    let closed_after = until_closed(&mut tls, AT_ONCE * 2).await;
    assert!(closed_after < AT_ONCE, "cut after {closed_after:?}");
    assert_eq!(b.status(&lease).await, "revoked");
}

/// Reads from `stream` until what was read contains `needle`; returns it all.
pub async fn read_until_tls(stream: &mut TlsStream<TcpStream>, needle: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let n = tokio::time::timeout(AT_ONCE, stream.read(&mut buf))
            .await
            .expect("nothing came")
            .unwrap();
        assert!(n > 0, "closed before {needle:?} came");
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// `body` is the origin's `/request` listing for request `?n={i}` (not another's), which got
/// the secret's value.
fn the_answer_to(i: usize, body: &str) {
    assert!(
        body.contains(&format!("?n={}\n", sha_hex(i.to_string().as_bytes()))),
        "request {i} got another's answer: {body}"
    );
    assert_eq!(
        received(body, "authorization"),
        Some(sha_hex(format!("Bearer {VALUE}").as_bytes())),
        "request {i}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_requests_in_a_tunnel_share_one_upstream_connection() {
    const REQUESTS: usize = 5;
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let tls = tls_through(&b, b.server.addr, &lease, &[b"http/1.1"]).await;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(connection);
    let port = b.origin.addr.port();
    for i in 0..REQUESTS {
        let request = http::Request::get(format!("/request?n={i}"))
            .header("host", format!("{HOST}:{port}"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        // The client's connection takes the next request only once it has seen the last
        // answer end: asking sooner is refused ("connection was not ready"), a race of the
        // client's own, not the proxy's.
        sender.ready().await.unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 200, "request {i}");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        the_answer_to(i, std::str::from_utf8(&body).unwrap());
    }
    // The connection made before the tunnel's 200 carried every request: each one after the
    // first took the connection the one before had used.
    assert_eq!(
        b.origin
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    let lines = https_lines(&b, REQUESTS).await;
    assert!(lines.iter().all(|l| l["status"] == 200), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_http2_streams_on_one_connection_each_get_the_value() {
    const STREAMS: usize = 8;
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let tls = tls_through(&b, b.server.addr, &lease, &[b"h2"]).await;
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(connection);
    let port = b.origin.addr.port();
    let requests = (0..STREAMS).map(|i| {
        let mut sender = sender.clone();
        async move {
            let request = http::Request::get(format!("https://{HOST}:{port}/request?n={i}"))
                .body(Empty::<Bytes>::new())
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (i, status, String::from_utf8(body.to_vec()).unwrap())
        }
    });
    let answers = futures_util::future::join_all(requests).await;
    for (i, status, body) in answers {
        assert_eq!(status, 200, "stream {i}: {body}");
        the_answer_to(i, &body);
    }
    let lines = https_lines(&b, STREAMS).await;
    assert_eq!(lines.len(), STREAMS, "{lines:?}");
    assert!(lines.iter().all(|l| l["status"] == 200), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_past_the_scan_window_arrives_whole_and_is_not_scanned_there() {
    const SIZE: usize = 1 << 20;
    let b = Brokered::start().await;
    let upload = |name: &str, body: &[u8]| {
        let path = b.h.dir.path().join(name);
        std::fs::write(&path, body).unwrap();
        format!("@{}", path.display())
    };
    let expect = |body: &[u8]| format!("{} {}", body.len(), sha_hex(body));
    let mut body: Vec<u8> = (0..SIZE as u64)
        .map(|i| b'a' + pattern_byte(i) % 26)
        .collect();
    let url = b.url("/upload");
    let lease = b.lease.clone();
    let file = upload("plain", &body);
    let out = b.curl(&lease, &["--data-binary", &file, &url]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    assert_eq!(out.body_text(), expect(&body));

    // The value far past the first 64 KiB (and past any read that could overshoot them):
    // not caught, and the origin gets the body whole.
    let at = 900 * 1024;
    body[at..at + VALUE.len()].copy_from_slice(VALUE.as_bytes());
    let file = upload("late", &body);
    let out = b.curl(&lease, &["--data-binary", &file, &url]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    assert_eq!(out.body_text(), expect(&body));
    assert_eq!(b.status(&lease).await, "open");

    // Inside the window it is caught, and the lease revoked.
    let other = b.second.clone();
    let mut early: Vec<u8> = (0..SIZE as u64)
        .map(|i| b'a' + pattern_byte(i) % 26)
        .collect();
    let at = 60 * 1024;
    early[at..at + VALUE.len()].copy_from_slice(VALUE.as_bytes());
    let file = upload("early", &early);
    let out = b.curl(&other, &["--data-binary", &file, &url]).await;
    assert_eq!(out.status, 403, "{}", out.stderr);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("secret-exposed")
    );
    assert_eq!(b.status(&other).await, "revoked");
    let lines = https_lines(&b, 3).await;
    let statuses: Vec<&Value> = lines.iter().map(|l| &l["status"]).collect();
    assert_eq!(statuses, [200, 200, 403], "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misdirected_placeholder_on_one_replica_closes_the_lease_on_another() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let on_nats = |data: &'static str, dir: std::path::PathBuf| {
        let location = cluster.location_as(Role::Replica, "LG");
        move |config: &mut leasegate::config::ServeConfig| {
            config.journal = JournalLocation::Nats(location);
            config.store.data_dir = dir.join(data);
            config.store.nats.replicas = 1;
        }
    };
    let scratch = tempfile::tempdir().unwrap();
    let b = Brokered::start_with(None, on_nats("a", scratch.path().to_owned())).await;
    let replica: Server = b.another(on_nats("b", scratch.path().to_owned())).await;
    publish_file(&stream, &b.h.journal).await;
    let lease = b.lease.clone();
    for server in [&b.server, &replica] {
        assert!(until_status(server, &lease, "open", AT_ONCE * 2).await);
    }
    // A tunnel on the replica, its first request answered with the value put in.
    let mut tls = tls_through(&b, replica.addr, &lease, &[b"http/1.1"]).await;
    get_inside(&b, &mut tls, "/request", "\nhost: ").await;

    // On the first proxy, the placeholder where its secret is not for.
    let query = format!("/headers?token={}", b.placeholder(&lease));
    let out = b.curl(&lease, &[&b.url(&query)]).await;
    assert_eq!(out.status, 403, "{}", out.stderr);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("secret-misdirected")
    );
    assert!(until_status(&replica, &lease, "revoked", AT_ONCE * 2).await);
    // The replica ends the tunnel open before, and refuses the next one.
    let closed_after = until_closed(&mut tls, AT_ONCE * 2).await;
    assert!(closed_after < AT_ONCE, "closed after {closed_after:?}");
    let answer = b.connect_answer(replica.addr, &lease).await;
    assert_eq!(status_of(&answer), 403, "{answer}");
    assert!(
        answer.contains("x-leasegate-refusal: lease-revoked"),
        "{answer}"
    );
    let records: Vec<Value> = stream
        .read_all()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, line)| serde_json::from_slice(&line).unwrap())
        .collect();
    assert_eq!(proxy_revocations(&records, &lease), 1, "{records:?}");
}
