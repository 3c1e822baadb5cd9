//! CONNECT tunnels: decide, dial, answer 200, check the ClientHello's SNI, then copy bytes both
//! ways, counted, until either side ends or the lease closes.
//!
//! Invariant: the upstream is dialled before the client hears 200 (so refusals are 403 and
//! dial failures 502); the client's first bytes reach the upstream untouched unless they are
//! a ClientHello naming a host the lease may not reach, in which case the tunnel is closed.

use super::body::SpliceEnd;
use super::exchange::Exchange;
use super::refusal::{Code, Refusal};
use super::{empty, Admitted, Body, ConnInfo, Proxy};
use crate::policy::target::{parse_authority, parse_host};
use crate::policy::{HostVerdict, Target};
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
    conn: Arc<ConnInfo>,
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
    match open(&proxy, &conn, &req, &authority, &mut ex).await {
        Err(refusal) => proxy.refuse(&mut ex, refusal, &authority).await,
        Ok((stream, admitted, target)) => {
            ex.status = Some(200);
            proxy.tasks.spawn(tunnel(
                proxy.clone(),
                conn.clone(),
                req,
                stream,
                admitted,
                target,
                ex,
            ));
            let mut response = Response::new(empty());
            *response.status_mut() = StatusCode::OK;
            response
        }
    }
}

async fn open(
    proxy: &Proxy,
    conn: &ConnInfo,
    req: &Request<Incoming>,
    authority: &str,
    ex: &mut Exchange,
) -> Result<(TcpStream, Admitted, Target), Refusal> {
    let admitted = proxy.admit(conn, req.headers(), ex)?;
    let target =
        parse_authority(authority, None).map_err(|e| Refusal::new(Code::BadTarget, e.0))?;
    ex.target = Some(target.clone());
    proxy.judge_host(&admitted, &target, ex)?;
    let addrs = proxy.route(&admitted, &target, ex).await?;
    let (stream, _) = proxy.dial(&addrs, ex).await?;
    Ok((stream, admitted, target))
}

async fn tunnel(
    proxy: Arc<Proxy>,
    // Held for the tunnel's life: the client connection stays counted against the lease.
    _conn: Arc<ConnInfo>,
    req: Request<Incoming>,
    mut upstream: TcpStream,
    admitted: Admitted,
    target: Target,
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
    let token = admitted.token.clone();

    // The client's first bytes, held back until we know whether they are a ClientHello.
    let mut first = Vec::with_capacity(4096);
    let sni = tokio::select! {
        _ = token.cancelled() => return,
        _ = proxy.hard_stop.cancelled() => {
            ex.error = SpliceEnd::Drained.describe();
            return;
        }
        _ = tokio::time::sleep(proxy.config.tunnel_idle_timeout) => {
            ex.error = SpliceEnd::Idle.describe();
            return;
        }
        sni = read_client_hello(&mut client, &mut first) => sni,
        // Server-speaks-first protocols: nothing to inspect.
        _ = upstream.readable() => None,
    };
    if let Some(sni) = sni {
        if let Err(refusal) = check_sni(&proxy, &admitted, &target, &sni, &mut ex) {
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

    proxy.splice(client, upstream, &token, &mut ex).await;
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
    admitted: &Admitted,
    target: &Target,
    sni: &str,
    ex: &mut Exchange,
) -> Result<(), Refusal> {
    if sni.is_empty() {
        return Ok(());
    }
    let allowed = match parse_host(sni) {
        Ok(host) if host == target.host => return Ok(()),
        Ok(host) => matches!(admitted.verdict(&host), HostVerdict::Allowed(_)),
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
