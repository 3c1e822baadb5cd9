//! The published bugs of peer proxies, tried on ours with raw sockets: request smuggling on the
//! proxy and inside terminated tunnels, `Host` forms on the proxy and the admin API, our
//! credentials and the lease token never reaching an origin, an origin that dresses its answer
//! as a refusal or echoes a secret back, and a tunnel used to reach another proxy.

use super::brokered::{Brokered, HOST, VALUE};
use super::brokered_streams::tls_through;
use crate::support::harness::*;
use base64::Engine;
use leasegate::proxy::OnRefusal;
use leasegate::server::Server;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Framing headers two HTTP parsers could read apart, each with a body framed for one reading.
/// Both `Transfer-Encoding: chunked` and a `Content-Length` (the first two) are read by the
/// coding alone (RFC 9112 §6.3: hyper drops the length before anything sees it) and the
/// connection closes after the answer; every other shape is refused. (Two equal
/// `Content-Length` fields are one length to hyper and to the origin it sends one to: no
/// shape of smuggling.)
const SHAPES: [(&str, &str, &str); 14] = [
    (
        "TE and CL",
        "Transfer-Encoding: chunked\r\nContent-Length: 40\r\n",
        CHUNKED,
    ),
    (
        "CL and TE",
        "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
        CHUNKED,
    ),
    (
        "unequal lengths",
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "hello",
    ),
    ("a length list", "Content-Length: 5, 5\r\n", "hello"),
    ("a signed length", "Content-Length: +5\r\n", "hello"),
    (
        "a coding list",
        "Transfer-Encoding: chunked, chunked\r\n",
        CHUNKED,
    ),
    (
        "another coding",
        "Transfer-Encoding: gzip, chunked\r\n",
        CHUNKED,
    ),
    (
        "two TE fields",
        "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        CHUNKED,
    ),
    (
        "a misspelt coding",
        "Transfer-Encoding: xchunked\r\n",
        CHUNKED,
    ),
    (
        "a list not ending in chunked",
        "Transfer-Encoding: Chunked , x\r\n",
        CHUNKED,
    ),
    (
        "two Host fields",
        "Host: other.test\r\nContent-Length: 5\r\n",
        "hello",
    ),
    (
        "whitespace before the colon (TE)",
        "Transfer-Encoding : chunked\r\n",
        CHUNKED,
    ),
    (
        "whitespace before the colon (CL)",
        "Content-Length : 5\r\n",
        "hello",
    ),
    (
        "a control byte in the coding",
        "Transfer-Encoding:\x0bchunked\r\n",
        CHUNKED,
    ),
];

/// How many of [`SHAPES`], the first, are read by their coding rather than refused.
const BY_CODING: usize = 2;

/// The answer to a shape: the upload of `hello` read by its coding, or a 400; either way the
/// only answer (nothing behind the body is read).
fn assert_one_reading(i: usize, what: &str, answer: &str) {
    let want = if i < BY_CODING { 200 } else { 400 };
    assert_eq!(status_of(answer), want, "{what}: {answer}");
    if i < BY_CODING {
        assert!(
            answer.ends_with(&format!("5 {}", sha_hex(b"hello"))),
            "{what}: {answer}"
        );
    }
    assert_eq!(
        answer.matches("HTTP/1.").count(),
        1,
        "{what}: the request behind the body was answered: {answer}"
    );
}

const CHUNKED: &str = "5\r\nhello\r\n0\r\n\r\n";

/// The egress lines of requests inside terminated tunnels among the first `n` lines.
fn https_only(lines: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    lines.into_iter().filter(|l| l["kind"] == "https").collect()
}

