//! A push scanner for JSON that follows the path of object keys and hands the few scalars the
//! meter reads to a [`Sink`], skipping everything else.
//!
//! Invariant: it never allocates and never holds more than [`CAPTURE`] bytes of any string or
//! more than [`DEPTH`] levels of nesting, whatever the input; a document deeper than that fails.
//! Only values whose path is made of known keys (at most [`TRACK`] levels) are captured; the
//! rest, a model's output text included, is skipped with `memchr`.
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
    Done,
    Failed,
}

/// The scanner of one JSON document; [`Scanner::reset`] readies it for the next.
#[derive(Clone)]
pub struct Scanner {
    state: State,
    /// Container kinds, one bit per level (set: object).
    kinds: u128,
    depth: usize,
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

    fn push(&mut self, object: bool) {
        if self.depth == DEPTH {
            return self.fail();
        }
        let bit = 1u128 << self.depth;
        if object {
            self.kinds |= bit;
        } else {
            self.kinds &= !bit;
        }
        if self.depth < TRACK {
            self.path[self.depth] = if object { Key::Other } else { Key::Index };
        }
        self.depth += 1;
        self.state = if object {
            State::KeyOrClose
        } else {
            State::ValueOrClose
        };
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
            if self.capturing && !self.spoiled && self.text_len <= KEY_MAX {
                self.path[self.depth - 1] = Key::of(&self.text[..self.text_len]);
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

    /// Reads `bytes`, the next part of the document.
    pub fn feed(&mut self, bytes: &[u8], sink: &mut impl Sink) {
        let mut at = 0;
        while at < bytes.len() {
            let byte = bytes[at];
            match self.state {
                State::Failed => return,
                State::Str if !self.capturing => {
                    // The hot path: text nobody reads, skipped to the next quote or backslash.
                    match memchr::memchr2(b'"', b'\\', &bytes[at..]) {
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
                State::Str => match byte {
                    b'"' => self.end_string(sink),
                    b'\\' => self.state = State::Escape,
                    _ => {
                        // Up to the next quote or backslash at once.
                        let run =
                            memchr::memchr2(b'"', b'\\', &bytes[at..]).unwrap_or(bytes.len() - at);
                        self.keep(&bytes[at..at + run]);
                        at += run;
                        continue;
                    }
                },
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
                State::Number => match byte {
                    b'0'..=b'9' => {
                        let digit = u64::from(byte - b'0');
                        self.number = self
                            .number
                            .and_then(|n| n.checked_mul(10))
                            .and_then(|n| n.checked_add(digit));
                    }
                    b'.' | b'e' | b'E' | b'+' | b'-' => self.number = None,
                    _ => {
                        // The byte after a number belongs to what follows: read it again.
                        self.end_number(sink);
                        continue;
                    }
                },
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
                    b',' if self.is_object() => self.state = State::Key,
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
