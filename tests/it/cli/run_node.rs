//! `leasegate run` and Node: Node's own `fetch` and its `http`/`https` modules reach the
//! network through the proxy on Node 20, 22 and 24 (`run`'s preload in `NODE_OPTIONS`), for
//! `https://` and for `http://` URLs with the proxy's default ports (443 tunnelled, 80
//! forwarded: the preload tunnels `http://` too, read by the proxy as the forwarded requests
//! they stand for), and a refusal's code reaches the program. Each runs in a network namespace
//! with only loopback, so a Node that went around the proxy would fail.

use crate::cli::run_trust::run;
use crate::proxy::clients::node::node_runtimes;
use crate::support::harness::{http_origin, https_origin, Harness};
use crate::support::netns::in_loopback_only_namespace;
use leasegate::policy::Ports;
use leasegate::proxy::OnRefusal;

/// A proxy whose ports are as the defaults make them (443 tunnelled, 80 forwarded), on two
/// origins' own ports, so the `http://` calls of a client that tunnels them are CONNECTs to a
/// port open to forwarded requests only; a lease for `origin.test` denying `denied.test`; and
/// the four URLs every runtime under `run` is asked for: allowed `https://` and `http://`,
/// then refused `https://` and `http://`.
pub(crate) struct RunSetup {
    pub h: Harness,
    pub _server: leasegate::server::Server,
    pub lease: String,
    /// The admin API's URL, for `run --admin`.
    pub admin: String,
    /// The HTTPS origin's CA file.
    pub ca: String,
    pub urls: [String; 4],
}

impl RunSetup {
    pub async fn start() -> RunSetup {
        let h = Harness::new();
        let lease = h.lease(&["origin.test"], &["denied.test"]);
        let (tls, ca) = https_origin("origin.test", h.dir.path()).await;
        let plain = http_origin().await;
        let (tls_port, plain_port) = (tls.addr.port(), plain.addr.port());
        let resolve = [("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")];
        let mut config = h.config(&resolve);
        config.on_refusal = OnRefusal::Log;
        config.connect_ports = Ports::only(tls_port);
        config.forward_ports = Ports::only(plain_port);
        let server = h.start(config).await;
        RunSetup {
            admin: format!("http://{}", server.admin_addr.unwrap()),
            _server: server,
            h,
            lease,
            ca: ca.to_str().unwrap().to_owned(),
            urls: [
                format!("https://origin.test:{tls_port}/"),
                format!("http://origin.test:{plain_port}/"),
                format!("https://denied.test:{tls_port}/"),
                format!("http://denied.test:{plain_port}/"),
            ],
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_fetch_and_http_reach_the_proxy_under_run_on_every_node() {
    let Some(nodes) = node_runtimes() else {
        return;
    };
    if !in_loopback_only_namespace().await {
        return;
    }
    let RunSetup {
        h,
        _server,
        lease,
        admin,
        ca,
        urls,
    } = RunSetup::start().await;
    let script = crate::support::data("clients/node/get_all.cjs");
    for (version, node) in &nodes {
        let mut args = vec!["run", "--lease", &lease, "--admin", &admin, "--"];
        args.extend([node.to_str().unwrap(), script.to_str().unwrap()]);
        args.extend(urls.iter().map(String::as_str));
        let env = [("NODE_EXTRA_CA_CERTS", ca.as_str())];
        let (code, stdout, stderr) = run(&args, &env).await;
        assert_eq!(code, Some(0), "Node {version}: {stdout}\n{stderr}");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 8, "Node {version}: {stdout}\n{stderr}");
        for (call, line) in ["fetch", "get"].iter().cycle().zip(&lines) {
            assert!(
                line.starts_with(&format!("{call} ")),
                "Node {version}: {line}"
            );
        }
        for line in &lines[..4] {
            assert!(
                line.ends_with(" status 200 hello from origin"),
                "Node {version}: {stdout}\n{stderr}"
            );
        }
        // The proxy's own words, and the refusal code on the error.
        for line in &lines[4..] {
            assert!(
                line.contains(" error leasegate refused CONNECT denied.test:")
                    && line.contains(&format!(" for lease {lease}: host-denied "))
                    && line.ends_with(" (403) [ERR_LEASEGATE_REFUSED] refusal=host-denied"),
                "Node {version}: {stdout}\n{stderr}"
            );
        }
        assert!(
            !stderr.contains("experimental"),
            "Node {version} warned: {stderr}"
        );
    }
    // Each allowed call is on the egress log under the lease: the `http://` ones as forwarded
    // requests (`http`) inside their CONNECT.
    let lines = h.egress_lines(nodes.len() * 10).await;
    let kinds = |host: &str, kind: &str| {
        lines
            .iter()
            .filter(|l| l["host"] == host && l["kind"] == kind && l["lease_id"] == lease.as_str())
            .count()
    };
    let n = nodes.len();
    assert_eq!(kinds("origin.test", "http"), 2 * n, "{lines:#?}");
    assert_eq!(kinds("origin.test", "connect"), 4 * n, "{lines:#?}");
    assert_eq!(kinds("denied.test", "connect"), 4 * n, "{lines:#?}");
}
