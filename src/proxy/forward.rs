//! Forwarding absolute-form `http://` requests: checks, then the request goes upstream with
//! hop-by-hop headers and our credentials removed, bodies streamed both ways, and WebSocket
//! upgrades relayed once the upstream agrees; the answer comes back without fields that could
//! pass for the proxy's own refusal.
//!
//! Invariant: what reaches the upstream names the same host the decision was made for — the
//! `Host` header must agree with the absolute URI, and the connection is to a checked address
//! and was opened for the same lease (a pooled connection is never lent to another lease).

use super::approve;
use super::body::Metered;
use super::body::Prefixed;
use super::decision::Asked;
use super::decision::Decision;
use super::exchange::Exchange;
use super::identify::{self, LEASE_ID_HEADER};
use super::mcp;
use super::pipeline::Cleared;
use super::upstream::held::{Held, Taken};
use super::upstream::PoolKey;
use super::workers::Workers;
use super::{empty, Body, ClientConn, Proxy};
use crate::intercept::inspect::{inspect, Seen, MAX_BODY_SCAN};
use crate::intercept::Broker;
use crate::mcp::McpServer;
use crate::policy::codes::{Code, Refusal};
use crate::policy::framing;
use crate::policy::path::{self, Ambiguous};
use crate::policy::{Target, TargetHost, UpstreamAddr};
use crate::secrets::{Secret, SecretSet};
use crate::telemetry::egress::Kind;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode, Uri};
use http_body::Body as _;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub async fn handle(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
) -> Response<Body> {
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        Kind::Http,
        req.method().clone(),
        conn.client,
        conn.listener,
    );
    // Shares the request's bytes: written out only for a refusal's line.
    let uri = req.uri().clone();
    let decided = match request_shape(&req) {
        Ok(authority) => {
            let asked = Asked::Forward {
                method: req.method(),
                host: req.headers().get(header::HOST),
            };
            proxy
                .clear(&conn, req.headers(), asked, authority, Some(80), &mut ex)
                .await
        }
        Err(refusal) => Err(refusal),
    };
    let decided = decided.and_then(|cleared| {
        let target = uri.path_and_query().map_or("", |p| p.as_str());
        identify::token_kept(&cleared.identity, target, req.headers())?;
        Ok(cleared)
    });
    let sent = match decided {
        Ok(cleared) => {
            let mut req = req;
            let client_upgrade = is_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
            let to = Upstream {
                lease_id: cleared.lease_id(),
                addrs: &cleared.addrs,
                target: &cleared.decision.target,
                token: &cleared.token,
                tls: None,
                held: None,
            };
            let server = proxy.config.mcp.find(&cleared.decision.target, false);
            let named = approve::names_host(&cleared.decision);
            match (&proxy.broker, server) {
                (_, Some(server)) => {
                    to_mcp_server(&proxy, server, req, client_upgrade, to, &cleared, &mut ex).await
                }
                (None, None) if !named => send(&proxy, req, client_upgrade, to, &mut ex).await,
                (broker, None) => {
                    let read = match broker {
                        Some(broker) => checked(broker, req, &cleared, MAX_BODY_SCAN).await,
                        None => {
                            let (parts, body) = req.into_parts();
                            read_ahead(body, &cleared.token, MAX_BODY_SCAN)
                                .await
                                .map(|(body, ahead)| (Request::from_parts(parts, body), ahead))
                        }
                    };
                    match read {
                        Ok((req, ahead)) => {
                            match hold(&proxy, &req, &ahead, &cleared, &mut ex).await {
                                Ok(()) => send(&proxy, req, client_upgrade, to, &mut ex).await,
                                Err(refusal) => Err(refusal),
                            }
                        }
                        Err(refusal) => Err(refusal),
                    }
                }
            }
        }
        Err(refusal) => Err(refusal),
    };
    match sent {
        Ok(forwarded) => forwarded.into_client_response(&proxy, &conn, ex),
        Err(refusal) => proxy.refuse(&mut ex, refusal, &uri.to_string()).await,
    }
}

