//! What the operator's figures count: an open download's call and bytes show while it runs and
//! are counted once when it ends; heads count in the bytes; the egress line says when the
//! exchange started and ended; a 407 asking for credentials is a challenge, not a refusal; a
//! decided line names the rule that decided it.

use crate::admin::operate::sample;
use crate::support::harness::{
    admin_get, admin_text, curl, eventually, http_origin, open_tunnel, read_head, Harness, AT_ONCE,
};
use crate::support::leasegate_command;
use leasegate::config::LeasePortCredentials;
use leasegate::contract::token;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// The response head the paced origin writes before the body (with a `date`, as any origin
/// sends, so the proxy adds nothing).
fn paced_head(length: usize) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {length}\r\ndate: Wed, 02 Dec 2026 07:00:00 GMT\r\n\r\n"
    )
}

/// An origin answering one request with a body of `length` bytes, sent in the pieces the test
/// releases. It hands the test the request head exactly as it arrived.
struct PacedOrigin {
    addr: SocketAddr,
    heads: mpsc::UnboundedReceiver<Vec<u8>>,
    release: mpsc::UnboundedSender<Vec<u8>>,
}

async fn paced_origin(length: usize) -> PacedOrigin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (heads_tx, heads) = mpsc::unbounded_channel();
    let (release, mut pieces) = mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(stream.read(&mut byte).await.unwrap(), 1);
            head.push(byte[0]);
        }
        heads_tx.send(head).unwrap();
        stream
            .write_all(paced_head(length).as_bytes())
            .await
            .unwrap();
        while let Some(piece) = pieces.recv().await {
            stream.write_all(&piece).await.unwrap();
        }
        // Held open until the test drops its sender.
    });
    PacedOrigin {
        addr,
        heads,
        release,
    }
}

/// Reads exactly `n` bytes.
async fn read_exact(stream: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(AT_ONCE, stream.read_exact(&mut buf))
        .await
        .expect("the bytes came at once")
        .unwrap();
    buf
}

/// Polls `GET /leases/{lease}` until `check` accepts it; the view it accepted.
async fn lease_view_when(
    server: &leasegate::server::Server,
    lease: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    let path = format!("/leases/{lease}");
    let last = std::cell::RefCell::new(Value::Null);
    let seen = eventually(AT_ONCE, || async {
        let (status, view) = admin_get(server, &path).await;
        assert_eq!(status, 200, "{view}");
        let ok = check(&view);
        *last.borrow_mut() = view.clone();
        ok.then_some(view)
    })
    .await;
    seen.unwrap_or_else(|| panic!("the lease's figures never matched: {}", last.borrow()))
}

/// Polls `/metrics` (a render is reused for up to a second) until every series in `want`
/// shows its value; the text that did.
async fn metrics_when(server: &leasegate::server::Server, want: &[(String, f64)]) -> String {
    let last = std::cell::RefCell::new(String::new());
    let seen = eventually(AT_ONCE, || async {
        let (status, text) = admin_text(server, "/metrics").await;
        assert_eq!(status, 200);
        let ok = want
            .iter()
            .all(|(series, value)| sample(&text, series) == Some(*value));
        *last.borrow_mut() = text.clone();
        ok.then_some(text)
    })
    .await;
    seen.unwrap_or_else(|| panic!("/metrics never showed {want:?}: {}", last.borrow()))
}

