//! Accepting client connections (mini-redis's Listener and Handler): the connection limit,
//! the optional TLS handshake, the HTTP/1.1 server with its header timeout, and dispatch of
//! each request to CONNECT or forwarding.
//!
//! Invariant: every accepted connection takes one slot of its source IP
//! (`max_connections_per_client`, taken first, before a byte is read) and one
//! `max_connections` permit, which its [`ClientConn`] holds from then on
//! ([`super::connection`]: the slot until it is first tied to a lease, the permit for as
//! long as it or a tunnel it became lives). So the per-address budget bounds what no lease answers for yet, and an
//! identified connection counts against its lease's budget only (every sidecar agent is
//! 127.0.0.1: one lease's tunnels must not lock the others out). A connection accepted past
//! the descriptor line ([`crate::descriptors`]) is answered 429 and closed before anything
//! else, so connections never take the descriptors the journal and the admin API need.

use super::answer;
use super::connection::ClientConn;
use super::sniffed::Sniffed;
use super::state::Proxy;
use super::{connect, forward, Body};
use crate::descriptors::Listener;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How long an accept loop waits after a failed accept (out of descriptors, say) before it
/// tries again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Accepts connections until `shutdown` fires. `port_lease` makes this a per-lease port.
pub async fn serve(
    listener: TcpListener,
    proxy: Arc<Proxy>,
    port_lease: Option<String>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let local = listener.local_addr()?;
    let inherited = set_inherited(&listener, local);
    let kind = match port_lease {
        Some(_) => Listener::LeasePort,
        None => Listener::Proxy,
    };
    loop {
        let (stream, client) = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(error) => {
                    // Out of descriptors and the like: back off rather than spin (the
                    // connection waits in the backlog), logged once and then counted.
                    proxy.descriptors.accept_failed(kind, &error);
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // The last descriptors are for the journal and the admin API, not for a connection.
        let fd = stream.as_raw_fd();
        if proxy.descriptors.is_past_line(fd) {
            proxy.descriptors.refused_at_line(kind, fd);
            refuse_now(stream, "out of file descriptors");
            continue;
        }
        proxy.descriptors.accepted();
        // Per client first: a client at its limit must not use up a slot of the total.
        let per_client = proxy.config.max_connections_per_client;
        let Some(slot) = proxy.clients.try_take(client.ip(), per_client) else {
            proxy.tasks.spawn(refuse_connection(
                stream,
                format!(
                    "{per_client} open from {} already",
                    client.ip().to_canonical()
                ),
            ));
            continue;
        };
        let Ok(permit) = proxy.connections.clone().try_acquire_owned() else {
            proxy.tasks.spawn(refuse_connection(
                stream,
                format!("all {} in use", proxy.config.max_connections),
            ));
            continue;
        };
        let (worker, placed) = match proxy.workers.place() {
            Some((worker, placed)) => (worker, Some(placed)),
            None => (None, None),
        };
        let stream = match Accepted::moving(stream, worker.is_some()) {
            Ok(stream) => stream,
            Err(error) => {
                tracing::warn!(%error, %client, "cannot hand an accepted connection over");
                continue;
            }
        };
        let conn = Arc::new(ClientConn::accepted(
            proxy.telemetry.clone(),
            client,
            local,
            port_lease.clone(),
            permit,
            slot,
            placed,
        ));
        let (task_proxy, shutdown) = (proxy.clone(), shutdown.clone());
        let task = async move {
            let stream = match stream.here() {
                Ok(stream) => stream,
                Err(error) => {
                    tracing::warn!(%error, %client, "cannot poll a handed-over connection");
                    return;
                }
            };
            if !inherited {
                let _ = stream.set_nodelay(true);
            }
            handle(task_proxy, stream, conn, shutdown).await;
        };
        match worker {
            Some(worker) => proxy.tasks.spawn_on(task, worker),
            None => proxy.tasks.spawn(task),
        };
    }
}

/// An accepted socket on its way to the runtime that serves it.
///
/// A socket's readiness is reported by the event loop it is registered with, which for
/// tokio's `accept` is the accepting thread's. One handed to another worker (to keep the
/// workers within `SLACK` of each other) is therefore taken off that loop here and
/// registered again where it lives; left where it was, every readiness event of its life
/// reached the wrong thread and was passed on with a wake across threads (half an eventfd
/// write per forwarded request, measured).
enum Accepted {
    /// Registered with the runtime it runs on.
    Here(TcpStream),
    /// Registered nowhere, until [`Accepted::here`] on its new runtime.
    Moving(std::net::TcpStream),
}

impl Accepted {
    fn moving(stream: TcpStream, moving: bool) -> std::io::Result<Accepted> {
        Ok(if moving {
            Accepted::Moving(stream.into_std()?)
        } else {
            Accepted::Here(stream)
        })
    }

    /// The socket, registered with the calling task's runtime.
    fn here(self) -> std::io::Result<TcpStream> {
        match self {
            Accepted::Here(stream) => Ok(stream),
            Accepted::Moving(stream) => TcpStream::from_std(stream),
        }
    }
}

/// Sets on `listener` what the sockets it accepts inherit: on a loopback address, a congestion
/// control that does not pace ([`super::congestion`]); and TCP_NODELAY, which on Linux they
/// inherit, saving a system call per connection. Returns whether they inherit TCP_NODELAY
/// (`false` where each must be set: another system, or it failed).
fn set_inherited(listener: &TcpListener, local: SocketAddr) -> bool {
    super::congestion::unpace_loopback(listener, local.ip());
    #[cfg(target_os = "linux")]
    {
        use nix::sys::socket::{setsockopt, sockopt::TcpNoDelay};
        setsockopt(listener, TcpNoDelay, &true).is_ok()
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Answers a connection over the total or the per-client limit with 429 and closes it;
/// `why` says which.
async fn refuse_connection(mut stream: TcpStream, why: String) {
    use tokio::io::AsyncWriteExt;
    let response = answer::too_many_connections(&why);
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
}

/// [`refuse_connection`] without a task: one write that does not wait (a fresh socket's buffer
/// takes it), and the descriptor is closed before this returns.
fn refuse_now(stream: TcpStream, why: &str) {
    use std::io::Write;
    if let Ok(stream) = stream.into_std() {
        let _ = (&stream).write(answer::too_many_connections(why).as_bytes());
    }
}

/// One connection's handler: TLS if configured, then HTTP/1.1 until it ends.
async fn handle(
    proxy: Arc<Proxy>,
    stream: TcpStream,
    conn: Arc<ClientConn>,
    shutdown: CancellationToken,
) {
    match proxy.tls.clone() {
        None => {
            let stream = Sniffed::new(stream, conn.client);
            serve_http(&proxy, TokioIo::new(stream), &conn, &shutdown).await
        }
        Some(acceptor) => {
            // The handshake counts against the header-read timeout: a silent client goes.
            match tokio::time::timeout(proxy.config.header_read_timeout, acceptor.accept(stream))
                .await
            {
                Ok(Ok(tls)) => serve_http(&proxy, TokioIo::new(tls), &conn, &shutdown).await,
                Ok(Err(error)) => {
                    tracing::debug!(%error, client = %conn.client, "TLS handshake failed")
                }
                Err(_) => tracing::debug!(client = %conn.client, "TLS handshake timed out"),
            }
        }
    }
    conn.closer().cancel();
}

async fn serve_http<I>(
    proxy: &Arc<Proxy>,
    io: TokioIo<I>,
    conn: &Arc<ClientConn>,
    shutdown: &CancellationToken,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service_conn = conn.clone();
    let service_proxy = proxy.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (proxy, conn) = (service_proxy.clone(), service_conn.clone());
        async move { Ok::<_, std::convert::Infallible>(dispatch(proxy, conn, req).await) }
    });
    let connection = http1(proxy).serve_connection(io, service).with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, client = %conn.client, "client connection ended with an error");
            }
        }
        _ = conn.closer().cancelled() => {
            // The lease closed: a request in flight ends with it (a forwarded body or wait is
            // tied to the lease's token), or is the refusal that closed it, which is answered;
            // then the connection closes. Nothing new is read from it.
            tracing::debug!(client = %conn.client, "connection closing: its lease closed");
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = proxy.hard_stop.cancelled() => {}
            }
        }
        _ = shutdown.cancelled() => {
            // Drain: finish the request in flight (until the drain's time is up), then close.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = proxy.hard_stop.cancelled() => {}
                _ = conn.closer().cancelled() => {}
            }
        }
    }
}

