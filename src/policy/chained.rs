//! Whether a tunnel's first plain (non-TLS) bytes are a request to another proxy: a `CONNECT`,
//! or a request of a [`METHODS`] method with an absolute-form target (`GET http://…`). A
//! tunnel is never a way to another proxy (one on loopback the guard allows, or one the lease
//! names), which would reach what the lease never allowed.
//!
//! Invariant: pure. [`judge`] reads a prefix that grows; once it answers other than
//! [`Chained::NeedMore`] the answer never changes as bytes are added, and it answers
//! `NeedMore` for at most [`MAX_PREFIX`] bytes, and only while the bytes could still open such
//! a request (a first message like `ping` passes at once: a protocol that sends it and waits
//! is never held). Leading empty lines are skipped, as HTTP servers skip them; the method is
//! compared without case, as lenient proxies compare it.
//! Hand-written: HTTP parsers want a whole head, and this must answer on a request line's
//! first bytes, before any of it reaches the upstream.

/// The most bytes [`judge`] asks for before it answers: empty lines, a method, blanks and a
/// scheme, each bounded.
pub const MAX_PREFIX: usize = MAX_BLANK_LINES * 2 + MAX_METHOD + MAX_GAP + MAX_SCHEME + 3;
const MAX_BLANK_LINES: usize = 4;
const MAX_METHOD: usize = 9;

/// The methods a proxy forwards in absolute form (RFC 9110's, `PATCH`, WebDAV's): a request
/// line opening with another token is no request to a proxy.
pub const METHODS: [&[u8]; 16] = [
    b"GET",
    b"HEAD",
    b"POST",
    b"PUT",
    b"DELETE",
    b"CONNECT",
    b"OPTIONS",
    b"TRACE",
    b"PATCH",
    b"PROPFIND",
    b"PROPPATCH",
    b"MKCOL",
    b"COPY",
    b"MOVE",
    b"LOCK",
    b"UNLOCK",
];

/// Whether `token` is (`whole`) or begins (`!whole`) one of [`METHODS`], without case.
fn is_method(token: &[u8], whole: bool) -> bool {
    METHODS.iter().any(|m| match whole {
        true => m.eq_ignore_ascii_case(token),
        false => m.len() >= token.len() && m[..token.len()].eq_ignore_ascii_case(token),
    })
}
const MAX_GAP: usize = 4;
const MAX_SCHEME: usize = 16;

/// What a tunnel's first plain bytes are, so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chained {
    /// Too few bytes to tell.
    NeedMore,
    /// A request to a proxy; the words say which kind.
    Proxy(&'static str),
    /// Not a request to a proxy.
    Plain,
}

