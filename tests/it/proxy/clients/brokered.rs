//! Unmodified clients through a terminated host ([`Brokered`]), each set up as `leasegate run`
//! sets up an agent: the lease in `HTTPS_PROXY`, the interception CA in the variables clients
//! read for their trust store, the lease's placeholder in `GITHUB_TOKEN`. Each client (a script
//! in `tests/data/clients/brokered/`) sends the placeholder in its `Authorization` header: to
//! the secret's route the origin gets the value and the client never sees it; to a route the
//! secret is not for, the client sees the 403 and the lease is revoked. A fresh fixture per
//! client, since that revokes its lease; each in a loopback-only namespace.

use super::{build, client, git_repository, text};
use crate::proxy::brokered::{received, Brokered, HOST, VALUE};
use crate::support::harness::{admin_get, eventually, port_range, proxy_url, sha_hex};
use crate::support::netns::in_loopback_only_namespace;
use crate::support::{missing, skip};
use std::time::Duration;

/// What a client did: its exit code, stdout and stderr.
#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    printed: String,
    warned: String,
}

/// The variables `leasegate run` gives an agent under `b.lease`: the proxy, the CA (`run`
/// writes the system bundle plus the CA; the CA alone is enough here) and the placeholder.
fn agent_env(b: &Brokered) -> Vec<(&'static str, String)> {
    let ca = b.ca_pem.to_str().unwrap().to_owned();
    let mut env = vec![
        ("HTTPS_PROXY", proxy_url(&b.server, &b.lease)),
        ("GITHUB_TOKEN", b.placeholder(&b.lease)),
    ];
    for name in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS",
    ] {
        env.push((name, ca.clone()));
    }
    env
}

/// Runs a client with [`agent_env`] and `more`, asserting that nothing it printed holds the
/// value.
async fn run(b: &Brokered, program: &str, args: &[&str], more: &[(&str, &str)]) -> Ran {
    let env = agent_env(b);
    let mut all: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    all.extend_from_slice(more);
    let out = client(program, args, &all, b.h.dir.path()).await;
    let ran = Ran {
        code: out.status.code(),
        printed: text(&out.stdout),
        warned: text(&out.stderr),
    };
    assert!(
        !ran.printed.contains(VALUE) && !ran.warned.contains(VALUE),
        "{program} saw the value: {ran:?}"
    );
    ran
}

/// A client's GET of `/request` under `version`: answered, and the origin got the value.
#[track_caller]
fn assert_origin_got_the_value(ran: &Ran, version: &str) {
    assert_eq!(ran.code, Some(0), "{version}: {ran:?}");
    assert!(
        ran.printed
            .starts_with(&format!("status 200 {version}\nGET /request\n")),
        "{version}: {ran:?}"
    );
    assert_eq!(
        received(&ran.printed, "authorization"),
        Some(sha_hex(format!("Bearer {VALUE}").as_bytes())),
        "{version}: the origin got the value in place of the placeholder"
    );
}

/// A client's GET of `/headers` (no route of the secret) with the placeholder: it printed the
/// 403 and its code, and the lease is revoked.
async fn assert_misdirected(b: &Brokered, ran: &Ran, version: &str) {
    assert_eq!(ran.code, Some(1), "{ran:?}");
    let head = format!("status 403 {version}\nx-leasegate-refusal: secret-misdirected\n");
    assert!(ran.printed.starts_with(&head), "{ran:?}");
    assert_revoked_as_misdirected(b, "/headers").await;
}

/// The lease is revoked, and the egress line of the request to `path` says
/// `secret-misdirected`.
async fn assert_revoked_as_misdirected(b: &Brokered, path: &str) {
    assert_eq!(b.status(&b.lease).await, "revoked");
    let line = eventually(Duration::from_secs(5), || async {
        let log = tokio::fs::read_to_string(&b.h.egress).await.ok()?;
        log.lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .find(|line| line["code"] == "secret-misdirected")
    })
    .await
    .expect("an egress line with code secret-misdirected");
    assert_eq!(line["kind"], "https", "{line}");
    assert_eq!(line["lease_id"], b.lease.as_str(), "{line}");
    assert!(line["path"].as_str().unwrap().starts_with(path), "{line}");
}

/// Whether `python3` can import `module`.
fn python_has(module: &str) -> bool {
    std::process::Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|out| out.status.success())
}

/// Whether `python3` has `module` (else [`skip`], naming `install`) and the test runs in the
/// loopback-only namespace.
async fn python_runs_here(module: &str, install: &str) -> bool {
    if !python_has(module) {
        skip(&format!(
            "Python {module} is missing ({install}; .ci/run does)"
        ));
        return false;
    }
    in_loopback_only_namespace().await
}

