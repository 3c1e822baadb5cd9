//! Forwarding absolute-form `http://` requests: checks, then the request goes upstream with
//! hop-by-hop headers and our credentials removed, bodies streamed both ways, and WebSocket
//! upgrades spliced once the upstream agrees.
//!
//! Invariant: what reaches the upstream names the same host the decision was made for — the
//! `Host` header must agree with the absolute URI, and the connection is to a checked address.

use super::body::Metered;
use super::exchange::Exchange;
use super::identify::LEASE_ID_HEADER;
use super::refusal::{Code, Refusal};
use super::{empty, Admitted, Body, ConnInfo, Proxy, UpBody};
use crate::policy::target::parse_authority;
use crate::policy::{Target, UpstreamAddr};
use crate::telemetry::egress::Kind;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::sync::Arc;

pub async fn handle(
    proxy: Arc<Proxy>,
    conn: Arc<ConnInfo>,
    mut req: Request<Incoming>,
) -> Response<Body> {
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        Kind::Http,
        req.method().as_str(),
        conn.client,
        conn.listener,
    );
    let shown_target = req.uri().to_string();
    match prepare(&proxy, &conn, &mut req, &mut ex).await {
        Err(refusal) => proxy.refuse(&mut ex, refusal, &shown_target).await,
        Ok((admitted, target, addrs)) => {
            match send(&proxy, req, admitted, &target, &addrs, &mut ex).await {
                Ok(response) => response.map_exchange(&proxy, &conn, ex),
                Err(refusal) => proxy.refuse(&mut ex, refusal, &shown_target).await,
            }
        }
    }
}

async fn prepare(
    proxy: &Proxy,
    conn: &ConnInfo,
    req: &mut Request<Incoming>,
    ex: &mut Exchange,
) -> Result<(Admitted, Target, Vec<UpstreamAddr>), Refusal> {
    let uri = req.uri().clone();
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(Refusal::new(
            Code::NotAProxyRequest,
            "this is a proxy: send absolute-form requests (GET http://host/path) or CONNECT",
        ));
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(Refusal::new(
            Code::BadTarget,
            format!("scheme {scheme} is not forwarded; use CONNECT for TLS"),
        ));
    }
    if req.headers().get_all(header::HOST).iter().count() > 1 {
        return Err(Refusal::new(Code::BadTarget, "more than one Host header"));
    }
    let admitted = proxy.admit(conn, req.headers(), ex)?;
    if req.method().as_str().eq_ignore_ascii_case("TRACE")
        || req.method().as_str().eq_ignore_ascii_case("TRACK")
    {
        return Err(Refusal::new(
            Code::MethodNotAllowed,
            format!("{} is not forwarded", req.method()),
        ));
    }
    let target = parse_authority(authority.as_str(), Some(80))
        .map_err(|e| Refusal::new(Code::BadTarget, e.0))?;
    ex.target = Some(target.clone());
    if let Some(host) = req.headers().get(header::HOST) {
        let named = host
            .to_str()
            .ok()
            .and_then(|h| parse_authority(h, Some(80)).ok());
        if named.as_ref() != Some(&target) {
            proxy.policy_failure(
                ex,
                Refusal::new(
                    Code::HostMismatch,
                    format!(
                        "Host header {:?} does not name the URI's {target}",
                        String::from_utf8_lossy(host.as_bytes())
                    ),
                ),
            )?;
        }
    }
    proxy.judge_host(&admitted, &target, ex)?;
    let addrs = proxy.route(&admitted, &target, ex).await?;
    Ok((admitted, target, addrs))
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and our own credentials: never forwarded.
const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    LEASE_ID_HEADER,
];

/// Removes hop-by-hop headers (and those `Connection` names); keeps an upgrade if asked.
fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    let upgrade = headers.get(header::UPGRADE).cloned();
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
    if let (true, Some(upgrade)) = (keep_upgrade, upgrade) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
}

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// A pooled connection to one of `addrs`, or a new one.
async fn sender_for(
    proxy: &Proxy,
    addrs: &[UpstreamAddr],
    upgrade: bool,
    ex: &mut Exchange,
) -> Result<(SendRequest<UpBody>, UpstreamAddr), Refusal> {
    if !upgrade {
        for &addr in addrs {
            if let Some(sender) = proxy.pool.checkout(addr) {
                ex.dialed = Some(addr);
                return Ok((sender, addr));
            }
        }
    }
    let (stream, addr) = proxy.dial(addrs, ex).await?;
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, UpBody>(TokioIo::new(stream))
        .await
        .map_err(|e| {
            Refusal::new(
                Code::UpstreamUnreachable,
                format!("HTTP handshake with {addr}: {e}"),
            )
        })?;
    tokio::spawn(async move {
        if let Err(error) = connection.with_upgrades().await {
            tracing::debug!(%error, "upstream connection ended with an error");
        }
    });
    Ok((sender, addr))
}

