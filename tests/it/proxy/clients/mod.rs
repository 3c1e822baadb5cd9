//! Unmodified clients through `HTTPS_PROXY` (or the JVM's proxy properties) against a local
//! HTTPS origin: curl, Python `requests`, git, Java's `HttpClient` and `HttpURLConnection`,
//! Node (`node`) and Go (`go`). Each asserts on the client's own exit status and the text it
//! prints, for an allowed host and for a refused one. Where a client prints the status line's
//! reason phrase, either `Forbidden` or the refusal code (`host-denied`) is accepted. Each runs
//! in a network namespace whose only interface is loopback
//! ([`in_loopback_only_namespace`]), so a client that ignored its proxy settings would fail
//! rather than reach out. `brokered` runs them through a terminated host, with the placeholder
//! of a brokered secret. `origin_paths` runs Go's and Node's own path resolution beside
//! leasegate's.

mod brokered;
mod go;
pub mod mcp_approvals;
mod mcp_sdk;
mod model_sdks;
pub mod node;
mod origin_paths;

use crate::support::harness::{
    curl, https_file_origin, https_origin, port_range, proxy_url, Harness,
};
use crate::support::netns::in_loopback_only_namespace;
use crate::support::{missing, skip};
use leasegate::proxy::OnRefusal;
use leasegate::server::Server;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

/// A proxy resolving `origin.test` and `denied.test` to loopback, logging refusals (not
/// revoking, so that one lease serves both calls), and a lease that allows `origin.test` and
/// denies `denied.test`.
struct Setup {
    h: Harness,
    server: Server,
    lease: String,
}

async fn setup(ports: Option<std::ops::RangeInclusive<u16>>) -> Setup {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]);
    config.on_refusal = OnRefusal::Log;
    let server = h.start_with_ports(config, ports).await;
    Setup { h, server, lease }
}

/// [`setup`] with an HTTPS origin for `origin.test`, for a client given the lease in
/// `HTTPS_PROXY`.
struct HttpsSetup {
    s: Setup,
    /// The origin's port (`origin.test` and `denied.test` both name it).
    port: u16,
    /// The CA file of the origin's certificate.
    ca: PathBuf,
    /// The proxy URL, with the lease as Basic credentials.
    proxy: String,
}

async fn https_setup() -> HttpsSetup {
    let s = setup(None).await;
    let (origin, ca) = https_origin("origin.test", s.h.dir.path()).await;
    let proxy = proxy_url(&s.server, &s.lease);
    HttpsSetup {
        s,
        port: origin.addr.port(),
        ca,
        proxy,
    }
}

/// Runs a client with no proxy or CA variables but `env`, for at most 30 s.
async fn client(program: &str, args: &[&str], env: &[(&str, &str)], cwd: &Path) -> Output {
    client_for(Duration::from_secs(30), program, args, env, cwd).await
}

/// [`client`] for at most `limit`.
pub(crate) async fn client_for(
    limit: Duration,
    program: &str,
    args: &[&str],
    env: &[(&str, &str)],
    cwd: &Path,
) -> Output {
    let mut command = tokio::process::Command::new(program);
    command.args(args).current_dir(cwd).kill_on_drop(true);
    for name in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "GIT_SSL_CAINFO",
        "JAVA_TOOL_OPTIONS",
        "JDK_JAVA_OPTIONS",
        "NODE_USE_ENV_PROXY",
        "NODE_EXTRA_CA_CERTS",
        "NODE_OPTIONS",
        "NODE_PATH",
        "GOFLAGS",
    ] {
        command.env_remove(name);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    let spawned = command.output();
    match tokio::time::timeout(limit, spawned).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("cannot run {program}: {e}"),
        Err(_) => panic!("{program} {args:?} ran for more than {limit:?}"),
    }
}

