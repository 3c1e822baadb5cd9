//! The proxy test harness: origins (HTTP, HTTPS, WebSocket) on loopback, a proxy on port 0
//! with a temp journal and egress log, and clients (curl, raw sockets).

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use leasegate::commands::issue::{self, IssueRequest};
use leasegate::config::ServeConfig;
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::intercept::{ca, Broker};
use leasegate::policy::Ports;
use leasegate::proxy::upstream::Resolver;
use leasegate::proxy::{BoxError, ProxyConfig};
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::secrets::Secrets;
use leasegate::server::Server;
use leasegate::telemetry::egress::Destination;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub type OriginBody = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// Byte `i` of every generated body.
pub fn pattern_byte(i: u64) -> u8 {
    (i % 251) as u8
}

pub fn sha_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn text(body: impl Into<Bytes>) -> Response<OriginBody> {
    Response::new(Full::new(body.into()).map_err(|e| match e {}).boxed())
}

async fn origin_service(req: Request<Incoming>) -> Result<Response<OriginBody>, Infallible> {
    let path = req.uri().path().to_owned();
    Ok(match path.as_str() {
        "/headers" => {
            let mut listing = String::new();
            for (name, value) in req.headers() {
                listing.push_str(&format!(
                    "{name}: {}\n",
                    String::from_utf8_lossy(value.as_bytes())
                ));
            }
            text(listing)
        }
        "/request" => {
            // What the origin received, each value as its SHA-256 (an origin that echoed a
            // credential back would hand it to the agent): the method and path, each query
            // pair, each header.
            let mut listing = format!("{} {}\n", req.method(), req.uri().path());
            for pair in req
                .uri()
                .query()
                .unwrap_or("")
                .split('&')
                .filter(|p| !p.is_empty())
            {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                listing.push_str(&format!("?{name}={}\n", sha_hex(value.as_bytes())));
            }
            for (name, value) in req.headers() {
                listing.push_str(&format!("{name}: {}\n", sha_hex(value.as_bytes())));
            }
            text(listing)
        }
        "/upload" => {
            let mut body = req.into_body();
            let mut hasher = Sha256::new();
            let mut len = 0u64;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.map(Frame::into_data) {
                    if let Ok(data) = data {
                        len += data.len() as u64;
                        hasher.update(&data);
                    }
                } else {
                    break;
                }
            }
            text(format!("{len} {}", hex::encode(hasher.finalize())))
        }
        "/ws" => websocket_echo(req),
        "/forged" => {
            // An origin dressing its answer as one of the proxy's refusals.
            let mut response = text("leasegate refused this (not really)\n");
            *response.status_mut() = StatusCode::FORBIDDEN;
            response
                .extensions_mut()
                .insert(hyper::ext::ReasonPhrase::try_from(&b"host-denied"[..]).unwrap());
            let headers = response.headers_mut();
            headers.insert("x-leasegate-refusal", "host-denied".parse().unwrap());
            headers.insert("X-Leasegate-Note", "forged".parse().unwrap());
            response
        }
        "/echo-redirect" => {
            // An origin that sends what it was given back: the `Authorization` it got, in a
            // header and in a redirect's target (raw and percent-encoded).
            let given = req
                .headers()
                .get("authorization")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                .unwrap_or_default();
            let encoded: String = url::form_urlencoded::byte_serialize(given.as_bytes()).collect();
            let mut response = text("moved\n");
            *response.status_mut() = StatusCode::FOUND;
            let headers = response.headers_mut();
            let location = format!("https://elsewhere.test/next?auth={encoded}");
            headers.insert("location", location.parse().unwrap());
            headers.insert("x-echo", given.parse().unwrap());
            response
        }
        p if p.starts_with("/delay/") => {
            let ms: u64 = p[7..].parse().unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            text("delayed\n")
        }
        p if p.starts_with("/big/") => {
            let total: u64 = p[5..].parse().unwrap_or(0);
            let stream = futures_util::stream::unfold(0u64, move |sent| async move {
                if sent >= total {
                    return None;
                }
                let n = (total - sent).min(64 * 1024);
                let chunk: Vec<u8> = (sent..sent + n).map(pattern_byte).collect();
                Some((Ok::<_, BoxError>(Frame::data(Bytes::from(chunk))), sent + n))
            });
            Response::new(StreamBody::new(stream).boxed())
        }
        "/slow" => {
            // A chunk every 50 ms until the client goes away.
            let stream = futures_util::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Some((
                    Ok::<_, BoxError>(Frame::data(Bytes::from_static(b"tick\n"))),
                    (),
                ))
            });
            Response::new(StreamBody::new(stream).boxed())
        }
        "/stall" => {
            // One chunk, then nothing more, ever: only the proxy can end this body.
            let stream = futures_util::StreamExt::chain(
                futures_util::stream::iter([Ok::<_, BoxError>(Frame::data(Bytes::from_static(
                    b"tick\n",
                )))]),
                futures_util::stream::pending(),
            );
            Response::new(StreamBody::new(stream).boxed())
        }
        _ => text("hello from origin\n"),
    })
}