/// A response not yet tied to its exchange.
struct Forwarded {
    response: Response<Incoming>,
    token: tokio_util::sync::CancellationToken,
    upgrade: Option<hyper::upgrade::OnUpgrade>,
}

impl Forwarded {
    /// The client's response: the upstream's, with a metered body that owns the exchange
    /// (or, for a WebSocket, a spliced upgrade that does).
    fn map_exchange(
        mut self,
        proxy: &Arc<Proxy>,
        conn: &Arc<ConnInfo>,
        mut ex: Exchange,
    ) -> Response<Body> {
        let upstream_upgrade = (self.response.status() == StatusCode::SWITCHING_PROTOCOLS
            && self.upgrade.is_some())
        .then(|| hyper::upgrade::on(&mut self.response));
        let (mut parts, body) = self.response.into_parts();
        ex.status = Some(parts.status.as_u16());
        if let (Some(upstream_upgrade), Some(client_upgrade)) = (upstream_upgrade, self.upgrade) {
            strip_hop_by_hop(&mut parts.headers, true);
            proxy.tasks.spawn(splice_upgrade(
                proxy.clone(),
                conn.clone(),
                client_upgrade,
                upstream_upgrade,
                self.token,
                ex,
            ));
            return Response::from_parts(parts, empty());
        }
        strip_hop_by_hop(&mut parts.headers, false);
        let counter = ex.bytes_down.clone();
        let body = Metered::new(body, counter, self.token, Some(ex));
        Response::from_parts(parts, body.boxed_unsync())
    }
}

async fn send(
    proxy: &Proxy,
    mut req: Request<Incoming>,
    admitted: Admitted,
    target: &Target,
    addrs: &[UpstreamAddr],
    ex: &mut Exchange,
) -> Result<Forwarded, Refusal> {
    let upgrade = is_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = Uri::try_from(path).map_err(|e| Refusal::new(Code::BadTarget, e.to_string()))?;
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers, upgrade);
    if !parts.headers.contains_key(header::HOST) {
        let host = HeaderValue::from_str(&host_header(target))
            .map_err(|e| Refusal::new(Code::BadTarget, e.to_string()))?;
        parts.headers.insert(header::HOST, host);
    }
    let body = Metered::new(body, ex.bytes_up.clone(), admitted.token.clone(), None).boxed_unsync();
    let request = Request::from_parts(parts, body);

    let (mut sender, addr) = sender_for(proxy, addrs, upgrade, ex).await?;
    let response = tokio::select! {
        response = sender.send_request(request) => response.map_err(|e| {
            // A body the client framed badly (hyper reads TE + CL as chunked, RFC 9112 §6.3)
            // is the client's fault, not the upstream's.
            if e.is_user() {
                Refusal::new(Code::BadTarget, format!("the request body is malformed: {e}"))
            } else {
                Refusal::new(Code::UpstreamUnreachable, format!("forwarding to {addr}: {e}"))
            }
        })?,
        _ = admitted.token.cancelled() => {
            return Err(Refusal::new(Code::LeaseRevoked, "the lease closed while the request was in flight"));
        }
    };
    if !upgrade {
        proxy.pool.checkin(addr, sender);
    }
    Ok(Forwarded {
        response,
        token: admitted.token,
        upgrade: client_upgrade,
    })
}

/// The Host header for a target (port only when not 80).
fn host_header(target: &Target) -> String {
    if target.port == 80 {
        match &target.host {
            crate::policy::TargetHost::Ip(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
            host => host.to_string(),
        }
    } else {
        target.to_string()
    }
}

/// Copies an upgraded (WebSocket) connection both ways until either side ends, the lease
/// closes, a drain runs out or it idles.
async fn splice_upgrade(
    proxy: Arc<Proxy>,
    // Held for the splice's life: the client connection stays counted against the lease.
    _conn: Arc<ConnInfo>,
    client: hyper::upgrade::OnUpgrade,
    upstream: hyper::upgrade::OnUpgrade,
    token: tokio_util::sync::CancellationToken,
    mut ex: Exchange,
) {
    let (client, upstream) = match tokio::try_join!(client, upstream) {
        Ok(pair) => pair,
        Err(error) => {
            ex.error = Some(format!("upgrade failed: {error}"));
            return;
        }
    };
    proxy
        .splice(
            TokioIo::new(client),
            TokioIo::new(upstream),
            &token,
            &mut ex,
        )
        .await;
}
