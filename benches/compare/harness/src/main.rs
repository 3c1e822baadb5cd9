//! Harness for `benches/compare/run.sh`: a local origin server and the CONNECT clients that
//! the HTTP load tool (oha) cannot play.
//!
//! ```text
//! compare-harness origin       --http ADDR --https ADDR --cert-dir DIR [--big-bytes N] [--threads N]
//!                              [--backlog N]  (a SO_REUSEPORT listener per thread)
//! compare-harness connect-rate --proxy ADDR|direct --target HOST:PORT [--auth 'Basic xxx'|none]
//!                              --concurrency N --duration S [--threads N]  (a runtime per thread)
//! compare-harness bulk         --proxy ADDR|direct --target HOST:PORT [--auth ...] --bytes N
//!                              [--repeat K] [--threads N]
//! compare-harness idle-tunnels --proxy ADDR --target HOST:PORT [--auth ...] --count N --pid PID
//!                              [--settle S] [--threads N]
//! compare-harness https-load   --proxy ADDR|direct [--addr IP:PORT] --target HOST:PORT --ca PEM
//!                              [--auth ...] [--path P] [--expect-bytes N] --concurrency N
//!                              --duration S [--threads N]  (kept-alive HTTPS requests;
//!                              [--body-file F]: POSTs F as JSON; time to first byte too)
//! compare-harness https-handshakes  (the same flags, and --resume on|off: a new connection
//!                              and TLS handshake per request)
//! compare-harness report       --runs DIR --out-md FILE --out-json FILE [metadata flags]
//! compare-harness floor        --listen ADDR [--threads N] [--resolve HOST=IP[,HOST=IP]]
//!                              (the floor proxy leasegate is measured against; see floor/)
//! compare-harness cpu          --pids NAME=PID[,NAME=PID]  (user and system CPU seconds so
//!                              far of each process and its descendants)
//! ```
//!
//! The origin's `POST /v1/chat/completions[?tokens=N]` streams an OpenAI Chat Completions
//! answer of N tokens (2,000 by default; see `sse.rs`).
//!
//! Every client subcommand prints one JSON object on stdout. Traffic goes only where the
//! addresses given point (the script passes loopback addresses only).

mod cpu;
mod floor;
mod report;
mod sse;
mod tls_load;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type Error = Box<dyn std::error::Error + Send + Sync>;
type Result<T, E = Error> = std::result::Result<T, E>;

const USAGE: &str =
    "usage: compare-harness origin|connect-rate|bulk|idle-tunnels|https-load|https-handshakes|report|floor|cpu --flag value ... \
(see the comment at the top of src/main.rs)";

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(cmd) = args.next() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let result = Opts::parse(args.collect()).and_then(|opts| match cmd.as_str() {
        "origin" => origin(&opts),
        "connect-rate" => connect_rate(&opts),
        "bulk" => client(&opts, bulk),
        "idle-tunnels" => client(&opts, idle_tunnels),
        "https-load" => tls_load::https_load(&opts),
        "https-handshakes" => tls_load::https_handshakes(&opts),
        "report" => report::report(&opts),
        "floor" => floor::floor(&opts),
        "cpu" => cpu::cpu(&opts),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => Err(format!("unknown subcommand {other:?}\n{USAGE}").into()),
    });
    if let Err(e) = result {
        eprintln!("compare-harness {cmd}: {e}");
        std::process::exit(1);
    }
}

// ---------------------------------------------------------------------------------------------
// Options: `--name value` pairs.

struct Opts(HashMap<String, String>);

impl Opts {
    fn parse(args: Vec<String>) -> Result<Opts> {
        let mut map = HashMap::new();
        let mut it = args.into_iter();
        while let Some(flag) = it.next() {
            let name = flag
                .strip_prefix("--")
                .ok_or_else(|| format!("expected --flag, got {flag:?}"))?;
            let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
            map.insert(name.to_owned(), value);
        }
        Ok(Opts(map))
    }

