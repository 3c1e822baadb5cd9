//! The optional webhook (`--approval-webhook URL`): each call that starts waiting is POSTed
//! there as JSON (`{"event": "approval.requested", "approval": {...}}`), so a human hears of
//! it.
//!
//! Invariant: best effort and never waited for — a webhook that is slow, refuses or is away
//! delays and decides nothing (the call waits for a decision either way); an `https://` URL is
//! verified under the public roots; at most 64 posts are in flight at once,
//! beyond which a post is dropped and logged.

use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long one post may take, connection included.
const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// Posts in flight at once.
const MAX_IN_FLIGHT: usize = 64;

/// Where requests for approval are posted.
#[derive(Debug, Clone)]
pub struct Webhook {
    url: url::Url,
    in_flight: Arc<AtomicUsize>,
}

impl Webhook {
    /// The webhook at `url` (`http://` or `https://`, with a host).
    pub fn parse(url: &str) -> Result<Webhook, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("{url:?}: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(format!(
                "{url:?}: the webhook is an http:// or https:// URL with a host"
            ));
        }
        Ok(Webhook {
            url: parsed,
            in_flight: Arc::default(),
        })
    }

    pub fn url(&self) -> &url::Url {
        &self.url
    }

    /// Posts `approval` (the admin API's view of a request) in the background.
    pub fn tell(&self, approval: Value) {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_IN_FLIGHT {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(url = %self.url, "the approval webhook has too many posts in flight: one dropped");
            return;
        }
        let (url, in_flight) = (self.url.clone(), self.in_flight.clone());
        let body = json!({"event": "approval.requested", "approval": approval}).to_string();
        tokio::spawn(async move {
            let sent = tokio::time::timeout(POST_TIMEOUT, post(&url, body)).await;
            in_flight.fetch_sub(1, Ordering::AcqRel);
            match sent {
                Ok(Ok(status)) if status.is_success() => {}
                Ok(Ok(status)) => {
                    tracing::warn!(%url, %status, "the approval webhook refused a post")
                }
                Ok(Err(error)) => {
                    tracing::warn!(%url, %error, "the approval webhook could not be reached")
                }
                Err(_) => {
                    tracing::warn!(%url, "the approval webhook did not answer within {POST_TIMEOUT:?}")
                }
            }
        });
    }
}

type Error = Box<dyn std::error::Error + Send + Sync>;

async fn post(url: &url::Url, body: String) -> Result<http::StatusCode, Error> {
    let host = url.host_str().unwrap_or_default();
    let port = url.port_or_known_default().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port)).await?;
    let authority = match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    };
    let path = match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_owned(),
    };
    let request = http::Request::post(path)
        .header(http::header::HOST, authority)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(bytes::Bytes::from(body)))?;
    match url.scheme() {
        "https" => {
            let mut roots = rustls::RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            let config = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
            let name =
                rustls::pki_types::ServerName::try_from(host.trim_matches(['[', ']']).to_owned())?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
                .connect(name, stream)
                .await?;
            send(tls, request).await
        }
        _ => send(stream, request).await,
    }
}

async fn send<IO>(
    io: IO,
    request: http::Request<Full<bytes::Bytes>>,
) -> Result<http::StatusCode, Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(connection);
    let response = sender.send_request(request).await?;
    let status = response.status();
    let _ = response.into_body().collect().await;
    Ok(status)
}
