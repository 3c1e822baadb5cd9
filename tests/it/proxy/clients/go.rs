//! Go's `net/http` (standard library only, `http.ProxyFromEnvironment`) through
//! `HTTPS_PROXY`: `tests/data/clients/proxy_get.go`, built by the test with Debian's
//! golang-go and no network. Go never proxies `localhost` or loopback targets, so the URLs name
//! `origin.test` and `denied.test`, which only the proxy resolves.

use super::{assert_printed_with_reason, build, client, https_setup, text, HttpsSetup};
use crate::support::missing;
use crate::support::netns::in_loopback_only_namespace;
use std::path::{Path, PathBuf};

/// `source` (under `tests/data/clients/`) built into `dir` as `name` with a build cache and
/// module path of its own under `dir` and no module proxy; returns the program.
pub(super) async fn go_client(dir: &Path, source: &str, name: &str) -> PathBuf {
    let program = dir.join(name);
    let source = crate::support::data(&format!("clients/{source}"));
    let (cache, path) = (dir.join("go-cache"), dir.join("go-path"));
    let env = [
        ("GOCACHE", cache.to_str().unwrap()),
        ("GOPATH", path.to_str().unwrap()),
        ("GOPROXY", "off"),
        ("GOTOOLCHAIN", "local"),
        ("HOME", dir.to_str().unwrap()),
    ];
    build(
        "go",
        &[
            "build",
            "-o",
            program.to_str().unwrap(),
            source.to_str().unwrap(),
        ],
        &env,
        dir,
        "Debian's golang-go; .ci/run installs it",
    )
    .await;
    program
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_net_http_through_https_proxy_prints_the_refusal_code() {
    if missing(&["go"], "apt-get install golang-go; .ci/run does")
        || !in_loopback_only_namespace().await
    {
        return;
    }
    let HttpsSetup { s, port, ca, proxy } = https_setup().await;
    let dir = s.h.dir.path();
    let program = go_client(dir, "proxy_get.go", "proxy_get").await;
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("SSL_CERT_FILE", ca.to_str().unwrap()),
    ];
    let get = |url: String| {
        let program = program.clone();
        async move { client(program.to_str().unwrap(), &[&url], &env, dir).await }
    };

    let out = get(format!("https://origin.test:{port}/")).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "status 200\nhello from origin\n");

    let denied = format!("https://denied.test:{port}/");
    let out = get(denied.clone()).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert_printed_with_reason(&text(&out.stdout), |reason| {
        format!("Get \"{denied}\": {reason}\n")
    });
}