    fn req(&self, name: &str) -> Result<&str> {
        self.0
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| format!("--{name} is required").into())
    }

    fn opt(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    fn num<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.0.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|_| format!("--{name} {v:?}: not a number").into()),
        }
    }

    /// `--proxy ADDR` or `--proxy direct`.
    fn proxy(&self) -> Result<Option<SocketAddr>> {
        match self.req("proxy")? {
            "direct" => Ok(None),
            addr => Ok(Some(
                addr.parse()
                    .map_err(|_| format!("--proxy {addr:?}: not IP:PORT"))?,
            )),
        }
    }

    /// `--auth 'Basic xxx'` → the Proxy-Authorization header line; `none` or absent → nothing.
    fn auth_line(&self) -> String {
        match self.opt("auth") {
            None | Some("none") | Some("") => String::new(),
            Some(v) => format!("Proxy-Authorization: {v}\r\n"),
        }
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit; returns the new soft limit.
fn raise_nofile() -> u64 {
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 0;
        }
        if lim.rlim_cur < lim.rlim_max {
            let want = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &want) == 0 {
                return lim.rlim_max;
            }
        }
        lim.rlim_cur
    }
}

fn runtime(opts: &Opts, default_threads: usize) -> Result<tokio::runtime::Runtime> {
    let threads: usize = opts.num("threads", default_threads)?;
    let rt = if threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    Ok(rt)
}

// ---------------------------------------------------------------------------------------------
// Origin.

/// A body served as slices of one shared buffer (no copies): `chunk` bytes per frame.
struct Chunked {
    data: Bytes,
    chunk: usize,
}

impl Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.data.is_empty() {
            return Poll::Ready(None);
        }
        let n = self.chunk.min(self.data.len());
        let frame = self.data.split_to(n);
        Poll::Ready(Some(Ok(Frame::data(frame))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.len() as u64)
    }
}

const CHUNK: usize = 256 * 1024;

struct Bodies {
    small: Bytes,
    big: Bytes,
}

/// What the origin answers with: a whole body in slices, or a streamed model answer.
enum OriginBody {
    Whole(Chunked),
    Events(sse::Events),
}

impl Body for OriginBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            OriginBody::Whole(b) => Pin::new(b).poll_frame(cx),
            OriginBody::Events(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            OriginBody::Whole(b) => b.is_end_stream(),
            OriginBody::Events(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            OriginBody::Whole(b) => b.size_hint(),
            OriginBody::Events(b) => b.size_hint(),
        }
    }
}

fn route(bodies: &Bodies, req: &Request<()>) -> Response<OriginBody> {
    // `POST /v1/chat/completions[?tokens=N]`: a streamed Chat Completions answer of N tokens.
    if req.uri().path() == "/v1/chat/completions" && req.method() == hyper::Method::POST {
        if let Some(n) = sse::tokens_of(req.uri().query()) {
            return Response::builder()
                .header("content-type", "text/event-stream; charset=utf-8")
                .header("cache-control", "no-cache")
                .body(OriginBody::Events(sse::Events::new(sse::events(n))))
                .expect("static response parts");
        }
    }
    let data = match req.uri().path() {
        "/small" => Some(bodies.small.clone()),
        "/big" => {
            // `/big?n=BYTES` serves a prefix of the big body.
            let n = req
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("n=")))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(bodies.big.len())
                .min(bodies.big.len());
            Some(bodies.big.slice(..n))
        }
        // What the request's Authorization header was: the check that a proxy put it in.
        "/auth" => Some(Bytes::copy_from_slice(
            req.headers()
                .get("authorization")
                .map(|v| v.as_bytes())
                .unwrap_or_default(),
        )),
        _ => None,
    };
    let (status, data) = match data {
        Some(d) => (StatusCode::OK, d),
        None => (StatusCode::NOT_FOUND, Bytes::from_static(b"not found\n")),
    };
    Response::builder()
        .status(status)
        .header("content-type", "application/octet-stream")
        .body(OriginBody::Whole(Chunked { data, chunk: CHUNK }))
        .expect("static response parts")
}