/// Whether `python3` finds every one of `modules`: found, not imported, since importing the
/// SDKs takes seconds (and a test checks once outside its namespace, once inside).
pub(crate) fn python_finds(modules: &[&str]) -> bool {
    let find = "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, sys.argv[1:])))";
    std::process::Command::new("python3")
        .args(["-c", find])
        .args(modules)
        .output()
        .is_ok_and(|out| out.status.success())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_through_https_proxy_prints_the_403() {
    if !in_loopback_only_namespace().await {
        return;
    }
    let HttpsSetup {
        s: _s,
        port,
        ca,
        proxy,
    } = https_setup().await;
    let ca = ca.to_str().unwrap();
    let env = [("HTTPS_PROXY", proxy.as_str())];
    let out = curl(
        &["--cacert", ca, &format!("https://origin.test:{port}/")],
        &env,
    )
    .await;
    assert_eq!((out.exit, out.status), (0, 200), "{out:?}");
    assert_eq!(out.body_text(), "hello from origin\n");
    let out = curl(
        &["--cacert", ca, &format!("https://denied.test:{port}/")],
        &env,
    )
    .await;
    assert_eq!(out.exit, 56, "{out:?}");
    assert_eq!(
        out.stderr,
        "curl: (56) CONNECT tunnel failed, response 403\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_through_https_proxy_prints_the_403() {
    let has_requests = std::process::Command::new("python3")
        .args(["-c", "import requests"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !has_requests {
        return skip("Python requests is missing (apt-get install python3-requests; .ci/run does)");
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let HttpsSetup { s, port, ca, proxy } = https_setup().await;
    let script = crate::support::data("clients/requests_get.py");
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("REQUESTS_CA_BUNDLE", ca.to_str().unwrap()),
    ];
    let get = |url: String| {
        let script = script.clone();
        let dir = s.h.dir.path().to_owned();
        async move { client("python3", &[script.to_str().unwrap(), &url], &env, &dir).await }
    };
    let out = get(format!("https://origin.test:{port}/")).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "status 200\nhello from origin\n");
    let out = get(format!("https://denied.test:{port}/")).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_printed_with_reason(&text(&out.stdout), |reason| {
        format!(
            "HTTPSConnectionPool(host='denied.test', port={port}): Max retries exceeded with \
             url: / (Caused by ProxyError('Unable to connect to proxy', OSError('Tunnel \
             connection failed: 403 {reason}')))\n"
        )
    });
}

/// A bare repository with one commit, prepared for the dumb HTTP protocol (static files):
/// the directory to serve, and the commit.
fn git_repository(dir: &Path) -> (PathBuf, String) {
    let work = dir.join("work");
    let git = |args: &[&str], cwd: &Path| {
        let out = std::process::Command::new("git")
            .args(["-c", "user.name=t", "-c", "user.email=t@example.test"])
            .args(args)
            .current_dir(cwd)
            .output()
            .unwrap_or_else(|e| panic!("cannot run git: {e}"));
        assert!(out.status.success(), "git {args:?}: {}", text(&out.stderr));
        text(&out.stdout)
    };
    std::fs::create_dir_all(&work).unwrap();
    git(&["init", "-q", "-b", "main"], &work);
    std::fs::write(work.join("README"), "through the lease\n").unwrap();
    git(&["add", "README"], &work);
    git(&["commit", "-q", "-m", "first"], &work);
    let root = dir.join("served");
    std::fs::create_dir_all(&root).unwrap();
    git(&["clone", "-q", "--bare", "work", "served/repo.git"], dir);
    git(&["update-server-info"], &root.join("repo.git"));
    (root, git(&["rev-parse", "main"], &work).trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn git_ls_remote_and_clone_through_https_proxy_print_the_403() {
    if missing(&["git"], "apt-get install git") || !in_loopback_only_namespace().await {
        return;
    }
    let s = setup(None).await;
    let dir = s.h.dir.path();
    let (root, head) = git_repository(dir);
    let (origin, ca) = https_file_origin("origin.test", dir, root).await;
    let port = origin.addr.port();
    let proxy = proxy_url(&s.server, &s.lease);
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("GIT_SSL_CAINFO", ca.to_str().unwrap()),
        ("GIT_TERMINAL_PROMPT", "0"),
        ("GIT_CONFIG_NOSYSTEM", "1"),
        ("HOME", dir.to_str().unwrap()),
    ];
    let url = format!("https://origin.test:{port}/repo.git");
    let out = client("git", &["ls-remote", &url], &env, dir).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout),
        format!("{head}\tHEAD\n{head}\trefs/heads/main\n")
    );
    let out = client("git", &["clone", "-q", &url, "cloned"], &env, dir).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(
        std::fs::read_to_string(dir.join("cloned/README")).unwrap(),
        "through the lease\n"
    );

    let denied = format!("https://denied.test:{port}/repo.git");
    let out = client("git", &["ls-remote", &denied], &env, dir).await;
    assert_eq!(out.status.code(), Some(128));
    assert_eq!(
        text(&out.stderr),
        format!("fatal: unable to access '{denied}/': CONNECT tunnel failed, response 403\n")
    );
}

/// `ProxyGet.java` compiled into a temp dir; returns that dir (the class path).
async fn java_client(dir: &Path) -> PathBuf {
    let classes = dir.join("classes");
    let source = crate::support::data("clients/ProxyGet.java");
    build(
        "javac",
        &["-d", classes.to_str().unwrap(), source.to_str().unwrap()],
        &[],
        dir,
        "Debian's default-jdk-headless; .ci/run installs it",
    )
    .await;
    classes
}

/// Runs a compiler as [`client`] runs a client, asserting that it succeeded; `install` says
/// where it comes from.
async fn build(program: &str, args: &[&str], env: &[(&str, &str)], cwd: &Path, install: &str) {
    let out = client(program, args, env, cwd).await;
    assert!(
        out.status.success(),
        "{program} ({install}): {}",
        text(&out.stderr)
    );
}

/// Whether the Java tests can run here and now (the JDK is there; in the loopback-only
/// namespace), as the clients tests start.
async fn java_runs_here() -> bool {
    !missing(
        &["javac", "java"],
        "apt-get install default-jdk-headless; .ci/run does",
    ) && in_loopback_only_namespace().await
}

/// Runs `ProxyGet` with the JVM's proxy set to `proxy_port` on loopback.
async fn java(
    classes: &Path,
    proxy_port: u16,
    properties: &[&str],
    args: &[&str],
    ca: &Path,
) -> (Option<i32>, String) {
    let mut all = vec![
        "-cp".to_owned(),
        classes.to_str().unwrap().to_owned(),
        "-Dhttps.proxyHost=127.0.0.1".to_owned(),
        format!("-Dhttps.proxyPort={proxy_port}"),
    ];
    all.extend(properties.iter().map(|p| p.to_string()));
    all.push("ProxyGet".into());
    all.push(args[0].into());
    all.push(args[1].into());
    all.push(ca.to_str().unwrap().into());
    all.extend(args[2..].iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    let out = client("java", &all, &[], classes).await;
    assert!(out.stderr.is_empty(), "{}", text(&out.stderr));
    (out.status.code(), text(&out.stdout))
}

const ENABLE_BASIC_FOR_TUNNELS: &str = "-Djdk.http.auth.tunneling.disabledSchemes=";

/// The JDK disables Basic for HTTPS tunnels: with the default, an `Authenticator` is never
/// asked and both clients return the 407 as the answer; with `-Djdk.http.auth.tunneling.disabledSchemes=` both get through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_with_basic_credentials_needs_basic_enabled_for_tunnels() {
    if !java_runs_here().await {
        return;
    }
    let s = setup(None).await;
    let dir = s.h.dir.path();
    let classes = java_client(dir).await;
    let (origin, ca) = https_origin("origin.test", dir).await;
    let port = origin.addr.port();
    let proxy_port = s.server.addr.port();
    let allowed = format!("https://origin.test:{port}/");
    let denied = format!("https://denied.test:{port}/");
    let lease = s.lease.as_str();

    for mode in ["httpclient", "urlconnection"] {
        assert_eq!(
            java(
                &classes,
                proxy_port,
                &[],
                &[mode, &allowed, "agent", lease],
                &ca
            )
            .await,
            (Some(1), "status 407\n".to_owned()),
            "{mode} returns the 407 without asking its Authenticator"
        );
    }

    for mode in ["httpclient", "urlconnection"] {
        let enabled = [ENABLE_BASIC_FOR_TUNNELS];
        assert_eq!(
            java(
                &classes,
                proxy_port,
                &enabled,
                &[mode, &allowed, "agent", lease],
                &ca
            )
            .await,
            (Some(0), "status 200\nhello from origin\n".to_owned()),
            "{mode}"
        );
        let (code, printed) = java(
            &classes,
            proxy_port,
            &enabled,
            &[mode, &denied, "agent", lease],
            &ca,
        )
        .await;
        assert_eq!(code, Some(1), "{mode}");
        assert_refusal_printed(mode, &printed);
    }
}

/// What each Java client prints for a refused CONNECT.
fn assert_refusal_printed(mode: &str, printed: &str) {
    match mode {
        "httpclient" => assert_eq!(printed, "java.io.IOException: Tunnel failed, got: 403\n"),
        _ => assert_printed_with_reason(printed, |reason| {
            format!(
                "java.io.IOException: Unable to tunnel through proxy. Proxy returns \
                 \"HTTP/1.1 403 {reason}\"\n"
            )
        }),
    }
}

/// The reason phrases of a 403 refusal: today's `Forbidden`, and the refusal code that is
/// to replace it.
const REASONS: [&str; 2] = ["Forbidden", "host-denied"];

/// Asserts that `printed` is `expected(reason)` for one of the refusal's reason phrases.
fn assert_printed_with_reason(printed: &str, expected: impl Fn(&str) -> String) {
    assert!(
        REASONS.iter().any(|reason| printed == expected(reason)),
        "printed {printed:?}, expected {:?}",
        expected(REASONS[0])
    );
}

/// A lease's own port needs no credentials, so the JDK's Basic restriction never applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn java_through_a_per_lease_port_needs_no_credentials() {
    if !java_runs_here().await {
        return;
    }
    let s = setup(Some(port_range(4))).await;
    let dir = s.h.dir.path();
    let classes = java_client(dir).await;
    let (origin, ca) = https_origin("origin.test", dir).await;
    let port = origin.addr.port();
    let lease_port = crate::support::harness::eventually(Duration::from_secs(5), || async {
        let (_, view) =
            crate::support::harness::admin_get(&s.server, &format!("/leases/{}", s.lease)).await;
        view["port"].as_u64().map(|p| p as u16)
    })
    .await
    .expect("the lease gets a port");
    let allowed = format!("https://origin.test:{port}/");
    let denied = format!("https://denied.test:{port}/");
    for mode in ["httpclient", "urlconnection"] {
        assert_eq!(
            java(&classes, lease_port, &[], &[mode, &allowed], &ca).await,
            (Some(0), "status 200\nhello from origin\n".to_owned()),
            "{mode}"
        );
        let (code, printed) = java(&classes, lease_port, &[], &[mode, &denied], &ca).await;
        assert_eq!(code, Some(1), "{mode}");
        assert_refusal_printed(mode, &printed);
    }
}
