//! Terminated tunnels: a CONNECT to a host some secret is for (or an https MCP server) is
//! answered, after the 200, with a
//! leaf minted under the interception CA; each request inside is decided again, checked for
//! misuse, given the secrets its lease is entitled to, and sent to the origin over verified TLS.
//!
//! Invariant: the origin's TLS, verified for the CONNECT host, is up before the client hears
//! 200, so a failure is a 502 `upstream-tls-failed` and never a blind relay; the client's SNI
//! must be the CONNECT host (`sni-mismatch` otherwise); every request inside is decided by
//! [`Proxy::clear_inside`] over the registry's current state, its framing checked
//! ([`crate::policy::framing`]), inspected ([`crate::intercept::inspect`]) before anything of it
//! reaches the origin, and written on its own egress line (kind `https`); no field of an
//! origin's answer shows the agent a secret's value.

use super::approve;
use super::body::{Counted, RelayEnd};
use super::decision::{Ask, Asked, Decision};
use super::exchange::{Counter, Exchange};
use super::forward::{self, Forwarded, Upstream};
use super::identify;
use super::mcp;
use super::metering;
use super::pipeline::Cleared;
use super::upstream::Held;
use super::{Body, ClientConn, Proxy};
use crate::intercept::inspect;
use crate::intercept::Broker;
use crate::meter::request::{self, CallRequest};
use crate::meter::{Api, Meter};
use crate::policy::codes::{Code, Refusal};
use crate::policy::framing;
use crate::policy::path::{self, Ambiguous};
use crate::policy::target::{parse_authority, TargetError};
use crate::policy::{Target, TargetHost, UpstreamAddr};
use crate::secrets::SecretSet;
use crate::telemetry::egress::Kind;
use http::header::{self, HeaderValue};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpStream;

/// The broker, when tunnels of `decision` are terminated: some secret in use is for its
/// host, the host is an https MCP server, or a route the chain's `approvals` names is of it.
/// A tunnel a route names that cannot be read (no broker, or a host outside the CA) is
/// refused: what it would carry could not be held for the human.
pub fn terminates(proxy: &Proxy, decision: &Decision) -> Result<Option<Arc<Broker>>, Refusal> {
    let target = &decision.target;
    let named = approve::names_host(decision);
    let Some(broker) = proxy.broker.as_ref() else {
        return match named {
            true => Err(unreadable(
                target,
                "this proxy terminates no TLS (no --secrets and --ca)",
            )),
            false => Ok(None),
        };
    };
    if named && broker.covers_name(&target.host).is_err() {
        return Err(unreadable(
            target,
            "the host is outside the interception CA's names",
        ));
    }
    let terminated = named
        || Broker::terminates(&broker.secrets.current(), &target.host)
        || proxy.config.mcp.terminates(target);
    Ok(terminated.then(|| broker.clone()))
}

fn unreadable(target: &Target, why: &str) -> Refusal {
    Refusal::new(
        Code::ApprovalUnavailable,
        format!(
            "a lease of the chain names routes of {} that need a human's approval, and the \
             tunnel cannot be read to hold them: {why}",
            target.host
        ),
    )
}

/// Before the client's 200: TLS to the origin over `stream`, dialled to `addr`, verified for
/// the CONNECT host; the connection goes into the lease's pool for the first request inside.
pub async fn open(
    proxy: &Proxy,
    broker: &Broker,
    (stream, addr): (TcpStream, UpstreamAddr),
    cleared: &Cleared,
) -> Result<(), Refusal> {
    let name = tls_name(&cleared.decision.target)?;
    let config = broker.upstream_config();
    let tls =
        forward::upstream_tls(&config, name, stream, addr, proxy.config.connect_timeout).await?;
    let to = upstream(cleared, &cleared.decision.target, &config, name);
    forward::pool_connection(proxy, &to, addr, TokioIo::new(tls)).await
}

fn tls_name(target: &Target) -> Result<&str, Refusal> {
    match &target.host {
        TargetHost::Name(name) => Ok(name),
        TargetHost::Ip(ip) => Err(Refusal::new(
            Code::UpstreamTlsFailed,
            format!("{ip} is an address: terminated tunnels are to names only"),
        )),
    }
}

