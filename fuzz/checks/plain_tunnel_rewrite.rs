//! A request inside a plain HTTP tunnel, rewritten as the forwarded request it stands for:
//! never panics, and what comes out names the CONNECT's authority and no other, keeps the
//! request's own path, and carries the CONNECT's credentials and none of its own; a request
//! naming another host, or a CONNECT, is refused.
//!
//! Input: the CONNECT's authority, a newline, the request's method, a newline, its target
//! (lossy UTF-8).

use leasegate::policy::target::parse_authority;
use leasegate::proxy::plain_tunnel::rewrite;

pub fn check(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut parts = text.splitn(3, '\n');
    let (authority, method, target) = (
        parts.next().unwrap_or(""),
        parts.next().unwrap_or("GET"),
        parts.next().unwrap_or("/"),
    );
    let Ok(method) = http::Method::from_bytes(method.as_bytes()) else {
        return;
    };
    let Ok(mut req) = http::Request::builder()
        .method(method.clone())
        .uri(target)
        .header("x-lease-id", "someone-else")
        .header("proxy-authorization", "Bearer someone-else")
        .body(())
    else {
        return;
    };
    let before = req.uri().clone();
    let credential = http::HeaderValue::from_static("Basic YTpi");
    let credentials = [(http::header::PROXY_AUTHORIZATION, credential.clone())];
    let rewritten = rewrite(authority, &credentials, &mut req);
    let named_other = before.authority().is_some_and(|named| {
        before.scheme_str() != Some("http")
            || parse_authority(named.as_str(), Some(80)).ok()
                != parse_authority(authority, Some(80)).ok()
    });
    if method == http::Method::CONNECT || named_other {
        assert!(
            rewritten.is_err(),
            "{method} {before} inside a tunnel to {authority:?}"
        );
        return;
    }
    let Ok(()) = rewritten else {
        return;
    };
    let uri = req.uri();
    assert_eq!(uri.scheme_str(), Some("http"));
    assert_eq!(uri.authority().map(|a| a.as_str()), Some(authority));
    assert_eq!(
        uri.path_and_query().map(|p| p.as_str()),
        Some(before.path_and_query().map_or("/", |p| p.as_str()))
    );
    let auth: Vec<_> = req
        .headers()
        .get_all("proxy-authorization")
        .iter()
        .collect();
    assert_eq!(auth, [&credential]);
    assert!(req.headers().get("x-lease-id").is_none());
}
