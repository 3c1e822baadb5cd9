//! The proxy end to end over real sockets: curl and raw clients, loopback origins.

use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_get, curl, eventually, exchange, http_origin, https_origin, pattern_byte, proxy_url, raw,
    sha_hex, status_of, Harness,
};
use crate::support::harness::{status_through, through};
use leasegate::contract::Timestamp;
use leasegate::proxy::Mode;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Asserts a refusal seen by curl: status, header, and the egress line it left.
async fn assert_refused(
    h: &Harness,
    out: &crate::support::harness::CurlOutput,
    status: u16,
    code: &str,
    egress_n: usize,
) -> Value {
    assert_eq!(out.status, status, "{out:?}");
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some(code),
        "{out:?}"
    );
    assert!(out.body_text().contains(code), "{}", out.body_text());
    let line = h.egress_line(egress_n).await;
    assert_eq!(line["code"], code, "{line}");
    let verdict = match code {
        "lease-missing" => "challenge",
        _ => "refuse",
    };
    assert_eq!(line["verdict"], verdict);
    assert_eq!(line["status"], status);
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_and_connect_reach_allowed_origins() {
    let h = Harness::new();
    let origin = http_origin().await;
    let (secure, ca) = https_origin("secure.test", h.dir.path()).await;
    let lease = h.lease(&["origin.test", "secure.test"], &[]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("secure.test", "127.0.0.1")]))
        .await;
    let proxy = proxy_url(&server, &lease);

    let out = curl(
        &[
            "-x",
            &proxy,
            &format!("http://origin.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{out:?}");
    assert_eq!(out.body_text(), "hello from origin\n");
    let line = h.egress_line(1).await;
    assert_eq!(line["verdict"], "allow");
    assert_eq!(line["kind"], "http");
    assert_eq!(line["lease_id"], lease.as_str());
    assert_eq!(line["label"], "agent");
    assert_eq!(line["host"], "origin.test");
    assert_eq!(line["dialed"], origin.addr.to_string());
    assert_eq!(line["bytes_down"], out.headers.len() + 18, "head and body");
    assert!(
        leasegate::contract::schema::Schema::EgressEvent.is_valid(&line),
        "{line}"
    );

    // CONNECT through HTTPS_PROXY, as an agent's environment would set it.
    let url = format!("https://secure.test:{}/", secure.addr.port());
    let out = curl(
        &["--cacert", ca.to_str().unwrap(), &url],
        &[("HTTPS_PROXY", &proxy)],
    )
    .await;
    assert_eq!(out.status, 200, "{out:?}");
    assert_eq!(out.body_text(), "hello from origin\n");
    let line = h.egress_line(2).await;
    assert_eq!(line["kind"], "connect");
    assert_eq!(line["method"], "CONNECT");
    assert_eq!(line["status"], 200);
    assert!(
        line["bytes_up"].as_u64().unwrap() > 200,
        "the ClientHello went up: {line}"
    );
    assert!(line["bytes_down"].as_u64().unwrap() > 200, "{line}");
    assert!(
        leasegate::contract::schema::Schema::EgressEvent.is_valid(&line),
        "{line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_both_ways_intact() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let proxy = proxy_url(&server, &lease);
    const SIZE: u64 = 48 * 1024 * 1024;

    let download = curl(
        &[
            "-x",
            &proxy,
            &format!("http://origin.test:{}/big/{SIZE}", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(download.status, 200);
    assert_eq!(download.body.len() as u64, SIZE);
    let expected: Vec<u8> = (0..SIZE).map(pattern_byte).collect();
    assert!(download.body == expected, "downloaded bytes differ");

    let upload_file = h.dir.path().join("upload.bin");
    tokio::fs::write(&upload_file, &expected).await.unwrap();
    let upload = curl(
        &[
            "-x",
            &proxy,
            "-H",
            "Transfer-Encoding: chunked",
            "--data-binary",
            &format!("@{}", upload_file.display()),
            &format!("http://origin.test:{}/upload", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(upload.status, 200, "{upload:?}");
    assert_eq!(upload.body_text(), format!("{SIZE} {}", sha_hex(&expected)));
    let lines = h.egress_lines(2).await;
    // The head and the body's data; the chunked framing the proxy adds (its
    // `transfer-encoding` field, chunk sizes) is not counted.
    let framing = "transfer-encoding: chunked\r\n".len() as u64;
    assert_eq!(
        lines[0]["bytes_down"],
        download.headers.len() as u64 - framing + SIZE
    );
    let up = lines[1]["bytes_up"].as_u64().unwrap();
    assert!(
        (SIZE + 100..SIZE + 1000).contains(&up),
        "the head and {SIZE}: {up}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_is_reused_on_both_sides_and_credentials_never_go_upstream() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let base = format!("http://origin.test:{}", origin.addr.port());
    let out = curl(
        &[
            "-v",
            "-x",
            &proxy_url(&server, &lease),
            "-H",
            &format!("X-Lease-Id: {lease}"),
            "-H",
            "Connection: keep-alive, X-Secret",
            "-H",
            "X-Secret: hop",
            &format!("{base}/headers"),
            &format!("{base}/headers"),
            &format!("{base}/"),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200);
    assert!(
        out.stderr.contains("Re-using existing connection"),
        "{}",
        out.stderr
    );
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one upstream connection"
    );
    let body = out.body_text().to_lowercase();
    for leaked in [
        "proxy-authorization",
        "x-lease-id",
        "proxy-connection",
        "x-secret",
        "keep-alive",
    ] {
        assert!(!body.contains(leaked), "{leaked} went upstream: {body}");
    }
    assert!(
        body.contains(&format!("host: origin.test:{}", origin.addr.port())),
        "{body}"
    );
    assert_eq!(h.egress_lines(3).await.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn websocket_upgrades_are_forwarded() {
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    let port = origin.addr.port();
    let request = format!(
        "GET http://origin.test:{port}/ws HTTP/1.1\r\nHost: origin.test:{port}\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         X-Lease-Id: {lease}\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reader = tokio::io::BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).await.unwrap();
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_lowercase()
            .contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
        reader.into_inner(),
        tokio_tungstenite::tungstenite::protocol::Role::Client,
        None,
    )
    .await;
    ws.send("ping through leasegate".into()).await.unwrap();
    let echoed = ws.next().await.unwrap().unwrap();
    assert_eq!(
        echoed.into_text().unwrap().as_str(),
        "ping through leasegate"
    );
    ws.close(None).await.unwrap();
    drop(ws);
    let line = h.egress_line(1).await;
    assert_eq!(line["status"], 101);
    assert!(line["bytes_up"].as_u64().unwrap() > 20, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identification_refusals() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let bare = format!("http://{}", server.addr);

    let out = curl(&["-x", &bare, &url], &[]).await;
    assert_refused(&h, &out, 407, "lease-missing", 1).await;
    assert_eq!(
        out.header("proxy-authenticate").as_deref(),
        Some("Basic realm=\"leasegate\"")
    );

    let unknown = "00000000-0000-4000-8000-000000000000";
    let out = curl(
        &[
            "-x",
            &format!("http://agent:{unknown}@{}", server.addr),
            &url,
        ],
        &[],
    )
    .await;
    assert_refused(&h, &out, 407, "lease-unknown", 2).await;
    let out = curl(
        &[
            "-x",
            &format!("http://agent:not-a-lease@{}", server.addr),
            &url,
        ],
        &[],
    )
    .await;
    assert_refused(&h, &out, 407, "lease-unknown", 3).await;

    let out = curl(
        &[
            "-x",
            &proxy_url(&server, &lease),
            "-H",
            &format!("X-Lease-Id: {other}"),
            &url,
        ],
        &[],
    )
    .await;
    assert_refused(&h, &out, 400, "lease-conflict", 4).await;

    // Bearer, and the lease id as user with an empty password.
    let out = curl(
        &[
            "-x",
            &bare,
            "--proxy-header",
            &format!("Proxy-Authorization: Bearer {lease}"),
            &url,
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200);
    let out = curl(
        &["-x", &format!("http://{lease}:@{}", server.addr), &url],
        &[],
    )
    .await;
    assert_eq!(out.status, 200);

    let origin_form = raw(
        server.addr,
        format!("GET / HTTP/1.1\r\nHost: origin.test\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_of(&origin_form), 400, "{origin_form}");
    assert!(
        origin_form.contains("x-leasegate-refusal: not-a-proxy-request"),
        "{origin_form}"
    );
    assert_eq!(h.egress_line(7).await["code"], "not-a-proxy-request");
    assert!(h.revocations().await.is_empty(), "none of these revokes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_refusals_each_have_their_code() {
    let h = Harness::new();
    let origin = http_origin().await;
    let now = Timestamp::now();
    let hour = Duration::from_secs(3600);
    let future = h.lease_with(
        &["*"],
        &[],
        None,
        now.saturating_add_millis(3_600_000),
        hour,
    );
    let expired = h.lease_with(
        &["*"],
        &[],
        None,
        now.saturating_add_millis(-7_200_000),
        hour,
    );
    let revoked = h.lease(&["*"], &[]);
    leasegate::commands::issue::revoke(&h.journal, &h.key, &revoked, "test", now).unwrap();
    let stopped = h.lease(&["*"], &[]);
    h.append(&crate::support::event_line(
        "stopped",
        &stopped,
        &now.to_string(),
        serde_json::json!({"reason": "done"}),
    ))
    .await;
    let parent = h.lease(&["*"], &[]);
    let child = h.lease_with(&["*"], &[], Some(&parent), Timestamp::now(), hour);
    h.append(&crate::support::event_line(
        "completed",
        &parent,
        &now.to_string(),
        serde_json::json!({}),
    ))
    .await;
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    for (n, (lease, code)) in [
        (future, "lease-not-yet-valid"),
        (expired, "lease-expired"),
        (revoked, "lease-revoked"),
        (stopped, "lease-closed"),
        (child, "ancestor-closed"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = through(&server, &lease, &url).await;
        assert_refused(&h, &out, 403, code, n + 1).await;
    }
    assert_eq!(
        h.revocations().await.len(),
        1,
        "only the issuer's own revocation"
    );
}

/// Leases closed (or expired) longer than `--closed-lease-retention` ago are retired to their
/// id, parent and closing: the admin API no longer knows them, but a request naming one is
/// still refused with its own closing code (never `lease-unknown`), and so is a child of a
/// retired parent (`ancestor-closed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retired_leases_keep_their_refusal_codes() {
    let h = Harness::new();
    let origin = http_origin().await;
    let now = Timestamp::now();
    let days = |n: i64| now.saturating_add_millis(n * 86_400_000);
    let week = Duration::from_secs(7 * 86_400);
    let revoked = h.lease_with(&["*"], &[], None, days(-3), week);
    leasegate::commands::issue::revoke(&h.journal, &h.key, &revoked, "test", days(-2)).unwrap();
    let stopped = h.lease_with(&["*"], &[], None, days(-3), week);
    h.append(&crate::support::event_line(
        "stopped",
        &stopped,
        &days(-2).to_string(),
        serde_json::json!({"reason": "done"}),
    ))
    .await;
    let parent = h.lease_with(&["*"], &[], None, days(-3), week);
    let child = h.lease_with(&["*"], &[], Some(&parent), days(-3), week);
    leasegate::commands::issue::revoke(&h.journal, &h.key, &parent, "test", days(-2)).unwrap();
    let expired = h.lease_with(&["*"], &[], None, days(-3), Duration::from_secs(3600));
    let open = h.lease(&["*"], &[]);
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.store.closed_lease_retention = Some(Duration::from_secs(86_400));
    let server = leasegate::server::Server::start(config).await.unwrap();
    for lease in [&revoked, &stopped, &parent, &expired] {
        let (status, _) = admin_get(&server, &format!("/leases/{lease}")).await;
        assert_eq!(
            status, 404,
            "{lease} is retired: the admin API no longer shows it"
        );
    }
    let (status, view) = admin_get(&server, &format!("/leases/{child}")).await;
    assert_eq!((status, &view["status"]), (200, &"ancestor-closed".into()));
    let url = format!("http://origin.test:{}/", origin.addr.port());
    for (n, (lease, code)) in [
        (&revoked, "lease-revoked"),
        (&stopped, "lease-closed"),
        (&parent, "lease-revoked"),
        (&child, "ancestor-closed"),
        (&expired, "lease-expired"),
    ]
    .into_iter()
    .enumerate()
    {
        let out = through(&server, lease, &url).await;
        assert_refused(&h, &out, 403, code, n + 1).await;
    }
    let out = through(&server, &open, &url).await;
    assert_eq!(out.status, 200, "{out:?}");
}

/// Provokes a revoking refusal, then checks the journal line and that the lease is closed.
async fn assert_revoked_after(
    h: &Harness,
    server: &leasegate::server::Server,
    lease: &str,
    code: &str,
    probe_url: &str,
) {
    let revocations = h.revocations().await;
    assert_eq!(
        revocations.len(),
        1,
        "exactly one revoked line: {revocations:?}"
    );
    let record = &revocations[0];
    assert_eq!(record["lease_id"], lease);
    assert_eq!(record["by"], "issuer");
    assert_eq!(record["egress"]["code"], code);
    assert!(record["reason"].as_str().unwrap().contains(code));
    assert!(
        leasegate::contract::schema::Schema::Record.is_valid(record),
        "{record}"
    );
    assert!(
        leasegate::contract::lease::verify_signature(record, &h.key).unwrap(),
        "signed with the lease's key"
    );
    let out = through(server, lease, probe_url).await;
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("lease-revoked"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_denied_revokes_and_the_lease_opens_nothing_after() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["*.test"], &["denied.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;
    let ok_url = format!("http://origin.test:{}/", origin.addr.port());
    assert_eq!(status_through(&server, &lease, &ok_url).await, 200);
    let out = curl(
        &[
            "-x",
            &proxy_url(&server, &lease),
            &format!("http://denied.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    let line = assert_refused(&h, &out, 403, "host-denied", 2).await;
    assert_eq!(line["revoked"], true);
    assert_revoked_after(&h, &server, &lease, "host-denied", &ok_url).await;
    // A second refusal of a revoked lease writes nothing more.
    let _ = curl(
        &[
            "-x",
            &proxy_url(&server, &lease),
            &format!("http://denied.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(h.revocations().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_revoking_code_is_provoked() {
    let origin = http_origin().await;
    let port = origin.addr.port();
    let (secure, _) = https_origin("secure.test", std::env::temp_dir().as_path()).await;
    // (what, lease allow, lease deny, curl args)
    let cases: Vec<(&str, Vec<&str>, Vec<String>)> = vec![
        (
            "host-not-allowed",
            vec!["origin.test"],
            vec![format!("http://elsewhere.test:{port}/")],
        ),
        (
            "address-not-allowed",
            vec!["*.test"],
            vec![format!("http://metadata.test:{port}/")],
        ),
        (
            "host-mismatch",
            vec!["*.test"],
            vec![
                "-H".into(),
                "Host: elsewhere.test".into(),
                format!("http://origin.test:{port}/"),
            ],
        ),
        (
            "sni-mismatch",
            vec!["secure.test"],
            vec![
                "-k".into(),
                "--connect-to".into(),
                format!(
                    "denied.test:{}:secure.test:{}",
                    secure.addr.port(),
                    secure.addr.port()
                ),
                format!("https://denied.test:{}/", secure.addr.port()),
            ],
        ),
    ];
    for (code, allow, args) in cases {
        let h = Harness::new();
        let lease = h.lease(&allow, &[]);
        let server = h
            .start(h.config(&[
                ("origin.test", "127.0.0.1"),
                ("elsewhere.test", "127.0.0.1"),
                ("secure.test", "127.0.0.1"),
                ("metadata.test", "169.254.169.254"),
            ]))
            .await;
        let proxy = proxy_url(&server, &lease);
        let mut full = vec!["-x", proxy.as_str()];
        full.extend(args.iter().map(String::as_str));
        let out = curl(&full, &[]).await;
        if code == "sni-mismatch" {
            // The tunnel was open (200) when the ClientHello named another host: it is closed.
            assert_ne!(out.exit, 0, "{out:?}");
            let line = h.egress_line(1).await;
            assert_eq!(line["code"], code, "{line}");
            assert_eq!(line["verdict"], "refuse");
        } else {
            let status = if code == "host-mismatch" { 421 } else { 403 };
            assert_refused(&h, &out, status, code, 1).await;
        }
        assert_revoked_after(
            &h,
            &server,
            &lease,
            code,
            &format!("http://origin.test:{port}/"),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_refusals_method_dns_and_upstream() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["*.test"], &[]);
    // A listener that accepts nothing, its backlog full: further connects hang.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let stuck = socket.listen(1).unwrap();
    let stuck_port = stuck.local_addr().unwrap().port();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(("127.0.0.1", stuck_port)),
        )
        .await
        {
            fillers.push(s);
        }
    }
    let closed_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.connect_timeout = Duration::from_millis(300);
    let server = h.start(config).await;
    let proxy = proxy_url(&server, &lease);

    let out = curl(
        &[
            "-x",
            &proxy,
            "-X",
            "TRACE",
            &format!("http://origin.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_refused(&h, &out, 405, "method-not-allowed", 1).await;
    let out = curl(&["-x", &proxy, "http://nowhere.test/"], &[]).await;
    assert_refused(&h, &out, 502, "dns-failed", 2).await;
    let out = curl(
        &["-x", &proxy, &format!("http://origin.test:{closed_port}/")],
        &[],
    )
    .await;
    assert_refused(&h, &out, 502, "upstream-unreachable", 3).await;
    let out = curl(
        &["-x", &proxy, &format!("http://origin.test:{stuck_port}/")],
        &[],
    )
    .await;
    assert_refused(&h, &out, 504, "upstream-timeout", 4).await;
    assert!(h.revocations().await.is_empty(), "none of these revokes");
    drop(fillers);
}

/// A CONNECT to `target` with the lease in X-Lease-Id; returns the raw answer.
async fn connect_raw(addr: std::net::SocketAddr, target: &str, lease: &str) -> String {
    raw(
        addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adversarial_targets() {
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease(
        &["*.test", "allowed.example", "xn--bcher-kva.test"],
        &["denied.example", "127.0.0.1"],
    );
    let star = h.lease(&["*"], &[]);
    let wild = h.lease(&["*.example.com"], &[]);
    // `lease` denies 127.0.0.1, so it denies every name resolving there too: the IDN origin
    // is reached under a lease without that deny.
    let idn = h.lease(&["xn--bcher-kva.test"], &[]);
    let mut config = h.config(&[
        ("allowed.example", "127.0.0.1"),
        ("xn--bcher-kva.test", "127.0.0.1"),
        ("meta.test", "169.254.169.254"),
        ("ten.test", "10.0.0.1"),
        ("cgnat.test", "100.64.0.1"),
        ("a.b.example.com", "127.0.0.1"),
    ]);
    config.on_refusal = leasegate::proxy::OnRefusal::Log;
    let server = h.start(config).await;
    assert_self_loops_are_refused(&h).await;

    let code_of = |answer: &str| -> String {
        answer
            .lines()
            .find_map(|l| l.strip_prefix("x-leasegate-refusal: "))
            .unwrap_or("")
            .trim()
            .to_owned()
    };
    // Spellings of a denied host, and of a denied IP address.
    for target in [
        "DENIED.EXAMPLE:443",
        "denied.example.:443",
        "127.1:443",
        "2130706433:443",
        "0x7f.0.0.1:443",
        "0177.0.0.1:443",
        "[::ffff:127.0.0.1]:443",
    ] {
        let answer = connect_raw(server.addr, target, &lease).await;
        assert_eq!(code_of(&answer), "host-denied", "{target}: {answer}");
    }
    // Ambiguous spellings are bad targets (or refused by the HTTP parser) — never allowed.
    for target in [
        "[denied.example]:443",
        "allowed.example@evil.example:443",
        "%61llowed.example:443",
        "[fe80::1%25eth0]:443",
    ] {
        let answer = connect_raw(server.addr, target, &lease).await;
        assert_eq!(status_of(&answer), 400, "{target}: {answer}");
        let code = code_of(&answer);
        assert!(
            code.is_empty() || code == "bad-target",
            "{target}: {answer}"
        );
    }
    // IPv6 and mapped forms meet the guard when the lease allows everything.
    for target in ["[::1]:443", "[64:ff9b::a9fe:a9fe]:443", "[fe80::1]:443"] {
        let answer = connect_raw(server.addr, target, &star).await;
        assert_eq!(
            code_of(&answer),
            "address-not-allowed",
            "{target}: {answer}"
        );
    }
    // Allowed names that resolve to guarded addresses.
    for target in ["meta.test:80", "ten.test:80", "cgnat.test:80"] {
        let answer = connect_raw(server.addr, target, &lease).await;
        assert_eq!(
            code_of(&answer),
            "address-not-allowed",
            "{target}: {answer}"
        );
        assert!(answer.contains("resolves to"), "{answer}");
    }
    // Wildcards: strict subdomains at any depth, never the apex.
    assert_eq!(
        code_of(&connect_raw(server.addr, "example.com:443", &wild).await),
        "host-not-allowed"
    );
    assert_eq!(
        status_of(&connect_raw(server.addr, &format!("a.b.example.com:{port}"), &wild).await),
        200
    );
    // IDN: the U-label (as curl sends it, converted) and the A-label name the same host.
    let out = curl(
        &[
            "-x",
            &proxy_url(&server, &idn),
            &format!("http://bücher.test:{port}/"),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{out:?}");
    let out = curl(
        &[
            "-x",
            &proxy_url(&server, &idn),
            &format!("http://xn--bcher-kva.test:{port}/"),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{out:?}");
    let utf8 = raw(
        server.addr,
        format!("CONNECT bücher.test:{port} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert_eq!(status_of(&utf8), 400, "raw UTF-8 in a request line: {utf8}");
    // Percent-escapes and userinfo in an absolute URI (curl would decode them itself).
    for authority in ["%61llowed.example", "allowed.example@evil.example"] {
        let answer = raw(
            server.addr,
            format!("GET http://{authority}:{port}/ HTTP/1.1\r\nHost: {authority}:{port}\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(status_of(&answer), 400, "{authority}: {answer}");
    }
}

/// An allowed name that resolves to the proxy's own address is a loop, whatever is allowed.
async fn assert_self_loops_are_refused(h: &Harness) {
    let lease = h.lease(&["*"], &[]);
    // A second proxy, everything allowed, whose resolver points a name at itself: it must refuse.
    let mut config = h.config(&[("self.test", "127.0.0.1")]);
    config.guard.allow_private = vec!["0.0.0.0/0".parse().unwrap()];
    config.on_refusal = leasegate::proxy::OnRefusal::Log;
    let server = h.start(config).await;
    let port = server.addr.port();
    let answer = connect_raw(server.addr, &format!("self.test:{port}"), &lease).await;
    assert!(
        answer.contains("x-leasegate-refusal: address-not-allowed"),
        "{answer}"
    );
    assert!(answer.contains("own listening"), "{answer}");
    let answer = connect_raw(server.addr, &format!("127.0.0.1:{port}"), &lease).await;
    assert!(
        answer.contains("x-leasegate-refusal: address-not-allowed"),
        "{answer}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_mode_lets_policy_refusals_through_and_logs_them() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]);
    config.mode = Mode::Report;
    let server = h.start(config).await;
    let out = curl(
        &[
            "-x",
            &proxy_url(&server, &lease),
            &format!("http://other.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200);
    let line = h.egress_line(1).await;
    assert_eq!(line["verdict"], "report");
    assert_eq!(line["code"], "host-not-allowed");
    assert!(h.revocations().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_mode_refuses_a_guarded_address_without_revoking() {
    let h = Harness::new();
    // An origin on a loopback address the harness does not exempt: report mode dialled it.
    let listener = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((_stream, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let lease = h.lease(&["*"], &[]);
    let mut config = h.config(&[("inside.test", "127.0.0.2")]);
    config.mode = Mode::Report;
    let server = h.start(config).await;
    for target in [format!("inside.test:{port}"), format!("127.0.0.2:{port}")] {
        let answer = raw(
            server.addr,
            format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
        )
        .await;
        assert_eq!(status_of(&answer), 403, "{target}: {answer}");
        assert!(
            answer.contains("x-leasegate-refusal: address-not-allowed"),
            "{target}: {answer}"
        );
    }
    for line in h.egress_lines(2).await {
        assert_eq!(line["verdict"], "refuse", "{line}");
        assert_eq!(line["code"], "address-not-allowed", "{line}");
        assert!(line["dialed"].is_null(), "{line}");
    }
    assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert!(
        h.revocations().await.is_empty(),
        "report mode revokes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_refusal_log_refuses_without_revoking() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]);
    config.on_refusal = leasegate::proxy::OnRefusal::Log;
    let server = h.start(config).await;
    let proxy = proxy_url(&server, &lease);
    let out = curl(
        &[
            "-x",
            &proxy,
            &format!("http://other.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_refused(&h, &out, 403, "host-not-allowed", 1).await;
    assert!(h.revocations().await.is_empty());
    assert_eq!(
        curl(
            &[
                "-x",
                &proxy,
                &format!("http://origin.test:{}/", origin.addr.port())
            ],
            &[]
        )
        .await
        .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_silent_past_the_response_timeout_is_a_504() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.upstream_response_timeout = Duration::from_millis(300);
    let server = h.start(config).await;
    let proxy = proxy_url(&server, &lease);
    let base = format!("http://origin.test:{}", origin.addr.port());

    // An upload slower than the timeout is not the upstream's fault: the clock starts once
    // the body has been sent.
    let mut upload = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    upload
        .write_all(
            format!(
                "POST {base}/upload HTTP/1.1\r\nHost: origin.test:{}\r\nX-Lease-Id: {lease}\r\n\
                 Content-Length: 10\r\nConnection: close\r\n\r\nhello",
                origin.addr.port()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    upload.write_all(b"world").await.unwrap();
    let mut answer = String::new();
    upload.read_to_string(&mut answer).await.unwrap();
    assert_eq!(status_of(&answer), 200, "{answer}");
    assert!(
        answer.ends_with(&format!("10 {}", sha_hex(b"helloworld"))),
        "{answer}"
    );

    let started = std::time::Instant::now();
    // The origin answers only after the bound: a proxy that waited for it is caught.
    let delay = (AT_ONCE + Duration::from_secs(1)).as_millis();
    let out = curl(&["-x", &proxy, &format!("{base}/delay/{delay}")], &[]).await;
    assert_refused(&h, &out, 504, "upstream-timeout", 2).await;
    assert!(
        started.elapsed() < AT_ONCE,
        "answered only after {:?}",
        started.elapsed()
    );
    assert!(
        h.revocations().await.is_empty(),
        "a timeout does not revoke"
    );
}

/// `bad-target` exactly: a forwarded request naming two hosts, and CONNECT authorities our
/// parser refuses, are refused as bad targets (400, the code as the reason phrase), each
/// with its egress line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_requests_are_bad_targets() {
    let h = Harness::new();
    let lease = h.lease(&["*.example"], &[]);
    let server = h.start(h.config(&[])).await;
    let two_hosts = raw(
        server.addr,
        format!(
            "GET http://a.example/ HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nX-Lease-Id: {lease}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert!(
        two_hosts.starts_with("HTTP/1.1 400 bad-target\r\n"),
        "{two_hosts}"
    );
    assert!(
        two_hosts.contains("x-leasegate-refusal: bad-target"),
        "{two_hosts}"
    );
    // Authorities the HTTP parser passes and ours refuses: port 0, an empty port, an empty
    // label, brackets around a name, a wildcard, a signed port, a malformed A-label.
    for target in [
        "a.example:0",
        "a.example:",
        "a..example:443",
        "[a.example]:443",
        "*.example:443",
        "a.example:+443",
        "xn--a.example:443",
    ] {
        let answer = connect_raw(server.addr, target, &lease).await;
        assert!(
            answer.starts_with("HTTP/1.1 400 bad-target\r\n"),
            "{target}: {answer}"
        );
    }
    let lines = h.egress_lines(8).await;
    assert!(lines.iter().all(|l| l["code"] == "bad-target"), "{lines:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_spread_over_the_workers_and_each_worker_pools_its_own_upstreams() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.workers = 2;
    let server = h.start(config).await;
    let port = origin.addr.port();
    let request = format!(
        "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {lease}\r\n\r\n"
    );
    // Three connections open at once: whichever worker accepts them, neither worker may hold
    // more than one above the other, so both hold at least one.
    let mut clients = Vec::new();
    for _ in 0..3 {
        clients.push(tokio::net::TcpStream::connect(server.addr).await.unwrap());
    }
    for _ in 0..2 {
        for client in &mut clients {
            let answer = exchange(client, request.as_bytes()).await;
            assert_eq!(status_of(&answer), 200, "{answer}");
        }
    }
    // A pool key per worker: each pooled its own connection to the origin.
    let keys = eventually(Duration::from_secs(5), || async {
        (server.proxy.pool.keys() == 2).then_some(())
    })
    .await;
    assert!(keys.is_some(), "pool keys: {}", server.proxy.pool.keys());
    let opened = origin.connections.load(std::sync::atomic::Ordering::SeqCst);
    assert!((2..=3).contains(&opened), "{opened} upstream connections");
    server.shutdown().await;
}
