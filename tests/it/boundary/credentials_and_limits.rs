//! The boundary: lease tokens and who sees credentials, one client against
//! the connection limit, the header timeout on idle keep-alive, and egress lines at drain.

use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_get, curl, http_origin, status_of, streaming_tunnel, until_closed, Harness,
};
use crate::support::succeeded;
use crate::support::{leasegate, leasegate_command};
use leasegate::config::Credentials;
use leasegate::contract::{token, Key};
use leasegate::server::Server;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// A connection to `to` from the loopback address `from` (any 127/8 address is local on Linux).
async fn connect_from(from: &str, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket
        .bind(SocketAddr::new(from.parse().unwrap(), 0))
        .unwrap();
    socket.connect(to).await.unwrap()
}

/// Sends `request` on `stream` and reads until the peer closes (at most 5 s).
async fn exchange(mut stream: TcpStream, request: &str) -> String {
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn header<'a>(response: &'a str, name: &str) -> Option<&'a str> {
    response.lines().find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_mode_admits_tokens_only() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.credentials = Credentials::Token;
    let server = h.start(config).await;
    let port = origin.addr.port();
    let get = |credential: String| {
        format!(
            "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\
             X-Lease-Id: {credential}\r\nConnection: close\r\n\r\n"
        )
    };

    let bare = exchange(
        TcpStream::connect(server.addr).await.unwrap(),
        &get(lease.clone()),
    )
    .await;
    assert_eq!(status_of(&bare), 407, "{bare}");
    assert_eq!(header(&bare, "x-leasegate-refusal"), Some("lease-missing"));
    assert!(bare.contains("token is required"), "{bare}");

    let forged = token::mint(&Key::generate(), &lease);
    let answer = exchange(TcpStream::connect(server.addr).await.unwrap(), &get(forged)).await;
    assert_eq!(status_of(&answer), 407, "{answer}");
    assert_eq!(
        header(&answer, "x-leasegate-refusal"),
        Some("lease-unknown")
    );

    let good = token::mint(&h.key, &lease);
    let url = format!("http://origin.test:{port}/");
    let out = curl(
        &["-x", &format!("http://agent:{good}@{}", server.addr), &url],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    let bearer = exchange(TcpStream::connect(server.addr).await.unwrap(), &get(good)).await;
    assert_eq!(status_of(&bearer), 200, "{bearer}");

    let lines = h.egress_lines(4).await;
    // An unproven credential is not the lease's traffic: the refusals name no lease.
    assert!(
        lines[..2].iter().all(|l| l["lease_id"].is_null()),
        "{lines:?}"
    );
    assert!(lines[2..].iter().all(|l| l["lease_id"] == lease.as_str()));
    assert!(h.revocations().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_shows_credentials_only_to_an_authenticated_caller() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let good = token::mint(&h.key, &lease);

    // No admin token: nobody is authenticated, so no URL carries a credential.
    for credentials in [Credentials::Id, Credentials::Token] {
        let mut config = h.config(&[]);
        config.credentials = credentials;
        let server = h.start(config).await;
        let bare = format!("http://{}", server.addr);
        let (status, view) = admin_get(&server, &format!("/leases/{lease}")).await;
        assert_eq!(status, 200);
        assert_eq!(view["proxy_url"], bare.as_str(), "{credentials:?}");
        let (_, list) = admin_get(&server, "/leases").await;
        assert_eq!(list["leases"][0]["proxy_url"], bare.as_str());
        assert!(!list.to_string().contains(&good));
        server.shutdown().await;
    }

    // An admin token, presented: the URL carries the token (token mode).
    let token_file = h.dir.path().join("admin-token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let mut config = h.config(&[]);
    config.credentials = Credentials::Token;
    let mut serve = h.serve_config(config, None);
    serve.admin_token = Some("s3cret".into());
    let server = Server::start(serve).await.unwrap();
    let answer = exchange(
        TcpStream::connect(server.admin_addr.unwrap()).await.unwrap(),
        &format!("GET /leases/{lease} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n"),
    )
    .await;
    let view: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let with_token = format!("http://agent:{good}@{}", server.addr);
    assert_eq!(view["proxy_url"], with_token.as_str());
    assert_eq!(view["credentials"], "token");

    // The lease's own token, presented: its own view carries it too.
    let answer = exchange(
        TcpStream::connect(server.admin_addr.unwrap()).await.unwrap(),
        &format!("GET /leases/{lease} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {good}\r\nConnection: close\r\n\r\n"),
    )
    .await;
    let view: serde_json::Value =
        serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(view["proxy_url"], with_token.as_str());

    // `run` with the lease's token puts it in the child's proxy URL.
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let echo = ["--", "sh", "-c", "echo $HTTPS_PROXY"];
    let lease_token = h.dir.path().join("lease-token");
    std::fs::write(&lease_token, format!("{good}\n")).unwrap();
    let lease_token = lease_token.to_str().unwrap();
    let mut args = vec!["run", "--lease", &lease, "--admin", &admin];
    args.extend(["--lease-token-file", lease_token]);
    args.extend(echo);
    let out = leasegate(&args).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), with_token);
    server.shutdown().await;

    // Without a token at hand, `run` says so rather than starting an agent that gets 407s.
    let mut config = h.config(&[]);
    config.credentials = Credentials::Token;
    let server = h.start(config).await;
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let mut args = vec!["run", "--lease", &lease, "--admin", &admin];
    args.extend(echo);
    let out = leasegate(&args).await;
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs the token"));
    // With it, an admin API that has no admin token of its own still knows the lease's.
    let mut args = vec!["run", "--lease", &lease, "--admin", &admin];
    args.extend(["--lease-token-file", lease_token]);
    args.extend(echo);
    let out = leasegate(&args).await;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("http://agent:{good}@{}", server.addr)
    );
}

