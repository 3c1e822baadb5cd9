//! RFC 8785 (JCS) canonical bytes, the input of every hash and signature in the contract.
//!
//! Invariant: one JSON value has exactly one canonical byte string, and a value that has none
//! (a non-finite number) is an error, never a placeholder.
//!
//! Written by hand rather than taken from a crate: the JCS crates work on `serde_json::Value`,
//! whose strings are Rust `String`s and so cannot hold the unpaired surrogate of the contract's
//! `lone-surrogate` vector (`"\ud800"` must canonicalise to those six escaped characters). Our
//! tree keeps strings as UTF-16 code units, which also makes the member order (by UTF-16 code
//! unit) a plain slice comparison. Numbers are formatted by `ryu-js`, which implements
//! ECMAScript's `Number::toString`, the one part that is easy to get subtly wrong.

use serde_json::Value;

/// Why a value has no canonical form.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CanonError {
    #[error("a non-finite number ({0}) has no canonical form")]
    NonFinite(f64),
    #[error("JSON text is malformed at byte {offset}: {what}")]
    Malformed { offset: usize, what: &'static str },
    #[error("JSON text repeats the member name {0:?}")]
    DuplicateMember(String),
}

/// A JSON value as canonicalisation sees it: strings are UTF-16 code units, so unpaired
/// surrogates survive, and members keep their parsed order until emission sorts them.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Null,
    Bool(bool),
    Number(f64),
    String(Vec<u16>),
    Array(Vec<Node>),
    Object(Vec<(Vec<u16>, Node)>),
}

/// A string as the emitter sees it: UTF-8 from serde_json, UTF-16 units from [`Node`].
#[derive(Clone, Copy)]
enum Text<'a> {
    Utf8(&'a str),
    Utf16(&'a [u16]),
}

impl Text<'_> {
    /// JCS orders member names by UTF-16 code units.
    fn cmp_units(&self, other: &Text<'_>) -> std::cmp::Ordering {
        match (self, other) {
            (Text::Utf16(a), Text::Utf16(b)) => a.cmp(b),
            (Text::Utf8(a), Text::Utf8(b)) if a.is_ascii() && b.is_ascii() => a.cmp(b),
            (a, b) => a.units().cmp(b.units()),
        }
    }

    fn units(&self) -> Box<dyn Iterator<Item = u16> + '_> {
        match self {
            Text::Utf8(s) => Box::new(s.encode_utf16()),
            Text::Utf16(u) => Box::new(u.iter().copied()),
        }
    }
}

/// One level of a JSON tree, borrowed: what the emitter needs from `Value` and `Node` alike.
enum View<'a, T> {
    Null,
    Bool(bool),
    Number(f64),
    String(Text<'a>),
    Array(&'a [T]),
    Object(Vec<(Text<'a>, &'a T)>),
}

trait Tree: Sized {
    fn view(&self) -> View<'_, Self>;
}

impl Tree for Value {
    fn view(&self) -> View<'_, Value> {
        match self {
            Value::Null => View::Null,
            Value::Bool(b) => View::Bool(*b),
            // serde_json numbers are i64, u64 or finite f64; ECMAScript reads every one of
            // them as an IEEE double, and so do we.
            Value::Number(n) => View::Number(n.as_f64().unwrap_or(f64::NAN)),
            Value::String(s) => View::String(Text::Utf8(s)),
            Value::Array(items) => View::Array(items),
            Value::Object(members) => {
                View::Object(members.iter().map(|(k, v)| (Text::Utf8(k), v)).collect())
            }
        }
    }
}

impl Tree for Node {
    fn view(&self) -> View<'_, Node> {
        match self {
            Node::Null => View::Null,
            Node::Bool(b) => View::Bool(*b),
            Node::Number(n) => View::Number(*n),
            Node::String(units) => View::String(Text::Utf16(units)),
            Node::Array(items) => View::Array(items),
            Node::Object(members) => {
                View::Object(members.iter().map(|(k, v)| (Text::Utf16(k), v)).collect())
            }
        }
    }
}

