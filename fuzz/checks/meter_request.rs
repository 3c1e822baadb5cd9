//! A model call's request as the meter reads it before it goes out, on arbitrary bodies: never
//! panics; a body it accepts reads the same to serde_json (no duplicate of a field the bound
//! depends on slipped through); a body it rewrites asks for its usage, keeps every other
//! member, and reads again to the same model, cap and stream with nothing left to rewrite.
//!
//! Input: one flags byte (bits 0-1: the call, Chat Completions, Responses, Messages, or Chat
//! Completions again), then the body.

use leasegate::meter::request::read;
use leasegate::meter::Call;
use serde_json::Value;

const CALLS: [Call; 4] = [
    Call::ChatCompletions,
    Call::Responses,
    Call::Messages,
    Call::ChatCompletions,
];

pub fn check(data: &[u8]) {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let call = CALLS[usize::from(flags & 3)];
    let Ok(read_once) = read(call, body) else {
        return;
    };
    let Ok(Value::Object(object)) = serde_json::from_slice::<Value>(body) else {
        assert_eq!(read_once.rewritten, None, "only an object is rewritten");
        assert_eq!(read_once.output_cap, None);
        return;
    };
    assert_eq!(
        read_once.streamed,
        object.get("stream") == Some(&Value::Bool(true)),
        "stream read apart"
    );
    assert_eq!(
        read_once.model.as_deref(),
        object.get("model").and_then(Value::as_str)
    );
    if let Some(rewritten) = &read_once.rewritten {
        assert!(read_once.streamed && call == Call::ChatCompletions);
        let again = read(call, rewritten).expect("a rewritten body reads");
        assert_eq!(again.rewritten, None, "asked once is enough");
        assert_eq!(
            (&again.model, again.output_cap, again.streamed),
            (&read_once.model, read_once.output_cap, read_once.streamed)
        );
        let Ok(Value::Object(sent)) = serde_json::from_slice::<Value>(rewritten) else {
            panic!("the rewritten body is an object");
        };
        assert_eq!(sent["stream_options"]["include_usage"], Value::Bool(true));
        for (key, value) in &object {
            if key != "stream_options" {
                assert_eq!(sent.get(key), Some(value), "{key} changed");
            }
        }
        assert_eq!(
            sent.len(),
            object.len() + usize::from(!object.contains_key("stream_options"))
        );
    }
}