fn origin(opts: &Opts) -> Result<()> {
    let http: SocketAddr = opts.req("http")?.parse()?;
    let https: SocketAddr = opts.req("https")?.parse()?;
    let cert_dir = PathBuf::from(opts.req("cert-dir")?);
    let big_bytes: usize = opts.num("big-bytes", 100 << 20)?;
    let nofile = raise_nofile();

    // Certificate for origin.test (self-signed: ca.pem is the certificate itself), and for
    // blind.test: a second name of the same origin, for a tunnel a proxy does not terminate.
    let rcgen::CertifiedKey { cert, key_pair } = rcgen::generate_simple_self_signed(vec![
        "origin.test".to_string(),
        "blind.test".to_string(),
    ])?;
    std::fs::create_dir_all(&cert_dir)?;
    std::fs::write(cert_dir.join("ca.pem"), cert.pem())?;
    std::fs::write(cert_dir.join("key.pem"), key_pair.serialize_pem())?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(key_pair.serialize_der().into());
    let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_no_client_auth()
    .with_single_cert(vec![cert.der().clone()], key)?;
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));

    // The big body: generated once, served as `Bytes` slices.
    let big: Vec<u8> = (0..big_bytes).map(|i| (i % 251) as u8).collect();
    let bodies = Arc::new(Bodies {
        small: Bytes::from(vec![b'x'; 64]),
        big: Bytes::from(big),
    });

    // One listener pair per thread, each on its own single-threaded runtime, all bound with
    // SO_REUSEPORT: the kernel spreads connections over them, so accepting scales with the
    // threads (one accept loop tops out near 14k connections/s), and a deep backlog keeps a
    // burst of connects from overflowing into SYN retransmits (a 1 s p99).
    let threads: usize = opts.num("threads", 2)?;
    let backlog: u32 = opts.num("backlog", 4096)?;
    let mut listeners = Vec::new();
    for _ in 0..threads.max(1) {
        listeners.push((
            listener(http, backlog, true)?,
            listener(https, backlog, true)?,
        ));
    }
    for (http_l, https_l) in listeners {
        let (bodies, acceptor) = (bodies.clone(), acceptor.clone());
        std::thread::Builder::new()
            .name("origin".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime per origin thread");
                rt.block_on(async move {
                    let http_l = TcpListener::from_std(http_l).expect("tokio listener");
                    let https_l = TcpListener::from_std(https_l).expect("tokio listener");
                    tokio::spawn(accept_loop(http_l, bodies.clone(), None));
                    accept_loop(https_l, bodies, Some(acceptor)).await;
                });
            })?;
    }
    println!(
        "{}",
        json!({"origin": "ready", "http": http.to_string(), "https": https.to_string(),
               "big_bytes": big_bytes, "nofile": nofile, "threads": threads,
               "backlog": backlog})
    );
    runtime(opts, 1)?.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        Ok::<_, Error>(())
    })?;
    // The accept threads never end on their own.
    std::process::exit(0)
}

/// A non-blocking listener on `addr` with SO_REUSEADDR (and SO_REUSEPORT when `reuseport`) and
/// `backlog`.
fn listener(addr: SocketAddr, backlog: u32, reuseport: bool) -> Result<std::net::TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(reuseport)?;
    socket.bind(addr)?;
    // TcpSocket::listen needs a runtime only to register the listener; listen(2) itself is
    // done here, the registration on the thread that serves it.
    let std_socket: std::net::TcpListener = {
        use std::os::fd::{FromRawFd, IntoRawFd};
        let fd = socket.into_raw_fd();
        // SAFETY: `fd` was just taken from the socket, which no longer owns it.
        if unsafe { libc::listen(fd, backlog as libc::c_int) } != 0 {
            let error = std::io::Error::last_os_error();
            // SAFETY: as above; closes it.
            drop(unsafe { std::net::TcpListener::from_raw_fd(fd) });
            return Err(error.into());
        }
        // SAFETY: as above.
        unsafe { std::net::TcpListener::from_raw_fd(fd) }
    };
    std_socket.set_nonblocking(true)?;
    Ok(std_socket)
}

