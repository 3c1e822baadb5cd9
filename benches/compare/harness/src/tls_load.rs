//! HTTPS clients for `brokered.sh`: kept-alive requests over TLS through a CONNECT proxy (or
//! straight to the origin), and new connections each with a TLS handshake, resumed or not.
//!
//! Invariant: a request counts only when the answer is a 200 with exactly `--expect-bytes` of
//! body; anything else is an error, counted and named, never a latency sample. The time to
//! first byte is taken at the first body byte (the head alone is not the answer).

use super::{open, percentile, runtime, Opts, Result};
use bytes::Bytes;
use hyper::body::Body;
use hyper::Request;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// What every connection of a run shares.
struct Setup {
    /// `None`: straight to `addr`.
    proxy: Option<SocketAddr>,
    /// Where a direct connection goes (the target's name need not resolve here).
    addr: Option<SocketAddr>,
    /// `host:port`: the CONNECT target and the Host header.
    target: String,
    name: ServerName<'static>,
    auth: String,
    path: String,
    /// `--body-file`: sent with `POST` (as JSON); none: `GET`.
    body: Option<Bytes>,
    expect: usize,
    tls: tokio_rustls::TlsConnector,
}

impl Setup {
    /// `resume`: whether the client keeps TLS sessions to resume with (rustls's default
    /// in-memory store) or none.
    fn new(opts: &Opts, resume: bool) -> Result<Setup> {
        let proxy = opts.proxy()?;
        let addr = match opts.opt("addr") {
            Some(a) => Some(
                a.parse()
                    .map_err(|_| format!("--addr {a:?}: not IP:PORT"))?,
            ),
            None if proxy.is_none() => return Err("--proxy direct needs --addr IP:PORT".into()),
            None => None,
        };
        let target = opts.req("target")?.to_owned();
        let host = target
            .rsplit_once(':')
            .map(|(h, _)| h)
            .ok_or_else(|| format!("--target {target:?}: not HOST:PORT"))?;
        let name = ServerName::try_from(host.to_owned())
            .map_err(|_| format!("--target {target:?}: not a DNS name"))?;
        let mut roots = rustls::RootCertStore::empty();
        let pem = std::fs::read(opts.req("ca")?)?;
        for cert in pem_certs(&pem)? {
            roots.add(cert)?;
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        if !resume {
            config.resumption = rustls::client::Resumption::disabled();
        }
        Ok(Setup {
            proxy,
            addr,
            target,
            name,
            auth: opts.auth_line(),
            path: opts.opt("path").unwrap_or("/small").to_owned(),
            body: match opts.opt("body-file") {
                Some(f) => Some(Bytes::from(std::fs::read(f)?)),
                None => None,
            },
            expect: opts.num("expect-bytes", 64)?,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    /// A TCP connection (through the proxy's tunnel when there is one), then TLS.
    async fn connect(&self) -> Result<TlsStream<TcpStream>> {
        let tcp = match (self.proxy, self.addr) {
            (None, Some(addr)) => {
                let s = TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                s
            }
            _ => open(self.proxy, &self.target, &self.auth).await?,
        };
        Ok(self.tls.connect(self.name.clone(), tcp).await?)
    }
}

/// The certificates of a PEM file.
fn pem_certs(pem: &[u8]) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    let certs: Vec<_> =
        rustls::pki_types::CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>()?;
    if certs.is_empty() {
        return Err("--ca: no certificate in the file".into());
    }
    Ok(certs)
}

type Sender = hyper::client::conn::http1::SendRequest<super::Chunked>;

/// HTTP/1.1 over `tls`; the connection's driver runs as its own task.
async fn http1(tls: TlsStream<TcpStream>) -> Result<Sender> {
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

/// One GET (or POST with `--body-file`); Ok only for a 200 with the expected body length,
/// with the time from `t0` to the first body byte.
async fn get(setup: &Setup, sender: &mut Sender, t0: Instant) -> Result<Duration> {
    sender.ready().await?;
    let req = match &setup.body {
        None => Request::get(&setup.path),
        Some(_) => Request::post(&setup.path).header("content-type", "application/json"),
    };
    let req = req.header("host", &setup.target).body(super::Chunked {
        data: setup.body.clone().unwrap_or_default(),
        chunk: 1 << 20,
    })?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let mut body = resp.into_body();
    let mut n = 0usize;
    let mut first = None;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        if let Ok(data) = frame?.into_data() {
            if !data.is_empty() {
                first.get_or_insert_with(|| t0.elapsed());
            }
            n += data.len();
        }
    }
    if status != 200 || n != setup.expect {
        return Err(format!(
            "{} {}: status {status}, {n} bytes",
            if setup.body.is_some() { "POST" } else { "GET" },
            setup.path
        )
        .into());
    }
    Ok(first.unwrap_or_else(|| t0.elapsed()))
}

/// A worker's tally: latencies (µs), errors, the first error, resumed and full handshakes.
#[derive(Default)]
struct Tally {
    lat_us: Vec<u64>,
    ttfb_us: Vec<u64>,
    errors: u64,
    first_error: Option<String>,
    resumed: u64,
    full: u64,
}

impl Tally {
    fn error(&mut self, e: impl ToString) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| e.to_string());
    }

    fn merge(&mut self, other: Tally) {
        self.lat_us.extend(other.lat_us);
        self.ttfb_us.extend(other.ttfb_us);
        self.errors += other.errors;
        self.resumed += other.resumed;
        self.full += other.full;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// Kept-alive GETs on one connection until `deadline`; a failed connection is replaced.
async fn keepalive_loop(setup: Arc<Setup>, deadline: Instant) -> Tally {
    let mut tally = Tally::default();
    let mut sender: Option<Sender> = None;
    while Instant::now() < deadline {
        let s = match sender.as_mut() {
            Some(s) => s,
            None => match setup.connect().await {
                Ok(tls) => match http1(tls).await {
                    Ok(s) => sender.insert(s),
                    Err(e) => {
                        tally.error(e);
                        continue;
                    }
                },
                Err(e) => {
                    tally.error(e);
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
            },
        };
        let t0 = Instant::now();
        match get(&setup, s, t0).await {
            Ok(ttfb) => {
                tally.lat_us.push(t0.elapsed().as_micros() as u64);
                tally.ttfb_us.push(ttfb.as_micros() as u64);
            }
            Err(e) => {
                tally.error(e);
                sender = None;
            }
        }
    }
    tally
}

/// New connection per request until `deadline`: tunnel, TLS handshake, one GET, close. The
/// sample is the whole of it; the handshake kind is counted.
async fn handshake_loop(setup: Arc<Setup>, deadline: Instant) -> Tally {
    let mut tally = Tally::default();
    while Instant::now() < deadline {
        let t0 = Instant::now();
        let result = async {
            let tls = setup.connect().await?;
            let kind = tls.get_ref().1.handshake_kind();
            let mut sender = http1(tls).await?;
            get(&setup, &mut sender, t0).await?;
            Ok::<_, super::Error>(kind)
        }
        .await;
        match result {
            Ok(kind) => {
                tally.lat_us.push(t0.elapsed().as_micros() as u64);
                if kind == Some(rustls::HandshakeKind::Resumed) {
                    tally.resumed += 1;
                } else {
                    tally.full += 1;
                }
            }
            Err(e) => {
                tally.error(e);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }
    tally
}

/// Runs `--concurrency` loops of `kind` for `--duration` seconds on one runtime of
/// `--threads` threads; prints one JSON object.
fn run(opts: &Opts, mode: &str) -> Result<()> {
    super::raise_nofile();
    let resume = match opts.opt("resume").unwrap_or("on") {
        "on" => true,
        "off" => false,
        other => return Err(format!("--resume {other:?}: on or off").into()),
    };
    let setup = Arc::new(Setup::new(opts, resume)?);
    let concurrency: usize = opts.num("concurrency", 1)?;
    let duration: f64 = opts.num("duration", 10.0)?;
    let rt = runtime(opts, 1)?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(duration);
    let tally = rt.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..concurrency.max(1) {
            let setup = setup.clone();
            if mode == "https-load" {
                tasks.spawn(keepalive_loop(setup, deadline));
            } else {
                tasks.spawn(handshake_loop(setup, deadline));
            }
        }
        let mut all = Tally::default();
        while let Some(t) = tasks.join_next().await {
            match t {
                Ok(t) => all.merge(t),
                Err(e) => all.error(e),
            }
        }
        all
    });
    let secs = start.elapsed().as_secs_f64();
    let mut lat = tally.lat_us;
    lat.sort_unstable();
    let mut ttfb = tally.ttfb_us;
    ttfb.sort_unstable();
    let mut out: Value = json!({
        "mode": mode,
        "proxy": opts.req("proxy")?,
        "target": setup.target,
        "path": setup.path,
        "concurrency": concurrency,
        "seconds": secs,
        "requests": lat.len(),
        "errors": tally.errors,
        "first_error": tally.first_error,
        "per_s": lat.len() as f64 / secs,
        "p50_us": percentile(&lat, 50.0),
        "p99_us": percentile(&lat, 99.0),
    });
    if mode == "https-load" {
        out["ttfb_p50_us"] = json!(percentile(&ttfb, 50.0));
        out["ttfb_p99_us"] = json!(percentile(&ttfb, 99.0));
    }
    if mode == "https-handshakes" {
        out["resume"] = json!(resume);
        out["resumed"] = json!(tally.resumed);
        out["full"] = json!(tally.full);
    }
    println!("{out}");
    Ok(())
}

/// `https-load`: kept-alive GETs, `--concurrency` connections.
pub fn https_load(opts: &Opts) -> Result<()> {
    run(opts, "https-load")
}

/// `https-handshakes`: a new connection (and TLS handshake) per GET.
pub fn https_handshakes(opts: &Opts) -> Result<()> {
    run(opts, "https-handshakes")
}