/// RFC 9110 §5.6.2 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Judges the first bytes of a tunnel (see the module's invariant).
pub fn judge(first: &[u8]) -> Chained {
    let mut at = 0;
    // Empty lines before a request line (RFC 9112 §2.2).
    let mut blank = 0;
    loop {
        match &first[at..] {
            // No protocol opens with so many: only a lenient server would read on.
            [b'\r', b'\n', ..] | [b'\n', ..] if blank == MAX_BLANK_LINES => {
                return Chained::Proxy("a request line after many empty lines");
            }
            [b'\r', b'\n', ..] | [b'\n', ..] => {
                at += if first[at] == b'\r' { 2 } else { 1 };
                blank += 1;
            }
            [] | [b'\r'] => return Chained::NeedMore,
            _ => break,
        }
    }
    let method_starts = at;
    while at < first.len() && is_tchar(first[at]) {
        at += 1;
        if at - method_starts > MAX_METHOD {
            return Chained::Plain;
        }
    }
    let method = &first[method_starts..at];
    if at == first.len() {
        return match is_method(method, false) {
            true => Chained::NeedMore,
            false => Chained::Plain,
        };
    }
    if !matches!(first[at], b' ' | b'\t') || !is_method(method, true) {
        return Chained::Plain;
    }
    if method.eq_ignore_ascii_case(b"CONNECT") {
        return Chained::Proxy("a CONNECT request");
    }
    let gap_starts = at;
    while at < first.len() && matches!(first[at], b' ' | b'\t') {
        at += 1;
        if at - gap_starts > MAX_GAP {
            return Chained::Plain;
        }
    }
    // `scheme "://"` (RFC 3986 §3.1) opens an absolute-form target.
    let scheme_starts = at;
    while at < first.len() {
        let b = first[at];
        let in_scheme = match at == scheme_starts {
            true => b.is_ascii_alphabetic(),
            false => b.is_ascii_alphanumeric() || b"+-.".contains(&b),
        };
        if !in_scheme {
            break;
        }
        at += 1;
        if at - scheme_starts > MAX_SCHEME {
            return Chained::Plain;
        }
    }
    if at == scheme_starts {
        // `/`, `*` or anything else that is no scheme: origin-form and the like.
        return match at == first.len() {
            true => Chained::NeedMore,
            false => Chained::Plain,
        };
    }
    let rest = &first[at..];
    let colon_slashes = b"://";
    let seen = rest.len().min(colon_slashes.len());
    if rest[..seen] != colon_slashes[..seen] {
        return Chained::Plain;
    }
    match seen == colon_slashes.len() {
        true => Chained::Proxy("a request with an absolute-form target"),
        false => Chained::NeedMore,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_to_a_proxy_are_seen() {
        for first in [
            &b"CONNECT evil.test:443 HTTP/1.1\r\n\r\n"[..],
            b"connect evil.test:443 HTTP/1.1\r\n",
            b"\r\nCONNECT evil.test:443 HTTP/1.1\r\n",
            b"\nCONNECT\tevil.test:443",
            b"GET http://evil.test/ HTTP/1.1\r\n",
            b"POST  HTTPS://evil.test/",
            b"PROPFIND ftp://evil.test/",
            b"GET svn+ssh://x",
            b"\r\n\r\n\n\r\n\r\nGET / HTTP/1.1",
        ] {
            assert!(
                matches!(judge(first), Chained::Proxy(_)),
                "{:?}",
                String::from_utf8_lossy(first)
            );
        }
    }

    #[test]
    fn other_first_bytes_pass() {
        for first in [
            &b"GET / HTTP/1.1\r\n"[..],
            b"OPTIONS * HTTP/1.1\r\n",
            b"GET /http://evil.test/ HTTP/1.1\r\n",
            b"GET http:/x",
            b"GET host:80",
            b"SSH-2.0-OpenSSH_9.6\r\n",
            b"*1\r\n$4\r\nPING\r\n",
            b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
            b"ping\r\n",
            b"ping",
            b"pi",
            b"FOO http://evil.test/ HTTP/1.1\r\n",
            b"GETX http://evil.test/",
        ] {
            assert_eq!(
                judge(first),
                Chained::Plain,
                "{:?}",
                String::from_utf8_lossy(first)
            );
        }
    }

    /// Every prefix of a request to a proxy asks for more, and no answer changes as bytes
    /// are added.
    #[test]
    fn prefixes_ask_for_more_and_answers_stay() {
        for whole in [
            &b"\r\nCONNECT evil.test:443 HTTP/1.1\r\n"[..],
            b"GET http://evil.test/",
            b"GET /index.html HTTP/1.1",
            b"PROPPATCH http://x/",
            b"pin",
        ] {
            let last = judge(whole);
            let mut answered = None;
            for end in 0..=whole.len() {
                let now = judge(&whole[..end]);
                match answered {
                    None if now != Chained::NeedMore => answered = Some(now),
                    None => assert!(end <= MAX_PREFIX),
                    Some(before) => assert_eq!(now, before, "{end}"),
                }
            }
            assert_eq!(answered, Some(last));
        }
    }
}
