//! Every answer the proxy itself writes to a client: a refusal's, the 429 of a connection over
//! a limit, the 431 of a head too large, and the 200 that opens a tunnel. (A forwarded
//! request's answer is the upstream's.)
//!
//! Invariant: every refusal answers with its code's status, the code as the status line's
//! reason phrase (`HTTP/1.1 403 host-denied`: most clients print only the status line), an
//! `X-Leasegate-Refusal` header and a one-line plain-text body naming the lease, the target and
//! the reason (for a read request to an MCP server, a JSON-RPC error saying the same; for a
//! model call, the API's own error saying the same).

use super::Body;
use crate::policy::codes::{Code, Refusal};
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

/// The 200 that opens a CONNECT tunnel (sent once the upstream is connected).
pub fn tunnel_open() -> Response<Body> {
    let mut response = Response::new(super::empty());
    *response.status_mut() = StatusCode::OK;
    response
}

/// The 429 that refuses a connection before a byte of it is read, as the bytes written on the
/// socket (there is no HTTP server on it yet); `why` says which limit.
pub fn too_many_connections(why: &str) -> String {
    let body = format!("leasegate refused the connection: too-many-connections ({why})\n");
    format!(
        "HTTP/1.1 429 too-many-connections\r\nx-leasegate-refusal: too-many-connections\r\n\
         content-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// 431 for a head over `--max-header-bytes`, in a refusal's words (it is no policy refusal:
/// there is no code); the connection then closes, as what follows the head cannot be trusted
/// to be framed.
pub fn head_too_large(method: &http::Method, uri: &http::Uri, detail: &str) -> Response<Body> {
    let body = format!("leasegate refused {method} {uri}: {detail}\n");
    let mut response = Response::new(super::full(Bytes::from(body)));
    *response.status_mut() = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// A refusal's one line: the lease, the target, the code and the reason (control characters
/// blanked).
pub fn line(refusal: &Refusal, method: &str, target: &str, lease_id: Option<&str>) -> String {
    let lease = lease_id.unwrap_or("(none)");
    let detail: String = refusal
        .detail
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    format!(
        "leasegate refused {method} {target} for lease {lease}: {} ({detail})",
        refusal.code
    )
}

/// Builds the client's response for a refusal.
pub fn response(
    refusal: &Refusal,
    method: &str,
    target: &str,
    lease_id: Option<&str>,
) -> Response<Body> {
    let body = format!("{}\n", line(refusal, method, target, lease_id));
    let mut response = Response::new(super::full(Bytes::from(body)));
    *response.status_mut() = refusal.code.status();
    if let Ok(reason) = hyper::ext::ReasonPhrase::try_from(refusal.code.as_str().as_bytes()) {
        response.extensions_mut().insert(reason);
    }
    let headers = response.headers_mut();
    headers.insert(
        "x-leasegate-refusal",
        HeaderValue::from_static(refusal.code.as_str()),
    );
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    if refusal.code.status() == StatusCode::PROXY_AUTHENTICATION_REQUIRED {
        headers.insert(
            header::PROXY_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"leasegate\""),
        );
    }
    // A spent budget does not come back: the model SDKs (OpenAI's, Anthropic's) retry a 429
    // unless told not to.
    if refusal.code == Code::BudgetExhausted {
        headers.insert("x-should-retry", HeaderValue::from_static("false"));
    }
    if matches!(
        refusal.code,
        Code::BadTarget | Code::NotAProxyRequest | Code::LeaseConflict | Code::TooManyConnections
    ) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// `answer` (a refusal's) with `body`, a JSON-RPC or model API error, in place of its text.
pub fn with_json(answer: Response<Body>, body: Vec<u8>) -> Response<Body> {
    let (mut parts, _) = answer.into_parts();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, super::full(Bytes::from(body)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_spent_budget_tells_the_sdks_not_to_retry() {
        let refusal = Refusal::new(Code::BudgetExhausted, "spent");
        let answer = response(&refusal, "POST", "https://api.test", Some("l"));
        assert_eq!(answer.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(answer.headers()["x-should-retry"], "false");
        assert_eq!(answer.headers()["x-leasegate-refusal"], "budget-exhausted");
    }

    use super::*;

    /// The 429 is written raw: its framing must be exact, or the client reads garbage.
    #[test]
    fn the_raw_429_is_framed_and_names_its_code() {
        let raw = too_many_connections("all 4 in use");
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 429 too-many-connections\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nx-leasegate-refusal: too-many-connections\r\n"));
        assert!(head.contains("\r\nconnection: close\r\n"));
        let length = format!("\r\ncontent-length: {}", body.len());
        assert!(head.ends_with(&length), "{head}");
        assert_eq!(
            body,
            "leasegate refused the connection: too-many-connections (all 4 in use)\n"
        );
    }

    #[test]
    fn a_head_too_large_is_431_and_closes() {
        let uri: http::Uri = "http://a.test/x".parse().unwrap();
        let response = head_too_large(&http::Method::GET, &uri, "too big");
        assert_eq!(
            response.status(),
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
        );
        assert_eq!(response.headers()[header::CONNECTION], "close");
        assert!(response.headers().get("x-leasegate-refusal").is_none());
    }
}
