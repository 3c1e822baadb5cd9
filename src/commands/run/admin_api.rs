//! `run`'s questions to the admin API: `GET /leases/{id}`, then `GET /leases/{id}/placeholders`.
//!
//! Invariant: the lease token leaves this process only over TLS (an `https://` admin URL whose
//! certificate verifies under `--admin-ca`, or the public roots without it) or to loopback:
//! the admin URL's host is resolved first, and a plain-HTTP admin URL with the token is refused,
//! before any connection, unless every address of its host is a loopback address. The
//! connection goes to the addresses checked, never to a second resolution of the name.

use super::RunError;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};

/// A path (its segments, escaped when joined) and a query string.
struct Target<'a> {
    segments: &'a [&'a str],
    query: Option<&'a str>,
}

/// Where the admin API is and how it is reached: its URL, whether by TLS, and the trust
/// anchors for its certificate (`None`: the public roots).
pub struct AdminApi {
    url: url::Url,
    /// What the operator wrote, for messages.
    shown: String,
    /// `--admin-ca`: the certificates an `https://` admin API's chain must end in.
    ca: Option<Vec<CertificateDer<'static>>>,
}

impl AdminApi {
    /// The admin API at `admin` (`http://` or `https://`); `ca` only with `https://`.
    pub fn new(
        admin: &str,
        ca: Option<Vec<CertificateDer<'static>>>,
    ) -> Result<AdminApi, RunError> {
        let bad = |reason: &str| RunError::Url(admin.to_owned(), reason.to_owned());
        let url = url::Url::parse(admin).map_err(|e| bad(&e.to_string()))?;
        match url.scheme() {
            "https" => {}
            "http" if ca.is_some() => {
                return Err(bad("--admin-ca is for an https:// admin URL"));
            }
            "http" => {}
            _ => return Err(bad("the admin URL is http:// or https://")),
        }
        if url.host_str().is_none() {
            return Err(bad("no host"));
        }
        Ok(AdminApi {
            url,
            shown: admin.to_owned(),
            ca,
        })
    }

    /// The URL the operator gave: the proxy's host defaults to its host.
    pub fn url(&self) -> &url::Url {
        &self.url
    }