fn websocket_echo(mut req: Request<Incoming>) -> Response<OriginBody> {
    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        let mut response = text("not a websocket request");
        *response.status_mut() = StatusCode::BAD_REQUEST;
        return response;
    };
    let upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        use futures_util::{SinkExt, StreamExt};
        let Ok(upgraded) = upgrade.await else { return };
        let mut ws = tokio_tungstenite::WebSocketStream::from_raw_socket(
            TokioIo::new(upgraded),
            tokio_tungstenite::tungstenite::protocol::Role::Server,
            None,
        )
        .await;
        while let Some(Ok(message)) = ws.next().await {
            if (message.is_text() || message.is_binary()) && ws.send(message).await.is_err() {
                break;
            }
        }
    });
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    // The names of the fields the upgrade request came with: what the proxy let through.
    let seen: Vec<&str> = req.headers().keys().map(|n| n.as_str()).collect();
    let seen = seen.join(",");
    let mut response = text(Bytes::new());
    response
        .headers_mut()
        .insert("x-seen-headers", seen.parse().unwrap());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    response
        .headers_mut()
        .insert("connection", "Upgrade".parse().unwrap());
    response
        .headers_mut()
        .insert("upgrade", "websocket".parse().unwrap());
    response
        .headers_mut()
        .insert("sec-websocket-accept", accept.parse().unwrap());
    response
}

/// An origin on loopback, counting the connections it accepted.
pub struct Origin {
    pub addr: SocketAddr,
    pub connections: Arc<AtomicUsize>,
}

/// Accepts connections on a loopback port, counting them, and serves each with `serve`.
async fn spawn_origin<F, Fut>(serve: F) -> Origin
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream));
        }
    });
    Origin { addr, connections }
}

/// A plain-HTTP origin (with WebSocket echo on /ws).
pub async fn http_origin() -> Origin {
    spawn_origin(|stream| async move {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(
                TokioIo::new(stream),
                hyper::service::service_fn(origin_service),
            )
            .with_upgrades()
            .await;
    })
    .await
}

/// A TLS acceptor for `names` with a self-signed certificate made now; the certificate is
/// written to `dir` (named after the first name) as the CA file clients trust.
fn tls_acceptor(names: &[&str], dir: &Path) -> (tokio_rustls::TlsAcceptor, PathBuf) {
    let cert =
        rcgen::generate_simple_self_signed(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap();
    let ca_path = dir.join(format!("{}.pem", names[0]));
    std::fs::write(&ca_path, cert.cert.pem()).unwrap();
    let certs = vec![cert.cert.der().clone()];
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .unwrap();
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), ca_path)
}

/// An HTTPS origin for `name` answering with `service`; returns it and the CA file.
async fn https_origin_with<S, Fut>(name: &str, dir: &Path, service: S) -> (Origin, PathBuf)
where
    S: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<OriginBody>, Infallible>> + Send + 'static,
{
    https_origin_named(&[name], dir, service).await
}

