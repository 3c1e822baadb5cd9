//! An MCP client's POST body as the server will read it: one JSON-RPC message or a batch, and
//! of each message what the edge decides on — its id, its method, and a `tools/call`'s tool.
//!
//! Invariant: pure; a body is read the way the server reads it or refused: not JSON, not a
//! message or an array of them, a `method` or a `tools/call`'s `name` that is not a string, a
//! `tools/call` without an id, or a member the decision depends on (`id`, `method`, `params`,
//! `params.name`) named twice — two parsers that disagree on a duplicate key are how a call
//! would be judged as one tool and run as another.

use serde::de::IgnoredAny;
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// The most messages one batch may hold.
pub const MAX_BATCH: usize = 256;

/// The method that calls a tool.
pub const TOOLS_CALL: &str = "tools/call";
/// The method whose answer lists the tools.
pub const TOOLS_LIST: &str = "tools/list";

/// What the edge reads of one message.
#[derive(Debug, Clone)]
pub struct Message {
    /// The id, as sent (`None`: a notification, or a message that has none).
    pub id: Option<Value>,
    /// The method of a request or notification; `None` for a response (the client answering
    /// a server's request).
    pub method: Option<String>,
    /// A `tools/call`'s tool (`params.name`).
    pub tool: Option<String>,
    /// A `tools/call`'s `params.arguments`, as sent (what an approver is shown).
    pub arguments: Option<Box<RawValue>>,
}

/// A POST body: one message, or a batch.
#[derive(Debug, Clone)]
pub struct Messages {
    pub batch: bool,
    pub messages: Vec<Message>,
}

impl Messages {
    /// The `tools/call` messages.
    pub fn calls(&self) -> impl Iterator<Item = &Message> {
        self.messages
            .iter()
            .filter(|m| m.method.as_deref() == Some(TOOLS_CALL))
    }

    /// Whether any message asks for the tool list.
    pub fn lists_tools(&self) -> bool {
        self.messages
            .iter()
            .any(|m| m.method.as_deref() == Some(TOOLS_LIST))
    }

    /// The ids of the requests (messages with a method and an id): what an answer made in
    /// the server's place answers.
    pub fn request_ids(&self) -> Vec<Value> {
        self.messages
            .iter()
            .filter(|m| m.method.is_some())
            .filter_map(|m| m.id.clone())
            .collect()
    }
}

/// A body the edge will not pass as it is: what is wrong, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(pub String);

/// The members of a message the decision reads; serde refuses one named twice.
#[derive(Deserialize)]
struct Raw {
    #[serde(default, deserialize_with = "present")]
    id: Option<Value>,
    #[serde(default)]
    method: Option<Value>,
    #[serde(default)]
    params: Option<Box<RawValue>>,
    #[serde(flatten)]
    _rest: IgnoredAny,
}

/// A `tools/call`'s params.
#[derive(Deserialize)]
struct CallParams {
    name: Option<Value>,
    #[serde(default)]
    arguments: Option<Box<RawValue>>,
    #[serde(flatten)]
    _rest: IgnoredAny,
}

