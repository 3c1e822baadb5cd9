//! A push scanner for JSON that follows the path of object keys and hands the few scalars the
//! meter reads to a [`Sink`], skipping everything else.
//!
//! Invariant: it never allocates and never holds more than [`CAPTURE`] bytes of any string or
//! more than [`DEPTH`] levels of nesting, whatever the input; a document deeper than that fails.
//! Only values whose path is made of known keys (at most [`TRACK`] levels) are captured; the
//! rest, a model's output text included, is skipped with `memchr`, and a container no tracked
//! path can reach (a chunk's `choices`, a response's `output`) is skipped whole, checking only
//! its strings and the pairing of its brackets.
//!
//! Written by hand rather than with a push parser crate (`actson` was the candidate): actson
//! copies every string and number into its own buffer and returns an event per token, so a
//! megabyte of output text would be held whole and walked twice; here a skipped string costs
//! one `memchr2` per chunk, and the structure is still checked, so a cut or broken body is told
//! apart from a complete one.

/// The most bytes kept of a captured string (a model name); longer ones read as unreadable.
pub const CAPTURE: usize = 256;
/// The deepest nesting accepted: one bit per level in a `u128`.
pub const DEPTH: usize = 128;
/// The deepest path whose keys are tracked (`response.usage.input_tokens_details.cached_tokens`).
pub const TRACK: usize = 4;
/// The longest key that can be a known one.
const KEY_MAX: usize = 32;

/// The object keys the meter looks for; any other key is `Other`, an array's items `Index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Other,
    Index,
    Model,
    Type,
    Usage,
    Response,
    Message,
    PromptTokens,
    CompletionTokens,
    PromptTokensDetails,
    InputTokens,
    OutputTokens,
    InputTokensDetails,
    CachedTokens,
    CacheReadInputTokens,
    CacheCreationInputTokens,
}

impl Key {
    fn of(name: &[u8]) -> Key {
        match name {
            b"model" => Key::Model,
            b"type" => Key::Type,
            b"usage" => Key::Usage,
            b"response" => Key::Response,
            b"message" => Key::Message,
            b"prompt_tokens" => Key::PromptTokens,
            b"completion_tokens" => Key::CompletionTokens,
            b"prompt_tokens_details" => Key::PromptTokensDetails,
            b"input_tokens" => Key::InputTokens,
            b"output_tokens" => Key::OutputTokens,
            b"input_tokens_details" => Key::InputTokensDetails,
            b"cached_tokens" => Key::CachedTokens,
            b"cache_read_input_tokens" => Key::CacheReadInputTokens,
            b"cache_creation_input_tokens" => Key::CacheCreationInputTokens,
            _ => Key::Other,
        }
    }

    fn is_known(self) -> bool {
        !matches!(self, Key::Other | Key::Index)
    }
}

/// A scalar at a tracked path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scalar<'a> {
    /// A non-negative integer that fits in a `u64`.
    Int(u64),
    /// A string of at most [`CAPTURE`] bytes of valid UTF-8 (escapes decoded).
    Str(&'a str),
    Null,
    /// Anything else: a boolean, a fraction, a negative or huge number, a string too long or
    /// with a surrogate escape.
    Other,
}

/// What receives the scalars at tracked paths.
pub trait Sink {
    fn scalar(&mut self, path: &[Key], value: Scalar<'_>);
}

/// Where a document stands when its bytes end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// One whole JSON value, nothing after it but whitespace.
    Complete,
    /// Nothing but whitespace yet.
    Empty,
    /// Stopped inside the value.
    Cut,
    /// Not JSON, or deeper than [`DEPTH`].
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the top-level value.
    Start,
    /// After `:` (a member's value).
    Value,
    /// After `[`: a value or `]`.
    ValueOrClose,
    /// After `{`: a key or `}`.
    KeyOrClose,
    /// After `,` in an object.
    Key,
    Colon,
    /// After a value inside a container: `,` or the closing bracket.
    Comma,
    Str,
    Escape,
    Unicode,
    Number,
    Literal,
    /// Inside a container no tracked path reaches: only strings and brackets are looked at,
    /// until the bracket that closes it (the one that brings `depth` back to `skip_to`).
    Skip,
    /// A string inside a skipped container.
    SkipStr,
    /// After a backslash in such a string.
    SkipEscape,
    Done,
    Failed,
}

/// The bytes [`State::Skip`] stops at: quotes and brackets; everything else inside a skipped
/// container is passed over without a look at the state.
static SKIP_STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    stops[b'"' as usize] = true;
    stops[b'{' as usize] = true;
    stops[b'}' as usize] = true;
    stops[b'[' as usize] = true;
    stops[b']' as usize] = true;
    stops
};