/// Holds a forwarded request (its body's start read ahead as `ahead`) while a route the chain's
/// `approvals` names takes it ([`approve::route`]).
async fn hold<B>(
    proxy: &Proxy,
    req: &Request<B>,
    ahead: &[u8],
    cleared: &Cleared,
    ex: &mut Exchange,
) -> Result<(), Refusal> {
    let (path, query) = (req.uri().path(), req.uri().query());
    let target = match &proxy.broker {
        Some(broker) => broker.secrets.current().shown_target(path, query),
        None => req
            .uri()
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
    };
    let shown = approve::Shown {
        scheme: "http",
        target: &target,
        body: ahead,
    };
    let asked = (req.method(), req.uri());
    approve::route(proxy, &cleared.decision, asked, shown, &cleared.token, ex).await
}

/// With secrets configured, a forwarded request is checked for misuse like one inside a
/// terminated tunnel, and nothing is put in: a secret never travels in plain HTTP.
async fn checked(
    broker: &Broker,
    req: Request<Incoming>,
    cleared: &Cleared,
    limit: usize,
) -> Result<(Request<Prefixed<Incoming>>, bytes::Bytes), Refusal> {
    let (parts, body) = req.into_parts();
    let (body, ahead) = read_ahead(body, &cleared.token, limit).await?;
    let set = broker.secrets.current();
    let normal = path::normalise(parts.uri.path());
    inspected(
        broker,
        &set,
        &cleared.decision,
        &parts,
        &ahead,
        normal.as_deref().map_err(|&why| why),
        false,
    )?;
    Ok((Request::from_parts(parts, body), ahead))
}

/// A forwarded request to a plain-HTTP MCP server: read whole (and checked for misuse, with
/// secrets configured), judged ([`mcp::read`]), sent, its answer's tool lists filtered.
async fn to_mcp_server(
    proxy: &Proxy,
    server: &McpServer,
    req: Request<Incoming>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    to: Upstream<'_>,
    cleared: &Cleared,
    ex: &mut Exchange,
) -> Result<Forwarded, Refusal> {
    let limit = mcp::MAX_REQUEST.saturating_add(1);
    let (req, ahead) = match &proxy.broker {
        Some(broker) => checked(broker, req, cleared, limit).await?,
        None => {
            let (parts, body) = req.into_parts();
            let (body, ahead) = read_ahead(body, &cleared.token, limit).await?;
            (Request::from_parts(parts, body), ahead)
        }
    };
    hold(proxy, &req, &ahead, cleared, ex).await?;
    let chain = &cleared.decision.chain;
    let edge = mcp::Edge {
        spending: &proxy.telemetry.spending,
        approvals: &proxy.approvals,
        lease_closed: &cleared.token,
    };
    let (tap, read) = mcp::read(server, req.method(), chain, edge, &ahead).await;
    ex.mcp = Some(tap);
    let filter_answer = read?;
    match send(proxy, req, client_upgrade, to, ex).await {
        Ok(mut forwarded) => {
            let read = ex.mcp.as_deref().expect("set above");
            let rewrite = mcp::answer_rewrite(forwarded.content_type(), server, chain, read);
            if let (true, Some(rewrite)) = (filter_answer, rewrite) {
                forwarded.rewrite_body(rewrite);
            }
            Ok(forwarded)
        }
        Err(refusal) => {
            if let (true, Some(read)) = (mcp::never_sent(refusal.code), ex.mcp.as_deref_mut()) {
                read.release();
            }
            Err(refusal)
        }
    }
}

/// The body's first `limit` bytes (at least; [`MAX_BODY_SCAN`] for inspection) read ahead
/// (to be looked at), and the body that still gives them out first.
pub async fn read_ahead(
    body: Incoming,
    token: &tokio_util::sync::CancellationToken,
    limit: usize,
) -> Result<(Prefixed<Incoming>, bytes::Bytes), Refusal> {
    tokio::select! {
        read = Prefixed::read_ahead(body, limit) => read.map_err(|e| {
            Refusal::new(Code::BadTarget, format!("reading the request body: {e}"))
        }),
        _ = token.cancelled() => Err(Refusal::new(
            Code::LeaseRevoked,
            "the lease closed while the request was read",
        )),
    }
}

