//! How a request's body is delimited, judged before any of it is relayed: one reading for
//! the proxy, the origin and every parser between them, or a refusal.
//!
//! Invariant: pure. A request passes only with at most one `Host`, at most one
//! `Content-Length` field whose value is decimal digits only, and, on HTTP/1.1 only, a
//! `Transfer-Encoding` that is exactly one `chunked` and comes without a `Content-Length`.
//! Everything else (lists, repeats, other codings, both headers) is a request two HTTP
//! parsers can split differently — the shapes of request smuggling — and is `bad-target`,
//! answered with the connection closed so nothing after it is read as a request.
//! hyper already refuses some of these (whitespace before a colon, a coding list not ending
//! in `chunked`, `Transfer-Encoding` on HTTP/1.0, unequal lengths); this check holds for the
//! rest (`chunked, chunked`, `gzip, chunked`, `Content-Length: 5, 5`, both headers) on every
//! path, forwarded or inside a terminated tunnel.

use super::codes::{Code, Refusal};
use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, Version};

/// Checks the framing headers of a request of `version`.
pub fn check(version: Version, headers: &HeaderMap) -> Result<(), Refusal> {
    let refused = |why: &str| Err(Refusal::new(Code::BadTarget, why.to_owned()));
    if headers.get_all(HOST).iter().count() > 1 {
        return refused("more than one Host header");
    }
    let mut lengths = headers.get_all(CONTENT_LENGTH).iter();
    let length = lengths.next();
    if lengths.next().is_some() {
        return refused("more than one Content-Length header");
    }
    if let Some(length) = length {
        let digits = length.as_bytes();
        if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
            return refused("Content-Length is not one decimal number");
        }
    }
    let mut codings = headers.get_all(TRANSFER_ENCODING).iter();
    let Some(coding) = codings.next() else {
        return Ok(());
    };
    if version != Version::HTTP_11 {
        return refused("Transfer-Encoding is HTTP/1.1's alone");
    }
    if codings.next().is_some() {
        return refused("more than one Transfer-Encoding header");
    }
    if !coding
        .as_bytes()
        .trim_ascii()
        .eq_ignore_ascii_case(b"chunked")
    {
        return refused("Transfer-Encoding is not exactly `chunked` (a list or another coding)");
    }
    if length.is_some() {
        return refused("both Transfer-Encoding and Content-Length");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field appended, repeats kept.
    fn headers(fields: &[(&str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            let name: http::HeaderName = name.parse().unwrap();
            map.append(name, http::HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn one_reading_passes() {
        let v11 = Version::HTTP_11;
        for fields in [
            &[][..],
            &[("content-length", &b"5"[..])],
            &[("content-length", b"0")],
            &[("transfer-encoding", b"chunked")],
            &[("transfer-encoding", b"Chunked ")],
            &[("host", b"a.test"), ("content-length", b"12")],
        ] {
            assert_eq!(check(v11, &headers(fields)), Ok(()), "{fields:?}");
        }
        let h2 = headers(&[("content-length", b"5")]);
        assert_eq!(check(Version::HTTP_2, &h2), Ok(()));
    }

    #[test]
    fn every_shape_two_parsers_could_split_is_a_bad_target() {
        let v11 = Version::HTTP_11;
        for fields in [
            &[("host", &b"a.test"[..]), ("host", b"b.test")][..],
            &[("content-length", b"5"), ("content-length", b"5")],
            &[("content-length", b"5, 5")],
            &[("content-length", b"+5")],
            &[("content-length", b" 5")],
            &[("content-length", b"0x5")],
            &[("content-length", b"")],
            &[("transfer-encoding", b"chunked, chunked")],
            &[("transfer-encoding", b"gzip, chunked")],
            &[("transfer-encoding", b"xchunked")],
            &[("transfer-encoding", b"identity")],
            &[
                ("transfer-encoding", b"chunked"),
                ("transfer-encoding", b"chunked"),
            ],
            &[("transfer-encoding", b"chunked"), ("content-length", b"5")],
        ] {
            let refused = check(v11, &headers(fields)).unwrap_err();
            assert_eq!(refused.code, Code::BadTarget, "{fields:?}");
        }
        let te = headers(&[("transfer-encoding", b"chunked")]);
        assert!(check(Version::HTTP_10, &te).is_err());
        assert!(check(Version::HTTP_2, &te).is_err());
    }
}
