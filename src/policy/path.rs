//! A request path as the origin resolves it: RFC 3986 dot segments removed, only unreserved
//! characters decoded, and every form origins resolve differently refused.
//!
//! Invariant: a path [`normalise`] accepts has no `.` or `..` segment, no encoded `/` or `\`,
//! no escape that decodes to a control byte or to invalid (overlong) UTF-8, and no escape of
//! an escape; each of its segments is what a decoding origin (Go's `net/http`, the WHATWG URL
//! of Node and browsers, a servlet container that strips `;` parameters) takes for one segment,
//! so a rule matched on it is matched on what the origin serves. Hand-written: the `url` crate
//! resolves dot segments the WHATWG way, which *accepts* `%2e%2e;`, `\` and `%2F` instead of
//! refusing them, and no crate refuses the forms the origins disagree on.

use std::fmt;

/// Why a path is refused: a form two kinds of origin resolve to different resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ambiguous {
    /// Not an absolute path (`*`, or a relative reference).
    NotAbsolute,
    /// `%2F`: a separator to origins that decode before routing, a character to the rest.
    EncodedSlash,
    /// `\` or `%5C`: a separator to WHATWG URLs and Windows origins.
    Backslash,
    /// `..;x`, `.%3B`, `.. ` and the like: a dot segment to origins that strip `;` parameters
    /// or trailing blanks before resolving, an ordinary segment to the rest.
    DotVariant,
    /// An escape that decodes to NUL or another control byte.
    Control,
    /// `%` not followed by two hex digits.
    BadEscape,
    /// Escapes that decode to invalid UTF-8, overlong forms (`%C0%AE`) included.
    NotUtf8,
    /// `%25` followed by two hex digits: an escape again to an origin that decodes twice.
    DoubleEncoded,
    /// `//..`: a `..` that takes an empty segment away to origins that keep `//` (RFC 3986,
    /// WHATWG), the segment before it to origins that merge slashes first (Go, nginx).
    EmptyDotDot,
    /// A `.` or `..` last: a directory (`/a/`) to RFC 3986 and WHATWG, a file (`/a`) to Go.
    DotAtEnd,
}

impl fmt::Display for Ambiguous {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Ambiguous::NotAbsolute => "it is not an absolute path",
            Ambiguous::EncodedSlash => "it has an encoded slash (%2F)",
            Ambiguous::Backslash => "it has a backslash (\\ or %5C)",
            Ambiguous::DotVariant => {
                "it has a dot segment with a parameter or trailing characters (such as ..;)"
            }
            Ambiguous::Control => "it has an escape of a control character (such as %00)",
            Ambiguous::BadEscape => "it has a % that is not followed by two hex digits",
            Ambiguous::NotUtf8 => "its escapes decode to invalid or overlong UTF-8",
            Ambiguous::DoubleEncoded => "it has an escaped escape (such as %252e)",
            Ambiguous::EmptyDotDot => "it has a .. right after an empty segment (//..)",
            Ambiguous::DotAtEnd => "it ends in a . or .. segment",
        })
    }
}

/// One segment, decoded as far as is safe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// `.` or `%2e`.
    Dot,
    /// `..`, `%2e.`, `%2E%2E`…
    DotDot,
    /// Anything else: unreserved characters decoded, every other escape kept with upper-case
    /// hex digits.
    Plain(String),
}

/// `path` (the path of a request target, without its query) as the origin resolves it, or why
/// origins would disagree on it.
pub fn normalise(path: &str) -> Result<String, Ambiguous> {
    let Some(body) = path.strip_prefix('/') else {
        return Err(Ambiguous::NotAbsolute);
    };
    let parts: Vec<&str> = body.split('/').collect();
    let mut out: Vec<String> = Vec::with_capacity(parts.len());
    let last = parts.len() - 1;
    for (i, part) in parts.iter().enumerate() {
        match segment(part)? {
            Segment::Plain(plain) => out.push(plain),
            // A dot segment at the end leaves a directory (`/a/b/..` is `/a/`) to some and a
            // file (`/a`) to others.
            Segment::Dot | Segment::DotDot if i == last => return Err(Ambiguous::DotAtEnd),
            Segment::Dot => {}
            Segment::DotDot => {
                if out.pop().is_some_and(|popped| popped.is_empty()) {
                    return Err(Ambiguous::EmptyDotDot);
                }
            }
        }
    }
    let mut normal = String::with_capacity(path.len());
    for segment in &out {
        normal.push('/');
        normal.push_str(segment);
    }
    if normal.is_empty() {
        normal.push('/');
    }
    Ok(normal)
}