fn script(name: &str) -> String {
    let path = crate::support::data(&format!("clients/brokered/{name}"));
    path.to_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_through_a_terminated_host() {
    if !in_loopback_only_namespace().await {
        return;
    }
    let b = Brokered::start().await;
    let curl = script("curl_get.sh");
    for (flag, version) in [("--http1.1", "HTTP/1.1"), ("--http2", "HTTP/2")] {
        let ran = run(&b, "sh", &[&curl, flag, &b.url("/request")], &[]).await;
        assert_origin_got_the_value(&ran, version);
    }
    let ran = run(&b, "sh", &[&curl, "--http2", &b.url("/headers")], &[]).await;
    assert_misdirected(&b, &ran, "HTTP/2").await;
}

/// `requests` (urllib3) speaks HTTP/1.1 only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_through_a_terminated_host() {
    if !python_runs_here("requests", "apt-get install python3-requests").await {
        return;
    }
    let b = Brokered::start().await;
    let get = script("requests_get.py");
    let ran = run(&b, "python3", &[&get, &b.url("/request")], &[]).await;
    assert_origin_got_the_value(&ran, "HTTP/1.1");
    let ran = run(&b, "python3", &[&get, &b.url("/headers")], &[]).await;
    assert_misdirected(&b, &ran, "HTTP/1.1").await;
}

/// httpx over HTTP/2 where the `h2` package is there (.ci/run installs it), else HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_httpx_through_a_terminated_host() {
    if !python_runs_here("httpx", "apt-get install python3-httpx python3-h2").await {
        return;
    }
    let (mode, version) = match python_has("h2") {
        true => ("http2", "HTTP/2"),
        false => ("http1", "HTTP/1.1"),
    };
    let b = Brokered::start().await;
    let get = script("httpx_get.py");
    let ran = run(&b, "python3", &[&get, mode, &b.url("/request")], &[]).await;
    assert_origin_got_the_value(&ran, version);
    let ran = run(&b, "python3", &[&get, mode, &b.url("/headers")], &[]).await;
    assert_misdirected(&b, &ran, version).await;
}

/// undici's `fetch` (HTTP/1.1: see the script), as `node.rs` runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_undici_through_a_terminated_host() {
    let Some(modules) = super::node::node_with_undici() else {
        return;
    };
    if !in_loopback_only_namespace().await {
        return;
    }
    let b = Brokered::start().await;
    let get = script("fetch_get.cjs");
    let modules = [("NODE_PATH", modules.to_str().unwrap())];
    let ran = run(&b, "node", &[&get, &b.url("/request")], &modules).await;
    assert_origin_got_the_value(&ran, "HTTP/1.1");
    let ran = run(&b, "node", &[&get, &b.url("/headers")], &modules).await;
    assert_misdirected(&b, &ran, "HTTP/1.1").await;
}

/// git over dumb HTTP from an origin that serves the repository only to the value; the
/// placeholder to another repository (no route of the secret) is misdirected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_through_a_terminated_host() {
    if missing(&["git"], "apt-get install git") || !in_loopback_only_namespace().await {
        return;
    }
    let served = tempfile::tempdir().unwrap();
    let (root, head) = git_repository(served.path());
    let b = Brokered::start_serving(root).await;
    let home = b.h.dir.path().to_str().unwrap().to_owned();
    let more = [
        ("GIT_TERMINAL_PROMPT", "0"),
        ("GIT_CONFIG_NOSYSTEM", "1"),
        ("HOME", home.as_str()),
    ];
    let ls_remote = script("git_ls_remote.sh");
    let ran = run(&b, "sh", &[&ls_remote, &b.url("/repo.git")], &more).await;
    assert_eq!(ran.code, Some(0), "{ran:?}");
    assert_eq!(
        ran.printed,
        format!("{head}\tHEAD\n{head}\trefs/heads/main\n"),
        "the origin served the repository: it got the value"
    );

    let other = b.url("/other.git");
    let ran = run(&b, "sh", &[&ls_remote, &other], &more).await;
    assert_eq!(ran.code, Some(128), "{ran:?}");
    // git shows the refusal's body as the remote's message, then its own.
    let (remote, fatal) = ran.warned.split_once('\n').unwrap_or_default();
    assert!(
        remote.starts_with(&format!("remote: leasegate refused GET {HOST}:"))
            && remote.contains(": secret-misdirected ("),
        "{ran:?}"
    );
    assert_eq!(
        fatal,
        format!("fatal: unable to access '{other}/': The requested URL returned error: 403\n")
    );
    assert_revoked_as_misdirected(&b, "/other.git/").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_net_http_through_a_terminated_host() {
    if missing(&["go"], "apt-get install golang-go; .ci/run does")
        || !in_loopback_only_namespace().await
    {
        return;
    }
    let b = Brokered::start().await;
    let program = super::go::go_client(b.h.dir.path(), "brokered/get.go", "get").await;
    let get = program.to_str().unwrap();
    for (mode, version) in [("h1", "HTTP/1.1"), ("h2", "HTTP/2")] {
        let ran = run(&b, get, &[mode, &b.url("/request")], &[]).await;
        assert_origin_got_the_value(&ran, version);
    }
    let ran = run(&b, get, &["h2", &b.url("/headers")], &[]).await;
    assert_misdirected(&b, &ran, "HTTP/2").await;
}

