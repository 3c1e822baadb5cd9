//! The meter: the token usage a model API reports in its responses, read as the body is
//! relayed, and the price table that turns it into a cost ([`prices`]).
//!
//! Invariant: pure (no I/O, no clock) and bounded: a [`Meter`] is a fixed-size value that
//! never allocates while it reads a body, whatever the body; it reads usage only from a
//! response it can read whole (identity encoding, JSON or an event stream, not cut before the
//! usage) and otherwise says why not ([`Reading::Unmetered`]), never a made-up zero.

mod doc;
mod json;
pub mod prices;
pub mod request;
mod sse;
#[cfg(test)]
mod tests;

use doc::{Count, Doc, Kind, ModelSeen, Name};
use json::{End, Scanner};
use serde::{Deserialize, Serialize};
use sse::{Events, Sse};
use std::fmt;
use std::str::FromStr;
use std::sync::LazyLock;

pub use prices::{Prices, PricesError};

/// The model APIs the meter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// OpenAI's Chat Completions (`/v1/chat/completions`) and Responses (`/v1/responses`).
    OpenAi,
    /// Anthropic's Messages (`/v1/messages`).
    Anthropic,
}

impl Api {
    pub fn as_str(self) -> &'static str {
        match self {
            Api::OpenAi => "openai",
            Api::Anthropic => "anthropic",
        }
    }
}

impl fmt::Display for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An API name that is not one of [`Api`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown model API {0:?}: expected \"openai\" or \"anthropic\"")]
pub struct UnknownApi(String);

impl FromStr for Api {
    type Err = UnknownApi;

    fn from_str(text: &str) -> Result<Api, UnknownApi> {
        match text {
            "openai" => Ok(Api::OpenAi),
            "anthropic" => Ok(Api::Anthropic),
            other => Err(UnknownApi(other.chars().take(64).collect())),
        }
    }
}

/// What one call used, normalised across the APIs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    /// The model the response names; `None` when it named none, or one not readable.
    pub model: Option<String>,
    /// Every input token, the cached ones (and, for Anthropic, those written to the cache)
    /// included.
    pub input: u64,
    pub output: u64,
    /// The part of `input` read from the provider's prompt cache.
    pub cached: u64,
}

/// The meter's word on one response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading {
    Metered(Usage),
    /// No usage could be read; `reason` is one of [`reason`]'s.
    Unmetered {
        model: Option<String>,
        reason: &'static str,
    },
}

/// Why a response is unmetered, as the egress line says it.
pub mod reason {
    /// The head never came.
    pub const NO_HEAD: &str = "no response head";
    /// A status other than 2xx, and no usage in the body: refused and failed calls count nothing.
    pub const ERROR_RESPONSE: &str = "error response";
    /// A `Content-Encoding` other than identity.
    pub const COMPRESSED: &str = "compressed";
    /// Neither JSON nor `text/event-stream`.
    pub const CONTENT_TYPE: &str = "unexpected content type";
    /// Not JSON (or an event whose data is not), or nested deeper than the meter follows.
    pub const MALFORMED: &str = "malformed body";
    /// A count that is not a non-negative integer, or counts that contradict each other.
    pub const UNREADABLE: &str = "unreadable usage";
    /// The body ended before its usage: cut mid-document, or a stream without its end.
    pub const CUT: &str = "cut";
    /// A whole JSON body without usage.
    pub const NO_USAGE_BODY: &str = "no usage in the body";
    /// A whole stream without usage (Chat Completions streamed without
    /// `stream_options.include_usage`).
    pub const NO_USAGE_STREAM: &str = "no usage in the stream";
    /// A stream that ended with an error event before its usage.
    pub const STREAM_ERROR: &str = "error in the stream";
}

/// Which call of its API a request is: the usage fields (and the request's caps) differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    ChatCompletions,
    Responses,
    Messages,
}