async fn accept_loop(
    listener: TcpListener,
    bodies: Arc<Bodies>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                eprintln!("origin: accept: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let bodies = bodies.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let bodies = bodies.clone();
                async move {
                    // The request's body (a model call's JSON) is read and dropped first, so
                    // the connection stays reusable.
                    let (parts, mut body) = req.into_parts();
                    while let Some(Ok(_)) =
                        std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
                    {
                    }
                    Ok::<_, Infallible>(route(&bodies, &Request::from_parts(parts, ())))
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            let _ = match tls {
                None => {
                    builder
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service)
                        .await
                }
                Some(acceptor) => match acceptor.accept(stream).await {
                    Ok(s) => {
                        builder
                            .keep_alive(true)
                            .serve_connection(TokioIo::new(s), service)
                            .await
                    }
                    Err(_) => return,
                },
            };
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Clients.

fn client<F, Fut>(opts: &Opts, f: F) -> Result<()>
where
    F: FnOnce(Arc<Opts>) -> Fut,
    Fut: std::future::Future<Output = Result<Value>>,
{
    raise_nofile();
    let rt = runtime(opts, 1)?;
    let opts = Arc::new(Opts(opts.0.clone()));
    let out = rt.block_on(f(opts))?;
    println!("{out}");
    Ok(())
}

/// Reads a response head; returns its status code and the bytes read past it.
async fn read_head(s: &mut TcpStream) -> Result<(u16, Vec<u8>)> {
    let mut buf = Vec::with_capacity(1024);
    let mut tmp = [0u8; 4096];
    loop {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            return Err(format!(
                "connection closed before a full response head ({} bytes: {:?})",
                buf.len(),
                String::from_utf8_lossy(&buf)
            )
            .into());
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = &buf[..end];
            let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
            let status = std::str::from_utf8(line)
                .ok()
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|c| c.parse::<u16>().ok())
                .ok_or_else(|| format!("bad status line {:?}", String::from_utf8_lossy(line)))?;
            return Ok((status, buf[end + 4..].to_vec()));
        }
        if buf.len() > 64 * 1024 {
            return Err("response head over 64 KiB".into());
        }
    }
}

/// Opens a CONNECT tunnel to `target` through `proxy` (or a plain TCP connection to `target`
/// when there is no proxy).
/// Source addresses a connect-and-close loop spreads its connections over (127.0.0.2 and up):
/// from one address, the ~28,000 ephemeral ports, each held in TIME_WAIT after its close, made
/// the kernel's port search the bound (a direct connect-and-close topped out near 14,000/s on
/// any machine).
const SOURCES: u32 = 16;

/// Connects to `to`, from the next of [`SOURCES`] loopback addresses when `to` is on IPv4
/// loopback (else wherever the kernel picks).
async fn connect_spread(to: SocketAddr) -> Result<TcpStream> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let std::net::IpAddr::V4(ip) = to.ip() else {
        return Ok(TcpStream::connect(to).await?);
    };
    if !ip.is_loopback() {
        return Ok(TcpStream::connect(to).await?);
    }
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SOURCES;
    let source = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(127, 0, 0, 2)) + n);
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from((source, 0)))?;
    Ok(socket.connect(to).await?)
}