/// An HTTPS origin (HTTP/1.1) whose one certificate holds all of `names`, answering with
/// `service`; returns it and the CA file.
pub async fn https_origin_named<S, Fut>(names: &[&str], dir: &Path, service: S) -> (Origin, PathBuf)
where
    S: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<OriginBody>, Infallible>> + Send + 'static,
{
    let (acceptor, ca_path) = tls_acceptor(names, dir);
    let origin = spawn_origin(move |stream| {
        let acceptor = acceptor.clone();
        let service = service.clone();
        async move {
            let Ok(tls) = acceptor.accept(stream).await else {
                return;
            };
            // With upgrades: `/ws` over TLS (a WebSocket through a terminated tunnel).
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), hyper::service::service_fn(service))
                .with_upgrades()
                .await;
        }
    })
    .await;
    (origin, ca_path)
}

/// An HTTPS origin for `name`, with a certificate made now; returns it and the CA file.
pub async fn https_origin(name: &str, dir: &Path) -> (Origin, PathBuf) {
    https_origin_with(name, dir, origin_service).await
}

/// An HTTPS origin for `name` serving the files under `root` (GET only; 404 for anything
/// missing), e.g. a git repository over the dumb HTTP protocol.
pub async fn https_file_origin(name: &str, dir: &Path, root: PathBuf) -> (Origin, PathBuf) {
    https_file_origin_for(name, dir, root, None).await
}

/// [`https_file_origin`] that, given `authorization`, serves only requests whose
/// `Authorization` header is exactly that, and answers 401 to any other: what a client gets
/// tells whether the origin received the credential.
pub async fn https_file_origin_for(
    name: &str,
    dir: &Path,
    root: PathBuf,
    authorization: Option<String>,
) -> (Origin, PathBuf) {
    https_origin_with(name, dir, move |req: Request<Incoming>| {
        let root = root.clone();
        let authorization = authorization.clone();
        async move {
            let given = req.headers().get("authorization").map(|v| v.as_bytes());
            if authorization.is_some_and(|wanted| given != Some(wanted.as_bytes())) {
                let mut response = text("unauthorized\n");
                *response.status_mut() = StatusCode::UNAUTHORIZED;
                return Ok(response);
            }
            let path = req.uri().path().trim_start_matches('/').to_owned();
            let file = (!path.split('/').any(|part| part == ".."))
                .then(|| root.join(&path))
                .filter(|file| file.is_file());
            Ok(match file {
                Some(file) => text(tokio::fs::read(file).await.unwrap()),
                None => {
                    let mut response = text("not found\n");
                    *response.status_mut() = StatusCode::NOT_FOUND;
                    response
                }
            })
        }
    })
    .await
}

/// A temp journal, key and egress log, and the proxy built on them.
pub struct Harness {
    pub dir: tempfile::TempDir,
    pub key: Key,
    #[allow(dead_code)]
    pub key_path: PathBuf,
    pub journal: PathBuf,
    pub egress: PathBuf,
}

