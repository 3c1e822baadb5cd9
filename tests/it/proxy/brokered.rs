//! Brokered credentials end to end with curl (HTTP/1.1 and HTTP/2): tunnels to a secret's host
//! are terminated under the interception CA, the origin gets the value and the agent never
//! does, misuse refuses and revokes, the route rules hold, the origin's TLS is verified, and no
//! output holds a value.

use crate::support::harness::*;
use leasegate::config::ServeConfig;
use leasegate::intercept::{ca, Broker};
use leasegate::secrets::{placeholder, Secrets};
use leasegate::server::Server;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub const VALUE: &str = "ghp_brokeredvalue0123456789abcdef";
pub const CANARY: &str = "AKIA-canary-never-anywhere-42";
pub const HOST: &str = "api.origin.test";

/// A proxy with a broker for `HOST` (one header secret with routes, for agent "tester"), its
/// origin over TLS, and the CA file an agent trusts.
pub struct Brokered {
    pub h: Harness,
    pub server: Server,
    /// What the proxy holds, for [`Brokered::another`].
    pub broker: Arc<Broker>,
    pub origin: Origin,
    /// The interception CA, as the agent's clients trust it.
    pub ca_pem: PathBuf,
    /// Another origin, not terminated (no secret is for it): plain HTTP.
    pub plain: Origin,
    /// A lease of agent "tester", entitled to the secret, issued before the start.
    pub lease: String,
    /// Another lease of the same agent.
    pub second: String,
    /// A lease of an agent the secret does not list.
    pub stranger: String,
}

fn secrets_toml(value_env: &str) -> String {
    format!(
        r#"canaries = ["{CANARY}"]

[[secret]]
id = "github"
hosts = ["{HOST}"]
header = "Authorization"
format = "Bearer {{value}}"
env = "{value_env}"
routes = [
  {{ method = "GET", path = "/request" }}, {{ method = "POST", path = "/upload" }},
  {{ method = "GET", path = "/ws" }}, {{ method = "GET", path = "/big/*" }},
  {{ method = "GET", path = "/echo-redirect" }},
  {{ method = "GET", path = "/slow" }}, {{ method = "GET", path = "/repo.git/**" }},
]
agents = ["tester"]
env_name = "GITHUB_TOKEN"
"#
    )
}

/// A CA for `HOST` in `dir/ca`.
fn make_ca(dir: &Path) -> PathBuf {
    let ca_dir = dir.join("ca");
    let made = ca::make(&[HOST.to_owned()], Duration::from_secs(3600)).unwrap();
    ca::write(&made, &ca_dir, false).unwrap();
    ca_dir
}

impl Brokered {
    pub async fn start() -> Brokered {
        Brokered::start_trusting(None).await
    }

    /// `upstream_ca`: what the proxy trusts for the origin (default: the origin's own cert).
    pub async fn start_trusting(upstream_ca: Option<PathBuf>) -> Brokered {
        Brokered::start_with(upstream_ca, |_| {}).await
    }

    /// [`Brokered::start_trusting`], with `adjust` applied to the serve configuration before
    /// the start (a journal on NATS, say).
    pub async fn start_with(
        upstream_ca: Option<PathBuf>,
        adjust: impl FnOnce(&mut ServeConfig),
    ) -> Brokered {
        let h = Harness::new();
        let origin = https_origin(HOST, h.dir.path()).await;
        Brokered::build(h, origin, upstream_ca, adjust).await
    }

    /// [`Brokered::start`] with a port of its own for each lease, taken from `ports`.
    pub async fn start_with_ports(ports: std::ops::RangeInclusive<u16>) -> Brokered {
        let h = Harness::new();
        let origin = https_origin(HOST, h.dir.path()).await;
        let bind = "127.0.0.1".parse().unwrap();
        Brokered::build(h, origin, None, move |serve| {
            serve.lease_ports = Some((ports, bind))
        })
        .await
    }

    /// [`Brokered::start`] whose origin serves the files under `root` (a git repository over
    /// dumb HTTP, for routes `GET /repo.git/**`) only to requests carrying the secret's value.
    pub async fn start_serving(root: PathBuf) -> Brokered {
        let h = Harness::new();
        let bearer = Some(format!("Bearer {VALUE}"));
        let origin = https_file_origin_for(HOST, h.dir.path(), root, bearer).await;
        Brokered::build(h, origin, None, |_| {}).await
    }

