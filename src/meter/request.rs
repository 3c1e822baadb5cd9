//! What a model call's request says about what it may spend, read before it goes out: the
//! model, whether it streams, the most output it may produce — and the one change the proxy
//! makes to it, asking a streamed Chat Completions call for its usage.
//!
//! Invariant: pure. A request is read as the origin will read it or refused: a field the
//! bound depends on (`model`, `stream`, `stream_options`, `max_tokens`,
//! `max_completion_tokens`, `max_output_tokens`, `n`) named twice at the top level, or of a
//! type the API does not take, is an error, never a guess (two parsers that disagree on a
//! duplicate key are how a call would go out streamed but be read as not). A body that is not
//! a JSON object is no error: the API refuses it, and the call is bounded by the default.

use super::Call;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::{Map, Value};

/// The largest `n` (Chat Completions' choices per call) read as such; more is refused.
const MOST_CHOICES: u64 = 128;

/// What a request says about its spending, and the body to send instead of the one read.
#[derive(Debug, Clone, PartialEq)]
pub struct CallRequest {
    /// The model it names, if any (prices the bound).
    pub model: Option<String>,
    /// The most output tokens it may produce, as the request caps them (`None`: it names no
    /// cap; the configured default applies).
    pub output_cap: Option<u64>,
    /// Whether it asks for an event stream.
    pub streamed: bool,
    /// The body to send instead (`stream_options.include_usage` set), when the call streamed
    /// Chat Completions without asking for its usage.
    pub rewritten: Option<Vec<u8>>,
}

/// A request the proxy will not send as it is: what is wrong, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(pub String);

/// The top-level fields the bound depends on; serde refuses a field named twice.
#[derive(Deserialize)]
struct Fields {
    model: Option<Value>,
    stream: Option<Value>,
    stream_options: Option<Value>,
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    max_output_tokens: Option<Value>,
    n: Option<Value>,
    #[serde(flatten)]
    _rest: IgnoredAny,
}

/// Reads the request body of a call (`None`: not a JSON object, so nothing to read).
pub fn read(call: Call, body: &[u8]) -> Result<CallRequest, Unreadable> {
    let fields: Fields = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(_)) => serde_json::from_slice(body)
            .map_err(|e| Unreadable(format!("the request body is ambiguous: {e}")))?,
        // Not an object (or not JSON): the API refuses it; nothing here to bound.
        _ => {
            return Ok(CallRequest {
                model: None,
                output_cap: None,
                streamed: false,
                rewritten: None,
            })
        }
    };
    let model = match fields.model {
        None => None,
        Some(Value::String(model)) => Some(model),
        Some(other) => return Err(wrong("model", "a string", &other)),
    };
    let streamed = match fields.stream {
        None | Some(Value::Null) => false,
        Some(Value::Bool(streamed)) => streamed,
        Some(other) => return Err(wrong("stream", "true or false", &other)),
    };
    let asked_usage = match &fields.stream_options {
        None | Some(Value::Null) => false,
        Some(Value::Object(options)) => match options.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(asked)) => *asked,
            Some(other) => {
                return Err(wrong(
                    "stream_options.include_usage",
                    "true or false",
                    other,
                ))
            }
        },
        Some(other) => return Err(wrong("stream_options", "an object", other)),
    };
    let cap = |name: &str, value: Option<Value>| -> Result<Option<u64>, Unreadable> {
        match value {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
            Some(other) => Err(wrong(name, "a non-negative integer", &other)),
        }
    };
    let output_cap = match call {
        Call::ChatCompletions => {
            let older = cap("max_tokens", fields.max_tokens)?;
            let most = cap("max_completion_tokens", fields.max_completion_tokens)?.or(older);
            let choices = match cap("n", fields.n)? {
                None => 1,
                Some(n @ 1..=MOST_CHOICES) => n,
                Some(n) => {
                    return Err(Unreadable(format!(
                        "n = {n}: the proxy meters at most {MOST_CHOICES} choices per call"
                    )))
                }
            };
            most.map(|most| most.saturating_mul(choices))
        }
        Call::Responses => cap("max_output_tokens", fields.max_output_tokens)?,
        Call::Messages => cap("max_tokens", fields.max_tokens)?,
    };
    let rewritten = match (call, streamed, asked_usage) {
        (Call::ChatCompletions, true, false) => Some(ask_usage(body)?),
        _ => None,
    };
    Ok(CallRequest {
        model,
        output_cap,
        streamed,
        rewritten,
    })
}