/// A proxy whose one lease may reach a plain-HTTP origin as `origin.test`.
async fn to_plain_origin() -> (Harness, Origin, String, Server) {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    (h, origin, lease, server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smuggling_shapes_are_refused_and_nothing_after_them_is_read() {
    let (h, origin, lease, server) = to_plain_origin().await;
    let port = origin.addr.port();
    let hidden = format!(
        "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: \
         {lease}\r\n\r\n"
    );
    let shapes = SHAPES.iter().map(|(w, h, b)| ("HTTP/1.1", *w, *h, *b));
    let old = (
        "HTTP/1.0",
        "TE on HTTP/1.0",
        "Transfer-Encoding: chunked\r\n",
        CHUNKED,
    );
    for (i, (version, what, headers, body)) in shapes.chain([old]).enumerate() {
        let head = format!(
            "POST http://origin.test:{port}/upload {version}\r\nHost: origin.test:{port}\r\n\
             X-Lease-Id: {lease}\r\n{headers}\r\n"
        );
        let answer = raw_to_close(server.addr, format!("{head}{body}{hidden}").as_bytes()).await;
        assert_one_reading(i, what, &answer);
    }
    // Only the uploads read by their coding reached the origin (the second, maybe, on the
    // pooled connection of the first).
    let reached = origin.connections.load(Ordering::SeqCst);
    assert!((1..=BY_CODING).contains(&reached), "{reached}");
    // A body that is not the chunked framing it claims is the client's error.
    let bad_chunks = format!(
        "POST http://origin.test:{port}/upload HTTP/1.1\r\nHost: origin.test:{port}\r\n\
         X-Lease-Id: {lease}\r\nTransfer-Encoding: chunked\r\n\r\nhello"
    );
    let answer = raw(server.addr, bad_chunks.as_bytes()).await;
    assert_eq!(status_of(&answer), 400, "{answer}");
    // Refused as bad targets where the HTTP parser passed them (the rest it answered itself):
    // none revokes, and the lease still works.
    let ok = raw(server.addr, hidden.as_bytes()).await;
    assert_eq!(status_of(&ok), 200, "{ok}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = h.egress_lines(BY_CODING + 2).await;
    let served = lines.iter().filter(|l| l["status"] == 200).count();
    assert_eq!(served, BY_CODING + 1, "{lines:?}");
    assert!(
        lines
            .iter()
            .all(|l| l["status"] == 200 || l["code"] == "bad-target"),
        "{lines:?}"
    );
    assert!(h.revocations().await.is_empty());
}

/// `request`, raw, in a new terminated tunnel of `b.lease` over HTTP/1.1: what the first read
/// of the answer gives.
async fn first_answer_inside(b: &Brokered, request: &str) -> String {
    let mut tls = tls_through(b, b.server.addr, &b.lease, &[b"http/1.1"]).await;
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut head = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut head))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&head[..n]).into_owned()
}