/// The lines of a head, sorted (the proxy may write its fields in another order).
fn sorted_lines(head: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = head.split("\r\n").collect();
    lines.sort_unstable();
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_download_shows_its_call_and_bytes_as_they_move_and_counts_them_once() {
    const PIECE: usize = 1000;
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let mut origin = paced_origin(3 * PIECE).await;
    let port = origin.addr.port();

    let mut client = TcpStream::connect(server.addr).await.unwrap();
    client
        .write_all(
            format!(
                "GET http://origin.test:{port}/dl HTTP/1.1\r\nHost: origin.test:{port}\r\n\
                 X-Lease-Id: {lease}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let upstream_head = origin.heads.recv().await.unwrap();
    let head = read_head(&mut client).await;
    assert_eq!(
        sorted_lines(&head),
        sorted_lines(&paced_head(3 * PIECE)),
        "the head is relayed as sent"
    );

    let mut received = head.len();
    for piece in 1..=2 {
        origin.release.send(vec![b'x'; PIECE]).unwrap();
        received += read_exact(&mut client, PIECE).await.len();
        let view =
            lease_view_when(&server, &lease, |v| v["counters"]["bytes_down"] == received).await;
        assert_eq!(
            (&view["counters"]["requests"], &view["counters"]["allowed"]),
            (&json!(1), &json!(1)),
            "the call counts from its start: {view}"
        );
        assert_eq!(view["counters"]["bytes_up"], upstream_head.len(), "{view}");
        let open = view["open"].as_array().unwrap();
        assert_eq!(open.len(), 1, "{view}");
        assert_eq!(
            (&open[0]["kind"], &open[0]["host"], &open[0]["port"]),
            (&json!("forward"), &json!("origin.test"), &json!(port)),
        );
        assert_eq!(open[0]["bytes_down"], received, "piece {piece}: {view}");
        assert_eq!(view["open_total"], 1);

        let text = metrics_when(
            &server,
            &[
                (
                    format!("leasegate_bytes_total{{lease_id=\"{lease}\",direction=\"down\"}}"),
                    received as f64,
                ),
                (
                    format!("leasegate_open_requests{{lease_id=\"{lease}\"}}"),
                    1.0,
                ),
            ],
        )
        .await;
        assert!(
            !text.contains(&format!("leasegate_requests_total{{lease_id=\"{lease}\"")),
            "a call enters leasegate_requests_total when it ends: {text}"
        );
    }
    assert!(
        h.egress_lines(0).await.is_empty(),
        "the line waits for the end"
    );

    origin.release.send(vec![b'x'; PIECE]).unwrap();
    received += read_exact(&mut client, PIECE).await.len();
    let line = h.egress_line(1).await;
    assert_eq!(
        line["bytes_down"], received,
        "head and body, exactly: {line}"
    );
    assert_eq!(
        line["bytes_up"],
        upstream_head.len(),
        "the head as the upstream read it"
    );
    let (started, ended) = (
        line["time"].as_str().unwrap(),
        line["ended"].as_str().unwrap(),
    );
    assert!(started <= ended, "{line}");
    assert!(
        leasegate::contract::schema::Schema::EgressEvent.is_valid(&line),
        "{line}"
    );

    let view = lease_view_when(&server, &lease, |v| v["open"] == json!([])).await;
    assert_eq!(view["counters"]["requests"], 1, "counted once: {view}");
    assert_eq!(view["counters"]["bytes_down"], received, "{view}");
    assert_eq!(view["counters"]["bytes_up"], upstream_head.len(), "{view}");
    metrics_when(
        &server,
        &[
            (
                format!("leasegate_requests_total{{lease_id=\"{lease}\",kind=\"http\",verdict=\"allow\",code=\"\"}}"),
                1.0,
            ),
            (
                format!("leasegate_open_requests{{lease_id=\"{lease}\"}}"),
                0.0,
            ),
            (
                format!("leasegate_bytes_total{{lease_id=\"{lease}\",direction=\"down\"}}"),
                received as f64,
            ),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_counts_its_head_as_sent_upstream() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let mut origin = paced_origin(0).await;
    let port = origin.addr.port();
    let (query, header) = ("q".repeat(6000), "h".repeat(6000));

    let mut client = TcpStream::connect(server.addr).await.unwrap();
    client
        .write_all(
            format!(
                "GET http://origin.test:{port}/search?q={query} HTTP/1.1\r\n\
                 Host: origin.test:{port}\r\nX-Lease-Id: {lease}\r\nX-Big: {header}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let upstream_head = origin.heads.recv().await.unwrap();
    assert!(upstream_head.len() > 12_000, "{}", upstream_head.len());
    let head = read_head(&mut client).await;
    assert_eq!(sorted_lines(&head), sorted_lines(&paced_head(0)));
    let line = h.egress_line(1).await;
    assert_eq!(line["bytes_up"], upstream_head.len(), "{line}");
    assert_eq!(line["bytes_down"], head.len(), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_shows_its_bytes_while_open_and_counts_them_once_when_closed() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;

    let target = format!("origin.test:{}", origin.addr.port());
    let mut tunnel = open_tunnel(server.addr, &target, Some(&lease)).await;
    let request = b"GET / HTTP/1.1\r\nHost: origin.test\r\n\r\n";
    tunnel.write_all(request).await.unwrap();
    let answer = crate::support::harness::read_until(&mut tunnel, "hello from origin\n").await;

    let view = lease_view_when(&server, &lease, |v| {
        v["counters"]["bytes_down"] == answer.len()
    })
    .await;
    assert_eq!(view["counters"]["requests"], 1, "{view}");
    assert_eq!(view["counters"]["bytes_up"], request.len(), "{view}");
    assert_eq!(view["open"][0]["kind"], "connect", "{view}");
    assert_eq!(view["open"][0]["bytes_up"], request.len(), "{view}");

    drop(tunnel);
    let line = h.egress_line(1).await;
    assert_eq!(
        (&line["bytes_up"], &line["bytes_down"]),
        (&json!(request.len()), &json!(answer.len())),
        "{line}"
    );
    let view = lease_view_when(&server, &lease, |v| v["open"] == json!([])).await;
    assert_eq!(
        (
            &view["counters"]["requests"],
            &view["counters"]["bytes_up"],
            &view["counters"]["bytes_down"]
        ),
        (&json!(1), &line["bytes_up"], &line["bytes_down"]),
        "counted once: {view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_request_without_credentials_is_a_challenge_not_a_refusal() {
    let h = Harness::new();
    let origin = http_origin().await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.lease_port_credentials = LeasePortCredentials::Token;
    let server = h
        .start_with_ports(config, Some(crate::support::harness::port_range(4)))
        .await;
    let ports = server.ports.clone().unwrap();
    let port = eventually(Duration::from_secs(10), || async { ports.port_of(&lease) })
        .await
        .expect("the lease has a port");

    // git and Java: the first request goes without credentials.
    let bare = curl(&["-x", &format!("http://{}", server.addr), &url], &[]).await;
    assert_eq!(
        (bare.status, bare.header("proxy-authenticate").as_deref()),
        (407, Some("Basic realm=\"leasegate\""))
    );
    let at_port = curl(&["-x", &format!("http://127.0.0.1:{port}"), &url], &[]).await;
    assert_eq!(at_port.status, 407, "{at_port:?}");
    // A wrong credential stays a refusal.
    let stranger = format!(
        "http://agent:00000000-0000-4000-8000-000000000000@{}",
        server.addr
    );
    let unknown = curl(&["-x", &stranger, &url], &[]).await;
    assert_eq!(
        unknown.header("x-leasegate-refusal").as_deref(),
        Some("lease-unknown")
    );
    let token = token::mint(&h.key, &lease);
    let served = curl(
        &[
            "-x",
            &format!("http://agent:{token}@127.0.0.1:{port}"),
            &url,
        ],
        &[],
    )
    .await;
    assert_eq!(served.status, 200, "{served:?}");

    let lines = h.egress_lines(4).await;
    let verdicts: Vec<(&Value, &Value, &Value)> = lines
        .iter()
        .map(|l| (&l["verdict"], &l["code"], &l["lease_id"]))
        .collect();
    assert_eq!(
        verdicts,
        [
            (&json!("challenge"), &json!("lease-missing"), &Value::Null),
            (&json!("challenge"), &json!("lease-missing"), &json!(lease)),
            (
                &json!("refuse"),
                &json!("lease-unknown"),
                &json!("00000000-0000-4000-8000-000000000000")
            ),
            (&json!("allow"), &Value::Null, &json!(lease)),
        ]
    );
    for line in &lines {
        assert!(
            leasegate::contract::schema::Schema::EgressEvent.is_valid(line),
            "{line}"
        );
    }

    let (_, refusals) = admin_get(&server, "/refusals").await;
    let codes: Vec<&Value> = refusals["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| &r["code"])
        .collect();
    assert_eq!(codes, [&json!("lease-unknown")], "{refusals}");

    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(
        (
            &view["counters"]["challenges"],
            &view["counters"]["refused"],
            &view["counters"]["allowed"]
        ),
        (&json!(1), &json!(0), &json!(1)),
        "{view}"
    );
    let text = metrics_when(
        &server,
        &[
            ("leasegate_challenges_total{lease_id=\"-\"}".to_owned(), 1.0),
            (
                format!("leasegate_challenges_total{{lease_id=\"{lease}\"}}"),
                1.0,
            ),
        ],
    )
    .await;
    assert_eq!(
        sample(
            &text,
            "leasegate_requests_total{lease_id=\"-\",kind=\"http\",verdict=\"refuse\",code=\"lease-missing\"}"
        ),
        None,
        "{text}"
    );

    let out = leasegate_command(&["usage", "--from", h.egress.to_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let rows: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = |id: &Value| rows.iter().find(|r| &r["lease_id"] == id).unwrap().clone();
    let (mine, none, stranger) = (
        row(&json!(lease)),
        row(&Value::Null),
        row(&json!("00000000-0000-4000-8000-000000000000")),
    );
    assert_eq!(
        (&mine["calls"], &mine["challenges"], &mine["refused"]),
        (&json!(2), &json!(1), &json!(0)),
        "{mine}"
    );
    assert_eq!(
        (&none["calls"], &none["challenges"], &none["refused"]),
        (&json!(1), &json!(1), &json!(0)),
        "{none}"
    );
    assert_eq!(
        (
            &stranger["challenges"],
            &stranger["refused"],
            &stranger["refusals"]
        ),
        (&json!(0), &json!(1), &json!({"lease-unknown": 1})),
        "{stranger}"
    );
    let table = leasegate_command(&["usage", "--from", h.egress.to_str().unwrap()])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table
            .lines()
            .next()
            .unwrap()
            .contains("REFUSED  CHALLENGES"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decided_line_names_the_rule_that_decided_it() {
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let allowed = h.lease(&["origin.test", "*.example.test"], &[]);
    let denied = h.lease(&["*.evil.test", "origin.test"], &["*.evil.test"]);
    let unlisted = h.lease(&["origin.test"], &[]);
    let guarded = h.lease(&["loop.test"], &[]);
    let server = h
        .start(h.config(&[
            ("origin.test", "127.0.0.1"),
            ("x.evil.test", "127.0.0.1"),
            ("loop.test", "127.0.0.2"),
        ]))
        .await;
    let through = |lease: String, host: &'static str| {
        let proxy = crate::support::harness::proxy_url(&server, &lease);
        async move { curl(&["-x", &proxy, &format!("http://{host}:{port}/")], &[]).await }
    };
    assert_eq!(through(allowed.clone(), "origin.test").await.status, 200);
    assert_eq!(through(denied.clone(), "x.evil.test").await.status, 403);
    assert_eq!(through(unlisted.clone(), "other.test").await.status, 403);
    assert_eq!(through(guarded.clone(), "loop.test").await.status, 403);

    let lines = h.egress_lines(4).await;
    let rules: Vec<(&Value, &Value)> = lines.iter().map(|l| (&l["code"], &l["rule"])).collect();
    assert_eq!(
        rules,
        [
            (&Value::Null, &json!("allow origin.test")),
            (&json!("host-denied"), &json!("deny *.evil.test")),
            (&json!("host-not-allowed"), &json!("not in allow")),
            (&json!("address-not-allowed"), &json!("guard: Loopback")),
        ]
    );
    let (_, recent) = admin_get(&server, "/refusals").await;
    let shown: Vec<(&Value, &Value, &Value)> = recent["refusals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (&r["lease_id"], &r["rule"], &r["revoked"]))
        .collect();
    assert_eq!(
        shown,
        [
            (&json!(guarded), &json!("guard: Loopback"), &json!(true)),
            (&json!(unlisted), &json!("not in allow"), &json!(true)),
            (&json!(denied), &json!("deny *.evil.test"), &json!(true)),
        ],
        "{recent}"
    );
}