fn upstream<'a>(
    cleared: &'a Cleared,
    target: &'a Target,
    config: &'a Arc<rustls::ClientConfig>,
    name: &'a str,
) -> Upstream<'a> {
    Upstream {
        lease_id: cleared.lease_id(),
        addrs: &cleared.addrs,
        target,
        token: &cleared.token,
        tls: Some((config, name)),
        held: None,
    }
}

/// One terminated tunnel, shared by the requests inside it.
struct Inside {
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    broker: Arc<Broker>,
    upstream: Arc<rustls::ClientConfig>,
    cleared: Cleared,
    /// The CONNECT target as the client wrote it.
    authority: String,
    /// `authority` parsed, once for the tunnel (IDNA and all: 2 µs a request otherwise).
    target: Result<Target, TargetError>,
    /// The upstream connection kept for the next request.
    held: Held,
    /// Requests being answered: a closing lease lets their answers (the refusal that closed
    /// it, above all) go out before the connection is shut.
    answering: AtomicUsize,
    answered: tokio::sync::Notify,
}

/// Counts a request as being answered until dropped.
struct Answering<'a>(&'a Inside);

impl<'a> Answering<'a> {
    fn new(inside: &'a Inside) -> Answering<'a> {
        inside.answering.fetch_add(1, Ordering::AcqRel);
        Answering(inside)
    }
}

impl Drop for Answering<'_> {
    fn drop(&mut self) {
        if self.0.answering.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.answered.notify_waiters();
        }
    }
}

/// How long a closing lease's tunnel waits for the answers being written, at most.
const LAST_ANSWERS: std::time::Duration = std::time::Duration::from_secs(5);
/// And then for them to be flushed: HTTP/2 clients (Java's, httpx) read a GOAWAY that
/// overtakes the answer to their last request as the request's failure.
const FLUSH: std::time::Duration = std::time::Duration::from_millis(100);

/// After the 200: the client's TLS, ended with a minted leaf, then HTTP/2 or HTTP/1.1 (ALPN)
/// served until either side ends, the lease closes or a drain runs out.
pub async fn tunnel(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
    broker: Arc<Broker>,
    cleared: Cleared,
    authority: String,
    mut ex: Exchange,
) {
    let Some(upgraded) = ex.upgraded(req).await else {
        return;
    };
    // What the client sends and is sent, watched for idleness (not the exchange's bytes: those
    // are the requests', on their own lines).
    let (read, written) = (Counter::default(), Counter::default());
    let upgraded = Counted::both(TokioIo::new(upgraded), read.clone(), written.clone());
    let acceptor = tokio_rustls::TlsAcceptor::from(broker.server_config());
    let limit = proxy.config.header_read_timeout;
    let accepted = tokio::select! {
        _ = cleared.token.cancelled() => return,
        _ = proxy.hard_stop.cancelled() => return,
        accepted = tokio::time::timeout(limit, acceptor.accept(upgraded)) => accepted,
    };
    let tls = match accepted {
        Ok(Ok(tls)) => tls,
        Ok(Err(error)) => {
            ex.error = Some(format!(
                "the client's TLS handshake failed (does it trust the interception CA? a client \
                 that pins certificates cannot use a terminated host): {error}"
            ));
            return;
        }
        Err(_) => {
            ex.error = Some(format!("no TLS handshake from the client within {limit:?}"));
            return;
        }
    };
    let sni = tls.get_ref().1.server_name().map(str::to_owned);
    let target = &cleared.decision.target;
    let same = sni
        .as_deref()
        .and_then(|sni| crate::policy::target::parse_host(sni).ok())
        .is_some_and(|host| host == target.host);
    if !same {
        let refusal = Refusal::new(
            Code::SniMismatch,
            format!(
                "TLS SNI {:?} is not the CONNECT host {} of a terminated tunnel",
                sni.as_deref().unwrap_or(""),
                target.host
            ),
        );
        if let Err(refusal) = proxy.policy_failure(&mut ex, refusal) {
            proxy.record_refusal(&mut ex, &refusal).await;
            ex.error = Some(refusal.detail);
            return;
        }
    }
    let token = cleared.token.clone();
    let inside = Arc::new(Inside {
        proxy: proxy.clone(),
        conn,
        upstream: broker.upstream_config(),
        broker,
        cleared,
        target: parse_authority(&authority, Some(443)),
        held: Held::default(),
        authority,
        answering: AtomicUsize::new(0),
        answered: tokio::sync::Notify::new(),
    });
    let waiting = inside.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let inside = inside.clone();
        async move { Ok::<_, std::convert::Infallible>(inside.request(req).await) }
    });
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let serving = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
    tokio::pin!(serving);
    let lease = ex.lease_id.clone().unwrap_or_default();
    proxy.telemetry.metrics.tunnel_opened(&lease);
    tokio::select! {
        served = serving.as_mut() => {
            if let Err(error) = served {
                tracing::debug!(%error, "terminated tunnel ended with an error");
            }
        }
        _ = token.cancelled() => {
            // The lease closed: a request in flight ends with it (its body and wait are tied
            // to the token), or is the refusal that closed it, which is answered and flushed
            // first; then nothing new is read.
            let last = async {
                waiting.settled().await;
                tokio::time::sleep(FLUSH).await;
            };
            let ended = tokio::select! {
                _ = serving.as_mut() => true,
                _ = tokio::time::timeout(LAST_ANSWERS, last) => false,
                _ = proxy.hard_stop.cancelled() => true,
            };
            if !ended {
                serving.as_mut().graceful_shutdown();
                tokio::select! {
                    _ = serving.as_mut() => {}
                    _ = proxy.hard_stop.cancelled() => {}
                }
            }
        }
        _ = proxy.hard_stop.cancelled() => {}
        _ = idle(&read, &written, &waiting.answering, proxy.config.tunnel_idle_timeout) => {
            ex.error = RelayEnd::Idle.describe();
        }
    }
    proxy.telemetry.metrics.tunnel_closed(&lease);
}