/// How the body is read, decided by the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Pending,
    Json,
    Sse,
    /// Not read at all, for this reason.
    Skipped(&'static str),
}

/// The meter of one response: [`Meter::head`], then [`Meter::feed`] for every body chunk in
/// order, then [`Meter::finish`].
#[derive(Clone)]
pub struct Meter {
    status: http::StatusCode,
    framing: Framing,
    sse: Sse,
    body: Body,
}

/// The body's reading so far (apart from the framing, so that the event stream can call it).
#[derive(Clone)]
struct Body {
    call: Call,
    streamed: bool,
    scanner: Scanner,
    doc: Doc,
    /// The latest model named, and whether it was readable.
    model: Name,
    model_seen: ModelSeen,
    /// OpenAI: the latest complete usage (input, output, cached).
    usage: Option<(u64, u64, u64)>,
    /// Anthropic: the latest value of each count, merged across events.
    input: Option<u64>,
    output: Option<u64>,
    cache_read: Option<u64>,
    cache_creation: Option<u64>,
    /// Anthropic: the counts are final (a whole body, or a `message_delta` with output).
    settled: bool,
    /// The stream's end marker came (`[DONE]`, `message_stop`, a response's last event).
    ended: bool,
    error_event: bool,
    malformed: bool,
    unreadable: bool,
    /// The first bytes of the current event's data, to tell `[DONE]`, and its length.
    lead: [u8; 6],
    data_len: usize,
    /// A streamed Chat Completions answer: the current event's data is held (while it fits)
    /// rather than read, and read at its end only if it may carry usage ([`may_carry_usage`]).
    sieve: bool,
    /// The current event's data is in `hold` (not yet read).
    holding: bool,
    hold: [u8; HOLD],
    hold_len: usize,
}

/// The most bytes of one event a sieved stream holds; a longer event is read as it comes.
const HOLD: usize = 4096;

/// Whether an event's data may carry a usage object: its last `"usage"`, then (past
/// whitespace) `:` and `{`. A Chat Completions stream names its usage in its last chunk only
/// (the others say `"usage":null` or nothing), so the thousands of chunks before it are sieved
/// out here with `memmem` instead of being read. The search runs from the event's end, where
/// the API writes `usage`, and the last such key decides: a chunk has one (a second, in a
/// chunk of the same API, would be a key the format does not have). An object key is only
/// ever this spelled out in the answers of the APIs metered (a string's quotes are escaped, so
/// no text an agent makes the model write can match); spelled otherwise, the usage is not seen
/// and the call reads as unmetered, never as zero.
fn may_carry_usage(data: &[u8]) -> bool {
    const NEEDLE: &[u8] = b"\"usage\"";
    static KEY_REV: LazyLock<memchr::memmem::FinderRev<'static>> =
        LazyLock::new(|| memchr::memmem::FinderRev::new(NEEDLE));
    // The last bytes first, where a chunk's `"usage":null` lies: the quotes there, from the
    // end, each tried as the end of the key (the first that is ends the event's last key).
    // Else the whole event, from its end.
    const TAIL: usize = 64;
    let tail = data.len().saturating_sub(TAIL);
    let in_tail = memchr::memrchr_iter(b'"', &data[tail..])
        .map(|quote| tail + quote)
        .find(|&end| end + 1 >= NEEDLE.len() && &data[end + 1 - NEEDLE.len()..=end] == NEEDLE)
        .map(|end| end + 1 - NEEDLE.len());
    let Some(at) = in_tail.or_else(|| KEY_REV.rfind(data)) else {
        return false;
    };
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut after = data[at + 7..].iter().skip_while(|b| is_space(b));
    after.next() == Some(&b':') && after.find(|b| !is_space(b)) == Some(&b'{')
}