/// Where the next `"` or `\\` in `bytes` is. Most strings here are short (keys, ids, a chunk's
/// text), for which a plain loop beats `memchr2`'s setup; a longer run goes to `memchr2`.
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    const SHORT: usize = 32;
    let head = &bytes[..bytes.len().min(SHORT)];
    if let Some(found) = head.iter().position(|&b| b == b'"' || b == b'\\') {
        return Some(found);
    }
    let tail = bytes.get(SHORT..).filter(|tail| !tail.is_empty())?;
    memchr::memchr2(b'"', b'\\', tail).map(|found| found + SHORT)
}

/// The scanner of one JSON document; [`Scanner::reset`] readies it for the next.
#[derive(Clone)]
pub struct Scanner {
    state: State,
    /// Container kinds, one bit per level (set: object).
    kinds: u128,
    depth: usize,
    /// In [`State::Skip`]: the depth outside the skipped container.
    skip_to: usize,
    /// The key (or `Index`) of each of the first [`TRACK`] levels.
    path: [Key; TRACK],
    /// Whether the string or number now being read is kept (its path is tracked).
    capturing: bool,
    /// Whether the string now being read is a key.
    in_key: bool,
    /// The bytes of the string being captured; `spoiled` once it cannot be used.
    text: [u8; CAPTURE],
    text_len: usize,
    spoiled: bool,
    /// The integer being captured; `None` once it is not a plain non-negative integer.
    number: Option<u64>,
    /// A `\u` escape: its value so far and the hex digits still to come.
    unicode: u32,
    unicode_left: u8,
    /// The rest of `true`, `false` or `null` still expected.
    literal: &'static [u8],
    literal_is_null: bool,
}

impl Default for Scanner {
    fn default() -> Self {
        Scanner {
            state: State::Start,
            kinds: 0,
            depth: 0,
            skip_to: 0,
            path: [Key::Other; TRACK],
            capturing: false,
            in_key: false,
            text: [0; CAPTURE],
            text_len: 0,
            spoiled: false,
            number: None,
            unicode: 0,
            unicode_left: 0,
            literal: b"",
            literal_is_null: false,
        }
    }
}

fn is_space(byte: u8) -> bool {
    matches!(byte, b' ' | b'\t' | b'\n' | b'\r')
}

impl Scanner {
    /// Ready for a new document (the capture buffer is not wiped: it is only read up to its
    /// length).
    pub fn reset(&mut self) {
        self.state = State::Start;
        self.kinds = 0;
        self.depth = 0;
        self.text_len = 0;
        self.spoiled = false;
    }

    /// Bytes of the input held now (a captured string so far).
    pub fn held(&self) -> usize {
        self.text_len
    }

    /// Whether the path to the current depth is all known keys, within [`TRACK`] levels.
    fn tracked(&self, depth: usize) -> bool {
        depth <= TRACK && self.path[..depth].iter().all(|k| k.is_known())
    }

    fn fail(&mut self) {
        self.state = State::Failed;
    }

    /// Opens a container; one no tracked path can reach is skipped whole ([`State::Skip`]).
    fn push(&mut self, object: bool) {
        if !self.open(object) {
            return;
        }
        if !self.tracked(self.depth - 1) {
            self.skip_to = self.depth - 1;
            self.state = State::Skip;
            return;
        }
        if self.depth - 1 < TRACK {
            self.path[self.depth - 1] = if object { Key::Other } else { Key::Index };
        }
        self.state = if object {
            State::KeyOrClose
        } else {
            State::ValueOrClose
        };
    }

    /// Records a container's kind one level deeper; `false` (and failed) past [`DEPTH`].
    fn open(&mut self, object: bool) -> bool {
        if self.depth == DEPTH {
            self.fail();
            return false;
        }
        let bit = 1u128 << self.depth;
        if object {
            self.kinds |= bit;
        } else {
            self.kinds &= !bit;
        }
        self.depth += 1;
        true
    }

    /// A bracket inside a skipped container: opens one level, or closes one (of the same kind),
    /// leaving [`State::Skip`] with the last.
    fn skip_bracket(&mut self, byte: u8) {
        match byte {
            b'{' => {
                self.open(true);
            }
            b'[' => {
                self.open(false);
            }
            close => {
                if self.is_object() != (close == b'}') {
                    return self.fail();
                }
                self.depth -= 1;
                if self.depth == self.skip_to {
                    self.after_value();
                }
            }
        }
    }

    fn is_object(&self) -> bool {
        self.depth > 0 && self.kinds & (1u128 << (self.depth - 1)) != 0
    }

    fn pop(&mut self, object: bool) {
        if self.depth == 0 || self.is_object() != object {
            return self.fail();
        }
        self.depth -= 1;
        self.after_value();
    }