#[test]
fn issue_prints_the_token_second_and_token_mints_the_same() {
    let h = Harness::new();
    let (journal, key) = (h.journal.to_str().unwrap(), h.key_path.to_str().unwrap());
    let out = leasegate_command(&[
        "issue",
        "--journal",
        journal,
        "--key-file",
        key,
        "--allow-host",
        "example.com",
    ])
    .output()
    .unwrap();
    let text = succeeded(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let lease = lines[0];
    assert_eq!(lines[1], token::mint(&h.key, lease));
    assert!(lines[2].starts_with("expires_at "), "{text}");
    let out = leasegate_command(&["token", "--lease", lease, "--key-file", key])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), lines[1]);
    let out = leasegate_command(&["token", "--lease", "not-a-lease", "--key-file", key])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// How many trickling connections the descriptor limit allows (each costs two descriptors
/// in this process, the client's and the proxy's, and other tests run beside this one).
fn flood_size(wanted: usize) -> usize {
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .unwrap_or((1024, 1024));
    let affordable = (soft as usize).saturating_sub(1024) / 2;
    if affordable < wanted {
        eprintln!(
            "descriptor limit {soft}: flooding with {affordable} connections instead of {wanted}"
        );
    }
    affordable.min(wanted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_take_every_connection_slot() {
    let flood = flood_size(1000);
    assert!(flood >= 100, "descriptor limit too low for this test");
    let per_client = flood / 4;
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    // Fewer slots in total than the flood: without a per-client limit it takes them all.
    config.max_connections = flood * 9 / 10;
    config.max_connections_per_client = per_client;
    // Longer than the test: only the per-client limit can keep the others served.
    config.header_read_timeout = Duration::from_secs(30);
    let server = h.start(config).await;

    let mut flooders = Vec::with_capacity(flood);
    for _ in 0..flood {
        let mut stream = connect_from("127.0.0.2", server.addr).await;
        stream
            .write_all(b"GET http://origin.test/ HTTP/1.1\r\nX-Slow: ")
            .await
            .unwrap();
        flooders.push(stream);
    }
    // Each trickles a byte every 100 ms until told to stop; answers what it heard.
    let stop = tokio_util::sync::CancellationToken::new();
    let trickles: Vec<_> = flooders
        .into_iter()
        .map(|mut stream| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 512];
                let mut heard = Vec::new();
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return heard,
                        read = stream.read(&mut buf) => match read {
                            Ok(n) if n > 0 => heard.extend_from_slice(&buf[..n]),
                            _ => return heard,
                        },
                        _ = tokio::time::sleep(Duration::from_millis(100)) => {
                            if stream.write_all(b"a").await.is_err() {
                                return heard;
                            }
                        }
                    }
                }
            })
        })
        .collect();

    let port = origin.addr.port();
    let request = format!(
        "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\
         X-Lease-Id: {lease}\r\nConnection: close\r\n\r\n"
    );
    let mut slowest = Duration::ZERO;
    for _ in 0..8 {
        let started = Instant::now();
        let answer = exchange(connect_from("127.0.0.3", server.addr).await, &request).await;
        let took = started.elapsed();
        assert_eq!(status_of(&answer), 200, "{answer}");
        slowest = slowest.max(took);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        slowest < AT_ONCE,
        "127.0.0.3 waited {slowest:?} while 127.0.0.2 held {per_client} connections"
    );

    stop.cancel();
    let mut refused = 0;
    for trickle in trickles {
        let heard = String::from_utf8_lossy(&trickle.await.unwrap()).into_owned();
        if heard.starts_with("HTTP/1.1 429") {
            assert!(
                heard.contains("x-leasegate-refusal: too-many-connections"),
                "{heard}"
            );
            refused += 1;
        }
    }
    assert_eq!(
        refused,
        flood - per_client,
        "all beyond the per-client limit got 429"
    );
}