/// Returns once a whole `limit` passed with no byte either way and no request being answered
/// (one held for a human moves nothing while it waits), so after between one and two limits
/// of silence.
async fn idle(
    read: &Counter,
    written: &Counter,
    answering: &AtomicUsize,
    limit: std::time::Duration,
) {
    let moved = || read.load(Ordering::Relaxed) + written.load(Ordering::Relaxed);
    let mut before = moved();
    loop {
        tokio::time::sleep(limit).await;
        let now = moved();
        if now == before && answering.load(Ordering::Acquire) == 0 {
            return;
        }
        before = now;
    }
}

impl Inside {
    /// One request inside the tunnel: its own exchange and egress line.
    /// Returns once no request is being answered.
    async fn settled(&self) {
        loop {
            let answered = self.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if self.answering.load(Ordering::Acquire) == 0 {
                return;
            }
            answered.await;
        }
    }

    async fn request(&self, req: Request<Incoming>) -> Response<Body> {
        let _answering = Answering::new(self);
        let proxy = &self.proxy;
        let mut ex = Exchange::new(
            proxy.telemetry.clone(),
            Kind::Https,
            req.method().clone(),
            self.conn.client,
            self.conn.listener,
        );
        ex.path = Some(
            self.broker
                .secrets
                .current()
                .shown_target(req.uri().path(), req.uri().query()),
        );
        let version = req.version();
        match self.pass(req, &mut ex).await {
            Ok(forwarded) => forwarded.into_client_response(proxy, &self.conn, ex),
            Err(refusal) => {
                let path = ex.path.as_deref().unwrap_or_default();
                let shown = format!("https://{}{path}", self.authority);
                let mut answer = proxy.refuse(&mut ex, refusal, &shown).await;
                // HTTP/2 has no connection-specific fields; over HTTP/1.1 a refusal that
                // closes (a request whose framing cannot be trusted) still closes, so
                // nothing after it is read as a request.
                let close = answer.headers().get(header::CONNECTION).cloned();
                forward::strip_hop_by_hop(answer.headers_mut(), false);
                if let (Some(close), true) = (close, version < http::Version::HTTP_2) {
                    answer.headers_mut().insert(header::CONNECTION, close);
                }
                answer
            }
        }
    }