impl Body {
    fn new(call: Call) -> Body {
        Body {
            call,
            streamed: false,
            scanner: Scanner::default(),
            doc: Doc::default(),
            model: Name::default(),
            model_seen: ModelSeen::Absent,
            usage: None,
            input: None,
            output: None,
            cache_read: None,
            cache_creation: None,
            settled: false,
            ended: false,
            error_event: false,
            malformed: false,
            unreadable: false,
            lead: [0; 6],
            data_len: 0,
            sieve: false,
            holding: false,
            hold: [0; HOLD],
            hold_len: 0,
        }
    }

    /// Takes in the model a document named (also from one cut or broken: the name is still
    /// shown on an unmetered line).
    fn take_model(&mut self) {
        match self.doc.model {
            ModelSeen::Named => {
                if let Some(name) = self.doc.name.as_str() {
                    self.model.set(name);
                    self.model_seen = ModelSeen::Named;
                }
            }
            ModelSeen::Unusable => self.model_seen = ModelSeen::Unusable,
            ModelSeen::Absent => {}
        }
    }

    /// Takes in what a whole document said.
    fn apply(&mut self) {
        self.take_model();
        let doc = &self.doc;
        self.unreadable |= doc.unreadable;
        let (input, output, cached) = match self.call {
            Call::ChatCompletions => (Count::Prompt, Count::Completion, Count::PromptCached),
            Call::Responses => (Count::Input, Count::Output, Count::InputCached),
            Call::Messages => {
                // Each count as last reported: `message_delta` repeats them cumulatively.
                for (slot, count) in [
                    (&mut self.input, Count::Input),
                    (&mut self.output, Count::Output),
                    (&mut self.cache_read, Count::CacheRead),
                    (&mut self.cache_creation, Count::CacheCreation),
                ] {
                    if let Some(n) = doc.count(count) {
                        *slot = Some(n);
                    }
                }
                let last = !self.streamed
                    || (doc.kind == Kind::MessageDelta && doc.count(Count::Output).is_some());
                self.settled |= last;
                (Count::Input, Count::Output, Count::CacheRead)
            }
        };
        if self.call != Call::Messages {
            if let (Some(i), Some(o)) = (doc.count(input), doc.count(output)) {
                self.usage = Some((i, o, doc.count(cached).unwrap_or(0)));
            }
        }
        match doc.kind {
            Kind::MessageStop | Kind::ResponseEnded => self.ended = true,
            Kind::Error => self.error_event = true,
            Kind::Other | Kind::MessageStart | Kind::MessageDelta => {}
        }
    }

    /// The usage read, normalised; `Err` when the counts contradict each other.
    fn tokens(&self) -> Result<Option<(u64, u64, u64)>, ()> {
        let (input, output, cached) = match self.call {
            Call::ChatCompletions | Call::Responses => match self.usage {
                Some(usage) => usage,
                None => return Ok(None),
            },
            Call::Messages => {
                let (Some(input), Some(output), true) = (self.input, self.output, self.settled)
                else {
                    return Ok(None);
                };
                let read = self.cache_read.unwrap_or(0);
                let written = self.cache_creation.unwrap_or(0);
                let all = input
                    .checked_add(read)
                    .and_then(|n| n.checked_add(written))
                    .ok_or(())?;
                (all, output, read)
            }
        };
        if cached > input || input.checked_add(output).is_none() {
            return Err(());
        }
        Ok(Some((input, output, cached)))
    }

    fn model(&self) -> Option<String> {
        match self.model_seen {
            ModelSeen::Named => self.model.as_str().map(str::to_owned),
            ModelSeen::Absent | ModelSeen::Unusable => None,
        }
    }
}