/// How the proxy reads its clients' HTTP/1.1 (on a connection, and inside a plain tunnel).
pub fn http1(proxy: &Proxy) -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(proxy.config.header_read_timeout)
        // hyper's floor is 8 KiB; the exact limit is `head_len`'s, in `over_head_limit`.
        .max_buf_size(proxy.config.max_header_bytes.max(8192))
        .keep_alive(true);
    builder
}

/// The 431 answer for a request whose head is over `--max-header-bytes`; none for the rest.
pub fn over_head_limit(
    proxy: &Proxy,
    conn: &ClientConn,
    req: &Request<Incoming>,
) -> Option<Response<Body>> {
    let limit = proxy.config.max_header_bytes;
    let len = head_len(req);
    (len > limit).then(|| head_too_large(proxy, conn, req, len, limit))
}

async fn dispatch(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
) -> Response<Body> {
    if let Some(too_large) = over_head_limit(&proxy, &conn, &req) {
        return too_large;
    }
    if req.method() == http::Method::CONNECT {
        connect::handle(proxy, conn, req).await
    } else {
        forward::handle(proxy, conn, req).await
    }
}

/// The size of a request head written plainly: the request line, one `name: value` line per
/// header and the blank line.
///
/// Counted here because hyper's `max_buf_size` bounds its read buffer, not the head: a head
/// that arrives in one large read is parsed whole even when it is far past the buffer's size.
/// hyper still stops a head that never ends once its buffer is full.
fn head_len(req: &Request<Incoming>) -> usize {
    let uri = req.uri();
    let path = uri.path_and_query().map_or(0, |p| p.as_str().len());
    let target = match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => {
            scheme.len() + "://".len() + authority.as_str().len() + path
        }
        (None, Some(authority)) => authority.as_str().len(),
        _ => path,
    };
    let line = req.method().as_str().len() + " ".len() + target + " HTTP/1.1\r\n".len();
    let headers: usize = req
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + ": ".len() + value.len() + "\r\n".len())
        .sum();
    line + headers + "\r\n".len()
}