    /// Decided, inspected, given its secrets, sent.
    async fn pass(
        &self,
        mut req: Request<Incoming>,
        ex: &mut Exchange,
    ) -> Result<Forwarded, Refusal> {
        let proxy = &self.proxy;
        let named = named_host(&req)?;
        let asked = Asked::Inside {
            method: req.method(),
            host: named.as_ref(),
        };
        let ask = Ask {
            asked,
            authority: &self.authority,
            default_port: Some(443),
            target: self.target.clone(),
        };
        let decision = proxy
            .clear_inside(&self.cleared.identity, ask, &self.cleared.token, ex)
            .await?;
        framing::check(req.version(), req.headers())?;
        let target = req.uri().path_and_query().map_or("", |p| p.as_str());
        identify::token_kept(&self.cleared.identity, target, req.headers())?;
        let client_upgrade =
            forward::is_upgrade(req.headers()).then(|| hyper::upgrade::on(&mut req));
        let (mut parts, body) = req.into_parts();
        let set = self.broker.secrets.current();
        let normal = path::normalise(parts.uri.path());
        let metered = self.metered(&set, &decision, &parts, &normal)?;
        ex.api = metered.as_ref().map(|(api, _)| *api);
        let server = proxy.config.mcp.find(&decision.target, true);
        // A model call is read whole: what it may spend is in its body; so is a request to an
        // MCP server: what it calls is.
        let most = self.proxy.config.max_model_request_bytes;
        let limit = match (&metered, server) {
            (Some(_), _) => most.saturating_add(1),
            (None, Some(_)) => mcp::MAX_REQUEST.saturating_add(1),
            (None, None) => inspect::MAX_BODY_SCAN,
        };
        let (mut body, ahead) = forward::read_ahead(body, &self.cleared.token, limit).await?;
        let request = match &metered {
            Some(_) if ahead.len() > most => {
                return Err(Refusal::new(
                    Code::BodyTooLarge,
                    format!(
                        "a model call's request body is read whole, and this one is over \
                         --max-model-request-bytes ({most})"
                    ),
                ))
            }
            Some((_, meter)) => {
                Some(request::read(meter.call(), &ahead).map_err(|unreadable| {
                    Refusal::new(
                        Code::BadTarget,
                        format!("the model call's request cannot be bounded: {unreadable}"),
                    )
                })?)
            }
            None => None,
        };
        let host = tls_name(&decision.target)?;
        let secrets = forward::inspected(
            &self.broker,
            &set,
            &decision,
            &parts,
            &ahead,
            normal.as_deref().map_err(|&why| why),
            true,
        )?;
        let target = ex.path.clone().unwrap_or_default();
        let shown = approve::Shown {
            scheme: "https",
            target: &target,
            body: &ahead,
        };
        let asked = (&parts.method, &parts.uri);
        approve::route(proxy, &decision, asked, shown, &self.cleared.token, ex).await?;
        // What route rules or the meter read is what the origin is sent.
        if let (Ok(normal), true) = (&normal, metered.is_some() || !secrets.is_empty()) {
            resolved(&mut parts, normal)?;
        }
        let given: Vec<String> = secrets
            .into_iter()
            .map(|secret| {
                inspect::put_in(&mut parts, secret)?;
                Ok(secret.spec().id.clone())
            })
            .collect::<Result<_, Refusal>>()?;
        ex.secrets = given;
        let filter_answer = match server {
            Some(server) => {
                let edge = mcp::Edge {
                    spending: &proxy.telemetry.spending,
                    approvals: &proxy.approvals,
                    lease_closed: &self.cleared.token,
                };
                let (tap, read) =
                    mcp::read(server, &parts.method, &decision.chain, edge, &ahead).await;
                ex.mcp = Some(tap);
                read?
            }
            None => false,
        };
        if let (false, Some(named)) = (parts.headers.contains_key(header::HOST), named) {
            parts.headers.insert(header::HOST, named);
        }
        let tap = match (metered, request) {
            (Some((api, meter)), Some(mut request)) => {
                if let Some(rewritten) = request.rewritten.take() {
                    if parts.headers.contains_key(header::CONTENT_LENGTH) {
                        parts
                            .headers
                            .insert(header::CONTENT_LENGTH, rewritten.len().into());
                    }
                    body = body.replaced(rewritten.into());
                }
                metering::ask_identity(&mut parts.headers);
                Some(
                    self.model_call(api, meter, &request, ahead.len(), &decision)
                        .await?,
                )
            }
            _ => None,
        };
        let to = Upstream {
            held: Some(&self.held),
            ..upstream(&self.cleared, &decision.target, &self.upstream, host)
        };
        let sent = forward::send(
            proxy,
            Request::from_parts(parts, body),
            client_upgrade,
            to,
            ex,
        )
        .await;
        match (sent, tap) {
            (Ok(mut forwarded), tap) => {
                ex.model = tap.map(Box::new);
                forwarded.without_values(&set);
                if let (true, Some(server), Some(read)) = (filter_answer, server, ex.mcp.as_deref())
                {
                    let content_type = forwarded.content_type();
                    if let Some(rewrite) =
                        mcp::answer_rewrite(content_type, server, &decision.chain, read)
                    {
                        forwarded.rewrite_body(rewrite);
                    }
                }
                Ok(forwarded)
            }
            (Err(refusal), Some(tap)) => {
                // Never sent: nothing spent. Sent, maybe, and no answer read: its bound.
                match refusal.code {
                    Code::DnsFailed | Code::AddressNotAllowed | Code::UpstreamTlsFailed => {
                        tap.release()
                    }
                    _ => ex.model = Some(Box::new(tap)),
                }
                Err(refusal)
            }
            (Err(refusal), None) => {
                if let (true, Some(read)) = (mcp::never_sent(refusal.code), ex.mcp.as_deref_mut()) {
                    read.release();
                }
                Err(refusal)
            }
        }
    }