async fn open(proxy: Option<SocketAddr>, target: &str, auth_line: &str) -> Result<TcpStream> {
    match proxy {
        None => {
            let to = tokio::net::lookup_host(target)
                .await?
                .next()
                .ok_or_else(|| format!("{target}: no address"))?;
            let s = connect_spread(to).await?;
            s.set_nodelay(true)?;
            Ok(s)
        }
        Some(p) => {
            let mut s = connect_spread(p).await?;
            s.set_nodelay(true)?;
            let req = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth_line}\r\n");
            s.write_all(req.as_bytes()).await?;
            let (status, rest) = read_head(&mut s).await?;
            if status != 200 {
                return Err(format!("CONNECT {target}: status {status}").into());
            }
            if !rest.is_empty() {
                return Err(format!("CONNECT {target}: {} unexpected bytes", rest.len()).into());
            }
            Ok(s)
        }
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One connect-rate worker's tally: setup times (µs), errors, the first error.
type Tally = (Vec<u64>, u64, Option<String>);

/// Loops CONNECT → 200 → close on `concurrency` connections until `deadline`.
async fn connect_loops(
    proxy: Option<SocketAddr>,
    target: String,
    auth: String,
    concurrency: usize,
    deadline: Instant,
) -> Tally {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let target = target.clone();
        let auth = auth.clone();
        tasks.spawn(async move {
            let mut lat_us: Vec<u64> = Vec::new();
            let mut errors = 0u64;
            let mut first_error: Option<String> = None;
            while Instant::now() < deadline {
                let t0 = Instant::now();
                match open(proxy, &target, &auth).await {
                    Ok(s) => {
                        lat_us.push(t0.elapsed().as_micros() as u64);
                        drop(s);
                    }
                    Err(e) => {
                        errors += 1;
                        first_error.get_or_insert_with(|| e.to_string());
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            (lat_us, errors, first_error)
        });
    }
    let mut tally: Tally = (Vec::new(), 0, None);
    while let Some(r) = tasks.join_next().await {
        let (l, e, f) = r.unwrap_or_else(|e| (Vec::new(), 1, Some(e.to_string())));
        tally.0.extend(l);
        tally.1 += e;
        if tally.2.is_none() {
            tally.2 = f;
        }
    }
    tally
}

/// Loops CONNECT → 200 → close on `--concurrency` connections for `--duration` seconds,
/// spread over `--threads` threads (default 1), each its own single-threaded runtime, so the
/// client is not what limits the rate. With `--proxy direct` each iteration is a plain TCP
/// connect + close to the target.
fn connect_rate(opts: &Opts) -> Result<()> {
    raise_nofile();
    let proxy = opts.proxy()?;
    let target = opts.req("target")?.to_owned();
    let auth = opts.auth_line();
    let concurrency: usize = opts.num("concurrency", 32)?;
    let threads: usize = opts
        .num::<usize>("threads", 1)?
        .clamp(1, concurrency.max(1));
    let duration: f64 = opts.num("duration", 10.0)?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(duration);
    let workers: Vec<_> = (0..threads)
        .map(|i| {
            // The first `concurrency % threads` threads take one connection more.
            let share = concurrency / threads + usize::from(i < concurrency % threads);
            let (target, auth) = (target.clone(), auth.clone());
            std::thread::spawn(move || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map(|rt| rt.block_on(connect_loops(proxy, target, auth, share, deadline)))
                    .unwrap_or_else(|e| (Vec::new(), 1, Some(e.to_string())))
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for worker in workers {
        let (l, e, f) = worker
            .join()
            .map_err(|_| "a connect-rate thread panicked")?;
        all.extend(l);
        errors += e;
        if first_error.is_none() {
            first_error = f;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let out = json!({
        "mode": "connect-rate",
        "proxy": opts.req("proxy")?,
        "target": target,
        "concurrency": concurrency,
        "threads": threads,
        "seconds": secs,
        "tunnels": all.len(),
        "errors": errors,
        "first_error": first_error,
        "per_s": all.len() as f64 / secs,
        "p50_us": percentile(&all, 50.0),
        "p99_us": percentile(&all, 99.0),
    });
    println!("{out}");
    Ok(())
}

/// One GET /big over a fresh tunnel; returns (body bytes read, seconds from request to last byte).
async fn bulk_once(
    proxy: Option<SocketAddr>,
    target: &str,
    auth: &str,
    bytes: u64,
) -> Result<(u64, f64)> {
    let mut s = open(proxy, target, auth).await?;
    let host = target;
    let t0 = Instant::now();
    let req = format!("GET /big?n={bytes} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let (status, rest) = read_head(&mut s).await?;
    if status != 200 {
        return Err(format!("GET /big: status {status}").into());
    }
    let mut got = rest.len() as u64;
    let mut buf = vec![0u8; 256 * 1024];
    while got < bytes {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Err(format!("GET /big: closed after {got} of {bytes} bytes").into());
        }
        got += n as u64;
    }
    Ok((got, t0.elapsed().as_secs_f64()))
}

/// `--repeat K` downloads of `--bytes N` (default 100 MiB), each on a new tunnel; MB/s = 10^6 B/s.
async fn bulk(opts: Arc<Opts>) -> Result<Value> {
    let proxy = opts.proxy()?;
    let target = opts.req("target")?.to_owned();
    let auth = opts.auth_line();
    let bytes: u64 = opts.num("bytes", 100 << 20)?;
    let repeat: usize = opts.num("repeat", 3)?;
    let mut rates = Vec::new();
    for _ in 0..repeat {
        let (got, secs) = bulk_once(proxy, &target, &auth, bytes).await?;
        rates.push(got as f64 / secs / 1e6);
    }
    let runs = rates.clone();
    Ok(json!({
        "mode": "bulk",
        "proxy": opts.req("proxy")?,
        "target": target,
        "bytes": bytes,
        "repeat": repeat,
        "mb_per_s": median(&mut rates),
        "runs_mb_per_s": runs,
    }))
}

fn proc_status_kib(pid: u32, field: &str) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| format!("/proc/{pid}/status has no {field}").into())
}

fn fd_count(pid: u32) -> Option<usize> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()
        .map(|d| d.count())
}

/// Opens `--count` tunnels, holds them idle, and reports the proxy's RSS growth per tunnel.
async fn idle_tunnels(opts: Arc<Opts>) -> Result<Value> {
    let proxy = opts.proxy()?.ok_or("idle-tunnels needs a proxy address")?;
    let target = opts.req("target")?.to_owned();
    let auth = opts.auth_line();
    let count: usize = opts.num("count", 10_000)?;
    let pid: u32 = opts.req("pid")?.parse()?;
    let settle: f64 = opts.num("settle", 2.0)?;
    let parallel: usize = opts.num("parallel", 64)?;
    let nofile = raise_nofile();
    if (nofile as usize) < count + 64 {
        return Err(format!(
            "RLIMIT_NOFILE is {nofile}: too low for {count} tunnels (raise the hard limit)"
        )
        .into());
    }

    let rss_before = proc_status_kib(pid, "VmRSS")?;
    let fds_before = fd_count(pid);
    let t0 = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(parallel));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..count {
        let permit = sem.clone().acquire_owned().await?;
        let target = target.clone();
        let auth = auth.clone();
        tasks.spawn(async move {
            let r = open(Some(proxy), &target, &auth).await;
            drop(permit);
            r
        });
    }
    let mut tunnels = Vec::with_capacity(count);
    let mut errors = 0usize;
    let mut first_error = None;
    while let Some(r) = tasks.join_next().await {
        match r? {
            Ok(s) => tunnels.push(s),
            Err(e) => {
                errors += 1;
                first_error.get_or_insert_with(|| e.to_string());
            }
        }
    }
    let open_secs = t0.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs_f64(settle)).await;
    let rss_after = proc_status_kib(pid, "VmRSS")?;
    let hwm = proc_status_kib(pid, "VmHWM")?;
    let fds_after = fd_count(pid);

    // Prove a sample of the held tunnels still carries traffic after the measurement.
    let mut sample_ok = 0;
    let sample = tunnels.len().min(10);
    for s in tunnels.iter_mut().take(sample) {
        let ok = async {
            s.write_all(b"GET /small HTTP/1.1\r\nHost: origin.test\r\n\r\n")
                .await?;
            let (status, _) = read_head(s).await?;
            Ok::<_, Error>(status == 200)
        };
        if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(5), ok).await {
            sample_ok += 1;
        }
    }
    let opened = tunnels.len();
    drop(tunnels);
    let per_tunnel = if opened > 0 {
        (rss_after.saturating_sub(rss_before) * 1024) as f64 / opened as f64
    } else {
        0.0
    };
    Ok(json!({
        "mode": "idle-tunnels",
        "proxy": proxy.to_string(),
        "target": target,
        "pid": pid,
        "requested": count,
        "opened": opened,
        "errors": errors,
        "first_error": first_error,
        "open_seconds": open_secs,
        "rss_before_kib": rss_before,
        "rss_after_kib": rss_after,
        "hwm_kib": hwm,
        "fds_before": fds_before,
        "fds_after": fds_after,
        "bytes_per_tunnel": per_tunnel,
        "sample_checked": sample,
        "sample_ok": sample_ok,
    }))
}
