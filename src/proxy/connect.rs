//! CONNECT tunnels: decide, dial, answer 200, check the ClientHello's SNI, then copy bytes both
//! ways, counted, until either side ends or the lease closes.
//!
//! Invariant: the upstream is dialled before the client hears 200 (so refusals are 403 and
//! dial failures 502); the client's first bytes reach the upstream untouched unless they are
//! a ClientHello naming a host the lease may not reach, in which case the tunnel is closed.

use super::body::RelayEnd;
use super::exchange::Exchange;
use super::pipeline::Decision;
use super::{empty, Body, ClientConn, Proxy};
use crate::policy::refusal::{Code, Refusal};
use crate::policy::target::parse_host;
use crate::policy::HostVerdict;
use crate::telemetry::egress::Kind;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The most client bytes held back while waiting for a whole ClientHello.
const MAX_HELLO: usize = 16 * 1024 + 5;

pub async fn handle(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
) -> Response<Body> {
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        Kind::Connect,
        "CONNECT",
        conn.client,
        conn.listener,
    );
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    match open(&proxy, &conn, req.headers(), &authority, &mut ex).await {
        Err(refusal) => proxy.refuse(&mut ex, refusal, &authority).await,
        Ok((stream, decision)) => {
            ex.status = Some(200);
            proxy.tasks.spawn(tunnel(
                proxy.clone(),
                conn.clone(),
                req,
                stream,
                decision,
                ex,
            ));
            let mut response = Response::new(empty());
            *response.status_mut() = StatusCode::OK;
            response
        }
    }
}

/// Decides, then dials: the client hears 200 only once the upstream is connected.
pub async fn open(
    proxy: &Proxy,
    conn: &ClientConn,
    headers: &http::HeaderMap,
    authority: &str,
    ex: &mut Exchange,
) -> Result<(TcpStream, Decision), Refusal> {
    let decision = proxy.decide(conn, headers, authority, None, ex).await?;
    let (stream, _) = proxy.dial(&decision.addrs, ex).await?;
    Ok((stream, decision))
}

async fn tunnel(
    proxy: Arc<Proxy>,
    // Held for the tunnel's life: the client connection stays counted against the lease.
    _conn: Arc<ClientConn>,
    req: Request<Incoming>,
    mut upstream: TcpStream,
    decision: Decision,
    mut ex: Exchange,
) {
    let upgraded = match hyper::upgrade::on(req).await {
        Ok(upgraded) => upgraded,
        Err(error) => {
            ex.error = Some(format!("upgrade failed: {error}"));
            return;
        }
    };
    let mut client = TokioIo::new(upgraded);
    let token = decision.token.clone();

    // The client's first bytes, held back until we know whether they are a ClientHello.
    let mut first = Vec::with_capacity(4096);
    let sni = tokio::select! {
        _ = token.cancelled() => return,
        _ = proxy.hard_stop.cancelled() => {
            ex.error = RelayEnd::Drained.describe();
            return;
        }
        _ = tokio::time::sleep(proxy.config.tunnel_idle_timeout) => {
            ex.error = RelayEnd::Idle.describe();
            return;
        }
        sni = read_client_hello(&mut client, &mut first) => sni,
        // Server-speaks-first protocols: nothing to inspect.
        _ = upstream.readable() => None,
    };
    if let Some(sni) = sni {
        if let Err(refusal) = check_sni(&proxy, &decision, &sni, &mut ex) {
            proxy.record_refusal(&mut ex, &refusal).await;
            ex.error = Some(refusal.detail);
            return;
        }
    }
    ex.bytes_up.fetch_add(first.len() as u64, Ordering::Relaxed);
    if let Err(error) = upstream.write_all(&first).await {
        ex.error = Some(format!("upstream write: {error}"));
        return;
    }
    drop(first);

    proxy.relay(client, upstream, &token, &mut ex).await;
}

/// Reads from the client until its bytes are known to be a ClientHello (returns its SNI, or
/// an empty string for a hello without one) or known not to be (returns `None`).
async fn read_client_hello<S: AsyncRead + Unpin>(
    client: &mut S,
    buf: &mut Vec<u8>,
) -> Option<String> {
    loop {
        match client_hello_sni(buf) {
            Probe::Hello(sni) => return Some(sni.unwrap_or_default()),
            Probe::NotHello => return None,
            Probe::NeedMore if buf.len() >= MAX_HELLO => return None,
            Probe::NeedMore => {}
        }
        buf.reserve(4096);
        match client.read_buf(buf).await {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

enum Probe {
    NeedMore,
    NotHello,
    Hello(Option<String>),
}

/// Parses a TLS ClientHello with rustls's `Acceptor` (never completing a handshake).
fn client_hello_sni(bytes: &[u8]) -> Probe {
    match bytes.first() {
        None => return Probe::NeedMore,
        Some(0x16) => {}
        Some(_) => return Probe::NotHello,
    }
    let mut acceptor = rustls::server::Acceptor::default();
    let mut cursor = std::io::Cursor::new(bytes);
    while (cursor.position() as usize) < bytes.len() {
        match acceptor.read_tls(&mut cursor) {
            Ok(0) => break,
            Ok(_) => {}
            Err(_) => return Probe::NotHello,
        }
    }
    match acceptor.accept() {
        Ok(Some(accepted)) => {
            Probe::Hello(accepted.client_hello().server_name().map(str::to_owned))
        }
        Ok(None) => Probe::NeedMore,
        Err(_) => Probe::NotHello,
    }
}

/// An SNI that differs from the CONNECT host must itself be allowed for the lease.
fn check_sni(
    proxy: &Proxy,
    decision: &Decision,
    sni: &str,
    ex: &mut Exchange,
) -> Result<(), Refusal> {
    if sni.is_empty() {
        return Ok(());
    }
    let target = &decision.target;
    let allowed = match parse_host(sni) {
        Ok(host) if host == target.host => return Ok(()),
        Ok(host) => matches!(decision.verdict(&host), HostVerdict::Allowed(_)),
        Err(_) => false,
    };
    if allowed {
        return Ok(());
    }
    proxy.policy_failure(
        ex,
        Refusal::new(
            Code::SniMismatch,
            format!(
                "TLS SNI {sni:?} differs from the CONNECT host {} and is not allowed",
                target.host
            ),
        ),
    )
}