/// Canonical bytes of a parsed JSON value.
pub fn canonical_bytes(value: &Value) -> Result<Vec<u8>, CanonError> {
    let mut out = Vec::with_capacity(1024);
    emit(value.view(), &mut out)?;
    Ok(out)
}

/// Canonical bytes of a JSON object without one of its top-level members: what a signature
/// covers (every member but `signature`, unknown members included).
pub fn canonical_bytes_without(value: &Value, member: &str) -> Result<Vec<u8>, CanonError> {
    let view = match value.view() {
        View::Object(mut members) => {
            members.retain(|(k, _)| !matches!(k, Text::Utf8(k) if *k == member));
            View::Object(members)
        }
        other => other,
    };
    let mut out = Vec::with_capacity(1024);
    emit(view, &mut out)?;
    Ok(out)
}

/// Canonical bytes of a tree.
pub fn canonical_bytes_of(node: &Node) -> Result<Vec<u8>, CanonError> {
    let mut out = Vec::with_capacity(1024);
    emit(node.view(), &mut out)?;
    Ok(out)
}

/// Canonical bytes of JSON text, for inputs a `serde_json::Value` cannot hold (unpaired
/// surrogates). Duplicate member names are refused: JCS requires I-JSON.
pub fn canonicalize_text(text: &str) -> Result<Vec<u8>, CanonError> {
    canonical_bytes_of(&parse_text(text)?)
}

/// Parses JSON text into a [`Node`] (strict RFC 8259, strings kept as UTF-16).
pub fn parse_text(text: &str) -> Result<Node, CanonError> {
    let mut p = Parser {
        bytes: text.as_bytes(),
        pos: 0,
    };
    p.skip_ws();
    let node = p.value(0)?;
    p.skip_ws();
    if p.pos != p.bytes.len() {
        return Err(p.err("trailing characters"));
    }
    Ok(node)
}