/// The body with `stream_options.include_usage: true` (the rest of `stream_options` kept).
fn ask_usage(body: &[u8]) -> Result<Vec<u8>, Unreadable> {
    let mut object: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| Unreadable(format!("the request body is not readable: {e}")))?;
    let options = object
        .entry("stream_options")
        .or_insert_with(|| Value::Object(Map::new()));
    if options.is_null() {
        *options = Value::Object(Map::new());
    }
    if let Value::Object(options) = options {
        options.insert("include_usage".to_owned(), Value::Bool(true));
    }
    serde_json::to_vec(&object).map_err(|e| Unreadable(e.to_string()))
}

fn wrong(name: &str, expected: &str, got: &Value) -> Unreadable {
    let shown: String = got.to_string().chars().take(40).collect();
    Unreadable(format!("{name} must be {expected}, not {shown}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<CallRequest, Unreadable> {
        read(Call::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn a_streamed_chat_call_is_asked_for_its_usage_and_nothing_else_changes() {
        let first = chat(r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"hi"}],"temperature":0.7}"#).unwrap();
        assert!(first.streamed);
        let sent: Value = serde_json::from_slice(&first.rewritten.unwrap()).unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"model":"gpt-4o-mini","stream":true,"stream_options":{"include_usage":true},
                "messages":[{"role":"user","content":"hi"}],"temperature":0.7})
        );
        // Asked already, or other options given: kept, with include_usage set.
        assert_eq!(
            chat(r#"{"stream":true,"stream_options":{"include_usage":true}}"#)
                .unwrap()
                .rewritten,
            None
        );
        let kept = chat(r#"{"stream":true,"stream_options":{"include_usage":false,"x":1}}"#)
            .unwrap()
            .rewritten
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&kept).unwrap(),
            serde_json::json!({"stream":true,"stream_options":{"include_usage":true,"x":1}})
        );
        let null = chat(r#"{"stream":true,"stream_options":null}"#).unwrap();
        assert!(null.rewritten.is_some());
        // Not streamed, or another call: sent as it is.
        assert_eq!(chat(r#"{"stream":false}"#).unwrap().rewritten, None);
        assert_eq!(
            read(Call::Responses, br#"{"stream":true}"#)
                .unwrap()
                .rewritten,
            None
        );
        assert_eq!(
            read(Call::Messages, br#"{"stream":true,"max_tokens":5}"#)
                .unwrap()
                .rewritten,
            None
        );
    }

    #[test]
    fn the_output_cap_is_the_requests_own() {
        let cap = |call, body: &str| read(call, body.as_bytes()).unwrap().output_cap;
        assert_eq!(
            cap(Call::ChatCompletions, r#"{"max_tokens":100}"#),
            Some(100)
        );
        assert_eq!(
            cap(
                Call::ChatCompletions,
                r#"{"max_tokens":100,"max_completion_tokens":50}"#
            ),
            Some(50),
            "max_completion_tokens replaces max_tokens"
        );
        assert_eq!(
            cap(Call::ChatCompletions, r#"{"max_tokens":100,"n":3}"#),
            Some(300),
            "every choice may use the cap"
        );
        assert_eq!(cap(Call::ChatCompletions, r#"{"n":3}"#), None);
        assert_eq!(cap(Call::Responses, r#"{"max_output_tokens":7}"#), Some(7));
        assert_eq!(cap(Call::Responses, r#"{"max_tokens":7}"#), None);
        assert_eq!(cap(Call::Messages, r#"{"max_tokens":9}"#), Some(9));
        assert_eq!(cap(Call::Messages, "not json"), None);
        assert_eq!(cap(Call::Messages, "[1,2]"), None);
        assert_eq!(
            read(Call::Messages, br#"{"model":"claude-x"}"#)
                .unwrap()
                .model
                .as_deref(),
            Some("claude-x")
        );
    }

    #[test]
    fn what_two_parsers_could_read_apart_is_refused() {
        for body in [
            r#"{"stream":false,"stream":true}"#,
            r#"{"max_tokens":1,"max_tokens":100000}"#,
            r#"{"model":"a","model":"b"}"#,
            r#"{"stream":"true"}"#,
            r#"{"stream":1}"#,
            r#"{"stream":true,"stream_options":"yes"}"#,
            r#"{"stream":true,"stream_options":{"include_usage":"false"}}"#,
            r#"{"max_tokens":-1}"#,
            r#"{"max_tokens":1.5}"#,
            r#"{"max_tokens":"100"}"#,
            r#"{"n":0}"#,
            r#"{"n":100000}"#,
            r#"{"model":7}"#,
        ] {
            assert!(chat(body).is_err(), "{body}");
        }
        // Other fields named twice are the API's business, not the bound's.
        assert!(chat(r#"{"temperature":1,"temperature":2}"#).is_ok());
    }
}