    /// The API and meter of a call to a metered host's model API; `None` for anything else. A
    /// path origins resolve differently is refused on a metered host: whether it is a model
    /// call cannot be told for sure.
    fn metered(
        &self,
        set: &SecretSet,
        decision: &Decision,
        parts: &http::request::Parts,
        normal: &Result<String, Ambiguous>,
    ) -> Result<Option<(Api, Meter)>, Refusal> {
        let Some(api) = Broker::meter_for(set, &decision.target.host) else {
            return Ok(None);
        };
        let normal = normal.as_ref().map_err(|why| {
            Refusal::new(
                Code::PathAmbiguous,
                format!(
                    "{} {}: a metered host's requests are metered on the path as the origin \
                     resolves it, and origins resolve this one differently, as {why}",
                    parts.method,
                    set.shown_target(parts.uri.path(), None)
                ),
            )
        })?;
        Ok(Meter::for_call(api, &parts.method, normal).map(|meter| (api, meter)))
    }

    /// A model call: refused when the lease's chain has spent (or reserved) a budget, else its
    /// bound reserved and the tap that will read its usage.
    async fn model_call(
        &self,
        api: Api,
        meter: Meter,
        request: &CallRequest,
        body_len: usize,
        decision: &Decision,
    ) -> Result<metering::Tap, Refusal> {
        let prices = self.broker.prices();
        let config = &self.proxy.config;
        let bound = metering::bound(
            request,
            body_len,
            config.model_output_bound,
            prices.as_deref(),
        );
        let spending = &self.proxy.telemetry.spending;
        let reservation = metering::reserve(spending, &decision.chain, bound).await?;
        Ok(metering::Tap::new(api, meter, reservation, prices))
    }
}

/// `parts`' path replaced by `normal` (its query kept), where they differ.
fn resolved(parts: &mut http::request::Parts, normal: &str) -> Result<(), Refusal> {
    if parts.uri.path() == normal {
        return Ok(());
    }
    let target = match parts.uri.query() {
        Some(query) => format!("{normal}?{query}"),
        None => normal.to_owned(),
    };
    let unusable = || {
        Refusal::new(
            Code::BadTarget,
            "the resolved request target would not parse",
        )
    };
    let mut uri = http::uri::Parts::from(parts.uri.clone());
    uri.path_and_query = Some(target.parse().map_err(|_| unusable())?);
    parts.uri = http::Uri::from_parts(uri).map_err(|_| unusable())?;
    Ok(())
}

/// The host a request inside names: `Host`, or HTTP/2's `:authority`; both, when both are
/// there, must agree (each is checked against the CONNECT target by the decision).
fn named_host(req: &Request<Incoming>) -> Result<Option<HeaderValue>, Refusal> {
    let from_uri = req
        .uri()
        .authority()
        .map(|a| HeaderValue::from_str(a.as_str()))
        .transpose()
        .map_err(|_| Refusal::new(Code::BadTarget, "the request's authority is not readable"))?;
    let host = req.headers().get(header::HOST).cloned();
    match (host, from_uri) {
        (Some(host), Some(uri)) if host != uri => Err(Refusal::new(
            Code::HostMismatch,
            format!(
                "Host {:?} and :authority {:?} differ",
                String::from_utf8_lossy(host.as_bytes()),
                String::from_utf8_lossy(uri.as_bytes())
            ),
        )),
        (Some(host), _) => Ok(Some(host)),
        (None, uri) => Ok(uri),
    }
}