/// [`inspect`] of a request of `decision`'s lease: its target, header values and `ahead`; its
/// path [`normalise`](path::normalise)d is `normal`.
pub fn inspected<'s>(
    broker: &Broker,
    set: &'s SecretSet,
    decision: &Decision,
    parts: &http::request::Parts,
    ahead: &[u8],
    normal: Result<&str, Ambiguous>,
    terminated: bool,
) -> Result<Vec<&'s Secret>, Refusal> {
    let lease = &decision.chain[0];
    let snapshot = &decision.snapshot;
    let key = snapshot.ledger.signing_key(&lease.id);
    let target = parts.uri.path_and_query().map_or("", |p| p.as_str());
    let mut scanned: Vec<&[u8]> = Vec::with_capacity(parts.headers.len() + 2);
    scanned.push(target.as_bytes());
    scanned.extend(parts.headers.values().map(HeaderValue::as_bytes));
    scanned.push(ahead);
    let host = match &decision.target.host {
        TargetHost::Name(name) => Some(name.as_str()),
        TargetHost::Ip(_) => None,
    };
    let shown = set.shown_target(parts.uri.path(), None);
    let seen = Seen {
        method: parts.method.as_str(),
        path: &shown,
        normal,
        host,
        parts: &scanned,
        terminated,
    };
    inspect(set, lease, key, &broker.placeholders, &seen)
}

/// What makes a request forwardable at all, before any lease is looked at: an absolute
/// `http://` URI, and one reading of its framing ([`framing::check`]). Returns the URI's
/// authority.
fn request_shape(req: &Request<Incoming>) -> Result<&str, Refusal> {
    let uri = req.uri();
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
    framing::check(req.version(), req.headers())?;
    Ok(authority.as_str())
}

/// How many fields [`HOP_BY_HOP`] names.
const HOPS: usize = 10;

/// Hop-by-hop headers (RFC 9110 §7.6.1) and our own credentials: never forwarded. Names, not
/// strings: removing by `&str` parses and lower-cases the name on every call, twice per
/// request for each of these.
const HOP_BY_HOP: [HeaderName; HOPS] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
    LEASE_ID_HEADER,
];

/// Removes hop-by-hop headers (and those `Connection` names); keeps an upgrade if asked.
pub fn strip_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) {
    // One pass over the few fields a message has, noting which of ours are there, instead of
    // a lookup for each of ours: most messages carry none of them, or only
    // `Proxy-Authorization`.
    let mut present = [false; HOPS];
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|hop| hop == name) {
            present[i] = true;
        }
    }
    if !present.contains(&true) {
        return;
    }
    let upgrade = headers.get(header::UPGRADE).cloned();
    // `HOP_BY_HOP[0]` is `Connection`: the fields it names go too.
    if present[0] {
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
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, there)| *there) {
        headers.remove(name);
    }
    if let (true, Some(upgrade)) = (keep_upgrade, upgrade) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        headers.insert(header::UPGRADE, upgrade);
    }
}

pub fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
}

/// Where a request goes upstream: the lease whose pool it may use, the checked addresses, the
/// target, the lease's token, and TLS to the origin for a terminated tunnel.
pub struct Upstream<'a> {
    pub lease_id: &'a str,
    pub addrs: &'a [UpstreamAddr],
    pub target: &'a Target,
    pub token: &'a tokio_util::sync::CancellationToken,
    /// The verified TLS configuration and the name to verify (the CONNECT host).
    pub tls: Option<(&'a Arc<rustls::ClientConfig>, &'a str)>,
    /// A terminated tunnel's kept connection, tried before the pool and given the connection
    /// back.
    pub held: Option<&'a Held>,
}

impl Upstream<'_> {
    fn key(&self, addr: UpstreamAddr) -> PoolKey {
        PoolKey {
            lease_id: self.lease_id.to_owned(),
            addr,
            worker: Workers::current(),
            tls_name: self.tls.map(|(_, name)| name.to_owned()),
        }
    }
}

/// The tunnel's kept connection, else one of the lease's own pool to one of `to.addrs`, else a
/// new one (over TLS to the origin, verified, for a terminated tunnel).
async fn sender_for(
    proxy: &Proxy,
    to: &Upstream<'_>,
    upgrade: bool,
    ex: &mut Exchange,
) -> Result<(SendRequest<Body>, UpstreamAddr), Refusal> {
    if !upgrade {
        let kept = to
            .held
            .map_or(Taken::Nothing, |held| held.take(proxy.pool.idle_for()));
        match kept {
            Taken::Ready(sender, addr) if to.addrs.contains(&addr) => {
                ex.dialed = Some(addr);
                return Ok((sender, addr));
            }
            // Still answering another stream (or not to an address asked now): for the pool,
            // which waits for it to be free.
            Taken::Ready(sender, addr) | Taken::Busy(sender, addr) => {
                proxy.pool.checkin(to.key(addr), sender);
            }
            Taken::Nothing => {}
        }
        for &addr in to.addrs {
            if let Some(sender) = proxy.pool.checkout(&to.key(addr)) {
                ex.dialed = Some(addr);
                return Ok((sender, addr));
            }
        }
    }
    let (stream, addr) = proxy.dial(to.addrs, ex).await?;
    let sender = match to.tls {
        None => handshake(TokioIo::new(stream), addr).await?,
        Some((config, name)) => {
            let tls =
                upstream_tls(config, name, stream, addr, proxy.config.connect_timeout).await?;
            handshake(TokioIo::new(tls), addr).await?
        }
    };
    Ok((sender, addr))
}