    fn after_value(&mut self) {
        self.state = if self.depth == 0 {
            State::Done
        } else {
            State::Comma
        };
    }

    fn keep(&mut self, bytes: &[u8]) {
        let end = self.text_len + bytes.len();
        if end > self.text.len() {
            self.spoiled = true;
            return;
        }
        self.text[self.text_len..end].copy_from_slice(bytes);
        self.text_len = end;
    }

    fn start_string(&mut self, key: bool) {
        self.in_key = key;
        self.text_len = 0;
        self.spoiled = false;
        self.capturing = if key {
            // A key is kept only where the object it names a member of is tracked.
            self.depth <= TRACK && self.tracked(self.depth - 1)
        } else {
            self.tracked(self.depth)
        };
        if key && self.depth <= TRACK {
            self.path[self.depth - 1] = Key::Other;
        }
        self.state = State::Str;
    }

    fn end_string(&mut self, sink: &mut impl Sink) {
        if self.in_key {
            if !self.spoiled {
                let text = self.text;
                self.name_key(&text[..self.text_len]);
            }
            self.state = State::Colon;
            return;
        }
        if self.capturing {
            let text = &self.text[..self.text_len];
            let value = match std::str::from_utf8(text) {
                Ok(text) if !self.spoiled => Scalar::Str(text),
                _ => Scalar::Other,
            };
            sink.scalar(&self.path[..self.depth], value);
        }
        self.after_value();
    }

    /// The key `name` names the member that follows (where it is captured); next, the colon.
    fn name_key(&mut self, name: &[u8]) {
        if self.capturing && name.len() <= KEY_MAX {
            self.path[self.depth - 1] = Key::of(name);
        }
        self.state = State::Colon;
    }

    fn end_number(&mut self, sink: &mut impl Sink) {
        if self.capturing {
            let value = self.number.map_or(Scalar::Other, Scalar::Int);
            sink.scalar(&self.path[..self.depth], value);
        }
        self.after_value();
    }

    fn start_value(&mut self, byte: u8) {
        match byte {
            b'{' => self.push(true),
            b'[' => self.push(false),
            b'"' => self.start_string(false),
            b'0'..=b'9' | b'-' => {
                self.capturing = self.tracked(self.depth);
                self.number = match byte {
                    b'-' => None,
                    digit => Some(u64::from(digit - b'0')),
                };
                self.state = State::Number;
            }
            b't' | b'f' | b'n' => {
                self.capturing = self.tracked(self.depth);
                self.literal_is_null = byte == b'n';
                self.literal = match byte {
                    b't' => b"rue",
                    b'f' => b"alse",
                    _ => b"ull",
                };
                self.state = State::Literal;
            }
            _ => self.fail(),
        }
    }

    /// Runs through a skipped container (its strings and brackets only) in one loop, until it
    /// closes or `bytes` end; returns how many bytes of `bytes` it took.
    fn skip(&mut self, bytes: &[u8]) -> usize {
        let mut at = 0;
        loop {
            match self.state {
                State::Skip => {
                    let Some(found) = bytes[at..].iter().position(|&b| SKIP_STOPS[usize::from(b)])
                    else {
                        return bytes.len();
                    };
                    at += found;
                    let stop = bytes[at];
                    at += 1;
                    if stop == b'"' {
                        self.state = State::SkipStr;
                    } else {
                        self.skip_bracket(stop);
                    }
                }
                State::SkipStr => {
                    let Some(found) = quote_or_backslash(&bytes[at..]) else {
                        return bytes.len();
                    };
                    at += found;
                    self.state = match bytes[at] {
                        b'"' => State::Skip,
                        _ => State::SkipEscape,
                    };
                    at += 1;
                }
                State::SkipEscape if at < bytes.len() => {
                    self.state = State::SkipStr;
                    at += 1;
                }
                // The container closed (or failed), or the bytes ended after a backslash.
                _ => return at,
            }
        }
    }

