//! A route of a lease's `approvals` (`METHOD:host/path`) against request paths: never panics,
//! and a request a route takes stays taken however an origin may respell it — its slashes
//! doubled, its letters in another case, a `;parameter` on a segment, `:` as `%3A`, something
//! more under it — while a route only ever takes its own method and host.
//!
//! Input: the `approvals` entry, a newline, then the request path (lossy UTF-8).

use leasegate::approvals::route::{parse, segments};
use leasegate::policy::path::normalise;

pub fn check(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let (entry, path) = text.split_once('\n').unwrap_or((&text, "/"));
    let _ = segments(path);
    let Some(route) = parse(entry) else {
        return;
    };
    assert!(
        route.method.bytes().all(|b| b.is_ascii_uppercase()),
        "{entry:?}"
    );
    assert!(!route.host.is_empty() && route.host == route.host.to_ascii_lowercase());
    // The route's own path is taken, spelled as it is named.
    let own = format!("/{}", route.segments.join("/"));
    if normalise(&own).is_ok_and(|n| segments(&n) == route.segments) {
        assert!(
            route.takes(route.method, &route.host, &segments(&own)),
            "{entry:?}"
        );
    }
    let Ok(normal) = normalise(path) else {
        return;
    };
    let taken = |p: &str| route.takes(route.method, &route.host, &segments(p));
    if !taken(&normal) {
        return;
    }
    for respelled in [
        normal.replace('/', "//"),
        normal.to_ascii_uppercase(),
        normal.replace(':', "%3A"),
        format!("{normal};jsessionid=1"),
        format!("{normal}/more/under"),
    ] {
        assert!(
            taken(&respelled),
            "{entry:?} takes {normal:?} but not {respelled:?}"
        );
    }
    assert!(route.takes(
        &route.method.to_ascii_lowercase(),
        &route.host.to_ascii_uppercase(),
        &segments(&normal)
    ));
    assert!(
        !route.takes("NOTAMETHOD", &route.host, &segments(&normal)) || route.method == "NOTAMETHOD"
    );
    assert!(!route.takes(
        route.method,
        &format!("x{}", route.host),
        &segments(&normal)
    ));
}