/// TLS to the origin of a terminated tunnel, verified for `name` (the CONNECT host): a failure
/// is `upstream-tls-failed`, never a way around it.
pub async fn upstream_tls(
    config: &Arc<rustls::ClientConfig>,
    name: &str,
    stream: tokio::net::TcpStream,
    addr: UpstreamAddr,
    limit: std::time::Duration,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, Refusal> {
    let failed = |why: String| {
        Refusal::new(
            Code::UpstreamTlsFailed,
            format!("TLS to {name} at {addr}: {why}"),
        )
    };
    let server_name = rustls::pki_types::ServerName::try_from(name.to_owned())
        .map_err(|e| failed(e.to_string()))?;
    let connector = tokio_rustls::TlsConnector::from(config.clone());
    match tokio::time::timeout(limit, connector.connect(server_name, stream)).await {
        Ok(Ok(tls)) => Ok(tls),
        Ok(Err(error)) => Err(failed(error.to_string())),
        Err(_) => Err(failed(format!("no handshake within {limit:?}"))),
    }
}

/// Puts a connection opened elsewhere (a terminated tunnel's first, made before its 200) into
/// the lease's pool, for the next request to `to`.
pub async fn pool_connection<IO>(
    proxy: &Proxy,
    to: &Upstream<'_>,
    addr: UpstreamAddr,
    io: IO,
) -> Result<(), Refusal>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let sender = handshake(io, addr).await?;
    proxy.pool.checkin(to.key(addr), sender);
    Ok(())
}

/// An HTTP/1.1 client connection over `io` (upgrades kept, for WebSockets).
async fn handshake<IO>(io: IO, addr: UpstreamAddr) -> Result<SendRequest<Body>, Refusal>
where
    IO: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(io)
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
    Ok(sender)
}

/// A response not yet tied to its exchange.
pub struct Forwarded {
    response: Response<Incoming>,
    token: tokio_util::sync::CancellationToken,
    upgrade: Option<hyper::upgrade::OnUpgrade>,
    /// What the answer's body goes through before the client has it (an MCP server's tool
    /// lists, cut to the lease's tools).
    rewrite: Option<Rewrite>,
}

/// A rewrite of an answer's body.
pub type Rewrite = Box<dyn FnOnce(Incoming) -> Body + Send>;

impl Forwarded {
    /// The answer's `Content-Type`, when it has a readable one.
    pub fn content_type(&self) -> Option<&str> {
        self.response
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
    }

    /// The answer's body goes through `rewrite` (its length is then the rewrite's: chunked).
    pub fn rewrite_body(&mut self, rewrite: Rewrite) {
        self.response.headers_mut().remove(header::CONTENT_LENGTH);
        self.rewrite = Some(rewrite);
    }

    /// Each field of the answer that holds a value of `set` shown as
    /// [`SecretSet::answered_field`] gives it (the value taken out).
    pub fn without_values(&mut self, set: &SecretSet) {
        for value in self.response.headers_mut().values_mut() {
            if let Some(shown) = set.answered_field(value.as_bytes()) {
                *value = HeaderValue::from_bytes(&shown)
                    .unwrap_or_else(|_| HeaderValue::from_static(crate::secrets::redact::REDACTED));
            }
        }
    }