/// Every sidecar agent connects from 127.0.0.1: a connection tied to a lease counts against
/// that lease's budget only, so one lease's idle tunnels beyond the per-address limit leave
/// another lease served; connections no lease answers for yet stay limited per address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lease_holding_tunnels_on_loopback_locks_no_other_lease_out() {
    // An origin that holds every connection open and says nothing.
    let origin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let origin_port = origin.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = origin.accept().await {
            held.push(stream);
        }
    });
    let h = Harness::new();
    let a = h.lease(&["origin.test"], &[]);
    let b = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    assert_eq!(config.max_connections_per_client, 256, "the default");
    // Longer than the test: silent connections stay until it ends.
    config.header_read_timeout = Duration::from_secs(120);
    let server = h.start(config).await;
    let target = format!("origin.test:{origin_port}");
    let mut tunnels = Vec::with_capacity(300);
    for _ in 0..300 {
        tunnels.push(crate::support::harness::open_tunnel(server.addr, &target, Some(&a)).await);
    }
    let answer = exchange(
        TcpStream::connect(server.addr).await.unwrap(),
        &format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {b}\r\n\r\n"),
    )
    .await;
    assert_eq!(status_of(&answer), 200, "lease B: {answer}");

    // 256 connections that never send a head fill 127.0.0.1's budget: the next is refused.
    let mut silent = Vec::with_capacity(256);
    for _ in 0..256 {
        silent.push(TcpStream::connect(server.addr).await.unwrap());
    }
    let refused = crate::support::harness::eventually(Duration::from_secs(10), || async {
        let answer = crate::support::harness::raw(
            server.addr,
            format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {b}\r\n\r\n").as_bytes(),
        )
        .await;
        (status_of(&answer) == 429).then_some(answer)
    })
    .await
    .expect("a connection beyond 256 unidentified ones is refused");
    assert!(
        refused.contains("x-leasegate-refusal: too-many-connections"),
        "{refused}"
    );
    assert!(refused.contains("256 open from 127.0.0.1"), "{refused}");
    drop((tunnels, silent));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_closes_after_the_header_timeout() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.header_read_timeout = Duration::from_millis(300);
    let server = h.start(config).await;
    let port = origin.addr.port();
    let mut stream = TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(
            format!(
                "GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\n\
                 X-Lease-Id: {lease}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).ends_with("hello from origin\n") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the response");
        seen.extend_from_slice(&buf[..n]);
    }
    // Kept alive, then idle: the next head has the same time as the first.
    let idle = until_closed(&mut stream, AT_ONCE * 2).await;
    assert!(idle >= Duration::from_millis(250), "{idle:?}");
    assert!(idle < AT_ONCE, "{idle:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_leaves_a_line_for_every_tunnel_it_cut() {
    const TUNNELS: usize = 200;
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let mut serve = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    serve.drain_timeout = Duration::from_secs(1);
    let server = Server::start(serve).await.unwrap();
    let target = format!("origin.test:{}", origin.addr.port());
    let opening: Vec<_> = (0..TUNNELS)
        .map(|_| {
            let (target, lease) = (target.clone(), lease.clone());
            let addr = server.addr;
            tokio::spawn(async move { streaming_tunnel(addr, &target, Some(&lease)).await })
        })
        .collect();
    let mut tunnels = Vec::new();
    for tunnel in opening {
        tunnels.push(tunnel.await.unwrap());
    }
    let telemetry = server.proxy.telemetry.clone();
    server.shutdown().await;
    // No waiting: shutdown returned, so every line is on disk.
    let text = std::fs::read_to_string(&h.egress).unwrap();
    let cut = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l["kind"] == "connect" && l["error"] == "closed: shutdown drain timed out")
        .count();
    assert_eq!(cut, TUNNELS, "{text}");
    assert_eq!(telemetry.egress.dropped(), 0);
    drop(tunnels);
}