impl Harness {
    pub fn new() -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let key = Key::generate();
        let key_path = dir.path().join("lease.key");
        std::fs::write(&key_path, key.to_file_text()).unwrap();
        Harness {
            journal: dir.path().join("journal.jsonl"),
            egress: dir.path().join("egress.jsonl"),
            key_path,
            key,
            dir,
        }
    }

    /// Issues a lease valid from now for an hour.
    pub fn lease(&self, allow: &[&str], deny: &[&str]) -> String {
        self.lease_with(
            allow,
            deny,
            None,
            Timestamp::now(),
            Duration::from_secs(3600),
        )
    }

    pub fn lease_with(
        &self,
        allow: &[&str],
        deny: &[&str],
        parent: Option<&str>,
        now: Timestamp,
        ttl: Duration,
    ) -> String {
        self.issue(allow, deny, parent, now, ttl, "tester")
    }

    /// Issues a lease valid from now for an hour whose manifest's `agent.name` is `agent`
    /// (what a secret's `agents` name).
    pub fn lease_for_agent(&self, agent: &str, allow: &[&str]) -> String {
        self.issue(
            allow,
            &[],
            None,
            Timestamp::now(),
            Duration::from_secs(3600),
            agent,
        )
    }

    /// Issues a lease valid from now for an hour, allowing `allow`, from the declared
    /// `manifest` (tools, approvals, budget…), under `parent` if given.
    pub fn lease_from(&self, allow: &[&str], manifest: Value, parent: Option<&str>) -> String {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        issue::issue(
            &self.journal,
            &self.key,
            &IssueRequest {
                manifest,
                allow_hosts: strings(allow),
                deny_hosts: Vec::new(),
                parent: parent.map(str::to_owned),
                ttl: Duration::from_secs(3600),
                name: "tester".into(),
                purpose: "integration test".into(),
                now: Timestamp::now(),
            },
        )
        .unwrap()
        .lease_id
    }

    fn issue(
        &self,
        allow: &[&str],
        deny: &[&str],
        parent: Option<&str>,
        now: Timestamp,
        ttl: Duration,
        agent: &str,
    ) -> String {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        issue::issue(
            &self.journal,
            &self.key,
            &IssueRequest {
                manifest: serde_json::json!({}),
                allow_hosts: strings(allow),
                deny_hosts: strings(deny),
                parent: parent.map(str::to_owned),
                ttl,
                name: agent.into(),
                purpose: "integration test".into(),
                now,
            },
        )
        .unwrap()
        .lease_id
    }

    /// A credential broker for [`ServeConfig::broker`]: an interception CA for `hosts`
    /// written into this harness's directory (`ca/`, replaced on a second call), the secrets
    /// of `toml` (written to `secrets.toml`) with the values `env` gives, and origins verified
    /// against `upstream_ca` (PEM) or, without it, the system's roots.
    pub fn broker(
        &self,
        hosts: &[&str],
        toml: &str,
        env: &[(&str, &str)],
        upstream_ca: Option<&Path>,
    ) -> Arc<Broker> {
        let patterns: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        let made = ca::make(&patterns, Duration::from_secs(3600)).unwrap();
        let ca_dir = self.dir.path().join("ca");
        ca::write(&made, &ca_dir, true).unwrap();
        let path = self.dir.path().join("secrets.toml");
        std::fs::write(&path, toml).unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let secrets = Secrets::load_with(&path, &lookup).unwrap();
        Arc::new(Broker::new(Arc::new(secrets), &ca_dir, upstream_ca).unwrap())
    }

    /// Grants lease [`super::id`]`(n)`, signed by this harness's key, valid from `issued` for
    /// an hour, allowing `allow`, with the manifest budget `budget`: appended to the journal.
    pub async fn grant_budgeted(
        &self,
        n: u32,
        parent: Option<&str>,
        issued: Timestamp,
        allow: &[&str],
        budget: Value,
    ) -> String {
        let until = issued.saturating_add_millis(3_600_000);
        let window = (issued.to_string(), until.to_string());
        let id = super::id(n);
        let mut signed = super::lease(&self.key, &id, parent, (&window.0, &window.1), allow, &[]);
        signed["manifest"]["budget"] = budget;
        leasegate::contract::lease::sign(&mut signed, &self.key).unwrap();
        self.append(&super::granted_line(&signed, &window.0)).await;
        id
    }

    /// Grants lease [`super::id`]`(n)` as [`Harness::grant_budgeted`] does, its signed lease
    /// changed by `edit` first (no issuer's rules applied: a chain exactly as written).
    pub async fn grant_edited(
        &self,
        n: u32,
        parent: Option<&str>,
        allow: &[&str],
        edit: impl FnOnce(&mut Value),
    ) -> String {
        let issued = Timestamp::now();
        let until = issued.saturating_add_millis(3_600_000);
        let window = (issued.to_string(), until.to_string());
        let id = super::id(n);
        let mut signed = super::lease(&self.key, &id, parent, (&window.0, &window.1), allow, &[]);
        edit(&mut signed);
        leasegate::contract::lease::sign(&mut signed, &self.key).unwrap();
        self.append(&super::granted_line(&signed, &window.0)).await;
        id
    }

    /// Appends a raw journal line (off the runtime's threads).
    pub async fn append(&self, line: &str) {
        use tokio::io::AsyncWriteExt;
        let mut file = tokio::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.journal)
            .await
            .unwrap();
        file.write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        // tokio's File writes in the background: without this the line may land after a
        // write the caller makes next (the journal's order is what the tests are about).
        file.flush().await.unwrap();
    }

    /// The proxy config every test starts from: loopback origins reachable via 127.0.0.1
    /// only, names resolved from `resolve`, never by the system, every port open (origins
    /// listen on random ports; tests of the port lists narrow them).
    pub fn config(&self, resolve: &[(&str, &str)]) -> ProxyConfig {
        let mut resolver = Resolver::default();
        for (name, ip) in resolve {
            resolver
                .overrides
                .entry(name.to_string())
                .or_default()
                .push(ip.parse().unwrap());
        }
        ProxyConfig {
            resolver,
            guard: leasegate::policy::Guard {
                allow_private: vec!["127.0.0.1/32".parse().unwrap()],
                ..Default::default()
            },
            connect_ports: Ports::all(),
            forward_ports: Ports::all(),
            ..ProxyConfig::default()
        }
    }

    pub async fn start(&self, config: ProxyConfig) -> Server {
        self.start_with_ports(config, None).await
    }

    /// Starts the proxy (admin API on port 0), with per-lease ports if given.
    pub async fn start_with_ports(
        &self,
        config: ProxyConfig,
        ports: Option<std::ops::RangeInclusive<u16>>,
    ) -> Server {
        Server::start(self.serve_config(config, ports))
            .await
            .unwrap()
    }

    /// The full serve configuration the harness uses (admin API on port 0).
    pub fn serve_config(
        &self,
        config: ProxyConfig,
        ports: Option<std::ops::RangeInclusive<u16>>,
    ) -> ServeConfig {
        let mut keyring = Keyring::new(false);
        keyring.insert(self.key.clone());
        ServeConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            journal: JournalLocation::File(self.journal.clone()),
            // Local state (lease port assignments) in this harness's directory, never in the
            // working directory shared by every test.
            store: StoreOptions {
                data_dir: self.dir.path().join("data"),
                ..StoreOptions::default()
            },
            keyring,
            egress: Some(Destination::File(self.egress.clone())),
            egress_stream: None,
            proxy: config,
            admin: Some("127.0.0.1:0".parse().unwrap()),
            admin_hosts: Vec::new(),
            lease_ports: ports.map(|range| (range, "127.0.0.1".parse().unwrap())),
            tls: None,
            admin_token: None,
            admin_insecure: false,
            drain_timeout: Duration::from_secs(30),
            wall: Default::default(),
            broker: None,
            issuing: Default::default(),
            approvals: Default::default(),
        }
    }

    /// Waits (up to 10 s) until the egress log has at least `n` lines, and returns them.
    pub async fn egress_lines(&self, n: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let text = tokio::fs::read_to_string(&self.egress)
                .await
                .unwrap_or_default();
            let lines: Vec<Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if lines.len() >= n || Instant::now() > deadline {
                assert!(
                    lines.len() >= n,
                    "expected {n} egress lines, have {}: {text}",
                    lines.len()
                );
                return lines;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The last egress line, once there are `n`.
    pub async fn egress_line(&self, n: usize) -> Value {
        self.egress_lines(n).await.pop().unwrap()
    }

    /// Every journal record.
    pub async fn journal_records(&self) -> Vec<Value> {
        tokio::fs::read_to_string(&self.journal)
            .await
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// The `revoked` records in the journal.
    pub async fn revocations(&self) -> Vec<Value> {
        self.journal_records()
            .await
            .into_iter()
            .filter(|r| r["event"] == "revoked")
            .collect()
    }
}

/// What curl saw.
#[derive(Debug)]
pub struct CurlOutput {
    pub status: u16,
    pub headers: String,
    pub body: Vec<u8>,
    pub stderr: String,
    pub exit: i32,
}

impl CurlOutput {
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The value of the last response's header `name` (lower-case).
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers.lines().rev().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    }
}

/// Runs curl with `args` (plus -sS, headers and body captured) and `env`.
pub async fn curl(args: &[&str], env: &[(&str, &str)]) -> CurlOutput {
    let dir = tempfile::tempdir().unwrap();
    let headers = dir.path().join("headers");
    let body = dir.path().join("body");
    let mut command = tokio::process::Command::new("curl");
    command
        .args(["-sS", "--max-time", "30", "-D"])
        .arg(&headers)
        .arg("-o")
        .arg(&body)
        .args(["-w", "%{http_code}"])
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        // curl converts IDN hosts only in a UTF-8 locale.
        .env("LC_ALL", "C.UTF-8");
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().await.unwrap();
    CurlOutput {
        // With several URLs, -w prints one code each: the last one counts.
        status: {
            let codes = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            codes[codes.len().saturating_sub(3)..].parse().unwrap_or(0)
        },
        headers: std::fs::read_to_string(&headers).unwrap_or_default(),
        body: std::fs::read(&body).unwrap_or_default(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        exit: out.status.code().unwrap_or(-1),
    }
}

/// The proxy URL carrying a lease as Basic credentials.
pub fn proxy_url(server: &Server, lease: &str) -> String {
    format!("http://agent:{lease}@{}", server.addr)
}

/// A plain request for `url` through `server` under `lease` (curl, the lease as Basic
/// credentials): the whole answer.
pub async fn through(server: &Server, lease: &str, url: &str) -> CurlOutput {
    curl(&["-x", &proxy_url(server, lease), url], &[]).await
}

/// The status of a request for `url` through `server` under `lease` (0: no answer).
pub async fn status_through(server: &Server, lease: &str, url: &str) -> u16 {
    through(server, lease, url).await.status
}

/// The status and refusal code of a request for `url` through `server` under `lease`.
pub async fn answer_through(server: &Server, lease: &str, url: &str) -> (u16, Option<String>) {
    let out = through(server, lease, url).await;
    (out.status, out.header("x-leasegate-refusal"))
}

/// Sends raw bytes to `addr` and reads one response: its head, and its body when it has a
/// Content-Length (or everything until the peer closes, at most 5 s).
pub async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    exchange(&mut TcpStream::connect(addr).await.unwrap(), request).await
}

/// [`raw`] on a connection already open (a kept-alive one, say), which stays open.
pub async fn exchange(stream: &mut TcpStream, request: &[u8]) -> String {
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 16 * 1024];
    loop {
        if let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&out[..end]).to_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            match length {
                Some(n) if out.len() >= end + 4 + n => break,
                None if head.starts_with("http/1.1 200") || head.starts_with("http/1.1 101") => {
                    break
                }
                _ => {}
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => out.extend_from_slice(&buf[..n]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sends raw bytes and reads until the peer closes (at most 5 s).
pub async fn raw_to_close(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// The status code of the first response in `raw` text.
pub fn status_of(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// A range of ports for one test's per-lease listeners (disjoint across tests). They lie below
/// Linux's ephemeral range (32768-60999 by default), where no other test's outgoing or port-0
/// socket can be holding one of them: a busy suite once took a lease's port from under it.
pub fn port_range(len: u16) -> std::ops::RangeInclusive<u16> {
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(22000);
    let start = NEXT.fetch_add(len, Ordering::SeqCst);
    start..=start + len - 1
}

/// Every lease `GET /leases` lists, page by page (1000 a page); `None` if a page is not 200.
pub async fn all_leases(server: &Server) -> Option<Vec<Value>> {
    let mut leases = Vec::new();
    let mut path = "/leases?limit=1000".to_owned();
    loop {
        let (status, page) = admin_get(server, &path).await;
        if status != 200 {
            return None;
        }
        leases.extend(page["leases"].as_array()?.iter().cloned());
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/leases?limit=1000&cursor={cursor}"),
            None => return Some(leases),
        }
    }
}

/// A request to the admin API with an optional bearer token and more header fields: its
/// status and body text.
pub async fn admin_call(
    server: &Server,
    method: &str,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut head = String::new();
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    // A write is JSON, as the admin API requires of one.
    if method != "GET" {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    let answer = raw(
        server.admin_addr.unwrap(),
        format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{head}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    super::openapi::check(method, path, &answer);
    (
        status_of(&answer),
        answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned(),
    )
}

/// `GET path` on the admin API: status and JSON body.
pub async fn admin_get(server: &Server, path: &str) -> (u16, Value) {
    let (status, body) = admin_text(server, path).await;
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// Polls `/readyz` until it answers `status`, for at most `limit`; the body it answered.
pub async fn readyz_turns(server: &Server, status: u16, limit: Duration) -> Option<Value> {
    eventually(limit, || async {
        let (answered, body) = admin_get(server, "/readyz").await;
        (answered == status).then_some(body)
    })
    .await
}

/// `GET path` on the admin API: the status and the body as text.
pub async fn admin_text(server: &Server, path: &str) -> (u16, String) {
    let answer = raw(
        server.admin_addr.unwrap(),
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    super::openapi::check("GET", path, &answer);
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("");
    (status_of(&answer), body.to_owned())
}

/// What "at once" may take on a loaded 2-core machine (CI shares its cores with other builds).
/// A test asserts promptness with it where the broken behaviour is "never" or a timer longer
/// than it (the test sets that timer); the measured figures (p50, p99) are the benches'.
pub const AT_ONCE: Duration = Duration::from_secs(5);

/// Polls `f` every 10 ms until it returns `Some`, for at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = f().await {
            return Some(value);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads a response head byte by byte (nothing past it) and returns it.
pub async fn read_head(stream: &mut (impl AsyncRead + Unpin)) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(
            stream.read(&mut byte).await.unwrap(),
            1,
            "proxy closed in the head: {}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

/// A CONNECT tunnel to `target` through `proxy` (credentials in `X-Lease-Id`), answered 200.
pub async fn open_tunnel(proxy: SocketAddr, target: &str, lease: Option<&str>) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).await.unwrap();
    let credentials = lease
        .map(|l| format!("X-Lease-Id: {l}\r\n"))
        .unwrap_or_default();
    stream
        .write_all(format!("CONNECT {target} HTTP/1.1\r\n{credentials}\r\n").as_bytes())
        .await
        .unwrap();
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    stream
}

/// A CONNECT tunnel to `target` through `proxy`, answered 200, streaming `/slow` from an
/// HTTP origin behind it. Returns the stream after the first tick arrived.
pub async fn streaming_tunnel(proxy: SocketAddr, target: &str, lease: Option<&str>) -> TcpStream {
    let mut stream = open_tunnel(proxy, target, lease).await;
    stream
        .write_all(b"GET /slow HTTP/1.1\r\nHost: origin.test\r\n\r\n")
        .await
        .unwrap();
    read_until(&mut stream, "tick").await;
    stream
}

/// Reads until what was read contains `needle`; returns it all (panics if the peer closes
/// first).
pub async fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains(needle) {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before {needle:?} came");
        seen.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

/// Reads until the peer closes; returns how long that took (panics after `limit`).
pub async fn until_closed(stream: &mut (impl AsyncRead + Unpin), limit: Duration) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(
            limit.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("the tunnel was still open after {limit:?}"),
        }
    }
}

/// Names `server` (`NAME=URL`, as `--mcp-server` takes it) as an MCP server of `config`.
pub fn with_mcp_server(config: &mut ProxyConfig, server: &str) {
    config.mcp = Arc::new(leasegate::mcp::McpServers::parse(&[server]).unwrap());
}

/// A forwarded POST of the JSON-RPC `body` to the MCP server at `http://host:port/mcp`, as
/// `lease` (`X-Lease-Id`), the connection closed after it: the raw request.
pub fn mcp_post_to(host: &str, port: u16, lease: &str, body: &str) -> String {
    format!(
        "POST http://{host}:{port}/mcp HTTP/1.1\r\nHost: {host}:{port}\r\nX-Lease-Id: {lease}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}