    async fn build(
        h: Harness,
        (origin, origin_ca): (Origin, PathBuf),
        upstream_ca: Option<PathBuf>,
        adjust: impl FnOnce(&mut ServeConfig),
    ) -> Brokered {
        let plain = http_origin().await;
        let ca_dir = make_ca(h.dir.path());
        let secrets_path = h.dir.path().join("secrets.toml");
        std::fs::write(&secrets_path, secrets_toml("LG_BROKERED_VALUE")).unwrap();
        let secrets = Secrets::load_with(&secrets_path, &|name| {
            (name == "LG_BROKERED_VALUE").then(|| VALUE.to_owned())
        })
        .unwrap();
        let upstream_ca = upstream_ca.unwrap_or(origin_ca);
        let broker = Broker::new(Arc::new(secrets), &ca_dir, Some(&upstream_ca)).unwrap();
        let allow = [HOST, "plain.origin.test"];
        let (lease, second) = (h.lease(&allow, &[]), h.lease(&allow, &[]));
        let stranger = issue_for_agent(&h, "someone-else", &allow);
        let broker = Arc::new(broker);
        let server = serve(&h, &broker, adjust).await;
        Brokered {
            broker,
            ca_pem: ca_dir.join("ca.pem"),
            h,
            server,
            origin,
            plain,
            lease,
            second,
            stranger,
        }
    }

    /// Another proxy with the same broker, keys and origins (a replica, once `adjust` puts
    /// its journal where the first one's is).
    pub async fn another(&self, adjust: impl FnOnce(&mut ServeConfig)) -> Server {
        serve(&self.h, &self.broker, adjust).await
    }

    /// A CONNECT to the origin through `proxy` under `lease`: the answer, lower-cased.
    pub async fn connect_answer(&self, proxy: std::net::SocketAddr, lease: &str) -> String {
        let connect = format!(
            "CONNECT {HOST}:{port} HTTP/1.1\r\nHost: {HOST}:{port}\r\nX-Lease-Id: {lease}\r\n\r\n",
            port = self.origin.addr.port()
        );
        raw(proxy, connect.as_bytes()).await.to_ascii_lowercase()
    }

    pub fn url(&self, path: &str) -> String {
        format!("https://{HOST}:{}{path}", self.origin.addr.port())
    }

    pub fn placeholder(&self, lease: &str) -> String {
        placeholder::derive(&self.h.key, lease, "github")
    }

    /// curl through the proxy under `lease`, trusting the interception CA.
    pub async fn curl(&self, lease: &str, args: &[&str]) -> CurlOutput {
        let proxy = proxy_url(&self.server, lease);
        let ca = self.ca_pem.display().to_string();
        let mut all = vec!["-x", &proxy, "--cacert", &ca];
        all.extend_from_slice(args);
        curl(&all, &[]).await
    }

    /// The lease's status as the admin API tells it.
    pub async fn status(&self, lease: &str) -> String {
        let (_, view) = admin_get(&self.server, &format!("/leases/{lease}")).await;
        view["status"].as_str().unwrap_or("").to_owned()
    }
}

/// A proxy on `h`'s journal and keys holding `broker`, names resolved to loopback.
async fn serve(h: &Harness, broker: &Arc<Broker>, adjust: impl FnOnce(&mut ServeConfig)) -> Server {
    let config = h.config(&[(HOST, "127.0.0.1"), ("plain.origin.test", "127.0.0.1")]);
    let mut serve = h.serve_config(config, None);
    serve.broker = Some(broker.clone());
    adjust(&mut serve);
    Server::start(serve).await.unwrap()
}

