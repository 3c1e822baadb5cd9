//! The fake's answers, shaped field for field as the real APIs send them (OpenAI's API
//! reference for Chat Completions and Responses, Anthropic's for Messages and its streaming
//! events): a plain answer is one JSON object, a streamed one a list of SSE events.

use super::{token, Call, Usage, CREATED};
use serde_json::{json, Value};

/// The whole answer's text: every token, in order.
fn text(call: &Call) -> String {
    (0..call.usage.output_tokens).map(token).collect()
}

/// An SSE event with data only (Chat Completions sends no `event:` lines).
fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

/// An SSE event with its type (Responses, Messages).
fn event(value: &Value) -> String {
    let kind = value["type"].as_str().expect("an event has a type");
    format!("event: {kind}\ndata: {value}\n\n")
}

fn chat_usage(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.input_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.input_tokens + u.output_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0,
        },
    })
}

pub(super) fn chat(call: &Call) -> Value {
    json!({
        "id": format!("chatcmpl-fake{}", call.id),
        "object": "chat.completion",
        "created": CREATED,
        "model": call.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text(call), "refusal": null, "annotations": []},
            "logprobs": null,
            "finish_reason": "stop",
        }],
        "usage": chat_usage(call.usage),
        "service_tier": "default",
        "system_fingerprint": "fp_fake",
    })
}

/// A role chunk, one chunk per token, the finish chunk, then — only with
/// `stream_options.include_usage` — a chunk with no choices and the usage (every chunk before
/// it then has `"usage": null`), then `[DONE]`.
pub(super) fn chat_events(call: &Call) -> Vec<String> {
    let include_usage = call.body["stream_options"]["include_usage"] == true;
    let chunk = |choices: Value| {
        let mut chunk = json!({
            "id": format!("chatcmpl-fake{}", call.id),
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": call.model,
            "service_tier": "default",
            "system_fingerprint": "fp_fake",
            "choices": choices,
        });
        if include_usage {
            chunk["usage"] = Value::Null;
        }
        chunk
    };
    let choice = |delta: Value, finish: Value| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    let mut events = vec![data(&chunk(choice(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
    )))];
    for i in 0..call.usage.output_tokens {
        let delta = json!({"content": token(i)});
        events.push(data(&chunk(choice(delta, Value::Null))));
    }
    events.push(data(&chunk(choice(json!({}), json!("stop")))));
    if include_usage {
        let mut last = chunk(json!([]));
        last["usage"] = chat_usage(call.usage);
        events.push(data(&last));
    }
    events.push("data: [DONE]\n\n".to_owned());
    events
}

fn message_item(call: &Call, status: &str, text: &str) -> Value {
    let content = match status {
        "in_progress" => json!([]),
        _ => json!([{"type": "output_text", "annotations": [], "logprobs": [], "text": text}]),
    };
    json!({
        "id": format!("msg_fake{}", call.id),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    })
}

/// A Responses object; `done`: completed, with its output and usage, else in progress.
pub(super) fn response(call: &Call, done: bool) -> Value {
    let (status, output, usage) = match done {
        true => {
            let u = call.usage;
            let usage = json!({
                "input_tokens": u.input_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.input_tokens + u.output_tokens,
            });
            let output = json!([message_item(call, "completed", &text(call))]);
            ("completed", output, usage)
        }
        false => ("in_progress", json!([]), Value::Null),
    };
    json!({
        "id": format!("resp_fake{}", call.id),
        "object": "response",
        "created_at": CREATED,
        "status": status,
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": call.body.get("instructions").cloned().unwrap_or_default(),
        "max_output_tokens": call.body.get("max_output_tokens").cloned().unwrap_or_default(),
        "model": call.model,
        "output": output,
        "parallel_tool_calls": true,
        "previous_response_id": null,
        "reasoning": {"effort": null, "summary": null},
        "service_tier": "default",
        "store": true,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": usage,
        "user": null,
        "metadata": {},
    })
}

/// `response.created`, `response.in_progress`, the item and its part added, one
/// `response.output_text.delta` per token, the text, part and item done, and
/// `response.completed` with the usage; each numbered (`sequence_number`).
pub(super) fn response_events(call: &Call) -> Vec<String> {
    let item_id = format!("msg_fake{}", call.id);
    let whole = text(call);
    let part = |text: &str| json!({"type": "output_text", "annotations": [], "logprobs": [], "text": text});
    let at = json!({"item_id": item_id, "output_index": 0, "content_index": 0});
    let with = |mut base: Value, more: Value| {
        for (k, v) in more.as_object().unwrap() {
            base[k] = v.clone();
        }
        base
    };
    let mut bodies = vec![
        json!({"type": "response.created", "response": response(call, false)}),
        json!({"type": "response.in_progress", "response": response(call, false)}),
        json!({"type": "response.output_item.added", "output_index": 0,
            "item": message_item(call, "in_progress", "")}),
        with(
            at.clone(),
            json!({"type": "response.content_part.added", "part": part("")}),
        ),
    ];
    for i in 0..call.usage.output_tokens {
        let delta =
            json!({"type": "response.output_text.delta", "delta": token(i), "logprobs": []});
        bodies.push(with(at.clone(), delta));
    }
    bodies.extend([
        with(
            at.clone(),
            json!({"type": "response.output_text.done", "text": whole, "logprobs": []}),
        ),
        with(
            at,
            json!({"type": "response.content_part.done", "part": part(&whole)}),
        ),
        json!({"type": "response.output_item.done", "output_index": 0,
            "item": message_item(call, "completed", &whole)}),
        json!({"type": "response.completed", "response": response(call, true)}),
    ]);
    bodies
        .into_iter()
        .enumerate()
        .map(|(n, mut body)| {
            body["sequence_number"] = json!(n);
            event(&body)
        })
        .collect()
}

/// Anthropic's usage: its `input_tokens` leaves out what was read from (or written to) the
/// cache; the total input is the sum of the three.
fn message_usage(u: Usage, output_tokens: u64) -> Value {
    json!({
        "input_tokens": u.input_tokens - u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": u.cached_tokens,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    })
}

fn message_object(call: &Call, content: Value, stop: Value, output_tokens: u64) -> Value {
    json!({
        "id": format!("msg_fake{}", call.id),
        "type": "message",
        "role": "assistant",
        "model": call.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": null,
        "usage": message_usage(call.usage, output_tokens),
    })
}

pub(super) fn message(call: &Call) -> Value {
    let content = json!([{"type": "text", "text": text(call)}]);
    message_object(call, content, json!("end_turn"), call.usage.output_tokens)
}

/// `message_start` (the input usage and an output count of at most 1, as the real API's
/// first count), the text block's start, a `ping`, one `content_block_delta` per token, the
/// block's stop, `message_delta` with the cumulative output tokens, `message_stop`.
pub(super) fn message_events(call: &Call) -> Vec<String> {
    let output = call.usage.output_tokens;
    let start = message_object(call, json!([]), Value::Null, output.min(1));
    let mut bodies = vec![
        json!({"type": "message_start", "message": start}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "ping"}),
    ];
    for i in 0..output {
        bodies.push(json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": token(i)}}));
    }
    bodies.extend([
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"output_tokens": output}}),
        json!({"type": "message_stop"}),
    ]);
    bodies.iter().map(event).collect()
}
