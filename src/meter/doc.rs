//! What one JSON document (a whole body, or one event's data) says about usage: its `type`,
//! its model, and the token counts at the paths the three APIs use.
//!
//! Invariant: fixed size, no allocation; a count is recorded only from a plain non-negative
//! integer, and anything else at a count's path marks the document unreadable rather than
//! reading as zero.

use super::json::{Key, Scalar, Sink, CAPTURE};

/// The counts a document can carry, by where they are under `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Chat Completions: `prompt_tokens`, `completion_tokens`,
    /// `prompt_tokens_details.cached_tokens`.
    Prompt,
    Completion,
    PromptCached,
    /// Responses and Messages: `input_tokens`, `output_tokens`; Responses:
    /// `input_tokens_details.cached_tokens`.
    Input,
    Output,
    InputCached,
    /// Messages: `cache_read_input_tokens`, `cache_creation_input_tokens`.
    CacheRead,
    CacheCreation,
}

const COUNTS: usize = 8;

/// The events (`type`) the meter tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kind {
    #[default]
    Other,
    /// Messages, streamed.
    MessageStart,
    MessageDelta,
    MessageStop,
    /// Responses, streamed: the events that end a response.
    ResponseEnded,
    /// An error event (Messages, streamed).
    Error,
}

/// A model name as read: at most [`CAPTURE`] bytes, held inline.
#[derive(Clone)]
pub struct Name {
    bytes: [u8; CAPTURE],
    len: usize,
}

impl Default for Name {
    fn default() -> Self {
        Name {
            bytes: [0; CAPTURE],
            len: 0,
        }
    }
}

impl Name {
    pub fn set(&mut self, text: &str) {
        // `text` is at most CAPTURE bytes (the scanner's capture), checked again here.
        let len = text.len().min(CAPTURE);
        self.bytes[..len].copy_from_slice(&text.as_bytes()[..len]);
        self.len = len;
    }

    pub fn as_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.bytes[..self.len]).ok()
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

/// The model field of a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ModelSeen {
    #[default]
    Absent,
    /// Read into [`Doc::name`].
    Named,
    /// Present but not a usable string (too long, not a string): the model is not known.
    Unusable,
}

/// One document's findings.
#[derive(Clone, Default)]
pub struct Doc {
    pub kind: Kind,
    pub model: ModelSeen,
    pub name: Name,
    counts: [Option<u64>; COUNTS],
    /// A count's path held something other than an integer (or null).
    pub unreadable: bool,
}

impl Doc {
    pub fn reset(&mut self) {
        self.kind = Kind::Other;
        self.model = ModelSeen::Absent;
        self.counts = [None; COUNTS];
        self.unreadable = false;
    }

    pub fn count(&self, which: Count) -> Option<u64> {
        self.counts[which as usize]
    }
}

/// The count at `rest`, the path under a `usage` object.
fn count_at(rest: &[Key]) -> Option<Count> {
    Some(match rest {
        [Key::PromptTokens] => Count::Prompt,
        [Key::CompletionTokens] => Count::Completion,
        [Key::PromptTokensDetails, Key::CachedTokens] => Count::PromptCached,
        [Key::InputTokens] => Count::Input,
        [Key::OutputTokens] => Count::Output,
        [Key::InputTokensDetails, Key::CachedTokens] => Count::InputCached,
        [Key::CacheReadInputTokens] => Count::CacheRead,
        [Key::CacheCreationInputTokens] => Count::CacheCreation,
        _ => return None,
    })
}

fn kind_of(text: &str) -> Kind {
    match text {
        "message_start" => Kind::MessageStart,
        "message_delta" => Kind::MessageDelta,
        "message_stop" => Kind::MessageStop,
        "response.completed" | "response.incomplete" | "response.failed" => Kind::ResponseEnded,
        "error" => Kind::Error,
        _ => Kind::Other,
    }
}

impl Sink for Doc {
    fn scalar(&mut self, path: &[Key], value: Scalar<'_>) {
        // The model and the usage sit at the top, or in the `response` (Responses, streamed)
        // or `message` (Messages, streamed `message_start`) object.
        let inner = match path {
            [Key::Type] => {
                if let Scalar::Str(text) = value {
                    self.kind = kind_of(text);
                }
                return;
            }
            [Key::Response | Key::Message, rest @ ..] => rest,
            rest => rest,
        };
        match inner {
            [Key::Model] => match value {
                Scalar::Str(text) if !text.is_empty() => {
                    self.name.set(text);
                    self.model = ModelSeen::Named;
                }
                Scalar::Null => {}
                _ => self.model = ModelSeen::Unusable,
            },
            [Key::Usage, rest @ ..] => {
                let Some(which) = count_at(rest) else {
                    return;
                };
                match value {
                    Scalar::Int(n) => self.counts[which as usize] = Some(n),
                    Scalar::Null => {}
                    _ => self.unreadable = true,
                }
            }
            _ => {}
        }
    }
}