/// A member that is there, `null` included (`Some(Value::Null)`).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Reads a POST body.
pub fn read(body: &[u8]) -> Result<Messages, Unreadable> {
    let text = std::str::from_utf8(body)
        .map_err(|e| Unreadable(format!("the body is not UTF-8 ({e})")))?;
    let ambiguous =
        |e: serde_json::Error| Unreadable(format!("the body is not a JSON-RPC message: {e}"));
    let (batch, raw): (bool, Vec<Raw>) = match text.trim_start().as_bytes().first() {
        Some(b'[') => (true, serde_json::from_str(text).map_err(ambiguous)?),
        Some(b'{') => (false, vec![serde_json::from_str(text).map_err(ambiguous)?]),
        _ => {
            return Err(Unreadable(
                "the body is not a JSON-RPC message (an object) or a batch (an array)".into(),
            ))
        }
    };
    if batch && raw.is_empty() {
        return Err(Unreadable("an empty batch".into()));
    }
    if raw.len() > MAX_BATCH {
        return Err(Unreadable(format!(
            "a batch of {} messages: at most {MAX_BATCH} are read",
            raw.len()
        )));
    }
    let messages = raw
        .into_iter()
        .enumerate()
        .map(|(i, raw)| {
            message(raw).map_err(|why| match batch {
                true => Unreadable(format!("message {} of the batch: {why}", i + 1)),
                false => Unreadable(why),
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Messages { batch, messages })
}

fn message(raw: Raw) -> Result<Message, String> {
    let id = match raw.id {
        None => None,
        Some(id @ (Value::String(_) | Value::Number(_) | Value::Null)) => Some(id),
        Some(other) => {
            return Err(format!(
                "its id {} is neither a string nor a number",
                brief(&other)
            ))
        }
    };
    let method = match raw.method {
        None => None,
        Some(Value::String(method)) => Some(method),
        Some(other) => return Err(format!("its method {} is not a string", brief(&other))),
    };
    let mut message = Message {
        id,
        method,
        tool: None,
        arguments: None,
    };
    if message.method.as_deref() != Some(TOOLS_CALL) {
        return Ok(message);
    }
    if !matches!(message.id, Some(Value::String(_) | Value::Number(_))) {
        return Err(
            "a tools/call without an id (a call must be a request the edge can answer)".into(),
        );
    }
    let params = raw.params.ok_or("a tools/call without params")?;
    let params: CallParams = serde_json::from_str(params.get())
        .map_err(|e| format!("a tools/call whose params are not an object read one way: {e}"))?;
    message.tool = match params.name {
        Some(Value::String(name)) => Some(name),
        Some(other) => {
            return Err(format!(
                "a tools/call whose name {} is not a string",
                brief(&other)
            ))
        }
        None => return Err("a tools/call without params.name".into()),
    };
    message.arguments = params.arguments;
    Ok(message)
}

/// A value as an error shows it: at most 40 characters.
fn brief(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(40) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(body: &str) -> Message {
        let read = read(body.as_bytes()).unwrap();
        assert!(!read.batch);
        read.messages.into_iter().next().unwrap()
    }

    fn why(body: &str) -> String {
        read(body.as_bytes()).unwrap_err().0
    }

    #[test]
    fn a_call_names_its_tool_and_id() {
        let call = one(
            r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_note","arguments":{"id":1}}}"#,
        );
        assert_eq!(call.id, Some(Value::from(7)));
        assert_eq!(call.tool.as_deref(), Some("read_note"));
        assert_eq!(call.arguments.unwrap().get(), r#"{"id":1}"#);
        // Escapes are read as the server reads them.
        let escaped = one(r#"{"id":"a","method":"tools\/call","params":{"name":"del\u0065te"}}"#);
        assert_eq!(escaped.method.as_deref(), Some(TOOLS_CALL));
        assert_eq!(escaped.tool.as_deref(), Some("delete"));
    }

    #[test]
    fn other_messages_pass_with_what_they_are() {
        let list = read(br#"[{"id":1,"method":"tools/list"},{"method":"notifications/initialized"},{"id":9,"result":{}}]"#).unwrap();
        assert!(list.batch && list.lists_tools());
        assert_eq!(list.calls().count(), 0);
        assert_eq!(list.request_ids(), vec![Value::from(1)]);
        assert_eq!(list.messages[2].method, None);
    }

    #[test]
    fn what_two_parsers_could_read_two_ways_is_refused() {
        assert!(
            why(r#"{"id":1,"method":"tools/call","method":"ping","params":{"name":"a"}}"#)
                .contains("duplicate field `method`")
        );
        assert!(
            why(r#"{"id":1,"method":"tools/call","params":{"name":"a","name":"b"}}"#)
                .contains("duplicate field `name`")
        );
        assert!(why(r#"{"id":1,"id":2,"method":"ping"}"#).contains("duplicate field `id`"));
        assert!(why(
            r#"{"id":1,"method":"tools/call","params":{"name":"a"},"params":{"name":"b"}}"#
        )
        .contains("duplicate field `params`"));
    }

    #[test]
    fn calls_the_edge_cannot_answer_or_name_are_refused() {
        assert!(why(r#"{"method":"tools/call","params":{"name":"a"}}"#).contains("without an id"));
        assert!(
            why(r#"{"id":null,"method":"tools/call","params":{"name":"a"}}"#)
                .contains("without an id")
        );
        assert!(why(r#"{"id":1,"method":"tools/call"}"#).contains("without params"));
        assert!(
            why(r#"{"id":1,"method":"tools/call","params":{}}"#).contains("without params.name")
        );
        assert!(
            why(r#"{"id":1,"method":"tools/call","params":{"name":["a"]}}"#)
                .contains("not a string")
        );
        assert!(why(r#"{"id":1,"method":"tools/call","params":[1]}"#).contains("params"));
        assert!(why(r#"{"id":[1],"method":"ping"}"#).contains("neither a string nor a number"));
        assert!(why(r#"{"id":1,"method":7}"#).contains("not a string"));
        assert!(why("[]").contains("empty batch"));
        assert!(why("[1]").contains("not a JSON-RPC message"));
        assert!(why(r#"[{"id":1,"method":"ping"},{"id":2,"method":3}]"#)
            .contains("message 2 of the batch"));
        assert!(why("\"tools/call\"").contains("not a JSON-RPC message"));
        assert!(why("{\"id\":1,").contains("not a JSON-RPC message"));
        assert!(read(b"\xff{}").unwrap_err().0.contains("UTF-8"));
        let big = format!(
            "[{}]",
            vec![r#"{"method":"ping"}"#; MAX_BATCH + 1].join(",")
        );
        assert!(why(&big).contains("at most 256"));
    }
}