/// Reads all a terminated tunnel's answers until the proxy closes it (5 s at most).
async fn to_close(tls: &mut (impl tokio::io::AsyncRead + Unpin)) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_a_terminated_tunnel_each_request_is_read_once_and_smuggling_closes_it() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let port = b.origin.addr.port();
    let hidden = format!("GET /request HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n");
    for (i, (what, headers, body)) in SHAPES.into_iter().enumerate() {
        let mut tls = tls_through(&b, b.server.addr, &lease, &[b"http/1.1"]).await;
        let head = format!("POST /upload HTTP/1.1\r\nHost: {HOST}:{port}\r\n{headers}\r\n");
        tls.write_all(format!("{head}{body}{hidden}").as_bytes())
            .await
            .unwrap();
        assert_one_reading(i, what, &to_close(&mut tls).await);
    }
    // The request behind each body never got the secret: the only requests answered are the
    // uploads read by their coding; every other inside line is a refusal (the parser's own
    // 400s have none).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines = https_only(b.h.egress_lines(BY_CODING).await);
    let served: Vec<_> = lines.iter().filter(|l| l["status"] == 200).collect();
    assert_eq!(served.len(), BY_CODING, "{lines:?}");
    assert!(served.iter().all(|l| l["path"] == "/upload"), "{lines:?}");
    assert!(
        lines.iter().all(|l| l["status"] == 200
            || (l["code"] == "bad-target" && l["secrets"].as_array().is_none_or(Vec::is_empty))),
        "{lines:?}"
    );

    // Two requests pipelined with clean framing: two answers, two lines, the secret put in
    // each exactly once.
    let before = b.h.egress_lines(1).await.len();
    let mut tls = tls_through(&b, b.server.addr, &lease, &[b"http/1.1"]).await;
    let pipelined = format!(
        "POST /upload HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Length: 5\r\n\r\nhello{hidden}"
    );
    tls.write_all(pipelined.as_bytes()).await.unwrap();
    let answers = super::brokered_streams::read_until_tls(&mut tls, "authorization: ").await;
    assert_eq!(answers.matches("HTTP/1.1 200").count(), 2, "{answers}");
    let bearer = sha_hex(format!("Bearer {VALUE}").as_bytes());
    assert_eq!(answers.matches(&bearer).count(), 1, "{answers}");
    assert!(
        answers.contains(&format!("5 {}", sha_hex(b"hello"))),
        "{answers}"
    );
    drop(tls);
    let lines = https_only(b.h.egress_lines(before + 3).await[before..].to_vec());
    let given: Vec<_> = lines
        .iter()
        .filter(|l| l["status"] == 200)
        .map(|l| l["secrets"].clone())
        .collect();
    assert_eq!(given, vec![serde_json::json!(["github"]); 2], "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_forms_that_broke_other_proxies_are_refused() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("evil.test", "127.0.0.1")]);
    config.on_refusal = OnRefusal::Log;
    let server = h.start(config).await;
    let port = origin.addr.port();
    let forms = |name: &str| -> Vec<String> {
        vec![
            format!("[{name}]:{port}"),
            format!("{name}@evil.test:{port}"),
            format!("evil.test@{name}:{port}"),
            format!("{name}:{port}@evil.test"),
            format!("{name}#@evil.test:{port}"),
            format!("{name}/evil:{port}"),
            format!("{name}\\evil.test:{port}"),
            format!("{name}:{port}\\@evil.test"),
        ]
    };
    // In `Host` beside a URI that names the allowed host, and in the URI itself.
    for form in forms("origin.test") {
        for (uri, host) in [
            (format!("origin.test:{port}"), &form),
            (form.clone(), &form),
        ] {
            let request = format!(
                "GET http://{uri}/ HTTP/1.1\r\nHost: {host}\r\nX-Lease-Id: {lease}\r\n\r\n"
            );
            let answer = raw(server.addr, request.as_bytes()).await;
            assert!(
                [400, 421].contains(&status_of(&answer)),
                "URI {uri}, Host {host}: {answer}"
            );
        }
    }
    // In the CONNECT authority.
    for authority in forms("origin.test") {
        let connect = format!("CONNECT {authority} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
        let answer = raw(server.addr, connect.as_bytes()).await;
        assert_eq!(status_of(&answer), 400, "CONNECT {authority}: {answer}");
    }
    assert_eq!(origin.connections.load(Ordering::SeqCst), 0);

    // The admin API answers to its own names only.
    let admin = server.admin_addr.unwrap();
    for host in [
        "[localhost]",
        "[127.0.0.1]",
        "localhost@evil.test",
        "evil.test@localhost",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain(["localhost#x", "localhost/x", "localhost\\x"].map(str::to_owned))
    {
        let answer = raw(
            admin,
            format!("GET /status HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            [400, 421].contains(&status_of(&answer)),
            "admin Host {host}: {answer}"
        );
    }
    let own = raw(admin, b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n").await;
    assert_eq!(status_of(&own), 200, "{own}");

    // Inside a terminated tunnel: the request never gets the secret.
    let b = Brokered::start_with(None, |serve| serve.proxy.on_refusal = OnRefusal::Log).await;
    let port = b.origin.addr.port();
    for host in forms(HOST) {
        let request = format!("GET /request HTTP/1.1\r\nHost: {host}\r\n\r\n");
        let answer = first_answer_inside(&b, &request).await;
        assert!(
            [400, 421].contains(&status_of(&answer)),
            "inside, Host {host} (port {port}): {answer}"
        );
    }
    let lines = https_only(b.h.egress_lines(forms(HOST).len()).await);
    assert!(
        lines
            .iter()
            .all(|l| l["secrets"].as_array().is_none_or(Vec::is_empty) && l["status"] != 200),
        "{lines:?}"
    );
}

/// A loopback "origin" that records the head of each request it gets and answers an upgrade.
struct Recorder {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    bytes: Arc<AtomicUsize>,
}

async fn recorder() -> Recorder {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let bytes = Arc::new(AtomicUsize::new(0));
    let (kept, counted) = (heads.clone(), bytes.clone());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (kept, counted) = (kept.clone(), counted.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(n) if n > 0 => {
                            counted.fetch_add(n, Ordering::SeqCst);
                            seen.extend_from_slice(&buf[..n]);
                        }
                        _ => return,
                    }
                }
                kept.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&seen).to_ascii_lowercase());
                let _ = stream
                    .write_all(
                        b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: \
                          websocket\r\n\r\n",
                    )
                    .await;
                let _ = stream.read(&mut buf).await;
            });
        }
    });
    Recorder { addr, heads, bytes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_credentials_and_the_lease_token_never_reach_an_origin() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test", "ws.test"], &[]);
    let token = leasegate::contract::token::mint(&h.key, &lease);
    let tag = token.split_once('.').unwrap().1.to_owned();
    let origin = http_origin().await;
    let ws = recorder().await;
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("ws.test", "127.0.0.1")]))
        .await;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("agent:{token}"));
    let ours = format!(
        "Proxy-Authorization: Basic {basic}\r\nX-Lease-Id: {token}\r\nConnection: \
         proxy-authorization, x-lease-id, keep-alive\r\n"
    );
    // Absolute-form, with `Connection` naming our fields.
    let port = origin.addr.port();
    let request = format!(
        "GET http://origin.test:{port}/headers HTTP/1.1\r\nHost: origin.test:{port}\r\n{ours}\r\n"
    );
    let answer = raw(server.addr, request.as_bytes())
        .await
        .to_ascii_lowercase();
    assert_eq!(status_of(&answer), 200, "{answer}");
    let listing = &answer[answer.find("\r\n\r\n").unwrap()..];
    for gone in [
        "proxy-authorization",
        "x-lease-id",
        &tag.to_ascii_lowercase(),
        &lease,
    ] {
        assert!(
            !listing.contains(gone),
            "{gone} reached the origin: {listing}"
        );
    }
    // A WebSocket upgrade, forwarded.
    let port = ws.addr.port();
    let upgrade = format!(
        "GET http://ws.test:{port}/ws HTTP/1.1\r\nHost: ws.test:{port}\r\n\
         Proxy-Authorization: Basic {basic}\r\nX-Lease-Id: {lease}\r\n\
         Connection: Upgrade, Proxy-Authorization, X-Lease-Id\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    );
    let answer = raw(server.addr, upgrade.as_bytes()).await;
    assert_eq!(status_of(&answer), 101, "{answer}");
    let heads = ws.heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 1, "{heads:?}");
    for gone in [
        "proxy-authorization",
        "x-lease-id",
        &tag.to_ascii_lowercase(),
        &lease,
    ] {
        assert!(
            !heads[0].contains(gone),
            "{gone} reached the origin: {}",
            heads[0]
        );
    }
    assert!(heads[0].contains("upgrade: websocket"), "{}", heads[0]);

    // The token anywhere else is refused before it leaves, and the lease revoked (a token
    // an origin saw is worthless).
    let port = origin.addr.port();
    let before = origin.connections.load(Ordering::SeqCst);
    let places = ["the query", "another header", "Authorization"];
    for place in places {
        let lease = h.lease(&["origin.test"], &[]);
        let token = leasegate::contract::token::mint(&h.key, &lease);
        let tag = token.split_once('.').unwrap().1.to_owned();
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("agent:{token}"));
        let (target, extra) = match place {
            "the query" => (format!("/?t={tag}"), String::new()),
            "another header" => ("/".to_owned(), format!("X-Api-Key: {token}\r\n")),
            _ => ("/".to_owned(), format!("Authorization: Basic {basic}\r\n")),
        };
        let request = format!(
            "GET http://origin.test:{port}{target} HTTP/1.1\r\nHost: origin.test:{port}\r\n\
             {extra}Proxy-Authorization: Basic {basic}\r\n\r\n"
        );
        let answer = eventually_answer(&server, &request).await;
        assert_eq!(status_of(&answer), 403, "{place}: {answer}");
        assert!(
            answer.contains("x-leasegate-refusal: secret-exposed"),
            "{place}: {answer}"
        );
        assert!(answer.contains("own proxy token"), "{place}: {answer}");
        assert!(
            !answer.contains(&tag),
            "the refusal repeats the token: {answer}"
        );
    }
    assert_eq!(origin.connections.load(Ordering::SeqCst), before);
    assert_eq!(h.revocations().await.len(), places.len());
}

