//! Server-sent events framing (the WHATWG HTML "event stream" format), reduced to what the
//! meter needs: the `data` of each event, and where each event ends.
//!
//! Invariant: holds no bytes at all; the data reaches [`Events::data`] in pieces as it arrives,
//! the lines of one event joined with LF as the standard says, and an event is dispatched only
//! at its blank line (one cut before that is never dispatched). Written by hand: the format is
//! four rules (line ends CRLF, LF or CR; `:` starts a comment; `field: value` with one optional
//! space; a blank line dispatches), smaller than any crate's buffering of whole events.

/// What receives an event stream's data.
pub trait Events {
    /// The next bytes of the current event's data.
    fn data(&mut self, bytes: &[u8]);
    /// The current event ended (a blank line) and had at least one `data` line.
    fn dispatch(&mut self);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// The first bytes of the stream, where a UTF-8 byte order mark is dropped; the number is
    /// how many of its bytes were seen.
    Bom(u8),
    LineStart,
    /// A field name that so far matches the first n bytes of `data`.
    Name(u8),
    /// After `data:`, where one space is dropped.
    ValueStart,
    Value,
    /// The rest of a line nobody reads (a comment, another field).
    Skip,
}

const BOM: &[u8] = b"\xEF\xBB\xBF";
const DATA: &[u8] = b"data";

/// The framing state of one event stream.
#[derive(Debug, Clone)]
pub struct Sse {
    state: State,
    /// A CR ended the last line: an LF right after it belongs to that line end.
    after_cr: bool,
    /// The current event has had a `data` line.
    has_data: bool,
}

impl Default for Sse {
    fn default() -> Self {
        Sse {
            state: State::Bom(0),
            after_cr: false,
            has_data: false,
        }
    }
}

impl Sse {
    /// Reads the next bytes of the stream.
    pub fn feed(&mut self, bytes: &[u8], events: &mut impl Events) {
        let mut at = 0;
        while at < bytes.len() {
            let byte = bytes[at];
            if self.after_cr {
                self.after_cr = false;
                if byte == b'\n' {
                    at += 1;
                    continue;
                }
            }
            let line_end = byte == b'\r' || byte == b'\n';
            match self.state {
                State::Bom(seen) => {
                    if byte == BOM[usize::from(seen)] {
                        self.state = match seen + 1 {
                            3 => State::LineStart,
                            n => State::Bom(n),
                        };
                        at += 1;
                        continue;
                    }
                    // No mark: the bytes seen so far (if any) began a field that is not `data`.
                    self.state = if seen == 0 {
                        State::LineStart
                    } else {
                        State::Skip
                    };
                    continue;
                }
                State::LineStart if line_end => {
                    if self.has_data {
                        self.has_data = false;
                        events.dispatch();
                    }
                }
                // The common line, `data: ...`, taken at once rather than byte by byte.
                State::LineStart if bytes[at..].starts_with(b"data:") => {
                    if self.has_data {
                        events.data(b"\n");
                    }
                    self.has_data = true;
                    at += DATA.len() + 1;
                    self.state = match bytes.get(at) {
                        Some(b' ') => {
                            at += 1;
                            State::Value
                        }
                        Some(_) => State::Value,
                        // The chunk ends here: a space opening the next is still dropped.
                        None => State::ValueStart,
                    };
                    continue;
                }
                State::LineStart => {
                    self.state = match byte {
                        b'd' => State::Name(1),
                        _ => State::Skip,
                    };
                }
                State::Name(4) if byte == b':' || line_end => {
                    // A data line (`data` alone is one with an empty value).
                    if self.has_data {
                        events.data(b"\n");
                    }
                    self.has_data = true;
                    if line_end {
                        self.state = State::LineStart;
                    } else {
                        self.state = State::ValueStart;
                    }
                }
                State::Name(n) if usize::from(n) < DATA.len() && byte == DATA[usize::from(n)] => {
                    self.state = State::Name(n + 1);
                }
                State::Name(_) if line_end => self.state = State::LineStart,
                State::Name(_) => self.state = State::Skip,
                State::ValueStart if byte == b' ' => self.state = State::Value,
                State::ValueStart => {
                    self.state = State::Value;
                    continue;
                }
                State::Value | State::Skip => {
                    let rest = &bytes[at..];
                    let run = memchr::memchr2(b'\r', b'\n', rest).unwrap_or(rest.len());
                    if self.state == State::Value && run > 0 {
                        events.data(&rest[..run]);
                    }
                    at += run;
                    if at < bytes.len() {
                        self.state = State::LineStart;
                        self.after_cr = bytes[at] == b'\r';
                        at += 1;
                    }
                    continue;
                }
            }
            if line_end {
                self.after_cr = byte == b'\r';
            }
            at += 1;
        }
    }

    /// Whether the stream stopped inside an event's data (a `data` line, or an event with one,
    /// not yet ended).
    pub fn is_inside_event(&self) -> bool {
        self.has_data
            || matches!(
                self.state,
                State::Name(_) | State::ValueStart | State::Value
            )
    }
}
