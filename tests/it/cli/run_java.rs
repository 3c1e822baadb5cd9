//! `leasegate run` and Java: the JVM reads no PEM variable, so `run` names a trust store of
//! the system's roots and the interception CA in `JAVA_TOOL_OPTIONS`, after what the variable
//! held; a Java program with no trust setup of its own reaches a terminated host.

use crate::cli::run_trust::run;
use crate::proxy::brokered::{received, Brokered, VALUE};
use crate::support::harness::{eventually, port_range, raw, sha_hex};
use crate::support::missing;
use crate::support::netns::in_loopback_only_namespace;
use std::time::Duration;

const TOKEN: &str = "s3cret";

/// `HttpClient` (`BrokeredGet.java`, launched from its source) under `run`, through the
/// lease's own port (no `Authenticator`, so its `Authorization` header goes out: see
/// `tests/it/proxy/clients/brokered.rs`): the origin gets the value in place of the
/// placeholder. The proxy's host comes from the inherited `JAVA_TOOL_OPTIONS`, so the answer
/// also shows that `run` kept what the variable held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_under_run_trusts_the_interception_ca() {
    let jdk = "apt-get install default-jdk-headless; .ci/run does";
    if missing(&["java"], jdk) || !in_loopback_only_namespace().await {
        return;
    }
    let bind = "127.0.0.1".parse().unwrap();
    let b = Brokered::start_with(None, |serve| {
        serve.admin_token = Some(TOKEN.to_owned());
        serve.lease_ports = Some((port_range(4), bind));
    })
    .await;
    let admin = b.server.admin_addr.unwrap();
    // `run` takes the lease's own port from the admin API: wait until it has one.
    let lease_port = eventually(Duration::from_secs(5), || async {
        let answer = raw(
            admin,
            format!(
                "GET /leases/{} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\n\
                 Connection: close\r\n\r\n",
                b.lease
            )
            .as_bytes(),
        )
        .await;
        let body = answer.split_once("\r\n\r\n")?.1;
        let view: serde_json::Value = serde_json::from_str(body).ok()?;
        view["port"].as_u64().map(|p| p as u16)
    })
    .await
    .expect("the lease gets a port");
    let source = crate::support::data("clients/brokered/BrokeredGet.java");
    let (port, url) = (format!("-Dhttps.proxyPort={lease_port}"), b.url("/request"));
    let java = ["java", &port, source.to_str().unwrap(), "2", &url];
    let env = [("JAVA_TOOL_OPTIONS", "-Dhttps.proxyHost=127.0.0.1")];
    let (code, stdout, stderr) = java_under_run(&b, &java, &env).await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("status 200 HTTP/2\nGET /request\n"),
        "{stdout}\n{stderr}"
    );
    assert_eq!(
        received(&stdout, "authorization"),
        Some(sha_hex(format!("Bearer {VALUE}").as_bytes())),
        "the origin got the value in place of the placeholder"
    );
    assert!(!stdout.contains(VALUE) && !stderr.contains(VALUE));
    // The JVM says what it read: the inherited option first, then the store.
    let picked = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Picked up JAVA_TOOL_OPTIONS: "))
        .unwrap_or_else(|| panic!("no JAVA_TOOL_OPTIONS picked up: {stderr}"));
    // The inherited option first; then the proxy (the lease's own port: no relay); then the
    // store.
    let ours = format!(
        "-Dhttps.proxyHost=127.0.0.1 -Dhttp.proxyHost=127.0.0.1 -Dhttp.proxyPort={lease_port} \
         -Dhttps.proxyHost=127.0.0.1 -Dhttps.proxyPort={lease_port} \
         -Dhttp.nonProxyHosts=127.0.0.1 -Djavax.net.ssl.trustStore="
    );
    let store = picked
        .strip_prefix(&ours)
        .and_then(|rest| {
            rest.strip_suffix(
                " -Djavax.net.ssl.trustStoreType=JKS -Djavax.net.ssl.trustStorePassword=changeit",
            )
        })
        .unwrap_or_else(|| panic!("{picked}"));
    assert!(store.ends_with("/truststore.jks"), "{store}");
    assert!(
        !std::path::Path::new(store).exists(),
        "{store} outlived the child"
    );
}

/// Without a lease port the JVM has no way to send the lease's credential: `run` points it at a
/// loopback relay that puts it on. A Java program with no proxy or trust setup of its own
/// (`JavaGet.java`, `HttpURLConnection`) then reaches a terminated host over HTTPS (the origin
/// getting the secret's value), a forwarded host over plain HTTP, and reads a refusal's code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_under_run_reaches_the_proxy_through_the_relay_with_the_leases_credential() {
    let jdk = "apt-get install default-jdk-headless; .ci/run does";
    if missing(&["java"], jdk) || !in_loopback_only_namespace().await {
        return;
    }
    let b = Brokered::start_with(None, |serve| serve.admin_token = Some(TOKEN.to_owned())).await;
    let source = crate::support::data("clients/JavaGet.java");
    let (https, plain, refused) = (
        b.url("/request"),
        format!("http://plain.origin.test:{}/", b.plain.addr.port()),
        format!("http://elsewhere.test:{}/", b.plain.addr.port()),
    );
    let java = ["java", source.to_str().unwrap(), &https, &plain, &refused];
    let (code, stdout, stderr) = java_under_run(&b, &java, &[]).await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}\n{stderr}");
    assert!(
        lines[0].starts_with(&format!("{https} status 200 GET /request")),
        "{stdout}\n{stderr}"
    );
    assert!(
        lines[1].starts_with(&format!("{plain} status 200 ")),
        "{stdout}\n{stderr}"
    );
    assert!(
        lines[2].starts_with(&format!(
            "{refused} status 403 host-not-allowed leasegate refused"
        )),
        "{stdout}\n{stderr}"
    );
    let picked = stderr
        .lines()
        .find_map(|l| l.strip_prefix("Picked up JAVA_TOOL_OPTIONS: "))
        .unwrap_or_else(|| panic!("no JAVA_TOOL_OPTIONS picked up: {stderr}"));
    assert!(
        picked.starts_with("-Dhttp.proxyHost=127.0.0.1 -Dhttp.proxyPort=")
            && picked.contains(" -Dhttp.nonProxyHosts=127.0.0.1 -Djavax.net.ssl.trustStore="),
        "{picked}"
    );
    let relay_port = picked
        .split_whitespace()
        .find_map(|o| o.strip_prefix("-Dhttp.proxyPort="))
        .unwrap();
    assert_ne!(
        relay_port,
        b.server.addr.port().to_string(),
        "the JVM goes through the relay"
    );
    // The egress lines name the lease: the relay put its credential on every request.
    let lines = b.h.egress_lines(4).await;
    for line in &lines {
        assert_eq!(line["lease_id"], b.lease.as_str(), "{line}");
    }
}

/// `leasegate run` of `b`'s lease (its token in a file, the admin API of `b`) running `java`:
/// exit code, stdout, stderr.
async fn java_under_run(
    b: &Brokered,
    java: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let token = b.h.dir.path().join("lease-token");
    std::fs::write(&token, leasegate::contract::token::mint(&b.h.key, &b.lease)).unwrap();
    let admin = format!("http://{}", b.server.admin_addr.unwrap());
    let mut args = vec![
        "run",
        "--lease",
        &b.lease,
        "--admin",
        &admin,
        "--lease-token-file",
        token.to_str().unwrap(),
        "--",
    ];
    args.extend_from_slice(java);
    run(&args, env).await
}