/// Java ignores `HTTPS_PROXY` and the CA variables: the proxy in its properties, the CA in a
/// PKCS12 trust store made with `keytool`. With Basic credentials (an `Authenticator`, Basic let
/// through for tunnels: see `mod.rs`) `HttpClient` drops the `Authorization` header it is given,
/// so the placeholder never leaves it: the proxy still puts the value in on the secret's routes,
/// and elsewhere the answer is `route-not-allowed`, which leaves the lease open. Through the
/// lease's own port, with no `Authenticator`, the header goes out as with any other client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_httpclient_through_a_terminated_host() {
    let jdk = "apt-get install default-jdk-headless; .ci/run does";
    if missing(&["javac", "java", "keytool"], jdk) || !in_loopback_only_namespace().await {
        return;
    }
    let b = &Brokered::start_with_ports(port_range(4)).await;
    let dir = b.h.dir.path();
    let classes = dir.join("classes");
    let source = script("BrokeredGet.java");
    build(
        "javac",
        &["-d", classes.to_str().unwrap(), &source],
        &[],
        dir,
        jdk,
    )
    .await;
    let store = dir.join("ca.p12");
    let store = store.to_str().unwrap();
    let ca = b.ca_pem.to_str().unwrap();
    let import = [
        "-importcert",
        "-noprompt",
        "-storetype",
        "PKCS12",
        "-keystore",
        store,
        "-storepass",
        "changeit",
        "-alias",
        "leasegate",
        "-file",
        ca,
    ];
    build("keytool", &import, &[], dir, jdk).await;
    let lease_port = eventually(Duration::from_secs(5), || async {
        let (_, view) = admin_get(&b.server, &format!("/leases/{}", b.lease)).await;
        view["port"].as_u64().map(|p| p as u16)
    })
    .await
    .expect("the lease gets a port");
    let java = |port: u16, version: &'static str, path: &'static str, basic: bool| {
        let mut args = vec![
            "-cp".to_owned(),
            classes.to_str().unwrap().to_owned(),
            format!("-Djavax.net.ssl.trustStore={store}"),
            "-Djavax.net.ssl.trustStorePassword=changeit".to_owned(),
            "-Djavax.net.ssl.trustStoreType=PKCS12".to_owned(),
            "-Dhttps.proxyHost=127.0.0.1".to_owned(),
            format!("-Dhttps.proxyPort={port}"),
            super::ENABLE_BASIC_FOR_TUNNELS.to_owned(),
            "BrokeredGet".to_owned(),
            version.to_owned(),
            b.url(path),
        ];
        if basic {
            args.extend(["agent".to_owned(), b.lease.clone()]);
        }
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(b, "java", &args, &[]).await
        }
    };

    let shared = b.server.addr.port();
    assert_origin_got_the_value(&java(shared, "2", "/request", true).await, "HTTP/2");
    let ran = java(shared, "2", "/headers", true).await;
    assert_eq!(ran.code, Some(1), "{ran:?}");
    let head = "status 403 HTTP/2\nx-leasegate-refusal: route-not-allowed\n";
    assert!(
        ran.printed.starts_with(head),
        "the placeholder was not sent: {ran:?}"
    );
    assert_eq!(b.status(&b.lease).await, "open");

    for (flag, version) in [("1.1", "HTTP/1.1"), ("2", "HTTP/2")] {
        let ran = java(lease_port, flag, "/request", false).await;
        assert_origin_got_the_value(&ran, version);
    }
    let ran = java(lease_port, "2", "/headers", false).await;
    assert_misdirected(b, &ran, "HTTP/2").await;
}