/// What the `/request` route says the origin received of header `name` (its SHA-256).
pub fn received(body: &str, name: &str) -> Option<String> {
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}: ")).map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_origin_gets_the_value_the_agent_holds_only_the_placeholder() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let bearer = format!("Authorization: Bearer {}", b.placeholder(&lease));
    for version in ["--http1.1", "--http2"] {
        let out = b
            .curl(&lease, &[version, "-H", &bearer, &b.url("/request")])
            .await;
        assert_eq!(out.status, 200, "{version}: {}", out.stderr);
        let body = out.body_text();
        assert!(body.starts_with("GET /request\n"), "{version}: {body}");
        assert_eq!(
            received(&body, "authorization"),
            Some(sha_hex(format!("Bearer {VALUE}").as_bytes())),
            "{version}: the origin got the value in place of the placeholder"
        );
        assert_eq!(
            received(&body, "host"),
            Some(sha_hex(
                format!("{HOST}:{}", b.origin.addr.port()).as_bytes()
            )),
            "{version}"
        );
        assert!(!out.headers.contains(VALUE) && !body.contains(VALUE));
    }
    // Without the placeholder the secret is put in all the same.
    let out = b.curl(&lease, &[&b.url("/request")]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    assert_eq!(
        received(&out.body_text(), "authorization"),
        Some(sha_hex(format!("Bearer {VALUE}").as_bytes()))
    );
    // Each request inside the tunnel has its own line: kind https, path, the secret put in.
    let lines = b.h.egress_lines(6).await;
    let inside: Vec<_> = lines.iter().filter(|l| l["kind"] == "https").collect();
    assert_eq!(inside.len(), 3, "{lines:?}");
    for line in &inside {
        assert_eq!(line["path"], "/request");
        assert_eq!(line["secrets"], serde_json::json!(["github"]));
        assert_eq!(line["status"], 200);
        assert_eq!(line["verdict"], "allow");
        assert_eq!(line["lease_id"], lease.as_str());
    }
    let all = std::fs::read_to_string(&b.h.egress).unwrap();
    assert!(!all.contains(VALUE));
    assert_eq!(b.status(&lease).await, "open");
    // The admin API (and the dashboard's lease page) count the calls per route.
    let (_, view) = admin_get(&b.server, &format!("/leases/{lease}")).await;
    assert_eq!(
        view["top_routes"],
        serde_json::json!([{"route": format!("GET {HOST}/request"), "requests": 3,
            "bytes_up": view["top_routes"][0]["bytes_up"], "bytes_down": view["top_routes"][0]["bytes_down"]}]),
        "{view}"
    );
    assert!(view["top_routes"][0]["bytes_down"].as_u64().unwrap() > 0);
    // `usage` over the egress log: the same route, three calls.
    let usage =
        crate::support::leasegate_command(&["usage", "--from", b.h.egress.to_str().unwrap()])
            .output()
            .unwrap();
    let table = String::from_utf8_lossy(&usage.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>()
                == [lease.as_str(), "GET", &format!("{HOST}/request"), "3"]),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_agent_is_not_listed_gets_nothing_put_in() {
    let b = Brokered::start().await;
    let other = b.stranger.clone();
    let out = b.curl(&other, &[&b.url("/request?page=2")]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    let body = out.body_text();
    assert_eq!(received(&body, "authorization"), None, "{body}");
    assert!(body.contains(&format!("?page={}", sha_hex(b"2"))), "{body}");
    let line = b.h.egress_line(1).await;
    let lines = b.h.egress_lines(2).await;
    let inside = lines.iter().find(|l| l["kind"] == "https").unwrap();
    assert_eq!(inside["path"], "/request?page=[redacted]", "{line}");
    assert!(inside.get("secrets").is_none(), "{inside}");
}

/// A lease for an agent of another name (the harness names its agent "tester").
fn issue_for_agent(h: &Harness, agent: &str, allow: &[&str]) -> String {
    use leasegate::commands::issue::{issue, IssueRequest};
    issue(
        &h.journal,
        &h.key,
        &IssueRequest {
            manifest: serde_json::json!({}),
            allow_hosts: allow.iter().map(|s| s.to_string()).collect(),
            deny_hosts: vec![],
            parent: None,
            ttl: Duration::from_secs(3600),
            name: agent.into(),
            purpose: "integration test".into(),
            now: leasegate::contract::Timestamp::now(),
        },
    )
    .unwrap()
    .lease_id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_outside_the_routes_is_refused_and_the_lease_stays() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let out = b.curl(&lease, &["-X", "DELETE", &b.url("/request")]).await;
    assert_eq!(out.status, 403, "{}", out.stderr);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("route-not-allowed")
    );
    assert!(
        out.body_text()
            .contains("DELETE /request is outside the routes of secret github"),
        "{}",
        out.body_text()
    );
    assert_eq!(b.status(&lease).await, "open");
    let out = b.curl(&lease, &[&b.url("/request")]).await;
    assert_eq!(out.status, 200);
}

/// What a revoking misuse refusal leaves: 403 with its code, the lease revoked (its next
/// request refused), a revocation in the journal naming the code, and no value anywhere.
pub async fn refused_and_revoked(b: &Brokered, lease: &str, out: CurlOutput, code: &str) {
    assert_eq!(out.status, 403, "{code}: {}", out.stderr);
    assert_eq!(out.header("x-leasegate-refusal").as_deref(), Some(code));
    assert_eq!(b.status(lease).await, "revoked", "{code}");
    let revocations = b.h.revocations().await;
    assert_eq!(revocations.len(), 1, "{revocations:?}");
    assert!(
        revocations[0]["reason"].as_str().unwrap().contains(code),
        "{revocations:?}"
    );
    let next = b.curl(lease, &[&b.url("/request")]).await;
    assert_ne!(next.status, 200, "the lease still opens after {code}");
    for file in [&b.h.egress, &b.h.journal] {
        let text = std::fs::read_to_string(file).unwrap();
        assert!(
            !text.contains(VALUE) && !text.contains(CANARY),
            "{code}: {file:?}"
        );
    }
    for (path, text) in admin_answers(b, &[lease]).await {
        assert!(
            !text.contains(VALUE) && !text.contains(CANARY),
            "{code}: {path}"
        );
    }
}

/// Every admin answer the dashboard draws from, and the metrics, with `leases`' views and
/// recent requests: (path, text), each answered 200.
pub async fn admin_answers(b: &Brokered, leases: &[&str]) -> Vec<(String, String)> {
    let mut paths = Vec::new();
    for lease in leases {
        paths.push(format!("/leases/{lease}"));
        paths.push(format!("/leases/{lease}/requests"));
    }
    paths.extend(["/leases", "/refusals", "/metrics", "/status", "/"].map(str::to_owned));
    let mut answers = Vec::with_capacity(paths.len());
    for path in paths {
        let (status, text) = admin_text(&b.server, &path).await;
        assert_eq!(status, 200, "{path}");
        answers.push((path, text));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placeholder_on_a_route_its_secret_is_not_for_revokes() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let query = format!("/headers?token={}", b.placeholder(&lease));
    let out = b.curl(&lease, &[&b.url(&query)]).await;
    refused_and_revoked(&b, &lease, out, "secret-misdirected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placeholder_sent_to_another_host_revokes() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let url = format!("http://plain.origin.test:{}/headers", b.plain.addr.port());
    let header = format!("X-Token: {}", b.placeholder(&lease));
    let out = b.curl(&lease, &["-H", &header, &url]).await;
    refused_and_revoked(&b, &lease, out, "secret-misdirected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_leases_placeholder_is_worthless_and_not_misuse_of_this_one() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let other = b.second.clone();
    let bearer = format!("Authorization: Bearer {}", b.placeholder(&other));
    // Replaced by the value like anything in the header: the other lease's stand-in gives
    // nothing more than none.
    let out = b.curl(&lease, &["-H", &bearer, &b.url("/request")]).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    assert_eq!(b.status(&lease).await, "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_value_in_a_request_revokes() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    // In the body of an allowed route, past the head.
    let out = b
        .curl(
            &lease,
            &["--data-binary", &format!("x={VALUE}"), &b.url("/upload")],
        )
        .await;
    refused_and_revoked(&b, &lease, out, "secret-exposed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_anywhere_revokes() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let url = format!("http://plain.origin.test:{}/headers", b.plain.addr.port());
    let header = format!("X-Api-Key: {CANARY}");
    let out = b.curl(&lease, &["-H", &header, &url]).await;
    refused_and_revoked(&b, &lease, out, "canary-tripped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_origin_whose_tls_does_not_verify_is_a_502_never_a_blind_tunnel() {
    // The proxy trusts another certificate than the origin's.
    let dir = tempfile::tempdir().unwrap();
    let (_, unrelated_ca) = https_origin(HOST, dir.path()).await;
    let b = Brokered::start_trusting(Some(unrelated_ca)).await;
    let lease = b.lease.clone();
    let answer = b.connect_answer(b.server.addr, &lease).await;
    assert_eq!(status_of(&answer), 502, "{answer}");
    assert!(
        answer.contains("x-leasegate-refusal: upstream-tls-failed"),
        "{answer}"
    );
    let line = b.h.egress_line(1).await;
    assert_eq!(line["code"], "upstream-tls-failed");
    assert_eq!(b.status(&lease).await, "open", "not a revoking code");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_trust_the_ca_fails_closed() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    // curl with only the system's roots: the minted leaf does not verify.
    let proxy = proxy_url(&b.server, &lease);
    let out = curl(&["-x", &proxy, &b.url("/request")], &[]).await;
    assert_eq!(out.exit, 60, "{}", out.stderr);
    assert_eq!(
        b.origin
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the proxy's own connection, made before the 200; no request reached the origin"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_inside_naming_another_host_is_a_host_mismatch() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    // The tunnel is to HOST; the request inside names plain.origin.test.
    let out = b
        .curl(
            &lease,
            &[
                "--http1.1",
                "-H",
                "Host: plain.origin.test",
                &b.url("/request"),
            ],
        )
        .await;
    assert_eq!(out.status, 421, "{}", out.stderr);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("host-mismatch")
    );
    let lines = b.h.egress_lines(2).await;
    let inside = lines.iter().find(|l| l["kind"] == "https").unwrap();
    assert_eq!(inside["code"], "host-mismatch", "{lines:?}");
    assert_eq!(
        b.origin
            .connections
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the connection made before the 200: nothing of the request reached the origin"
    );
}