impl Events for Body {
    fn data(&mut self, bytes: &[u8]) {
        if self.data_len < self.lead.len() {
            let take = bytes.len().min(self.lead.len() - self.data_len);
            self.lead[self.data_len..self.data_len + take].copy_from_slice(&bytes[..take]);
        }
        self.data_len = self.data_len.saturating_add(bytes.len());
        if self.holding {
            let end = self.hold_len + bytes.len();
            if end <= HOLD {
                self.hold[self.hold_len..end].copy_from_slice(bytes);
                self.hold_len = end;
                return;
            }
            // Too long to hold: read as it comes, what was held first.
            self.holding = false;
            self.scanner
                .feed(&self.hold[..self.hold_len], &mut self.doc);
        }
        self.scanner.feed(bytes, &mut self.doc);
    }

    fn dispatch(&mut self) {
        if self.data_len == self.lead.len() && &self.lead == b"[DONE]" {
            self.ended = true;
        } else {
            // A held event is read if it may carry usage, or while no model has been named
            // (so that an answer without usage still shows its model).
            let held = &self.hold[..self.hold_len];
            if self.holding && self.model_seen != ModelSeen::Absent && !may_carry_usage(held) {
                // Sieved out: the scanner saw none of it and has nothing to end or reset.
                self.data_len = 0;
                self.hold_len = 0;
                return;
            }
            if self.holding {
                self.scanner.feed(held, &mut self.doc);
            }
            match self.scanner.end(&mut self.doc) {
                End::Complete => self.apply(),
                // Whitespace only: no document.
                End::Empty => {}
                End::Cut | End::Failed => self.malformed = true,
            }
        }
        self.scanner.reset();
        self.doc.reset();
        self.data_len = 0;
        self.holding = self.sieve;
        self.hold_len = 0;
    }
}

/// Whether a `Content-Encoding` leaves the body as sent (absent, or identity only).
fn is_identity(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .all(|value| match value.to_str() {
            Ok(text) => text
                .split(',')
                .map(str::trim)
                .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case("identity")),
            Err(_) => false,
        })
}

/// The framing a `Content-Type` calls for. An absent type is read as JSON: the body must then
/// parse as JSON to be metered.
fn framing_of(headers: &http::HeaderMap) -> Framing {
    let Some(value) = headers.get(http::header::CONTENT_TYPE) else {
        return Framing::Json;
    };
    let Ok(text) = value.to_str() else {
        return Framing::Skipped(reason::CONTENT_TYPE);
    };
    let essence = text.split(';').next().unwrap_or("").trim();
    if essence.eq_ignore_ascii_case("application/json")
        || essence
            .get(essence.len().saturating_sub(5)..)
            .is_some_and(|tail| tail.eq_ignore_ascii_case("+json"))
    {
        Framing::Json
    } else if essence.eq_ignore_ascii_case("text/event-stream") {
        Framing::Sse
    } else {
        Framing::Skipped(reason::CONTENT_TYPE)
    }
}

/// `path` as the widest origin reads it for routing: each segment without its `;` parameters,
/// empty segments dropped, lower case.
fn call_key(path: &str) -> String {
    let mut key = String::with_capacity(path.len());
    for segment in path.split('/') {
        let segment = segment.split(';').next().unwrap_or(segment);
        if !segment.is_empty() {
            key.push('/');
            key.extend(segment.chars().map(|c| c.to_ascii_lowercase()));
        }
    }
    key
}

impl Meter {
    /// The most bytes of a body a meter ever holds (an event of a sieved stream, three
    /// captured strings).
    pub const MOST_HELD: usize = HOLD + 3 * json::CAPTURE;

