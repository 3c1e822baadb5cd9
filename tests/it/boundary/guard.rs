//! The boundary: deny entries that are IP literals, malformed patterns,
//! the upstream pool across leases, and a wildcard listener's own interface addresses.

use crate::support::harness::through;
use crate::support::harness::{
    admin_text, curl, eventually, http_origin, open_tunnel, proxy_url, raw, status_of, Harness,
};
use crate::support::succeeded;
use crate::support::{granted_line, key, lease, leasegate_sync as run};
use leasegate::proxy::{OnRefusal, ProxyConfig};
use leasegate::server::Server;
use std::net::IpAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_ip_literal_refuses_a_name_resolving_to_it_end_to_end() {
    let h = Harness::new();
    let origin = http_origin().await;
    let open = h.lease(&["*"], &[]);
    let denying = h.lease(&["*"], &["127.0.0.1"]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let control = through(&server, &open, &url).await;
    assert_eq!(control.status, 200, "{control:?}");
    let before = origin.connections.load(Ordering::SeqCst);

    let out = through(&server, &denying, &url).await;
    assert_eq!(out.status, 403, "{out:?}");
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("host-denied")
    );
    assert!(
        out.body_text().contains("resolves to 127.0.0.1")
            && out.body_text().contains(&format!("in lease {denying}")),
        "{}",
        out.body_text()
    );
    assert_eq!(
        origin.connections.load(Ordering::SeqCst),
        before,
        "nothing reached the origin"
    );
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1, "{revocations:?}");
    assert_eq!(revocations[0]["lease_id"], denying.as_str());
    assert_eq!(revocations[0]["egress"]["code"], "host-denied");
    server.shutdown().await;
}