    /// The client's response: the upstream's, with a metered body that owns the exchange
    /// (or, for a WebSocket, a relayed upgrade that does).
    pub fn into_client_response(
        mut self,
        proxy: &Arc<Proxy>,
        conn: &Arc<ClientConn>,
        mut ex: Exchange,
    ) -> Response<Body> {
        let upstream_upgrade = (self.response.status() == StatusCode::SWITCHING_PROTOCOLS
            && self.upgrade.is_some())
        .then(|| hyper::upgrade::on(&mut self.response));
        let (mut parts, body) = self.response.into_parts();
        unforged(&mut parts);
        ex.status = Some(parts.status.as_u16());
        if let (Some(upstream_upgrade), Some(client_upgrade)) = (upstream_upgrade, self.upgrade) {
            strip_hop_by_hop(&mut parts.headers, true);
            ex.bytes_down
                .fetch_add(response_head_len(&parts), Ordering::Relaxed);
            proxy.tasks.spawn(relay_upgrade(
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
        ex.bytes_down
            .fetch_add(response_head_len(&parts), Ordering::Relaxed);
        if let Some(tap) = ex.model.as_mut() {
            tap.head(parts.status, &parts.headers);
        }
        let counter = ex.bytes_down.clone();
        let body = match self.rewrite {
            None => Metered::new(body, counter, self.token, Some(ex)).boxed_unsync(),
            Some(rewrite) => {
                Metered::new(rewrite(body), counter, self.token, Some(ex)).boxed_unsync()
            }
        };
        Response::from_parts(parts, body)
    }
}

/// The prefix of the fields the proxy's own answers carry (`x-leasegate-refusal`).
const OUR_FIELDS: &str = "x-leasegate-";

/// An upstream's answer never passes for one of the proxy's own refusals: its
/// `X-Leasegate-*` fields go, and so does a reason phrase that names a refusal code.
fn unforged(parts: &mut http::response::Parts) {
    let ours: Vec<HeaderName> = parts
        .headers
        .keys()
        .filter(|name| name.as_str().starts_with(OUR_FIELDS))
        .cloned()
        .collect();
    for name in ours {
        parts.headers.remove(name);
    }
    let names_a_code = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()
        .is_some_and(|reason| {
            let reason = reason.as_bytes().trim_ascii();
            Code::ALL
                .iter()
                .any(|code| code.as_str().as_bytes().eq_ignore_ascii_case(reason))
        });
    if names_a_code {
        parts.extensions.remove::<hyper::ext::ReasonPhrase>();
    }
}

/// Phases 6 and 7 for a forwarded request (or one inside a terminated tunnel): a pooled or new
/// connection to a checked address, the request streamed up, and the response head awaited
/// (bounded by `upstream_response_timeout`).
pub async fn send<B>(
    proxy: &Proxy,
    req: Request<B>,
    client_upgrade: Option<hyper::upgrade::OnUpgrade>,
    to: Upstream<'_>,
    ex: &mut Exchange,
) -> Result<Forwarded, Refusal>
where
    B: http_body::Body<Data = bytes::Bytes> + Unpin + Send + 'static,
    B::Error: Into<super::BoxError>,
{
    let upgrade = client_upgrade.is_some();
    let (mut parts, body) = req.into_parts();
    // Origin-form, sharing the request's bytes.
    let mut origin_form = http::uri::Parts::default();
    origin_form.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .filter(|p| !p.as_str().is_empty())
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/")),
    );
    parts.uri =
        Uri::from_parts(origin_form).map_err(|e| Refusal::new(Code::BadTarget, e.to_string()))?;
    parts.version = http::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers, upgrade);
    if !parts.headers.contains_key(header::HOST) {
        let host = HeaderValue::from_str(&host_header(to.target))
            .map_err(|e| Refusal::new(Code::BadTarget, e.to_string()))?;
        parts.headers.insert(header::HOST, host);
    }
    let head_len = request_head_len(&parts);
    let mut body = Metered::new(body, ex.bytes_up.clone(), to.token.clone(), None);
    let body_sent = (!body.is_end_stream()).then(|| body.on_end());
    let request = Request::from_parts(parts, body.boxed_unsync());

    let (mut sender, addr) = sender_for(proxy, &to, upgrade, ex).await?;
    // The head as hyper writes it upstream; the body's data follows as it is sent.
    ex.bytes_up.fetch_add(head_len, Ordering::Relaxed);
    // The upstream's time to answer counts from the end of the request body: a slow upload
    // is not the upstream's fault.
    let timeout = proxy.config.upstream_response_timeout;
    let silent_upstream = async {
        if let Some(body_sent) = body_sent {
            let _ = body_sent.await;
        }
        tokio::time::sleep(timeout).await;
    };
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
        _ = silent_upstream => {
            return Err(Refusal::new(
                Code::UpstreamTimeout,
                format!("{addr} sent no response head within {timeout:?} of the request"),
            ));
        }
        _ = to.token.cancelled() => {
            return Err(Refusal::new(Code::LeaseRevoked, "the lease closed while the request was in flight"));
        }
    };
    if !upgrade {
        // Kept by the tunnel for its next request (the one it displaces, another stream's,
        // goes to the pool), or pooled once its answer is read.
        let back = match to.held {
            Some(held) => held.put(sender, addr),
            None => Some((sender, addr)),
        };
        if let Some((sender, addr)) = back {
            proxy.pool.checkin(to.key(addr), sender);
        }
    }
    Ok(Forwarded {
        response,
        token: to.token.clone(),
        upgrade: client_upgrade,
        rewrite: None,
    })
}

