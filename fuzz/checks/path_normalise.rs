//! The path normaliser on arbitrary bytes: never panics, and a path it accepts is absolute,
//! already normal (normalising it again gives it back), holds no `.` or `..` segment, no
//! encoded `/` or `\`, no control byte, no escape of an unreserved character or of a `%`
//! followed by two hex digits, no lower-case hex escape, and is what the RFC 3986 reference
//! (`remove_dot_segments` after decoding the unreserved characters, here written the plain
//! way) gives; every segment of it is one a route literal may be.
//!
//! Input: the path, as bytes (lossy UTF-8: a request target is ASCII on the wire, and hyper
//! refuses the rest).

use leasegate::policy::path::{normalise, segment, Segment};

pub fn check(data: &[u8]) {
    let raw = String::from_utf8_lossy(data);
    let Ok(normal) = normalise(&raw) else {
        return;
    };
    assert!(normal.starts_with('/'), "{raw:?} -> {normal:?}");
    assert_eq!(
        normalise(&normal).as_deref(),
        Ok(normal.as_str()),
        "{raw:?}"
    );
    for part in normal[1..].split('/') {
        assert_eq!(
            segment(part),
            Ok(Segment::Plain(part.to_owned())),
            "{raw:?} -> {normal:?}"
        );
        assert!(!part.contains(['\\']) && !part.bytes().any(|b| b.is_ascii_control()));
        let bytes = part.as_bytes();
        for (i, _) in part.match_indices('%') {
            let escape = &bytes[i + 1..i + 3];
            assert!(
                escape
                    .iter()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_uppercase()),
                "{normal:?}"
            );
            let byte = u8::from_str_radix(std::str::from_utf8(escape).unwrap(), 16).unwrap();
            let unreserved = byte.is_ascii_alphanumeric() || b"-._~".contains(&byte);
            assert!(!unreserved && byte != b'/' && byte != b'\\', "{normal:?}");
        }
    }
    assert_eq!(normal, reference(&raw), "{raw:?}");
}

/// RFC 3986 §5.2.4 on the path with its unreserved escapes decoded: the output buffer holds
/// whole segments, `..` drops the last one, `.` is dropped.
fn reference(raw: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    for part in raw[1..].split('/') {
        let Ok(segment) = segment(part) else {
            unreachable!("normalise accepted {raw:?}");
        };
        match segment {
            Segment::Dot => {}
            Segment::DotDot => {
                out.pop();
            }
            Segment::Plain(plain) => out.push(plain),
        }
    }
    format!("/{}", out.join("/"))
}
