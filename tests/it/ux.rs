//! What a user sees: refusal status lines in real clients, the dev banner, default egress
//! log, journal path mistakes, messages.

use crate::harness::{curl, http_origin, proxy_url, raw, Harness};

/// The first line of a raw response.
fn status_line(response: &str) -> &str {
    response.lines().next().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_code_is_the_reason_phrase() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let second = h.lease(&["origin.test"], &[]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;

    let answer = raw(
        server.addr,
        b"GET http://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n",
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 407 lease-missing",
        "{answer}"
    );

    let auth = base64_basic(&lease);
    let answer = raw(
        server.addr,
        format!(
            "CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\
             Proxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 403 host-denied", "{answer}");
    assert!(
        answer
            .to_lowercase()
            .contains("\r\nx-leasegate-refusal: host-denied\r\n"),
        "{answer}"
    );
    assert!(
        answer.ends_with(&format!(
            "\r\n\r\nleasegate refused CONNECT denied.test:443 for lease {lease}: host-denied \
             (denied.test is denied by denied.test in lease {lease})\n"
        )),
        "{answer}"
    );

    // A refusal revokes its lease by default: the next case needs a lease of its own.
    let auth = base64_basic(&second);
    let answer = raw(
        server.addr,
        format!(
            "GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\
             Proxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 403 host-not-allowed",
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_prints_the_refusal_code() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let second = h.lease(&["origin.test"], &["denied.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;
    let proxy = proxy_url(&server, &lease);

    // Plain HTTP: curl -v shows the status line as received.
    let out = curl(
        &[
            "-v",
            "-x",
            &proxy,
            &format!("http://denied.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 403, "{out:?}");
    assert!(
        out.stderr.contains("< HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.headers.starts_with("HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.headers
    );

    // CONNECT: the tunnel's refusal, as curl reports it (a refusal revoked the first lease).
    let out = curl(
        &["-v", "https://denied.test:443/"],
        &[("HTTPS_PROXY", &proxy_url(&server, &second))],
    )
    .await;
    assert_eq!(out.exit, 56, "{out:?}");
    assert!(
        out.stderr.contains("< HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("curl: (56) CONNECT tunnel failed, response 403"),
        "{}",
        out.stderr
    );
}

/// `agent:<lease>` as Basic credentials.
fn base64_basic(lease: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(format!("agent:{lease}"))
}