/// Bytes of the header fields as HTTP/1.1 writes them (`name: value` CRLF each), and the
/// blank line after them.
fn fields_len(headers: &HeaderMap) -> u64 {
    let fields: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + 2 + value.len() + 2)
        .sum();
    (fields + 2) as u64
}

/// The request head as sent upstream: `METHOD origin-form HTTP/1.1` CRLF and its fields.
fn request_head_len(parts: &http::request::Parts) -> u64 {
    let target = parts.uri.path_and_query().map_or(1, |p| p.as_str().len());
    (parts.method.as_str().len() + 1 + target + " HTTP/1.1\r\n".len()) as u64
        + fields_len(&parts.headers)
}

/// The response head as relayed to the client: `HTTP/1.1 <status> <reason>` CRLF (the
/// upstream's own reason phrase, if it sent another), its fields, and the `date` field the
/// server adds when the upstream sent none.
fn response_head_len(parts: &http::response::Parts) -> u64 {
    let reason = parts
        .extensions
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes().len())
        .or_else(|| parts.status.canonical_reason().map(str::len))
        .unwrap_or("<none>".len());
    let date = match parts.headers.contains_key(header::DATE) {
        true => 0,
        // `date: ` + an IMF-fixdate (29 bytes) + CRLF.
        false => 6 + 29 + 2,
    };
    ("HTTP/1.1 200 \r\n".len() + reason + date) as u64 + fields_len(&parts.headers)
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
async fn relay_upgrade(
    proxy: Arc<Proxy>,
    // Held for the relay's life: the client connection stays counted against the lease.
    _conn: Arc<ClientConn>,
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
        .relay(
            TokioIo::new(client),
            TokioIo::new(upstream),
            &token,
            &mut ex,
        )
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(fields: &[(&str, &str)]) -> HeaderMap {
        fields
            .iter()
            .map(|(n, v)| (n.parse().unwrap(), HeaderValue::from_str(v).unwrap()))
            .collect()
    }

    fn names(headers: &HeaderMap) -> Vec<&str> {
        headers.keys().map(HeaderName::as_str).collect()
    }

    #[test]
    fn hop_by_hop_fields_and_those_connection_names_go_the_rest_stays() {
        let plain = [("host", "a.test"), ("accept", "*/*"), ("x-trace", "1")];
        let mut kept = headers(&plain);
        strip_hop_by_hop(&mut kept, false);
        assert_eq!(kept, headers(&plain), "nothing to strip: untouched");

        let mut mixed = headers(&[
            ("host", "a.test"),
            ("connection", "keep-alive, X-Trace"),
            ("keep-alive", "timeout=5"),
            ("x-trace", "1"),
            ("proxy-authorization", "Basic eA=="),
            ("x-lease-id", "lease"),
            ("te", "trailers"),
            ("accept", "*/*"),
        ]);
        strip_hop_by_hop(&mut mixed, false);
        assert_eq!(names(&mixed), ["host", "accept"]);

        let mut upgrade = headers(&[
            ("connection", "Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-key", "k"),
        ]);
        strip_hop_by_hop(&mut upgrade, true);
        assert_eq!(upgrade["connection"], "upgrade");
        assert_eq!(upgrade["upgrade"], "websocket");
        assert_eq!(upgrade["sec-websocket-key"], "k");
        strip_hop_by_hop(&mut upgrade, false);
        assert_eq!(names(&upgrade), ["sec-websocket-key"]);
    }
}
