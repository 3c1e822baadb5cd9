//! `compare-harness floor`: the floor — the cheapest proxy doing leasegate's socket work and
//! nothing else: a CONNECT relay (dial, answer 200, splice bytes both ways) and an
//! absolute-form HTTP/1.1 forwarder with a keep-alive upstream pool. It exists only so that
//! `run.sh` can measure leasegate against it ("× floor"); it is never a product path, and it
//! has no identification, no policy, no address guard, no logging, no metrics and no timeouts.
//!
//! Invariant: every socket the floor touches is set up and moved as leasegate's are — the same
//! runtime layout ([`workers`]: a current-thread runtime per core, a connection kept where it
//! was accepted unless that worker is ahead of the least busy), the same listener and dial
//! options ([`sockets`]: TCP_NODELAY inherited, loopback unpaced), the same HTTP/1.1 library
//! (hyper 1, upgrades for CONNECT), the same splice relay ([`splice`]) and one idle upstream
//! pool per worker ([`forward`]). What leasegate adds beyond it is what "× floor" measures.

mod connect;
mod forward;
mod sockets;
mod splice;
mod workers;

use crate::{raise_nofile, Opts, Result};
use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::json;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use workers::{Accepted, Workers};

/// What every connection reads: set once before the first accept.
struct Floor {
    workers: Workers,
    /// `--resolve HOST=IP`: the only names the floor knows (as leasegate's `--resolve` in
    /// run.sh); IP literals need none.
    names: Vec<(String, IpAddr)>,
    /// Whether accepted sockets inherit TCP_NODELAY from the listener.
    inherited: bool,
}

static FLOOR: OnceLock<Floor> = OnceLock::new();

fn floor_state() -> &'static Floor {
    FLOOR.get().expect("set before the first accept")
}

/// How long an accept loop waits after a failed accept (out of descriptors) before it tries
/// again, as leasegate's.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// `compare-harness floor --listen ADDR [--threads N] [--resolve HOST=IP[,HOST=IP...]]`:
/// serves until SIGTERM or Ctrl-C. `--threads 0` (the default): one worker per core the
/// process may run on, as `leasegate serve --worker-threads 0`.
pub fn floor(opts: &Opts) -> Result<()> {
    let listen: SocketAddr = opts
        .req("listen")?
        .parse()
        .map_err(|_| "--listen: not IP:PORT")?;
    let threads = match opts.num("threads", 0usize)? {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let names = parse_names(opts.opt("resolve").unwrap_or(""))?;
    raise_nofile();
    let (addr, inherited) = start(listen, threads, names)?;
    println!(
        "{}",
        json!({"floor": "ready", "listen": addr.to_string(), "threads": threads,
               "nodelay_inherited": inherited})
    );
    let control = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    control.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        Ok::<_, crate::Error>(())
    })?;
    // The workers never end on their own.
    std::process::exit(0)
}

/// Binds `listen` and starts `threads` workers, each accepting on it; returns the bound address
/// and whether accepted sockets inherit TCP_NODELAY. Once per process.
fn start(
    listen: SocketAddr,
    threads: usize,
    names: Vec<(String, IpAddr)>,
) -> Result<(SocketAddr, bool)> {
    // Bound as leasegate's listener is (tokio's bind: SO_REUSEADDR, a 1,024 backlog), then
    // shared by one accept loop per worker.
    let listener = crate::listener(listen, 1024, false)?;
    let addr = listener.local_addr()?;
    let inherited = sockets::set_inherited(&listener, addr);
    let workers = Workers::start(threads)?;
    FLOOR
        .set(Floor {
            workers,
            names,
            inherited,
        })
        .map_err(|_| "one floor per process")?;
    floor_state().workers.spawn_each_made(|| {
        let listener = TcpListener::from_std(listener.try_clone()?)?;
        Ok::<_, std::io::Error>(accept_loop(listener))
    })?;
    Ok((addr, inherited))
}

/// `HOST=IP[,HOST=IP...]` → the names the floor resolves.
fn parse_names(list: &str) -> Result<Vec<(String, IpAddr)>> {
    list.split(',')
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let (host, ip) = entry
                .split_once('=')
                .ok_or_else(|| format!("--resolve {entry:?}: expected HOST=IP"))?;
            let ip: IpAddr = ip
                .parse()
                .map_err(|_| format!("--resolve {entry:?}: {ip:?} is not an IP address"))?;
            Ok((host.to_ascii_lowercase(), ip))
        })
        .collect()
}

/// Accepts until the process ends; each connection goes where [`Workers::place`] says.
async fn accept_loop(listener: TcpListener) {
    let floor = floor_state();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let (worker, placed) = floor.workers.place();
        let Ok(stream) = Accepted::moving(stream, worker.is_some()) else {
            continue;
        };
        let task = async move {
            // Counted on its worker for as long as the connection lives.
            let _placed = placed;
            let Ok(stream) = stream.here() else {
                return;
            };
            if !floor.inherited {
                let _ = stream.set_nodelay(true);
            }
            serve(stream).await;
        };
        match worker {
            Some(handle) => drop(handle.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
    }
}

/// One client connection: HTTP/1.1 with keep-alive until it ends (or becomes a tunnel).
async fn serve(stream: TcpStream) {
    let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
        Ok::<_, Infallible>(match req.method() == hyper::Method::CONNECT {
            true => connect::handle(req).await,
            false => forward::handle(req).await,
        })
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades()
        .await;
}

/// Where `host` (a URI's host: a name, an IPv4 address or a bracketed IPv6 one) and `port`
/// are: an IP literal as it is, a name only from `--resolve`.
fn upstream_addr(host: &str, port: u16) -> Option<SocketAddr> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = bare.parse::<IpAddr>() {
        return Some(SocketAddr::new(ip, port));
    }
    floor_state()
        .names
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case(host))
        .map(|&(_, ip)| SocketAddr::new(ip, port))
}

/// A response's body: the upstream's, relayed as it comes, or a few bytes of our own.
pub enum FloorBody {
    Relayed(Incoming),
    Said(Option<Bytes>),
}

impl Body for FloorBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            FloorBody::Relayed(body) => Pin::new(body).poll_frame(cx),
            FloorBody::Said(said) => Poll::Ready(said.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            FloorBody::Relayed(body) => body.is_end_stream(),
            FloorBody::Said(said) => said.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            FloorBody::Relayed(body) => body.size_hint(),
            FloorBody::Said(said) => {
                SizeHint::with_exact(said.as_ref().map_or(0, |b| b.len()) as u64)
            }
        }
    }
}

/// An answer of the floor's own: `status` with `why` as a one-line text body.
fn answer(status: StatusCode, why: String) -> Response<FloorBody> {
    let mut response = Response::new(FloorBody::Said(Some(Bytes::from(why + "\n"))));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests;