fn emit<T: Tree>(view: View<'_, T>, out: &mut Vec<u8>) -> Result<(), CanonError> {
    match view {
        View::Null => out.extend_from_slice(b"null"),
        View::Bool(true) => out.extend_from_slice(b"true"),
        View::Bool(false) => out.extend_from_slice(b"false"),
        View::Number(n) => emit_number(n, out)?,
        View::String(text) => emit_string(text, out),
        View::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                emit(item.view(), out)?;
            }
            out.push(b']');
        }
        View::Object(mut members) => {
            members.sort_by(|a, b| a.0.cmp_units(&b.0));
            out.push(b'{');
            for (i, (key, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                emit_string(key, out);
                out.push(b':');
                emit(value.view(), out)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

/// ECMAScript `Number::toString` of a finite double; `-0` is `0`.
pub fn emit_number(n: f64, out: &mut Vec<u8>) -> Result<(), CanonError> {
    if !n.is_finite() {
        return Err(CanonError::NonFinite(n));
    }
    if n == 0.0 {
        out.push(b'0');
        return Ok(());
    }
    let mut buf = ryu_js::Buffer::new();
    out.extend_from_slice(buf.format_finite(n).as_bytes());
    Ok(())
}

fn emit_string(text: Text<'_>, out: &mut Vec<u8>) {
    out.push(b'"');
    match text {
        Text::Utf8(s) => {
            // Everything but the escape set is copied as it is, so copy runs of bytes.
            let bytes = s.as_bytes();
            let mut run = 0;
            for (i, &b) in bytes.iter().enumerate() {
                if b < 0x20 || b == b'"' || b == b'\\' {
                    out.extend_from_slice(&bytes[run..i]);
                    escape_ascii(b, out);
                    run = i + 1;
                }
            }
            out.extend_from_slice(&bytes[run..]);
        }
        Text::Utf16(units) => {
            for decoded in char::decode_utf16(units.iter().copied()) {
                match decoded {
                    Ok(c) if c.is_ascii() => match c as u8 {
                        b if b < 0x20 || b == b'"' || b == b'\\' => escape_ascii(b, out),
                        b => out.push(b),
                    },
                    Ok(c) => {
                        let mut b = [0u8; 4];
                        out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
                    }
                    Err(lone) => push_u_escape(lone.unpaired_surrogate(), out),
                }
            }
        }
    }
    out.push(b'"');
}

/// The closed escape set: the five short forms, else `\u00xx` in lower-case hex.
fn escape_ascii(b: u8, out: &mut Vec<u8>) {
    match b {
        b'"' => out.extend_from_slice(b"\\\""),
        b'\\' => out.extend_from_slice(b"\\\\"),
        0x08 => out.extend_from_slice(b"\\b"),
        b'\t' => out.extend_from_slice(b"\\t"),
        b'\n' => out.extend_from_slice(b"\\n"),
        0x0c => out.extend_from_slice(b"\\f"),
        b'\r' => out.extend_from_slice(b"\\r"),
        b => push_u_escape(u16::from(b), out),
    }
}

fn push_u_escape(unit: u16, out: &mut Vec<u8>) {
    out.extend_from_slice(format!("\\u{unit:04x}").as_bytes());
}

/// Nesting deeper than this is refused rather than risking the stack.
const MAX_DEPTH: usize = 128;

struct Parser<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, what: &'static str) -> CanonError {
        CanonError::Malformed {
            offset: self.pos,
            what,
        }
    }

    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.pos) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, lit: &[u8]) -> bool {
        if self.bytes[self.pos..].starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Node, CanonError> {
        if depth > MAX_DEPTH {
            return Err(self.err("nesting too deep"));
        }
        match self.bytes.get(self.pos) {
            Some(b'{') => self.object(depth),
            Some(b'[') => self.array(depth),
            Some(b'"') => Ok(Node::String(self.string()?)),
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ if self.eat(b"null") => Ok(Node::Null),
            _ if self.eat(b"true") => Ok(Node::Bool(true)),
            _ if self.eat(b"false") => Ok(Node::Bool(false)),
            _ => Err(self.err("expected a value")),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Node, CanonError> {
        self.pos += 1;
        let mut members: Vec<(Vec<u16>, Node)> = Vec::new();
        self.skip_ws();
        if self.eat(b"}") {
            return Ok(Node::Object(members));
        }
        loop {
            self.skip_ws();
            if self.bytes.get(self.pos) != Some(&b'"') {
                return Err(self.err("expected a member name"));
            }
            let key = self.string()?;
            if members.iter().any(|(k, _)| *k == key) {
                return Err(CanonError::DuplicateMember(String::from_utf16_lossy(&key)));
            }
            self.skip_ws();
            if !self.eat(b":") {
                return Err(self.err("expected ':'"));
            }
            self.skip_ws();
            let value = self.value(depth + 1)?;
            members.push((key, value));
            self.skip_ws();
            if self.eat(b",") {
                continue;
            }
            if self.eat(b"}") {
                return Ok(Node::Object(members));
            }
            return Err(self.err("expected ',' or '}'"));
        }
    }

    fn array(&mut self, depth: usize) -> Result<Node, CanonError> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.eat(b"]") {
            return Ok(Node::Array(items));
        }
        loop {
            self.skip_ws();
            items.push(self.value(depth + 1)?);
            self.skip_ws();
            if self.eat(b",") {
                continue;
            }
            if self.eat(b"]") {
                return Ok(Node::Array(items));
            }
            return Err(self.err("expected ',' or ']'"));
        }
    }

    fn number(&mut self) -> Result<Node, CanonError> {
        let start = self.pos;
        let digits = |p: &mut Self| {
            let s = p.pos;
            while let Some(b'0'..=b'9') = p.bytes.get(p.pos) {
                p.pos += 1;
            }
            p.pos > s
        };
        self.eat(b"-");
        if !self.eat(b"0") && !digits(self) {
            return Err(self.err("expected digits"));
        }
        if self.eat(b".") && !digits(self) {
            return Err(self.err("expected fraction digits"));
        }
        if matches!(self.bytes.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            let _ = self.eat(b"+") || self.eat(b"-");
            if !digits(self) {
                return Err(self.err("expected exponent digits"));
            }
        }
        let lexeme = std::str::from_utf8(&self.bytes[start..self.pos])
            .map_err(|_| self.err("number is not ASCII"))?;
        // Rust's float parser is correctly rounded, as ECMAScript's is.
        lexeme
            .parse::<f64>()
            .map(Node::Number)
            .map_err(|_| self.err("unreadable number"))
    }

    fn string(&mut self) -> Result<Vec<u16>, CanonError> {
        self.pos += 1;
        let mut units = Vec::new();
        loop {
            let start = self.pos;
            while let Some(&b) = self.bytes.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            // The input is a &str, and we stopped on ASCII, so this slice is valid UTF-8.
            let run = std::str::from_utf8(&self.bytes[start..self.pos])
                .map_err(|_| self.err("invalid UTF-8"))?;
            units.extend(run.encode_utf16());
            match self.bytes.get(self.pos) {
                Some(b'"') => {
                    self.pos += 1;
                    return Ok(units);
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let esc = *self
                        .bytes
                        .get(self.pos)
                        .ok_or(self.err("unfinished escape"))?;
                    self.pos += 1;
                    units.push(match esc {
                        b'"' => 0x22,
                        b'\\' => 0x5c,
                        b'/' => 0x2f,
                        b'b' => 0x08,
                        b'f' => 0x0c,
                        b'n' => 0x0a,
                        b'r' => 0x0d,
                        b't' => 0x09,
                        b'u' => {
                            let hex = self
                                .bytes
                                .get(self.pos..self.pos + 4)
                                .and_then(|h| std::str::from_utf8(h).ok())
                                .and_then(|h| u16::from_str_radix(h, 16).ok())
                                .ok_or(self.err("bad \\u escape"))?;
                            self.pos += 4;
                            hex
                        }
                        _ => return Err(self.err("unknown escape")),
                    });
                }
                Some(_) => return Err(self.err("control character in string")),
                None => return Err(self.err("unterminated string")),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        String::from_utf8(canonicalize_text(text).unwrap()).unwrap()
    }

    #[test]
    fn numbers_take_the_ecmascript_form() {
        assert_eq!(
            canon("[1.0, -0, 1e21, 1e-7, 0.1, 123456789012345680000]"),
            "[1,0,1e+21,1e-7,0.1,123456789012345680000]"
        );
    }

    #[test]
    fn non_finite_numbers_are_refused() {
        assert_eq!(
            canonical_bytes_of(&Node::Number(f64::NAN))
                .unwrap_err()
                .to_string(),
            "a non-finite number (NaN) has no canonical form"
        );
        assert!(matches!(
            canonical_bytes_of(&Node::Array(vec![Node::Number(f64::INFINITY)])),
            Err(CanonError::NonFinite(_))
        ));
    }

    #[test]
    fn duplicate_members_and_malformed_text_are_refused() {
        assert!(matches!(
            canonicalize_text(r#"{"a":1,"a":2}"#),
            Err(CanonError::DuplicateMember(_))
        ));
        assert!(matches!(
            canonicalize_text(r#"{"a":1,}"#),
            Err(CanonError::Malformed { .. })
        ));
        assert!(matches!(
            canonicalize_text("[01]"),
            Err(CanonError::Malformed { .. })
        ));
    }

    #[test]
    fn value_and_text_paths_agree() {
        let text = r#"{"b":[1,2.5,"x\u0001"],"a":{"é":null,"e":true}}"#;
        let value: Value = serde_json::from_str(text).unwrap();
        assert_eq!(
            canonical_bytes(&value).unwrap(),
            canonicalize_text(text).unwrap()
        );
        assert_eq!(
            canonical_bytes_without(&value, "b").unwrap(),
            r#"{"a":{"e":true,"é":null}}"#.as_bytes().to_vec()
        );
    }
}