/// One segment of a path (between two `/`), or why it is ambiguous.
pub fn segment(raw: &str) -> Result<Segment, Ambiguous> {
    let bytes = raw.as_bytes();
    let mut plain = String::with_capacity(raw.len());
    // Every byte the segment stands for, to check that it is UTF-8 and to find dot segments.
    let mut decoded = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b != b'%' {
            if b == b'\\' {
                return Err(Ambiguous::Backslash);
            }
            if b.is_ascii_control() {
                return Err(Ambiguous::Control);
            }
            decoded.push(b);
            push_kept(&mut plain, b);
            i += 1;
            continue;
        }
        let (Some(hi), Some(lo)) = (hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) else {
            return Err(Ambiguous::BadEscape);
        };
        let byte = hi << 4 | lo;
        i += 3;
        match byte {
            b'/' => return Err(Ambiguous::EncodedSlash),
            b'\\' => return Err(Ambiguous::Backslash),
            b if b.is_ascii_control() => return Err(Ambiguous::Control),
            // `%25` then two hex digits, each sent as itself or escaped (`%25A%42` is `%AB`
            // once the `B` is decoded).
            b'%' if hex_digit_at(bytes, i)
                .and_then(|after| hex_digit_at(bytes, after))
                .is_some() =>
            {
                return Err(Ambiguous::DoubleEncoded)
            }
            _ => {}
        }
        decoded.push(byte);
        if is_unreserved(byte) {
            plain.push(char::from(byte));
        } else {
            push_escape(&mut plain, byte);
        }
    }
    let decoded = std::str::from_utf8(&decoded).map_err(|_| Ambiguous::NotUtf8)?;
    match decoded {
        "." => return Ok(Segment::Dot),
        ".." => return Ok(Segment::DotDot),
        _ => {}
    }
    // What a servlet container keeps of the segment (`;` starts its parameters), and what an
    // origin that trims trailing blanks and dots (Windows) keeps of it.
    let stem = decoded.split(';').next().unwrap_or(decoded);
    let trimmed = decoded.trim_end_matches([' ', '\t']);
    if matches!(stem, "." | "..") || matches!(trimmed, "." | "..") {
        return Err(Ambiguous::DotVariant);
    }
    Ok(Segment::Plain(plain))
}

/// Where the character after the one at `i` starts, when the one at `i` is a hex digit, sent
/// as itself or as an escape of one.
fn hex_digit_at(bytes: &[u8], i: usize) -> Option<usize> {
    if hex(bytes.get(i)).is_some() {
        return Some(i + 1);
    }
    if bytes.get(i) != Some(&b'%') {
        return None;
    }
    let (hi, lo) = (hex(bytes.get(i + 1))?, hex(bytes.get(i + 2))?);
    (hi << 4 | lo).is_ascii_hexdigit().then_some(i + 3)
}

/// A byte as it was sent, other than `%`: printable ASCII as itself, anything above escaped
/// (the request line carried it raw; the origin reads the same byte).
fn push_kept(out: &mut String, b: u8) {
    if b.is_ascii() {
        out.push(char::from(b));
    } else {
        push_escape(out, b);
    }
}

fn push_escape(out: &mut String, b: u8) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0xF)]));
}

fn hex(b: Option<&u8>) -> Option<u8> {
    match b? {
        b @ b'0'..=b'9' => Some(b - b'0'),
        b @ b'a'..=b'f' => Some(b - b'a' + 10),
        b @ b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// RFC 3986 §2.3: decoding these never changes what a path means.
fn is_unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_segments_are_removed_and_only_unreserved_characters_decoded() {
        let cases = [
            ("/", "/"),
            ("/a/b", "/a/b"),
            ("/a/./b", "/a/b"),
            ("/a/../b", "/b"),
            ("/../../a", "/a"),
            ("/a/%2e%2E/b", "/b"),
            ("/a/.%2e/b", "/b"),
            ("/a/%2E/b", "/a/b"),
            ("/a/...", "/a/..."),
            ("/a/.hidden", "/a/.hidden"),
            ("/a//b/", "/a//b/"),
            ("/%75ser", "/user"),
            ("/a%7eb", "/a~b"),
            ("/a%20b", "/a%20b"),
            ("/a%3fb", "/a%3Fb"),
            ("/%e2%82%ac", "/%E2%82%AC"),
            ("/a;b/c", "/a;b/c"),
            ("/a%3Bb", "/a%3Bb"),
        ];
        for (raw, normal) in cases {
            assert_eq!(normalise(raw).as_deref(), Ok(normal), "{raw}");
        }
    }

    #[test]
    fn forms_origins_disagree_on_are_refused() {
        use Ambiguous::*;
        let cases = [
            ("*", NotAbsolute),
            ("a/b", NotAbsolute),
            ("/a%2Fb", EncodedSlash),
            ("/a%2f..%2fb", EncodedSlash),
            ("/a\\b", Backslash),
            ("/a%5cb", Backslash),
            ("/a/..;/b", DotVariant),
            ("/a/..;x=1/b", DotVariant),
            ("/a/.;/b", DotVariant),
            ("/a/%2e%2e;/b", DotVariant),
            ("/a/..%3B/b", DotVariant),
            ("/a/..%20/b", DotVariant),
            ("/a/.%09/b", Control),
            ("/a%00b", Control),
            ("/a%0Ab", Control),
            ("/a%7Fb", Control),
            ("/a%zz", BadEscape),
            ("/a%2", BadEscape),
            ("/a%", BadEscape),
            ("/%c0%ae%c0%ae/b", NotUtf8),
            ("/%ff", NotUtf8),
            ("/a%252e%252e/b", DoubleEncoded),
            ("/a%252F", DoubleEncoded),
            ("/;%25A%42/5eb", DoubleEncoded),
            ("/%25%41%42", DoubleEncoded),
            ("/a//../b", EmptyDotDot),
            ("/a//%2e%2e/b", EmptyDotDot),
            ("/a/b/..", DotAtEnd),
            ("/a/b/.", DotAtEnd),
            ("/..", DotAtEnd),
        ];
        for (raw, why) in cases {
            assert_eq!(normalise(raw), Err(why), "{raw}");
        }
        // A percent sign of its own is a character.
        assert_eq!(normalise("/100%25").as_deref(), Ok("/100%25"));
    }
}