    /// The meter for a request, or `None` when it is not a metered call (another method or
    /// path, e.g. `GET /v1/models`). `path` is the request's path as the origin resolves it
    /// ([`normalise`](crate::policy::path::normalise)d; a query is ignored); it matches when it
    /// ends with the call's path (`/v1/chat/completions`, `/v1/responses`, `/v1/messages`), so
    /// that a provider's prefix (`/openai/v1/...`) is still metered. What some origin would
    /// still take for the call is metered too: letters in any case, empty segments (`//`, a
    /// trailing `/`) and `;` parameters are ignored in the comparison.
    pub fn for_call(api: Api, method: &http::Method, path: &str) -> Option<Meter> {
        if method != http::Method::POST {
            return None;
        }
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        let key = call_key(path);
        let call = match api {
            Api::OpenAi if key.ends_with("/v1/chat/completions") => Call::ChatCompletions,
            Api::OpenAi if key.ends_with("/v1/responses") => Call::Responses,
            Api::Anthropic if key.ends_with("/v1/messages") => Call::Messages,
            Api::OpenAi | Api::Anthropic => return None,
        };
        Some(Meter {
            status: http::StatusCode::OK,
            framing: Framing::Pending,
            sse: Sse::default(),
            body: Body::new(call),
        })
    }

    /// Which call it meters.
    pub fn call(&self) -> Call {
        self.body.call
    }

    /// The response head: its status, `Content-Type` and `Content-Encoding` decide how (and
    /// whether) the body is read.
    pub fn head(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        self.status = status;
        self.framing = if is_identity(headers) {
            framing_of(headers)
        } else {
            Framing::Skipped(reason::COMPRESSED)
        };
        self.body.streamed = self.framing == Framing::Sse;
        self.body.sieve = self.body.streamed && self.body.call == Call::ChatCompletions;
        self.body.holding = self.body.sieve;
    }

    /// The next chunk of the body, as relayed (split anywhere).
    pub fn feed(&mut self, chunk: &[u8]) {
        match self.framing {
            Framing::Json => self.body.scanner.feed(chunk, &mut self.body.doc),
            Framing::Sse => self.sse.feed(chunk, &mut self.body),
            Framing::Pending | Framing::Skipped(_) => {}
        }
    }

    /// Bytes of the body the meter holds now (an event's data held, a string being read, the
    /// model names of the current event and of the response): never more than
    /// [`Meter::MOST_HELD`], whatever the body.
    pub fn held(&self) -> usize {
        let body = &self.body;
        body.hold_len + body.scanner.held() + body.doc.name.len() + body.model.len()
    }

    /// The reading, once the body has ended (or stopped: a body cut before its usage reads as
    /// [`reason::CUT`]).
    pub fn finish(mut self) -> Reading {
        let mut cut = false;
        let skipped = match self.framing {
            Framing::Pending => Some(reason::NO_HEAD),
            Framing::Skipped(why) => Some(why),
            Framing::Json => {
                let body = &mut self.body;
                match body.scanner.end(&mut body.doc) {
                    End::Complete => body.apply(),
                    End::Empty => {}
                    End::Cut => {
                        body.take_model();
                        cut = true;
                    }
                    End::Failed => {
                        body.take_model();
                        body.malformed = true;
                    }
                }
                None
            }
            // An event not ended by its blank line is dropped, as the standard says.
            Framing::Sse => {
                cut = self.sse.is_inside_event();
                None
            }
        };
        let body = &self.body;
        let model = body.model();
        let tokens = body.tokens();
        if let (None, false, false, Ok(Some((input, output, cached)))) =
            (skipped, body.malformed, body.unreadable, tokens)
        {
            return Reading::Metered(Usage {
                model,
                input,
                output,
                cached,
            });
        }
        let reason = if self.framing == Framing::Pending {
            reason::NO_HEAD
        } else if !self.status.is_success() {
            reason::ERROR_RESPONSE
        } else if let Some(why) = skipped {
            why
        } else if body.unreadable || tokens.is_err() {
            reason::UNREADABLE
        } else if body.malformed {
            reason::MALFORMED
        } else if cut {
            reason::CUT
        } else if self.framing == Framing::Json {
            reason::NO_USAGE_BODY
        } else if body.error_event {
            reason::STREAM_ERROR
        } else if body.ended {
            reason::NO_USAGE_STREAM
        } else {
            reason::CUT
        };
        Reading::Unmetered { model, reason }
    }
}
