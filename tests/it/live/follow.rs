//! Live leases: journal tailing, teardown on revocation and expiry, per-lease ports, `run`.

use crate::support::harness::status_through;
use crate::support::harness::AT_ONCE;
use crate::support::harness::{
    admin_get, curl, eventually, http_origin, port_range, raw, read_until, readyz_turns,
    streaming_tunnel, until_closed, Harness,
};
use crate::support::leasegate_ok;
use leasegate::contract::Timestamp;
use std::time::{Duration, Instant};

pub(crate) async fn issue_cli(h: &Harness, allow: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "issue",
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
        "--allow-host",
        allow,
    ];
    args.extend_from_slice(extra);
    leasegate_ok(&args).await.lines().next().unwrap().to_owned()
}

pub(crate) async fn revoke_cli(h: &Harness, lease: &str) {
    leasegate_ok(&[
        "revoke",
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
        "--lease",
        lease,
        "--reason",
        "operator revoked",
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_issued_while_running_opens_within_the_poll_interval() {
    let h = Harness::new();
    let origin = http_origin().await;
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let lease = issue_cli(&h, "origin.test", &[]).await;
    let issued = Instant::now();
    let works = eventually(AT_ONCE * 2, || async {
        (status_through(&server, &lease, &url).await == 200).then_some(())
    })
    .await;
    assert!(works.is_some(), "the new lease never opened");
    // Polled every 50 ms; the bound is loose because curl itself is a process start per try.
    assert!(issued.elapsed() < AT_ONCE, "took {:?}", issued.elapsed());
    let (status, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200);
    assert_eq!(view["status"], "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoke_from_another_process_closes_a_streaming_tunnel() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let target = format!("origin.test:{}", origin.addr.port());
    let mut tunnel = streaming_tunnel(server.addr, &target, Some(&lease)).await;
    revoke_cli(&h, &lease).await;
    let closed_after = until_closed(&mut tunnel, AT_ONCE * 2).await;
    assert!(closed_after < AT_ONCE, "closed after {closed_after:?}");
    let line = h.egress_line(1).await;
    assert_eq!(line["kind"], "connect");
    assert!(
        line["error"]
            .as_str()
            .unwrap_or_default()
            .contains("no longer opens"),
        "{line}"
    );
    assert!(line["bytes_down"].as_u64().unwrap() > 0);
    let answer = raw(
        server.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        answer.contains("x-leasegate-refusal: lease-revoked"),
        "{answer}"
    );
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1, "the proxy wrote nothing of its own");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_closes_an_open_tunnel_without_another_request() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease_with(
        &["origin.test"],
        &[],
        None,
        Timestamp::now(),
        Duration::from_secs(2),
    );
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let opened = Instant::now();
    let mut tunnel = streaming_tunnel(
        server.addr,
        &format!("origin.test:{}", origin.addr.port()),
        Some(&lease),
    )
    .await;
    until_closed(&mut tunnel, Duration::from_secs(2) + AT_ONCE * 2).await;
    let lived = opened.elapsed();
    assert!(
        lived > Duration::from_millis(1500) && lived < Duration::from_secs(2) + AT_ONCE,
        "closed after {lived:?}"
    );
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "expired");
    assert_eq!(
        h.journal_records().await.len(),
        1,
        "closed by the expiry timer alone: the journal holds only the grant"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_parent_closes_a_childs_tunnel_and_keep_alive_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let h = Harness::new();
    let origin = http_origin().await;
    let parent = h.lease(&["*.test"], &[]);
    let child = h.lease_with(
        &["origin.test"],
        &[],
        Some(&parent),
        Timestamp::now(),
        Duration::from_secs(600),
    );
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let port = origin.addr.port();
    let mut tunnel =
        streaming_tunnel(server.addr, &format!("origin.test:{port}"), Some(&child)).await;
    // An idle keep-alive connection of the child, after one forwarded request.
    let mut keep_alive = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    keep_alive
        .write_all(format!("GET http://origin.test:{port}/ HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {child}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = keep_alive.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    revoke_cli(&h, &parent).await;
    assert!(until_closed(&mut tunnel, AT_ONCE * 2).await < AT_ONCE);
    assert!(until_closed(&mut keep_alive, AT_ONCE * 2).await < AT_ONCE);
    let (_, view) = admin_get(&server, &format!("/leases/{child}")).await;
    assert_eq!(view["status"], "ancestor-closed");
}

/// A forwarded response whose upstream has gone quiet mid-body still ends when its lease
/// closes (the connection is tied to the lease; the body is too, see `proxy::body`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_ends_a_forwarded_body_the_upstream_has_stopped_sending() {
    use tokio::io::AsyncWriteExt;
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let port = origin.addr.port();
    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(format!("GET http://origin.test:{port}/stall HTTP/1.1\r\nHost: origin.test:{port}\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    assert!(read_until(&mut stream, "tick")
        .await
        .starts_with("HTTP/1.1 200"));
    revoke_cli(&h, &lease).await;
    assert!(until_closed(&mut stream, AT_ONCE * 2).await < AT_ONCE);
    let line = h.egress_line(1).await;
    assert_eq!(line["error"], "closed: the lease no longer opens anything");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_journal_is_read_from_its_start() {
    let h = Harness::new();
    let origin = http_origin().await;
    let old = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    tokio::fs::rename(&h.journal, h.dir.path().join("journal.jsonl.1"))
        .await
        .unwrap();
    let new = issue_cli(&h, "origin.test", &[]).await;
    let opened = eventually(Duration::from_secs(5), || async {
        (status_through(&server, &new, &url).await == 200).then_some(())
    })
    .await;
    assert!(
        opened.is_some(),
        "a lease in the new journal file never opened"
    );
    assert_eq!(
        status_through(&server, &old, &url).await,
        200,
        "earlier state is kept"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_lease_ports_need_no_credentials_and_answer_as_their_lease_once_closed() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let range = port_range(8);
    let server = h
        .start_with_ports(
            h.config(&[("origin.test", "127.0.0.1")]),
            Some(range.clone()),
        )
        .await;
    let port_of = |id: String| {
        let server = &server;
        async move {
            let (_, view) = admin_get(server, &format!("/leases/{id}")).await;
            view["port"].as_u64().map(|p| p as u16)
        }
    };
    let port = eventually(Duration::from_secs(5), || port_of(lease.clone()))
        .await
        .expect("a port");
    assert!(range.contains(&port));
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["proxy_url"], format!("http://127.0.0.1:{port}"));
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let plain = format!("http://127.0.0.1:{port}");
    let out = curl(&["-x", &plain, &url], &[]).await;
    assert_eq!(out.status, 200, "{out:?}");
    assert_eq!(h.egress_line(1).await["lease_id"], lease.as_str());
    let out = curl(
        &[
            "-x",
            &format!("http://agent:{other}@127.0.0.1:{port}"),
            &url,
        ],
        &[],
    )
    .await;
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("lease-conflict")
    );

    revoke_cli(&h, &lease).await;
    let closed = eventually(AT_ONCE, || async {
        let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
        view["port"].is_null().then_some(())
    })
    .await;
    assert!(closed.is_some(), "the revoked lease still shows its port");
    // The closed lease's port lingers, answering as that lease.
    let refused = curl(&["-x", &plain, &url], &[]).await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert_eq!(
        refused.header("x-leasegate-refusal").as_deref(),
        Some("lease-revoked")
    );
    // A lease issued now gets another port: the closed lease's is held within retention.
    let newer = issue_cli(&h, "origin.test", &[]).await;
    let new_port = eventually(Duration::from_secs(5), || port_of(newer.clone()))
        .await
        .expect("a port");
    assert_ne!(new_port, port);
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["port"], serde_json::Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_port_opens_and_closes_by_the_clock_alone() {
    let h = Harness::new();
    // Valid from 2 s from now, for 2 s; nothing is written to the journal meanwhile, and the
    // lease ports' floor pass (every 5 s) is too late for either check below.
    let from = Timestamp::from_millis(Timestamp::now().as_millis() + 2_000);
    let lease = h.lease_with(&["origin.test"], &[], None, from, Duration::from_secs(2));
    let server = h.start_with_ports(h.config(&[]), Some(port_range(4))).await;
    let ports = server.ports.clone().unwrap();
    assert_eq!(
        ports.port_of(&lease),
        None,
        "a port before the lease is valid"
    );
    let valid = eventually(AT_ONCE * 2, || async { ports.port_of(&lease) }).await;
    let opened = Timestamp::now().as_millis() - from.as_millis();
    assert!(valid.is_some(), "no port once the lease became valid");
    assert!(
        opened < AT_ONCE.as_millis() as i64,
        "the port opened {opened} ms after the lease became valid"
    );
    let closed = eventually(AT_ONCE * 2, || async {
        ports.port_of(&lease).is_none().then_some(())
    })
    .await;
    let expired = from.as_millis() + 2_000;
    assert!(closed.is_some(), "the port outlived its lease");
    assert!(
        Timestamp::now().as_millis() - expired < AT_ONCE.as_millis() as i64,
        "the port closed long after the lease expired"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_range_warns_once_per_open_lease_and_forgets_closed_ones() {
    let h = Harness::new();
    let first = h.lease(&["origin.test"], &[]);
    let second = h.lease(&["origin.test"], &[]);
    // One port for two leases: whichever is reconciled second is warned.
    let server = h.start_with_ports(h.config(&[]), Some(port_range(1))).await;
    let ports = server.ports.clone().unwrap();
    let warned = eventually(Duration::from_secs(5), || async {
        [&first, &second]
            .into_iter()
            .find(|id| ports.is_warned(id))
            .cloned()
    })
    .await
    .expect("one lease warned about the exhausted range");
    assert!(ports.port_of(&warned).is_none());
    revoke_cli(&h, &warned).await;
    let forgotten = eventually(Duration::from_secs(5), || async {
        (!ports.is_warned(&warned)).then_some(())
    })
    .await;
    assert!(
        forgotten.is_some(),
        "a closed lease stays in the warned set"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_lookups_answer_json() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[])).await;
    assert_eq!(
        admin_get(&server, "/healthz").await,
        (200, serde_json::json!({"status": "ok"}))
    );
    let (status, ready) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200);
    assert_eq!(ready["ready"], true);
    assert!(ready["journal_follow_lag_seconds"].is_f64(), "{ready}");
    let (status, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200);
    assert_eq!(view["lease_id"], lease.as_str());
    assert_eq!(view["status"], "open");
    assert_eq!(view["port"], serde_json::Value::Null);
    // No admin token configured: nobody is authenticated, so the URL carries no credential.
    assert_eq!(view["proxy_url"], format!("http://{}", server.addr));
    assert!(view["expires_at"].as_str().unwrap().ends_with('Z'));
    let (status, body) = admin_get(&server, "/leases/00000000-0000-4000-8000-000000000000").await;
    assert_eq!(status, 404);
    assert!(body["error"].as_str().unwrap().contains("no lease"));
    let (status, body) = admin_get(&server, "/nope").await;
    assert_eq!(status, 404);
    assert!(body["error"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_points_its_child_at_the_lease_and_passes_the_exit_code() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let port = origin.addr.port();
    let run = |args: Vec<String>| {
        let admin = admin.clone();
        let lease = lease.clone();
        async move {
            let mut command = crate::support::leasegate_command(&[
                "run", "--lease", &lease, "--admin", &admin, "--",
            ]);
            command.args(args).env("NO_PROXY", "*");
            tokio::process::Command::from(command)
                .output()
                .await
                .unwrap()
        }
    };
    let out = run(vec![
        "curl".into(),
        "-sf".into(),
        format!("http://origin.test:{port}/"),
    ])
    .await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello from origin\n");
    let out = run(vec!["sh".into(), "-c".into(), "echo $HTTPS_PROXY $all_proxy ${NODE_OPTIONS%% *} $LEASEGATE_LEASE_ID ${NO_PROXY:-unset}; exit 7".into()]).await;
    assert_eq!(out.status.code(), Some(7));
    let expected = format!("http://agent:{lease}@{}", server.addr);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{expected} {expected} --require {lease} 127.0.0.1")
    );
    let out = run(vec!["sh".into(), "-c".into(), "kill -TERM $$".into()]).await;
    assert_eq!(out.status.code(), Some(128 + 15));
    let out = run(vec![
        "curl".into(),
        "-sf".into(),
        format!("http://denied.test:{port}/"),
    ])
    .await;
    assert_eq!(
        out.status.code(),
        Some(22),
        "curl's exit code for the 403 passes through"
    );
    // The denial revoked the lease: run now refuses to start anything.
    let out = run(vec!["true".into()]).await;
    assert_eq!(out.status.code(), Some(125));
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not open anything now"));
}

/// `run` says what the admin API answered (401, 400, 404), not that it cannot reach it; the
/// lease token comes from `--lease-token-file` or `LEASEGATE_LEASE_TOKEN_FILE`; the operator's
/// credentials are refused; a command that is not found exits 127 and one that cannot be
/// executed 126, as in shells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_says_what_the_admin_api_answered_and_exits_as_shells_do() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let mut serve = h.serve_config(h.config(&[]), None);
    serve.admin_token = Some("s3cret".into());
    let server = leasegate::server::Server::start(serve).await.unwrap();
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let token = h.dir.path().join("lease.token");
    let minted = leasegate::contract::token::mint(&h.key, &lease);
    std::fs::write(&token, format!("{minted}\n")).unwrap();
    let wrong = h.dir.path().join("wrong.token");
    let forged = format!("{lease}.AAAAAAAAAAAAAAAAAAAAAA");
    std::fs::write(&wrong, format!("{forged}\n")).unwrap();
    let admin_token = h.dir.path().join("admin.token");
    std::fs::write(&admin_token, "s3cret\n").unwrap();
    let run = |lease: &str, env: Option<&std::path::Path>, extra: &[&str], command: &[&str]| {
        let mut args = vec!["run", "--lease", lease, "--admin", &admin];
        args.extend(extra);
        args.push("--");
        args.extend(command);
        let mut command = crate::support::leasegate_command(&args);
        command.env_remove("LEASEGATE_LEASE_TOKEN_FILE");
        if let Some(path) = env {
            command.env("LEASEGATE_LEASE_TOKEN_FILE", path);
        }
        async move {
            let out = tokio::process::Command::from(command)
                .output()
                .await
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let ok = (Some(0), "ran\n".to_owned(), String::new());
    let echo = ["echo", "ran"];

    assert_eq!(
        run(&lease, None, &[], &echo).await,
        (
            Some(125),
            String::new(),
            format!(
                "leasegate run: the admin API at {admin} answered 401: give --lease-token-file \
                 (or LEASEGATE_LEASE_TOKEN_FILE) with the lease's proxy token (`leasegate token \
                 --lease ID --key-file K` mints it; the issuer's answer carries it)\n"
            )
        )
    );
    let token_arg = token.to_str().unwrap();
    assert_eq!(
        run(&lease, None, &["--lease-token-file", token_arg], &echo).await,
        ok
    );
    assert_eq!(run(&lease, Some(&token), &[], &echo).await, ok);
    assert_eq!(
        run(&lease, Some(&wrong), &[], &echo).await,
        (
            Some(125),
            String::new(),
            format!(
                "leasegate run: the admin API at {admin} answered 401: it refused the token in \
                 --lease-token-file: the bearer token is neither the admin token nor a lease's \
                 proxy token\n"
            )
        )
    );
    // The operator's credentials are not taken: the agent could read them.
    for (flag, path) in [
        ("--admin-token-file", admin_token.to_str().unwrap()),
        ("--key-file", h.key_path.to_str().unwrap()),
    ] {
        let (code, stdout, stderr) = run(&lease, None, &[flag, path], &echo).await;
        assert_eq!((code, stdout.as_str()), (Some(2), ""), "{stderr}");
        assert_eq!(
            stderr,
            format!(
                "leasegate run: {flag} is not taken by `run`: the agent, the same user as \
                 `run`, could read it and act as the operator (list, read and revoke every \
                 lease). Give the lease's own proxy token instead: `leasegate token --lease ID \
                 --key-file K > F` (or the issuer's answer), then `run --lease-token-file F`\n"
            )
        );
    }
    // A token of another lease is not this lease's.
    let other = "00000000-0000-4000-8000-000000000001";
    let (code, _, stderr) = run(other, Some(&token), &[], &echo).await;
    assert_eq!(code, Some(125));
    assert_eq!(
        stderr,
        format!(
            "leasegate run: {} holds the token of lease {lease}, not of --lease {other}\n",
            token.display()
        )
    );
    // Not a lease id: refused as every `--lease` is, before the admin API is asked.
    let (code, stdout, stderr) = run("nope", Some(&token), &[], &echo).await;
    assert_eq!((code, stdout.as_str()), (Some(2), ""), "{stderr}");
    assert!(
        stderr.starts_with(
            "error: invalid value 'nope' for '--lease <LEASE>': \"nope\" is not a lease id (a \
             lower-case UUID)\n"
        ),
        "{stderr}"
    );
    let unknown = "00000000-0000-4000-8000-000000000000";
    let unknown_token = h.dir.path().join("unknown.token");
    std::fs::write(
        &unknown_token,
        leasegate::contract::token::mint(&h.key, unknown),
    )
    .unwrap();
    assert_eq!(
        // Without waiting: the admin API's own answer.
        run(unknown, Some(&unknown_token), &["--wait", "0s"], &echo).await,
        (
            Some(125),
            String::new(),
            format!(
                "leasegate run: no such lease {unknown}: the admin API at {admin} answered 404 \
                 Not Found\n"
            )
        )
    );

    assert_eq!(
        run(&lease, Some(&token), &[], &["leasegate-no-such-command"]).await,
        (
            Some(127),
            String::new(),
            "leasegate run: leasegate-no-such-command: command not found\n".to_owned()
        )
    );
    let script = h.dir.path().join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\necho ran\n").unwrap();
    let script = script.to_str().unwrap();
    assert_eq!(
        run(&lease, Some(&token), &[], &[script]).await,
        (
            Some(126),
            String::new(),
            format!("leasegate run: {script}: cannot execute: Permission denied (os error 13)\n")
        )
    );
    let dir = h.dir.path().to_str().unwrap();
    assert_eq!(run(&lease, Some(&token), &[], &[dir]).await.0, Some(126));
    server.shutdown().await;

    // Only a proxy that is not there is "cannot reach" (once `--wait` has passed).
    let (code, _, stderr) = run(&lease, Some(&token), &["--wait", "200ms"], &echo).await;
    assert_eq!(code, Some(125));
    assert!(
        stderr.starts_with(&format!(
            "leasegate run: cannot reach the admin API at {admin}: "
        )),
        "{stderr}"
    );
}

/// A closing record dated an hour ahead closes the lease when it is read: its open tunnel ends
/// and the next request is refused (it used to wait for the record's `at`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_line_dated_in_the_future_closes_an_open_tunnel_now() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let target = format!("origin.test:{}", origin.addr.port());
    let mut tunnel = streaming_tunnel(server.addr, &target, Some(&lease)).await;
    let ahead = Timestamp::from_millis(Timestamp::now().as_millis() + 3_600_000);
    h.append(
        &serde_json::json!({
            "schema_version": "1.0",
            "at": ahead.to_string(),
            "event": "stopped",
            "lease_id": lease,
            "reason": "done",
        })
        .to_string(),
    )
    .await;
    let closed_after = until_closed(&mut tunnel, AT_ONCE * 2).await;
    assert!(closed_after < AT_ONCE, "closed after {closed_after:?}");
    let answer = raw(
        server.addr,
        format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        answer.contains("x-leasegate-refusal: lease-closed"),
        "{answer}"
    );
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "stopped");
}

/// The journal cannot be written (its path turned into a directory after start): a refusal
/// still revokes in memory, `/readyz` says why, and once the journal is back the queued record
/// is appended once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_while_the_journal_is_unwritable_revokes_and_queues_its_record() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let (status, _) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200);
    let saved = std::fs::read(&h.journal).unwrap();
    std::fs::remove_file(&h.journal).unwrap();
    std::fs::create_dir(&h.journal).unwrap();

    let refused = raw(
        server.addr,
        format!("CONNECT elsewhere.test:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        refused.contains("x-leasegate-refusal: host-not-allowed"),
        "{refused}"
    );
    let again = raw(
        server.addr,
        format!("CONNECT origin.test:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        again.contains("x-leasegate-refusal: lease-revoked"),
        "{again}"
    );
    let (status, body) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    let reason = body["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("journal not writable") && reason.contains("1 revocation(s) pending"),
        "{body}"
    );
    let pending = leasegate::registry::pending::pending_path(&h.journal);
    assert!(pending.exists(), "the record is durable");
    let (_, metrics) = {
        let answer = raw(
            server.admin_addr.unwrap(),
            b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
        )
        .await;
        (0, answer)
    };
    assert!(
        metrics.contains("leasegate_journal_append_failures_total 1"),
        "{metrics}"
    );

    std::fs::remove_dir(&h.journal).unwrap();
    std::fs::write(&h.journal, saved).unwrap();
    let ready = readyz_turns(&server, 200, Duration::from_secs(5)).await;
    assert!(ready.is_some(), "ready again once the queue is flushed");
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1, "appended once");
    assert_eq!(revocations[0]["lease_id"], lease);
    assert!(!pending.exists());
    let (_, view) = admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "revoked");
}

/// The journal cannot be read (its path turned into a directory after start): closing records
/// written elsewhere go unseen meanwhile, so `/readyz` answers 503 naming the cause until a
/// read succeeds again (it used to stay 200, with a warning every poll).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_journal_makes_readyz_say_so() {
    let h = Harness::new();
    h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let (status, _) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200);
    let saved = std::fs::read(&h.journal).unwrap();
    std::fs::remove_file(&h.journal).unwrap();
    std::fs::create_dir(&h.journal).unwrap();
    let unready = readyz_turns(&server, 503, Duration::from_secs(5))
        .await
        .expect("/readyz turns 503");
    let reason = unready["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("journal not readable"), "{unready}");
    assert!(
        reason.contains("decisions use the last state read"),
        "{unready}"
    );

    std::fs::remove_dir(&h.journal).unwrap();
    std::fs::write(&h.journal, saved).unwrap();
    let ready = readyz_turns(&server, 200, Duration::from_secs(5)).await;
    assert!(ready.is_some(), "ready again once a read succeeds");
}

/// Opens the FIFO at its path for writing when dropped, so that a reader blocked opening it
/// (the follower) goes on.
struct Unstall(std::path::PathBuf);

impl Unstall {
    /// A writer of the FIFO at `path`, opened without waiting (it fails when nobody reads it).
    fn writer(path: &std::path::Path) -> std::io::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(nix::libc::O_NONBLOCK)
            .open(path)
    }
}

impl Drop for Unstall {
    fn drop(&mut self) {
        let _ = Unstall::writer(&self.0);
    }
}

/// A read of the journal that never completes (its path now names a FIFO nobody writes to: a
/// hung filesystem, as far as the follower can tell) stalls the follower: `/readyz` turns 503
/// saying so, with the lag, within a second or two, and ready again once the follower reads.
/// It used to stay 200 while no revocation written elsewhere was seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_follower_makes_readyz_say_so() {
    let h = Harness::new();
    h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let (status, ready) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert!(
        ready["journal_follow_lag_seconds"].as_f64().unwrap() < 1.0,
        "{ready}"
    );
    let saved = h.dir.path().join("journal.saved");
    std::fs::rename(&h.journal, &saved).unwrap();
    nix::unistd::mkfifo(&h.journal, nix::sys::stat::Mode::S_IRWXU).unwrap();
    // However the test ends, the follower's open of the FIFO returns.
    let _unstall = Unstall(h.journal.clone());
    let unready = readyz_turns(&server, 503, Duration::from_secs(10))
        .await
        .expect("/readyz turns 503");
    let reason = unready["reason"].as_str().unwrap_or_default();
    assert!(
        reason.contains("the journal follower has completed no read"),
        "{unready}"
    );
    assert!(
        unready["journal_follow_lag_seconds"].as_f64().unwrap() > 1.0,
        "{unready}"
    );

    // A writer lets the follower's open of the FIFO return; the journal goes back first.
    let writer = Unstall::writer(&h.journal).unwrap();
    std::fs::rename(&saved, &h.journal).unwrap();
    drop(writer);
    let ready = readyz_turns(&server, 200, Duration::from_secs(10)).await;
    assert!(ready.is_some(), "ready again once the follower reads");
}

/// A restart with a queued revocation in `<journal>.pending` serves with that lease closed,
/// and appends the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_a_pending_revocation_keeps_the_lease_revoked() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let record = leasegate::contract::record::revoked(
        &leasegate::contract::record::Revocation {
            lease_id: &lease,
            parent_lease_id: None,
            by: "issuer",
            reason: "refused before the restart",
            extra: Default::default(),
        },
        &h.key,
        Timestamp::now(),
    )
    .unwrap();
    let pending = leasegate::registry::pending::pending_path(&h.journal);
    std::fs::write(&pending, format!("{record}\n")).unwrap();
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let answer = raw(
        server.addr,
        format!("CONNECT origin.test:443 HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        answer.contains("x-leasegate-refusal: lease-revoked"),
        "{answer}"
    );
    let flushed = eventually(Duration::from_secs(5), || async {
        (!pending.exists()).then_some(())
    })
    .await;
    assert!(flushed.is_some());
    let revocations = h.revocations().await;
    assert_eq!(revocations.len(), 1);
    assert_eq!(revocations[0]["reason"], "refused before the restart");
}

/// Anyone who can append to the journal (no key needed) can leave a huge last line without
/// its newline. The proxy holds at most `--max-journal-line` of it, counts it once as
/// `too-long`, gets ready and serves; an append after it starts on a new line and is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_torn_last_line_is_skipped_without_being_held_and_the_proxy_serves() {
    const TORN: usize = 64 << 20;
    let h = Harness::new();
    let origin = http_origin().await;
    let before = h.lease(&["origin.test"], &[]);
    let journal = h.journal.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(journal)
            .unwrap();
        file.write_all(&vec![b'x'; TORN]).unwrap();
    })
    .await
    .unwrap();
    let started = Instant::now();
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    // A copy of the torn line per read made this 30 s and more (debug build); a bound far
    // above what one pass takes.
    let ready = started.elapsed();
    assert!(ready < Duration::from_secs(20), "ready after {ready:?}");
    assert!(readyz_turns(&server, 200, Duration::from_secs(5))
        .await
        .is_some());
    let url = format!("http://origin.test:{}/", origin.addr.port());
    assert_eq!(status_through(&server, &before, &url).await, 200);
    let too_long = |text: &str| {
        crate::admin::operate::sample(
            text,
            "leasegate_journal_invalid_lines_total{reason=\"too-long\"}",
        )
    };
    let (_, metrics) = crate::support::harness::admin_text(&server, "/metrics").await;
    assert_eq!(too_long(&metrics), Some(1.0), "{metrics}");

    // An append after it: a newline first ends the torn line, then the grant is read.
    let after = h.lease(&["origin.test"], &[]);
    let served = eventually(Duration::from_secs(5), || async {
        (status_through(&server, &after, &url).await == 200).then_some(())
    })
    .await;
    assert!(
        served.is_some(),
        "the lease granted after the torn line opens"
    );
    let (_, metrics) = crate::support::harness::admin_text(&server, "/metrics").await;
    assert_eq!(too_long(&metrics), Some(1.0), "counted once: {metrics}");
    server.shutdown().await;
}