/// The answer to `request` once the proxy knows the lease it names (folded from the journal).
async fn eventually_answer(server: &Server, request: &str) -> String {
    let found = eventually(Duration::from_secs(10), || async {
        let answer = raw(server.addr, request.as_bytes()).await;
        (!answer.contains("lease-unknown")).then_some(answer)
    })
    .await;
    found.expect("the lease was never folded")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_cannot_dress_as_a_refusal_or_hand_a_secret_back() {
    // Forwarded: the origin's `x-leasegate-*` fields and a reason phrase naming a code go.
    let (h, origin, lease, server) = to_plain_origin().await;
    let port = origin.addr.port();
    let request = format!(
        "GET http://origin.test:{port}/forged HTTP/1.1\r\nHost: origin.test:{port}\r\n\
         X-Lease-Id: {lease}\r\n\r\n"
    );
    let answer = raw(server.addr, request.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{answer}");
    assert!(
        !answer.to_ascii_lowercase().contains("x-leasegate-"),
        "{answer}"
    );
    assert!(
        answer.ends_with("(not really)\n"),
        "the body is the origin's: {answer}"
    );
    let line = h.egress_line(1).await;
    assert_eq!(
        (&line["status"], &line["code"]),
        (&403.into(), &serde_json::Value::Null)
    );
    assert!(h.revocations().await.is_empty());

    // Terminated: the same, and a secret the origin echoes (in a field, in a redirect's
    // target, raw and percent-encoded) never reaches the agent.
    let b = Brokered::start().await;
    let forged = b.curl(&b.stranger, &["--http1.1", &b.url("/forged")]).await;
    assert_eq!(forged.status, 403, "{forged:?}");
    assert!(
        !forged.headers.to_ascii_lowercase().contains("x-leasegate-"),
        "{}",
        forged.headers
    );
    assert!(
        !forged.headers.contains("host-denied"),
        "{}",
        forged.headers
    );
    let bearer = format!("Authorization: Bearer {}", b.placeholder(&b.lease));
    let echoed = b
        .curl(&b.lease, &["-H", &bearer, &b.url("/echo-redirect")])
        .await;
    assert_eq!(echoed.status, 302, "{echoed:?}");
    let encoded: String = url::form_urlencoded::byte_serialize(VALUE.as_bytes()).collect();
    for shown in [&echoed.headers, &echoed.body_text()] {
        assert!(
            !shown.contains(VALUE) && !shown.contains(&encoded),
            "{shown}"
        );
    }
    assert_eq!(
        echoed.header("x-echo").as_deref(),
        Some("Bearer [redacted]")
    );
    assert_eq!(
        echoed.header("location").as_deref(),
        Some("https://elsewhere.test/next?auth=Bearer+[redacted]")
    );
    let lines = https_only(b.h.egress_lines(4).await);
    let given = lines.iter().find(|l| l["status"] == 302).unwrap();
    assert_eq!(given["secrets"], serde_json::json!(["github"]), "{given}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_is_never_a_way_to_another_proxy() {
    let h = Harness::new();
    let other = recorder().await;
    let lease = h.lease(&["127.0.0.1"], &[]);
    let mut config = h.config(&[]);
    config.on_refusal = OnRefusal::Log;
    config.header_read_timeout = Duration::from_millis(500);
    let server = h.start(config).await;
    let target = other.addr.to_string();
    // Each opens a tunnel to a proxy on loopback (the guard allows 127.0.0.1 here) and asks
    // it for another host; the last sends a prefix and waits.
    let tries: [&[&[u8]]; 6] = [
        &[b"CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n"],
        &[b"connect evil.test:443 HTTP/1.1\r\n\r\n"],
        &[b"\r\nCONNECT evil.test:443 HTTP/1.1\r\n\r\n"],
        &[b"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n"],
        &[b"CONN", b"ECT evil.test:443 HTTP/1.1\r\n\r\n"],
        &[b"CONNEC"],
    ];
    for parts in tries {
        let mut tunnel = open_tunnel(server.addr, &target, Some(&lease)).await;
        for part in parts {
            tunnel.write_all(part).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let closed = until_closed(&mut tunnel, Duration::from_secs(5)).await;
        assert!(
            closed < Duration::from_secs(5),
            "{parts:?}: the tunnel stayed open"
        );
    }
    assert_eq!(
        other.bytes.load(Ordering::SeqCst),
        0,
        "the other proxy heard from us"
    );
    let lines = h.egress_lines(tries.len()).await;
    assert!(lines.iter().all(|l| l["code"] == "bad-target"), "{lines:?}");
    let waited = lines.iter().find(|l| {
        l["error"]
            .as_str()
            .is_some_and(|e| e.contains("within the header-read timeout"))
    });
    assert!(waited.is_some(), "{lines:?}");
    // A plain request in origin-form goes through.
    let mut tunnel = open_tunnel(server.addr, &target, Some(&lease)).await;
    tunnel
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut tunnel, "101").await;
    assert!(other.bytes.load(Ordering::SeqCst) > 0);

    // The proxy's own admin port is never a tunnel's end, whatever the guard allows.
    let admin = server.admin_addr.unwrap();
    let answer = raw(
        server.addr,
        format!(
            "CONNECT 127.0.0.1:{} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n",
            admin.port()
        )
        .as_bytes(),
    )
    .await;
    assert!(
        answer.contains("x-leasegate-refusal: address-not-allowed"),
        "{answer}"
    );
    assert!(answer.contains("own listening"), "{answer}");

    // Inside a terminated tunnel a CONNECT is refused, and so is TRACE (which would echo the
    // secret put in back).
    let b = Brokered::start().await;
    let authority = format!("{HOST}:{}", b.origin.addr.port());
    for method in [format!("CONNECT {authority}"), "TRACE /request".to_owned()] {
        let request = format!("{method} HTTP/1.1\r\nHost: {authority}\r\n\r\n");
        let answer = first_answer_inside(&b, &request).await;
        assert_eq!(status_of(&answer), 405, "{method}: {answer}");
        assert!(
            answer.contains("x-leasegate-refusal: method-not-allowed"),
            "{answer}"
        );
    }
    let lines = https_only(b.h.egress_lines(4).await);
    assert!(lines
        .iter()
        .all(|l| l["secrets"].as_array().is_none_or(Vec::is_empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_a_terminated_tunnel_our_fields_never_reach_the_origin() {
    let b = Brokered::start().await;
    let ours = [
        "-H",
        "Proxy-Authorization: Basic YWdlbnQ6eA==",
        "-H",
        "X-Lease-Id: 00000000-0000-4000-8000-000000000000",
        "-H",
        "Connection: proxy-authorization, x-lease-id",
    ];
    for version in ["--http1.1", "--http2"] {
        let mut args = vec![version];
        args.extend_from_slice(&ours);
        let url = b.url("/headers");
        args.push(&url);
        let out = b.curl(&b.stranger, &args).await;
        assert_eq!(out.status, 200, "{version}: {out:?}");
        let listing = out.body_text().to_ascii_lowercase();
        for gone in ["proxy-authorization", "x-lease-id", "connection"] {
            assert!(
                !listing.contains(gone),
                "{version}: {gone} reached the origin: {listing}"
            );
        }
    }
    // A WebSocket upgrade inside: the origin lists the fields it got in its 101.
    let mut tls = tls_through(&b, b.server.addr, &b.stranger, &[b"http/1.1"]).await;
    let upgrade = format!(
        "GET /ws HTTP/1.1\r\nHost: {HOST}:{}\r\nProxy-Authorization: Basic YWdlbnQ6eA==\r\n\
         X-Lease-Id: {}\r\nConnection: Upgrade, X-Lease-Id\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        b.origin.addr.port(),
        b.stranger
    );
    tls.write_all(upgrade.as_bytes()).await.unwrap();
    let head = super::brokered_streams::read_until_tls(&mut tls, "\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    let seen = head
        .lines()
        .find_map(|l| l.strip_prefix("x-seen-headers: "))
        .unwrap_or_else(|| panic!("{head}"));
    assert!(
        seen.contains("upgrade") && seen.contains("sec-websocket-key"),
        "{seen}"
    );
    for gone in ["proxy-authorization", "x-lease-id"] {
        assert!(
            !seen.split(',').any(|n| n == gone),
            "{gone} reached the origin: {seen}"
        );
    }
}

/// The secret's own host over plain HTTP: nothing is put in, and its placeholder there is
/// misuse (the value would cross the network in the clear).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_is_never_put_on_plain_http_even_to_its_own_host() {
    let b = Brokered::start().await;
    let url = format!("http://{HOST}:{}/request", b.plain.addr.port());
    let out = b.curl(&b.lease, &[&url]).await;
    assert_eq!(out.status, 200, "{out:?}");
    assert!(
        !out.body_text().contains("authorization"),
        "{}",
        out.body_text()
    );
    let bearer = format!("Authorization: Bearer {}", b.placeholder(&b.lease));
    let out = b.curl(&b.lease, &["-H", &bearer, &url]).await;
    assert_eq!(out.status, 403, "{out:?}");
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("secret-misdirected")
    );
    assert!(
        out.body_text().contains("(plain HTTP)"),
        "{}",
        out.body_text()
    );
}

/// A client told the proxy is `https://` opens with a TLS ClientHello: it gets one fatal TLS
/// `protocol_version` alert — curl says "alert protocol version" instead of "wrong version
/// number" — and nothing of an HTTP answer; a plain client on the same listener is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_speaking_tls_to_the_plain_listener_gets_a_tls_alert() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["127.0.0.1"], &[]);
    let server = h.start(h.config(&[])).await;
    // The start of a ClientHello record (TLS 1.2 record, handshake).
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(&[22, 3, 1, 0, 200, 1, 0, 0, 196, 3, 3])
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        answer,
        [21, 3, 1, 0, 2, 2, 70],
        "{:?}",
        String::from_utf8_lossy(&answer)
    );

    let https_proxy = format!("https://agent:{lease}@{}", server.addr);
    let url = format!("http://127.0.0.1:{}/", origin.addr.port());
    let out = curl(&["-x", &https_proxy, "--proxy-insecure", &url], &[]).await;
    assert_eq!(out.exit, 35, "{}", out.stderr);
    assert!(
        out.stderr.contains("alert protocol version"),
        "{}",
        out.stderr
    );
    let plain = through(&server, &lease, &url).await;
    assert_eq!(plain.status, 200, "{}", plain.stderr);
}