/// 431 for a head over `--max-header-bytes` ([`answer::head_too_large`]), logged as refused
/// with no code: nothing was identified or decided.
fn head_too_large(
    proxy: &Proxy,
    conn: &ClientConn,
    req: &Request<Incoming>,
    len: usize,
    limit: usize,
) -> Response<Body> {
    use crate::telemetry::egress::{Kind, LoggedVerdict};
    let kind = match req.method() == http::Method::CONNECT {
        true => Kind::Connect,
        false => Kind::Http,
    };
    let mut ex = super::exchange::Exchange::new(
        proxy.telemetry.clone(),
        kind,
        req.method().clone(),
        conn.client,
        conn.listener,
    );
    let detail = format!("the request head is {len} bytes, over --max-header-bytes {limit}");
    let response = answer::head_too_large(req.method(), req.uri(), &detail);
    ex.verdict = LoggedVerdict::Refuse;
    ex.status = Some(response.status().as_u16());
    ex.error = Some(detail);
    response
}

#[cfg(test)]
mod tests {
    use super::{set_inherited, Accepted};
    #[cfg(target_os = "linux")]
    use crate::proxy::congestion::{current as congestion, paces};
    use std::io::Write;
    use std::time::Duration;
    use tokio::io::AsyncReadExt;

    /// What a listener's accepted sockets inherit: TCP_NODELAY (or it is set on each), and on
    /// loopback, wherever the system's congestion control paces, reno.
    #[tokio::test]
    async fn accepted_sockets_have_nodelay_and_on_loopback_no_pacing() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        #[cfg(target_os = "linux")]
        let default = congestion(&listener);
        let inherited = set_inherited(&listener, addr);
        assert_eq!(inherited, cfg!(target_os = "linux"));
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        if !inherited {
            accepted.set_nodelay(true).unwrap();
        }
        assert!(
            accepted.nodelay().unwrap(),
            "an accepted socket without TCP_NODELAY"
        );
        #[cfg(target_os = "linux")]
        {
            let want = if paces(&default) {
                "reno"
            } else {
                default.as_str()
            };
            assert_eq!(congestion(&accepted), want, "system default {default}");
        }
    }

    /// A connection accepted on one runtime and handed to another is polled by the second:
    /// it still reads after the accepting runtime (and its event loop) is gone.
    #[test]
    fn a_handed_over_socket_is_polled_where_it_moved() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let accepting = runtime();
        let (accepted, mut client) = accepting.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (stream, _) = listener.accept().await.unwrap();
            (Accepted::moving(stream, true).unwrap(), client)
        });
        drop(accepting);
        let read = runtime().block_on(async move {
            let mut stream = accepted.here().unwrap();
            client.write_all(b"ping").unwrap();
            let mut buf = [0u8; 4];
            tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut buf))
                .await
                .expect("the read finishes")
                .map(|_| buf)
        });
        assert_eq!(read.unwrap(), *b"ping");
    }
}
