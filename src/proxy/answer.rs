//! The one place a refusal becomes the response the client sees.
//!
//! Invariant: every refusal answers with its code's status, the code as the status line's
//! reason phrase (`HTTP/1.1 403 host-denied`: most clients print only the status line), an
//! `X-Leasegate-Refusal` header and a one-line plain-text body naming the lease, the target and
//! the reason.

use super::Body;
use crate::policy::codes::{Code, Refusal};
use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

/// Builds the client's response for a refusal.
pub fn response(
    refusal: &Refusal,
    method: &str,
    target: &str,
    lease_id: Option<&str>,
) -> Response<Body> {
    let lease = lease_id.unwrap_or("(none)");
    let detail: String = refusal
        .detail
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let body = format!(
        "leasegate refused {method} {target} for lease {lease}: {} ({detail})\n",
        refusal.code
    );
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
    if matches!(
        refusal.code,
        Code::BadTarget | Code::NotAProxyRequest | Code::LeaseConflict | Code::TooManyConnections
    ) {
        headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}