    /// Reads `bytes`, the next part of the document.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut impl Sink) {
        let mut at = 0;
        while at < bytes.len() {
            let byte = bytes[at];
            match self.state {
                State::Failed => return,
                State::Skip | State::SkipStr | State::SkipEscape => {
                    at += self.skip(&bytes[at..]);
                    continue;
                }
                State::Str if !self.capturing => {
                    // The hot path: text nobody reads, skipped to the next quote or backslash.
                    match quote_or_backslash(&bytes[at..]) {
                        None => return,
                        Some(found) => {
                            at += found;
                            if bytes[at] == b'"' {
                                self.end_string(sink);
                            } else {
                                self.state = State::Escape;
                            }
                        }
                    }
                }
                State::Str => {
                    let rest = &bytes[at..];
                    let Some(run) = quote_or_backslash(rest) else {
                        self.keep(rest);
                        return;
                    };
                    at += run;
                    if rest[run] == b'\\' {
                        self.keep(&rest[..run]);
                        self.state = State::Escape;
                    } else if self.in_key && self.text_len == 0 && !self.spoiled {
                        // A whole key in this chunk (the usual case): named where it lies, and
                        // the colon right after it taken at once.
                        self.name_key(&rest[..run]);
                        if bytes.get(at + 1) == Some(&b':') {
                            at += 1;
                            self.state = State::Value;
                        }
                    } else {
                        self.keep(&rest[..run]);
                        self.end_string(sink);
                    }
                }
                State::Escape => {
                    self.state = State::Str;
                    if self.capturing {
                        let plain = match byte {
                            b'"' => b'"',
                            b'\\' => b'\\',
                            b'/' => b'/',
                            b'b' => 8,
                            b'f' => 12,
                            b'n' => b'\n',
                            b'r' => b'\r',
                            b't' => b'\t',
                            b'u' => {
                                self.unicode = 0;
                                self.unicode_left = 4;
                                self.state = State::Unicode;
                                at += 1;
                                continue;
                            }
                            _ => {
                                self.fail();
                                return;
                            }
                        };
                        self.keep(&[plain]);
                    }
                }
                State::Unicode => {
                    let Some(digit) = (byte as char).to_digit(16) else {
                        self.fail();
                        return;
                    };
                    self.unicode = self.unicode * 16 + digit;
                    self.unicode_left -= 1;
                    if self.unicode_left == 0 {
                        self.state = State::Str;
                        // A surrogate (half of a pair) is not decoded: the string is unusable.
                        match char::from_u32(self.unicode) {
                            Some(c) => {
                                let mut utf8 = [0; 4];
                                self.keep(c.encode_utf8(&mut utf8).as_bytes());
                            }
                            None => self.spoiled = true,
                        }
                    }
                }
                State::Number => {
                    let rest = &bytes[at..];
                    let digits = rest
                        .iter()
                        .position(|b| !b.is_ascii_digit())
                        .unwrap_or(rest.len());
                    for &digit in &rest[..digits] {
                        let digit = u64::from(digit - b'0');
                        self.number = self
                            .number
                            .and_then(|n| n.checked_mul(10))
                            .and_then(|n| n.checked_add(digit));
                    }
                    at += digits;
                    match bytes.get(at) {
                        None => return,
                        Some(b'.' | b'e' | b'E' | b'+' | b'-') => self.number = None,
                        Some(_) => {
                            // The byte after a number belongs to what follows: read it again.
                            self.end_number(sink);
                            continue;
                        }
                    }
                }
                State::Literal => match self.literal.split_first() {
                    Some((&want, rest)) if want == byte => {
                        self.literal = rest;
                        if rest.is_empty() {
                            if self.capturing {
                                let value = match self.literal_is_null {
                                    true => Scalar::Null,
                                    false => Scalar::Other,
                                };
                                sink.scalar(&self.path[..self.depth], value);
                            }
                            self.after_value();
                        }
                    }
                    _ => {
                        self.fail();
                        return;
                    }
                },
                _ if is_space(byte) => {}
                State::Start | State::Value => self.start_value(byte),
                State::ValueOrClose => match byte {
                    b']' => self.pop(false),
                    _ => self.start_value(byte),
                },
                State::KeyOrClose => match byte {
                    b'}' => self.pop(true),
                    b'"' => self.start_string(true),
                    _ => self.fail(),
                },
                State::Key => match byte {
                    b'"' => self.start_string(true),
                    _ => self.fail(),
                },
                State::Colon => match byte {
                    b':' => self.state = State::Value,
                    _ => self.fail(),
                },
                State::Comma => match byte {
                    b',' if self.is_object() => {
                        // The next key's quote, usually right here, taken with the comma.
                        if bytes.get(at + 1) == Some(&b'"') {
                            at += 1;
                            self.start_string(true);
                        } else {
                            self.state = State::Key;
                        }
                    }
                    b',' => self.state = State::Value,
                    b'}' => self.pop(true),
                    b']' => self.pop(false),
                    _ => self.fail(),
                },
                State::Done => self.fail(),
            }
            at += 1;
        }
    }

    /// The document's bytes are over: a number at the top level ends here.
    pub fn end(&mut self, sink: &mut impl Sink) -> End {
        if self.state == State::Number && self.depth == 0 {
            self.end_number(sink);
        }
        match self.state {
            State::Done => End::Complete,
            State::Start => End::Empty,
            State::Failed => End::Failed,
            _ => End::Cut,
        }
    }
}
