//! CONNECT tunnels: decide, dial, answer 200, check the ClientHello's SNI, then copy bytes both
//! ways, counted (spliced when the client is a plain socket), until either side ends or the
//! lease closes. A tunnel to a host some secret is for is handed to [`super::terminate`] after
//! the dial instead.
//!
//! Invariant: the upstream is dialled before the client hears 200 (so refusals are 403 and
//! dial failures 502); the client's first bytes reach the upstream untouched, and only once
//! judged: first bytes that open a TLS record of any content type ([`hello::opening`]) must
//! be a complete ClientHello, with no other record before it (`tls-unverifiable` otherwise),
//! whose SNI the lease may reach (`sni-mismatch` otherwise); first bytes that open no record
//! must not be a request to another proxy ([`chained`]: `bad-target`); under `--require-sni`
//! anything but such a ClientHello is `tls-unverifiable`.

use super::answer;
use super::body::RelayEnd;
use super::decision::{Asked, Decision};
use super::exchange::Exchange;
use super::hello::{self, Opening, Probe, Reassembler, Unverifiable};
use super::pipeline::Cleared;
use super::plain_tunnel;
use super::sniffed::Sniffed;
use super::terminate;
use super::{Body, ClientConn, Proxy};
use crate::policy::chained::{self, Chained};
use crate::policy::codes::{Code, Refusal};
use crate::policy::target::parse_host;
use crate::policy::{HostVerdict, Rule, UpstreamAddr};
use crate::telemetry::egress::Kind;
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub async fn handle(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
) -> Response<Body> {
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        Kind::Connect,
        http::Method::CONNECT,
        conn.client,
        conn.listener,
    );
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_owned())
        .unwrap_or_default();
    if plain_tunnel::applies(&proxy.config, &authority) {
        return plain_tunnel::open(proxy, conn, req, authority, ex).await;
    }
    match open(&proxy, &conn, req.headers(), &authority, &mut ex).await {
        Err(refusal) => proxy.refuse(&mut ex, refusal, &authority).await,
        Ok((dialed, cleared)) => {
            let broker = match terminate::terminates(&proxy, &cleared.decision) {
                Ok(broker) => broker,
                Err(refusal) => return proxy.refuse(&mut ex, refusal, &authority).await,
            };
            if let Some(broker) = broker {
                if let Err(refusal) = terminate::open(&proxy, &broker, dialed, &cleared).await {
                    return proxy.refuse(&mut ex, refusal, &authority).await;
                }
                ex.status = Some(200);
                proxy.tasks.spawn(terminate::tunnel(
                    proxy.clone(),
                    conn.clone(),
                    req,
                    broker,
                    cleared,
                    authority,
                    ex,
                ));
                return answer::tunnel_open();
            }
            ex.status = Some(200);
            proxy.tasks.spawn(tunnel(
                proxy.clone(),
                conn.clone(),
                req,
                dialed.0,
                cleared,
                ex,
            ));
            answer::tunnel_open()
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
) -> Result<((TcpStream, UpstreamAddr), Cleared), Refusal> {
    let cleared = proxy
        .clear(conn, headers, Asked::Tunnel, authority, None, ex)
        .await?;
    let dialed = proxy.dial(&cleared.addrs, ex).await?;
    Ok((dialed, cleared))
}

async fn tunnel(
    proxy: Arc<Proxy>,
    // Held for the tunnel's life: the client connection stays counted against the lease.
    _conn: Arc<ClientConn>,
    req: Request<Incoming>,
    mut upstream: TcpStream,
    cleared: Cleared,
    mut ex: Exchange,
) {
    let Some(upgraded) = ex.upgraded(req).await else {
        return;
    };
    let mut client = TokioIo::new(upgraded);
    let (token, decision) = (cleared.token, cleared.decision);

    // The client's first bytes, held back until we know what they are.
    let mut first = Vec::with_capacity(4096);
    let looked = tokio::select! {
        _ = token.cancelled() => return,
        _ = proxy.hard_stop.cancelled() => {
            ex.error = RelayEnd::Drained.describe();
            return;
        }
        looked = look_at_first_bytes(&proxy, &mut client, &upstream, &mut first) => looked,
    };
    let require_sni = proxy.config.require_sni;
    let checked = match looked {
        FirstBytes::Idle => {
            ex.error = RelayEnd::Idle.describe();
            return;
        }
        FirstBytes::ClientGone => {
            ex.error = Some("the client closed the tunnel before its first bytes were read".into());
            return;
        }
        FirstBytes::Hello(Some(sni)) => check_sni(&decision, &sni),
        FirstBytes::Hello(None) if require_sni => Err(unverifiable(Unverifiable::NoSni)),
        FirstBytes::NotTls if require_sni => Err(unverifiable(Unverifiable::NotTls)),
        FirstBytes::ServerFirst if require_sni => Err(unverifiable(Unverifiable::ServerFirst)),
        FirstBytes::Hello(None) | FirstBytes::NotTls | FirstBytes::ServerFirst => Ok(()),
        FirstBytes::Unverifiable(why) => Err(unverifiable(why)),
        FirstBytes::Chained(what) => Err(Refusal::new(
            Code::BadTarget,
            format!(
                "the tunnel's first bytes are {what}: a tunnel is never a way to another proxy"
            ),
        )),
    };
    // Report mode lets a policy refusal through; a request to another proxy is none.
    let checked = checked.or_else(|refusal| match refusal.code.is_policy() {
        true => proxy.policy_failure(&mut ex, refusal),
        false => Err(refusal),
    });
    if let Err(refusal) = checked {
        proxy.record_refusal(&mut ex, &refusal).await;
        ex.error = Some(refusal.detail);
        return;
    }
    // A plain socket underneath (not the TLS listener's stream): hyper hands back what it
    // read past the CONNECT head and not yet given out, which follows `first`.
    let (client, rest) = match client.into_inner().downcast::<TokioIo<Sniffed>>() {
        Ok(parts) => (Ok(parts.io.into_inner().into_inner()), parts.read_buf),
        Err(upgraded) => (Err(TokioIo::new(upgraded)), Bytes::new()),
    };
    // Exactly the client's bytes, records as sent (zero-length ones included).
    for held in [&first[..], &rest[..]] {
        ex.bytes_up.fetch_add(held.len() as u64, Ordering::Relaxed);
        if let Err(error) = upstream.write_all(held).await {
            ex.error = Some(format!("upstream write: {error}"));
            return;
        }
    }
    drop((first, rest));

    match client {
        Ok(socket) => proxy.relay_tcp(socket, upstream, &token, &mut ex).await,
        Err(upgraded) => proxy.relay(upgraded, upstream, &token, &mut ex).await,
    }
}

/// What a tunnel's first client bytes turned out to be.
enum FirstBytes {
    /// A complete ClientHello, and its SNI if it has one.
    Hello(Option<String>),
    /// The first bytes open no TLS record.
    NotTls,
    /// The upstream spoke before the client sent anything (SMTP, SSH and the like).
    ServerFirst,
    /// Plain bytes that are (or may yet be) a request to another proxy.
    Chained(&'static str),
    /// Began like TLS (or had to, under `--require-sni`) but cannot be checked.
    Unverifiable(Unverifiable),
    /// Nothing either way for the tunnel idle timeout.
    Idle,
    /// The client closed (or failed) before its first bytes could be judged.
    ClientGone,
}

/// Reads the client's first bytes into `buf`. Nothing is forwarded meanwhile: bytes that may
/// open a TLS record commit the client to telling (and then to a whole ClientHello) within the
/// header-read timeout.
async fn look_at_first_bytes<S: AsyncRead + Unpin>(
    proxy: &Proxy,
    client: &mut S,
    upstream: &TcpStream,
    buf: &mut Vec<u8>,
) -> FirstBytes {
    let config = &proxy.config;
    // Without --require-sni a silent client is an idle tunnel; with it, it owes a ClientHello.
    let silence = match config.require_sni {
        true => config.header_read_timeout,
        false => config.tunnel_idle_timeout,
    };
    tokio::select! {
        read = client.read_buf(buf) => match read {
            Ok(0) | Err(_) => return FirstBytes::ClientGone,
            Ok(_) => {}
        },
        _ = upstream.readable() => return FirstBytes::ServerFirst,
        _ = tokio::time::sleep(silence) => {
            return match config.require_sni {
                true => FirstBytes::Unverifiable(Unverifiable::Timeout),
                false => FirstBytes::Idle,
            };
        }
    }
    let judged = async {
        loop {
            match hello::opening(buf) {
                Opening::NotTls => return read_plain(client, buf).await,
                Opening::Tls => return read_client_hello(client, buf).await,
                Opening::NeedMore => match client.read_buf(buf).await {
                    Ok(0) | Err(_) => return FirstBytes::ClientGone,
                    Ok(_) => {}
                },
            }
        }
    };
    let judged = tokio::time::timeout(config.header_read_timeout, judged).await;
    // What the bytes held opened with says which of the two was being waited for.
    judged.unwrap_or(match hello::opening(buf) == Opening::NotTls {
        true => FirstBytes::Chained(
            "a prefix that did not tell, within the header-read timeout, whether it is a \
             request to another proxy",
        ),
        false => FirstBytes::Unverifiable(Unverifiable::Timeout),
    })
}

/// Reads until the plain first bytes in `buf` tell whether they are a request to another
/// proxy ([`chained::judge`]). A client that ends its sending first sent what it had.
async fn read_plain<S: AsyncRead + Unpin>(client: &mut S, buf: &mut Vec<u8>) -> FirstBytes {
    loop {
        match chained::judge(buf) {
            Chained::Plain => return FirstBytes::NotTls,
            Chained::Proxy(what) => return FirstBytes::Chained(what),
            Chained::NeedMore => match client.read_buf(buf).await {
                Ok(0) => return FirstBytes::NotTls,
                Err(_) => return FirstBytes::ClientGone,
                Ok(_) => {}
            },
        }
    }
}

/// Reads until `buf` holds a whole ClientHello, or is known never to.
async fn read_client_hello<S: AsyncRead + Unpin>(client: &mut S, buf: &mut Vec<u8>) -> FirstBytes {
    let mut reassembler = Reassembler::default();
    loop {
        match reassembler.probe(buf) {
            Probe::Hello(sni) => return FirstBytes::Hello(sni),
            Probe::Unverifiable(why) => return FirstBytes::Unverifiable(why),
            Probe::NeedMore => {}
        }
        buf.reserve(4096);
        match client.read_buf(buf).await {
            // A client that gives up mid-hello sent nothing onward: closed, not refused.
            Ok(0) | Err(_) => return FirstBytes::ClientGone,
            Ok(_) => {}
        }
    }
}

fn unverifiable(why: Unverifiable) -> Refusal {
    Refusal::new(Code::TlsUnverifiable, why.to_string())
}

/// An SNI that differs from the CONNECT host must itself be allowed for the lease.
fn check_sni(decision: &Decision, sni: &str) -> Result<(), Refusal> {
    let target = &decision.target;
    let rule = match parse_host(sni) {
        Ok(host) if host == target.host => return Ok(()),
        Ok(host) => match decision.verdict(&host) {
            HostVerdict::Allowed(_) => return Ok(()),
            HostVerdict::Denied(by) => by.pattern(&host).map(Rule::Deny),
            HostVerdict::NotAllowed(_) => Some(Rule::NotInAllow),
        },
        Err(_) => None,
    };
    let refusal = Refusal::new(
        Code::SniMismatch,
        format!(
            "TLS SNI {sni:?} differs from the CONNECT host {} and is not allowed",
            target.host
        ),
    );
    Err(Refusal { rule, ..refusal })
}
