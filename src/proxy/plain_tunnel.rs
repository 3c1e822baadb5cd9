//! A CONNECT to a port open to forwarded requests and not to tunnels (`--forward-ports`, 80,
//! and not `--connect-ports`): plain HTTP inside a tunnel, which undici's `EnvHttpProxyAgent`
//! and Node's own proxy support send even for `http://` URLs. The client hears 200 once its
//! lease may send forwarded requests to the host; what it sends inside is read as HTTP/1.1
//! and each request is served exactly as the absolute-form request it stands for
//! ([`forward::handle`]: the same checks, metering, MCP reading and approvals).
//!
//! Invariant: nothing sent inside reaches anything but the CONNECT's host and port, on
//! anything but the CONNECT's lease: each request's target is the CONNECT's authority (an
//! absolute URI naming another, or a CONNECT, is `bad-target`), and its credentials are the
//! CONNECT's (any it carries itself are dropped).

use super::answer;
use super::decision::Asked;
use super::exchange::Exchange;
use super::forward;
use super::identify::LEASE_ID_HEADER;
use super::listener;
use super::pipeline::Cleared;
use super::{Body, ClientConn, Proxy};
use crate::config::ProxyConfig;
use crate::policy::codes::{Code, Refusal};
use crate::policy::target::parse_authority;
use crate::telemetry::egress::Kind;
use http::header::{HeaderName, HeaderValue, PROXY_AUTHORIZATION};
use http::{Method, Request, Response, Uri};
use hyper::body::Incoming;
use std::sync::Arc;

/// Whether a CONNECT to `authority` is plain HTTP inside a tunnel: its port is open to
/// forwarded requests and not to tunnels. A port open to both stays a blind tunnel.
pub fn applies(config: &ProxyConfig, authority: &str) -> bool {
    match parse_authority(authority, None) {
        Ok(target) => {
            config.forward_ports.contains(target.port)
                && !config.connect_ports.contains(target.port)
        }
        Err(_) => false,
    }
}

/// Decides the CONNECT as a forwarded request to its host (lease, host, port, addresses),
/// answers 200, and serves what follows.
pub async fn open(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
    authority: String,
    mut ex: Exchange,
) -> Response<Body> {
    let asked = Asked::Forward {
        method: &Method::CONNECT,
        host: None,
    };
    let cleared = proxy
        .clear(&conn, req.headers(), asked, &authority, Some(80), &mut ex)
        .await;
    match cleared {
        Err(refusal) => proxy.refuse(&mut ex, refusal, &authority).await,
        Ok(cleared) => {
            ex.status = Some(200);
            proxy
                .tasks
                .spawn(serve(proxy.clone(), conn, req, cleared, authority, ex));
            answer::tunnel_open()
        }
    }
}

/// The headers that name the lease, as the CONNECT carried them.
fn credentials(headers: &http::HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    [PROXY_AUTHORIZATION, LEASE_ID_HEADER]
        .into_iter()
        .flat_map(|name| {
            let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
            values.into_iter().map(move |value| (name.clone(), value))
        })
        .collect()
}

async fn serve(
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    req: Request<Incoming>,
    cleared: Cleared,
    authority: String,
    mut ex: Exchange,
) {
    let credentials = credentials(req.headers());
    let Some(upgraded) = ex.upgraded(req).await else {
        return;
    };
    let token = cleared.token;
    let inner = Arc::new(Inner {
        proxy: proxy.clone(),
        conn: conn.clone(),
        authority,
        credentials,
    });
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let inner = inner.clone();
        async move { Ok::<_, std::convert::Infallible>(inner.request(req).await) }
    });
    let connection = listener::http1(&proxy)
        .serve_connection(upgraded, service)
        .with_upgrades();
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                tracing::debug!(%error, client = %conn.client, "plain HTTP tunnel ended with an error");
            }
        }
        _ = token.cancelled() => {
            // The lease closed: the request in flight ends with it, or is the refusal that
            // closed it, which is answered; nothing new is read.
            connection.as_mut().graceful_shutdown();
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = proxy.hard_stop.cancelled() => {}
            }
        }
        _ = proxy.hard_stop.cancelled() => {
            ex.error = Some("closed by the drain".into());
        }
    }
}

/// What each request inside one tunnel is served with.
struct Inner {
    proxy: Arc<Proxy>,
    conn: Arc<ClientConn>,
    /// The CONNECT's target, as the client wrote it.
    authority: String,
    credentials: Vec<(HeaderName, HeaderValue)>,
}