    /// The admin URL as the operator wrote it, for messages.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    fn is_tls(&self) -> bool {
        self.url.scheme() == "https"
    }

    /// Its host as a name or address (an IPv6 address without brackets).
    fn host(&self) -> &str {
        let host = self.url.host_str().unwrap_or_default();
        host.trim_matches(|c| c == '[' || c == ']')
    }

    fn port(&self) -> u16 {
        self.url.port_or_known_default().unwrap_or(80)
    }

    /// The addresses to connect to: every address of the host, each checked when a token goes
    /// in plain HTTP.
    async fn addresses(&self, with_token: bool) -> Result<Vec<SocketAddr>, RunError> {
        let addrs: Vec<SocketAddr> = tokio::net::lookup_host((self.host(), self.port()))
            .await
            .map_err(|e| self.unreachable(format!("cannot resolve {}: {e}", self.host())))?
            .collect();
        if with_token && !self.is_tls() {
            if let Some(beyond) = addrs.iter().find(|a| !is_loopback(a)) {
                return Err(RunError::PlainTextToken {
                    url: self.shown.clone(),
                    addr: beyond.ip(),
                });
            }
        }
        Ok(addrs)
    }

    fn unreachable(&self, reason: String) -> RunError {
        RunError::Unreachable {
            url: self.shown.clone(),
            reason,
        }
    }

    /// Asks for `GET /leases/{id}` (with `token` as bearer token). Every answer but 200 is an
    /// error that says what the API said.
    pub async fn lookup(&self, lease: &str, token: Option<&str>) -> Result<Value, RunError> {
        let (status, body) = self.get(&["leases", lease], token).await?;
        self.answer(lease, token.is_some(), status, &body)
    }

    /// Asks for `GET /leases/{id}/placeholders` (with `token`). `None`: the admin API does not
    /// know the route (a proxy older than brokered credentials); every other answer but 200
    /// is an error that says what the API said.
    pub async fn placeholders(
        &self,
        lease: &str,
        token: Option<&str>,
    ) -> Result<Option<Value>, RunError> {
        let (status, body) = self.get(&["leases", lease, "placeholders"], token).await?;
        if status == http::StatusCode::NOT_FOUND && message_of(&body).starts_with("no route ") {
            return Ok(None);
        }
        self.answer(lease, token.is_some(), status, &body).map(Some)
    }

    /// Ends the lease, as its own token may: `POST /leases/{id}/complete` (`completed`) or
    /// `/stop`, with `reason`. The answer's JSON on 200 (409 when it was already closed is
    /// an error that says so).
    pub async fn end(
        &self,
        lease: &str,
        token: Option<&str>,
        how: &str,
        reason: &str,
    ) -> Result<Value, RunError> {
        let body = serde_json::json!({"reason": reason}).to_string();
        let (status, answer) = self
            .request(
                http::Method::POST,
                &["leases", lease, how],
                token,
                Some(body),
            )
            .await?;
        self.answer(lease, token.is_some(), status, &answer)
    }

    /// `POST` of `body` (JSON) to the path made of `segments`, with `token` as bearer token and
    /// `headers`: the status and the answer's JSON (`{"error": text}` for one that is not).
    pub async fn post(
        &self,
        segments: &[&str],
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: &Value,
    ) -> Result<(http::StatusCode, Value), RunError> {
        let (status, answer) = self
            .request_with(
                http::Method::POST,
                segments,
                token,
                headers,
                Some(body.to_string()),
            )
            .await?;
        let value = serde_json::from_slice(&answer)
            .unwrap_or_else(|_| serde_json::json!({"error": message_of(&answer)}));
        Ok((status, value))
    }

    /// `GET` of the path made of `segments` (with `token` as bearer token): status and body.
    pub async fn get(
        &self,
        segments: &[&str],
        token: Option<&str>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError> {
        self.request(http::Method::GET, segments, token, None).await
    }

    /// [`AdminApi::get`] with a query string (`key=value&…`, already encoded).
    pub async fn get_query(
        &self,
        segments: &[&str],
        query: &str,
        token: Option<&str>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError> {
        let at = Target {
            segments,
            query: Some(query),
        };
        self.request_at(http::Method::GET, at, token, &[], None)
            .await
    }

    /// `method` on the path made of `segments` (with `token` as bearer token, and a JSON
    /// `body`): status and body.
    async fn request(
        &self,
        method: http::Method,
        segments: &[&str],
        token: Option<&str>,
        body: Option<String>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError> {
        self.request_with(method, segments, token, &[], body).await
    }

    async fn request_with(
        &self,
        method: http::Method,
        segments: &[&str],
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError> {
        let at = Target {
            segments,
            query: None,
        };
        self.request_at(method, at, token, headers, body).await
    }

    async fn request_at(
        &self,
        method: http::Method,
        Target { segments, query }: Target<'_>,
        token: Option<&str>,
        headers: &[(&str, &str)],
        body: Option<String>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError> {
        let addrs = self.addresses(token.is_some()).await?;
        let stream = tokio::net::TcpStream::connect(&addrs[..])
            .await
            .map_err(|e| self.unreachable(e.to_string()))?;
        // The id goes into the path as given (escaped), so that the API judges it, not us.
        let mut path = self.url.clone();
        path.path_segments_mut()
            .map_err(|()| RunError::Url(self.shown.clone(), "cannot be a base".into()))?
            .clear()
            .extend(segments);
        let authority = match self.url.port() {
            Some(port) => format!("{}:{port}", self.url.host_str().unwrap_or_default()),
            None => self.url.host_str().unwrap_or_default().to_owned(),
        };
        path.set_query(query);
        let mut request = http::Request::builder()
            .method(method)
            .uri(match path.query() {
                Some(query) => format!("{}?{query}", path.path()),
                None => path.path().to_owned(),
            })
            .header(http::header::HOST, authority);
        if let Some(token) = token {
            request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if body.is_some() {
            request = request.header(http::header::CONTENT_TYPE, "application/json");
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(bytes::Bytes::from(body.unwrap_or_default())))
            .map_err(|e| RunError::Url(self.shown.clone(), e.to_string()))?;
        if self.is_tls() {
            let name = ServerName::try_from(self.host().to_owned())
                .map_err(|e| RunError::Url(self.shown.clone(), e.to_string()))?;
            let tls = self
                .connector()?
                .connect(name, stream)
                .await
                .map_err(|e| self.unreachable(format!("TLS: {e}")))?;
            self.send(tls, request).await
        } else {
            self.send(stream, request).await
        }
    }

    /// A TLS client that trusts `--admin-ca`, else the public roots.
    fn connector(&self) -> Result<tokio_rustls::TlsConnector, RunError> {
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca {
            Some(certs) => {
                for cert in certs {
                    roots.add(cert.clone()).map_err(|e| {
                        RunError::Url(self.shown.clone(), format!("--admin-ca: {e}"))
                    })?;
                }
            }
            None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        }
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| RunError::Url(self.shown.clone(), e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
    }

    async fn send<IO>(
        &self,
        io: IO,
        request: http::Request<Full<bytes::Bytes>>,
    ) -> Result<(http::StatusCode, bytes::Bytes), RunError>
    where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let unreachable = |e: hyper::Error| self.unreachable(e.to_string());
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .map_err(unreachable)?;
        tokio::spawn(connection);
        let response = sender.send_request(request).await.map_err(unreachable)?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(unreachable)?
            .to_bytes();
        Ok((status, body))
    }

    /// The lease's view on 200; otherwise the error that says what the API answered.
    fn answer(
        &self,
        lease: &str,
        with_token: bool,
        status: http::StatusCode,
        body: &[u8],
    ) -> Result<Value, RunError> {
        let url = self.shown.clone();
        if status == http::StatusCode::OK {
            return serde_json::from_slice(body).map_err(|e| RunError::Admin {
                url,
                status,
                message: format!("unreadable answer: {e}"),
            });
        }
        let message = message_of(body);
        Err(match status {
            http::StatusCode::BAD_REQUEST => RunError::BadLeaseId {
                url,
                status,
                message,
            },
            http::StatusCode::UNAUTHORIZED if with_token => {
                RunError::WrongLeaseToken { url, message }
            }
            http::StatusCode::UNAUTHORIZED => RunError::NoLeaseToken { url },
            http::StatusCode::NOT_FOUND => RunError::UnknownLease {
                url,
                lease: lease.to_owned(),
            },
            _ => RunError::Admin {
                url,
                status,
                message,
            },
        })
    }
}

/// What an error answer says: the API's `{"error": ...}`, else the body as text.
fn message_of(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned())
}

/// Whether `addr` stays on this host (IPv4-mapped loopback included).
fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().to_canonical().is_loopback()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_token_goes_in_plain_http_only_to_loopback() {
        let plain = |url: &str| AdminApi::new(url, None).unwrap();
        for url in [
            "http://127.0.0.1:3129",
            "http://127.9.9.9:3129",
            "http://[::1]:3129",
            "http://[::ffff:127.0.0.1]:3129",
        ] {
            assert!(plain(url).addresses(true).await.is_ok(), "{url}");
        }
        for url in [
            "http://192.0.2.1:3129",
            "http://10.0.0.1",
            "http://[2001:db8::1]:3129",
            "http://0.0.0.0:3129",
        ] {
            assert!(
                matches!(
                    plain(url).addresses(true).await,
                    Err(RunError::PlainTextToken { .. })
                ),
                "{url}"
            );
            // Without a token nothing secret is sent.
            assert!(plain(url).addresses(false).await.is_ok(), "{url}");
        }
        // Over TLS the certificate, not the address, says who answers.
        let tls = AdminApi::new("https://192.0.2.1:3129", None).unwrap();
        assert!(tls.addresses(true).await.is_ok());
    }

    #[test]
    fn only_http_and_https_admin_urls() {
        for bad in ["ftp://127.0.0.1", "unix:/run/admin.sock", "127.0.0.1:3129"] {
            assert!(
                matches!(AdminApi::new(bad, None), Err(RunError::Url(..))),
                "{bad}"
            );
        }
        assert!(matches!(
            AdminApi::new("http://127.0.0.1:3129", Some(Vec::new())),
            Err(RunError::Url(..))
        ));
    }
}