/// Waits (up to 5 s) until the proxy's pool holds `n` keys; says whether it did.
async fn pooled(server: &Server, n: usize) -> bool {
    eventually(Duration::from_secs(5), || async {
        (server.proxy.pool.keys() == n).then_some(())
    })
    .await
    .is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_upstream_connection_is_never_lent_to_another_lease() {
    let h = Harness::new();
    let origin = http_origin().await;
    let a = h.lease(&["origin.test"], &[]);
    let b = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    // One connection worker: each worker pools its own connections, and each curl below is
    // a new client connection that must find its lease's pooled one.
    config.workers = 1;
    let server = h.start(config).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let get = |lease: String| {
        let (proxy, url) = (proxy_url(&server, &lease), url.clone());
        async move { curl(&["-x", &proxy, &url], &[]).await.status }
    };
    assert_eq!(get(a.clone()).await, 200);
    assert!(pooled(&server, 1).await, "lease A's connection is pooled");
    assert_eq!(get(b.clone()).await, 200);
    // With a pool keyed by address only, B took A's connection and the pool holds one key.
    let two_keys = pooled(&server, 2).await;
    assert_eq!(get(a.clone()).await, 200);
    assert_eq!(get(b.clone()).await, 200);
    assert_eq!(
        origin.connections.load(Ordering::SeqCst),
        2,
        "one upstream connection per lease, each reused by its own lease only"
    );
    assert!(two_keys, "one pool key per lease");
    server.shutdown().await;
}

/// A non-loopback IPv4 address of this host, if it has one.
fn local_non_loopback_v4() -> Option<IpAddr> {
    nix::ifaddrs::getifaddrs().ok()?.find_map(|interface| {
        let ip = interface.address?.as_sockaddr_in()?.ip();
        (!ip.is_loopback() && !ip.is_unspecified()).then_some(IpAddr::V4(ip))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wildcard_listener_refuses_connects_to_its_own_interface_addresses() {
    let Some(own) = local_non_loopback_v4() else {
        return crate::support::netns::rerun_with_own_address().await;
    };
    let h = Harness::new();
    let lease = h.lease(&["*"], &[]);
    let mut config = h.config(&[]);
    // The operator exempts the host's own address: still never a way back into leasegate.
    config.guard.allow_private = vec![IpAddr::into(own)];
    config.on_refusal = OnRefusal::Log;
    let mut serve = h.serve_config(config, None);
    serve.listen = "0.0.0.0:0".parse().unwrap();
    serve.admin = Some("0.0.0.0:0".parse().unwrap());
    let server = Server::start(serve).await.unwrap();
    let admin_port = server.admin_addr.unwrap().port();
    for port in [admin_port, server.addr.port()] {
        let target = std::net::SocketAddr::new(own, port);
        let local = std::net::SocketAddr::new("127.0.0.1".parse().unwrap(), server.addr.port());
        let answer = raw(
            local,
            format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            answer.contains("x-leasegate-refusal: address-not-allowed")
                && answer.contains("own listening"),
            "{target}: {answer}"
        );
    }
    server.shutdown().await;
}

#[test]
fn issue_refuses_every_spelling_that_is_not_a_pattern() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");
    succeeded(&run(&["keygen", "--out", s(&key)]));
    for (flag, host, said) in [
        (
            "--allow-host",
            "*.",
            "'*.': a wildcard needs a domain after '*.', e.g. '*.example.com'",
        ),
        ("--allow-host", "https://x", "'https://x': no scheme"),
        ("--allow-host", "x:443", "'x:443': no port"),
        (
            "--allow-host",
            "*x.com",
            "'*x.com': a wildcard is only a whole leading label",
        ),
        (
            "--deny-host",
            "*.10.0.0.1",
            "'*.10.0.0.1': a wildcard covers the subdomains of a name, never an IP address",
        ),
        ("--deny-host", "x.com/path", "'x.com/path': no path"),
    ] {
        let out = run(&[
            "issue",
            "--journal",
            s(&journal),
            "--key-file",
            s(&key),
            "--allow-host",
            "ok.example",
            flag,
            host,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{host} was issued");
        assert!(stderr.contains(said), "{host}: {stderr}");
    }
    assert!(
        std::fs::read_to_string(&journal)
            .unwrap_or_default()
            .is_empty(),
        "nothing appended"
    );
    // Valid spellings are written in their normal form.
    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "*.Bücher.example.",
        "--deny-host",
        "0x7f.0.0.1",
    ]);
    succeeded(&out);
    let line = std::fs::read_to_string(&journal).unwrap();
    assert!(
        line.contains(r#""hosts":["*.xn--bcher-kva.example"]"#)
            && line.contains(r#""hosts":["127.0.0.1"]"#),
        "{line}"
    );
}

#[test]
fn verify_and_leases_flag_a_signed_lease_whose_pattern_is_malformed() {
    let dir = tempfile::tempdir().unwrap();
    let signing = key(9);
    let key_file = dir.path().join("key");
    std::fs::write(&key_file, signing.to_file_text()).unwrap();
    let journal = dir.path().join("journal.jsonl");
    let id = crate::support::id(42);
    // Schema-valid, but not a pattern: a wildcard over an IP literal, a name ending in a number.
    let signed = lease(
        &signing,
        &id,
        None,
        ("2026-01-01T00:00:00.000Z", "2099-01-01T00:00:00.000Z"),
        &["*.10.0.0.1", "api.example.com"],
        &["1.2.3.4.5"],
    );
    std::fs::write(
        &journal,
        format!("{}\n", granted_line(&signed, "2026-01-01T00:00:00.000Z")),
    )
    .unwrap();

    let out = run(&["verify", "--key-file", s(&key_file), s(&journal)]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.lines().any(|l| l.contains(&format!("lease {id}"))
            && l.contains("'*.10.0.0.1'")
            && l.contains("matches nothing")),
        "{said}"
    );
    assert!(said.contains("'1.2.3.4.5'"), "{said}");
    assert!(!said.contains("api.example.com"), "{said}");

    let lease_file = dir.path().join("lease.json");
    std::fs::write(&lease_file, signed.to_string()).unwrap();
    let out = run(&["verify", "--key-file", s(&key_file), s(&lease_file)]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("/manifest/allow/hosts/0") && said.contains(&format!("lease {id}")),
        "{said}"
    );

    let out = run(&[
        "leases",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key_file),
    ]);
    let table = String::from_utf8_lossy(&out.stdout);
    let row = table.lines().find(|l| l.starts_with(&id)).unwrap();
    assert!(
        row.contains("!*.10.0.0.1,api.example.com") && row.contains("!1.2.3.4.5"),
        "{table}"
    );
    assert!(table.contains("! not a host pattern"), "{table}");
}

/// Tunnels reach 443 and forwarded requests 80 unless the operator widens the lists; a port
/// outside them is `port-not-allowed`, which revokes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_outside_the_lists_are_refused_without_revoking() {
    let origin = http_origin().await;
    let port = origin.addr.port();
    let get = |lease: &str| {
        format!(
            "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\
             X-Lease-Id: {lease}\r\nConnection: close\r\n\r\n"
        )
    };
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.connect_ports = ProxyConfig::default().connect_ports;
    config.forward_ports = ProxyConfig::default().forward_ports;
    let server = h.start(config.clone()).await;
    let requests = [
        format!("CONNECT origin.test:22 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n"),
        format!("CONNECT origin.test:{port} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n"),
        get(&lease),
        // A WebSocket upgrade is a forwarded request.
        format!(
            "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\
             X-Lease-Id: {lease}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
             Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
        ),
    ];
    for (i, request) in requests.iter().enumerate() {
        let answer = raw(server.addr, request.as_bytes()).await;
        if i == 0 {
            assert!(
                answer.contains("port 22 is not open to tunnels (--connect-ports 443)"),
                "{answer}"
            );
        }
        assert_eq!(status_of(&answer), 403, "{request}: {answer}");
        assert!(
            answer.contains("x-leasegate-refusal: port-not-allowed"),
            "{answer}"
        );
    }
    let lines = h.egress_lines(requests.len()).await;
    for line in &lines {
        assert_eq!(line["code"], "port-not-allowed", "{line}");
        assert_eq!(line["verdict"], "refuse", "{line}");
        assert!(line["revoked"].is_null(), "{line}");
        assert!(
            leasegate::contract::schema::Schema::EgressEvent.is_valid(line),
            "{line}"
        );
    }
    assert!(h.revocations().await.is_empty(), "nothing revoked");
    assert_eq!(
        origin.connections.load(Ordering::SeqCst),
        0,
        "nothing dialled"
    );
    let (_, metrics) = admin_text(&server, "/metrics").await;
    assert!(metrics.contains("code=\"port-not-allowed\""), "{metrics}");

    // Widened, the same lease reaches the origin's port both ways.
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    config.connect_ports = format!("443,{port}").parse().unwrap();
    config.forward_ports = format!("80,{}-{port}", port - 1).parse().unwrap();
    let server = h.start(config).await;
    drop(open_tunnel(server.addr, &format!("origin.test:{port}"), Some(&lease)).await);
    let answer = raw(server.addr, get(&lease).as_bytes()).await;
    assert_eq!(status_of(&answer), 200, "{answer}");
    assert!(h.revocations().await.is_empty());
}