impl Inner {
    async fn request(&self, mut req: Request<Incoming>) -> Response<Body> {
        if let Some(too_large) = listener::over_head_limit(&self.proxy, &self.conn, &req) {
            return too_large;
        }
        match rewrite(&self.authority, &self.credentials, &mut req) {
            Ok(()) => forward::handle(self.proxy.clone(), self.conn.clone(), req).await,
            Err(refusal) => {
                let mut ex = Exchange::new(
                    self.proxy.telemetry.clone(),
                    Kind::Http,
                    req.method().clone(),
                    self.conn.client,
                    self.conn.listener,
                );
                let target = req.uri().to_string();
                self.proxy.refuse(&mut ex, refusal, &target).await
            }
        }
    }
}

/// The request as the absolute-form one it stands for: the CONNECT's `authority`, its own path,
/// the CONNECT's `credentials`.
pub fn rewrite<B>(
    authority: &str,
    credentials: &[(HeaderName, HeaderValue)],
    req: &mut Request<B>,
) -> Result<(), Refusal> {
    let bad = |what: String| Err(Refusal::new(Code::BadTarget, what));
    if req.method() == Method::CONNECT {
        return bad(format!(
            "a CONNECT inside the plain HTTP tunnel to {}",
            authority
        ));
    }
    let uri = req.uri();
    let same = |named: &http::uri::Authority| {
        parse_authority(named.as_str(), Some(80)).ok() == parse_authority(authority, Some(80)).ok()
    };
    match (uri.scheme_str(), uri.authority()) {
        (None, None) => {}
        (Some("http"), Some(named)) if same(named) => {}
        _ => {
            return bad(format!(
                "{uri} inside the plain HTTP tunnel to {}: a tunnel reaches its own host only",
                authority
            ))
        }
    }
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let absolute = Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|error| {
            Refusal::new(
                Code::BadTarget,
                format!("{path:?} is not a request target: {error}"),
            )
        })?;
    *req.uri_mut() = absolute;
    let headers = req.headers_mut();
    headers.remove(PROXY_AUTHORIZATION);
    headers.remove(LEASE_ID_HEADER);
    for (name, value) in credentials {
        headers.append(name.clone(), value.clone());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `req` as rewritten inside a tunnel to `authority` opened with Basic `a:b`.
    fn rewritten(authority: &str, req: Request<()>) -> Result<Request<()>, Code> {
        let credentials = [(PROXY_AUTHORIZATION, HeaderValue::from_static("Basic YTpi"))];
        let mut req = req;
        rewrite(authority, &credentials, &mut req).map_err(|refusal| refusal.code)?;
        Ok(req)
    }

    #[test]
    fn a_request_inside_is_the_absolute_form_one_with_the_connects_credentials() {
        let req = Request::get("/a/b?c=d")
            .header("host", "example.com")
            .header("proxy-authorization", "Basic b3RoZXI6bGVhc2U=")
            .header(LEASE_ID_HEADER, "someone-else")
            .body(())
            .unwrap();
        let req = rewritten("example.com:80", req).unwrap();
        assert_eq!(req.uri(), "http://example.com:80/a/b?c=d");
        let auth: Vec<_> = req.headers().get_all(PROXY_AUTHORIZATION).iter().collect();
        assert_eq!(auth, ["Basic YTpi"]);
        assert!(req.headers().get(LEASE_ID_HEADER).is_none());
        assert_eq!(req.headers()["host"], "example.com");
    }

    #[test]
    fn an_absolute_uri_inside_must_name_the_tunnels_own_host() {
        let same = Request::get("http://EXAMPLE.com/x").body(()).unwrap();
        assert_eq!(
            rewritten("example.com:80", same).unwrap().uri(),
            "http://example.com:80/x"
        );
        for other in [
            "http://other.example/x",
            "http://example.com:8080/x",
            "https://example.com/x",
        ] {
            let req = Request::get(other).body(()).unwrap();
            assert_eq!(
                rewritten("example.com:80", req).unwrap_err(),
                Code::BadTarget,
                "{other}"
            );
        }
        let connect = Request::connect("other.example:443").body(()).unwrap();
        assert_eq!(
            rewritten("example.com:80", connect).unwrap_err(),
            Code::BadTarget
        );
    }

    #[test]
    fn only_a_port_open_to_forwarding_and_not_to_tunnels_is_plain() {
        let config = ProxyConfig::default();
        assert!(applies(&config, "example.com:80"));
        assert!(!applies(&config, "example.com:443"));
        assert!(!applies(&config, "example.com:25"));
        assert!(!applies(&config, "example.com"));
    }
}
