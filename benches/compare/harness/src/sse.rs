//! The origin's streamed model answer for `metered.sh`: an OpenAI Chat Completions stream of
//! N one-token `chat.completion.chunk` events, the finish chunk, the usage chunk and
//! `data: [DONE]`, in the shape of the integration tests' fake model API
//! (tests/it/support/model_api/shapes.rs, `chat_events` with `include_usage`).
//!
//! Invariant: each event is its own body frame, and the body yields to the connection between
//! frames, so every event goes out in a write of its own (one TLS record), as a model streams
//! its tokens; nothing sleeps.

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

/// The model every answer names (priced by `metered.sh`'s price table).
pub const MODEL: &str = "gpt-4o-mini";
/// The prompt tokens every answer reports.
pub const INPUT_TOKENS: u64 = 12;
/// Answers longer than this are refused (404): the events are kept in memory per length.
const MAX_TOKENS: usize = 100_000;

/// `?tokens=N` of a query (2,000 when absent); `None` when not a number or over the cap.
pub fn tokens_of(query: Option<&str>) -> Option<usize> {
    let n = match query.and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("tokens="))) {
        None => 2000,
        Some(n) => n.parse().ok()?,
    };
    (n <= MAX_TOKENS).then_some(n)
}

/// The events of an answer of `n` tokens, built once per length (the origin's CPU is not what
/// is measured, and it shares the machine with the proxy).
pub fn events(n: usize) -> Arc<[Bytes]> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<[Bytes]>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    cache.entry(n).or_insert_with(|| build(n)).clone()
}

fn data(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

fn build(n: usize) -> Arc<[Bytes]> {
    let chunk = |choices: Value| {
        json!({
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1_767_225_600u64,
            "model": MODEL,
            "service_tier": "default",
            "system_fingerprint": "fp_bench",
            "choices": choices,
            "usage": null,
        })
    };
    let choice = |delta: Value, finish: Value| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    let mut events = Vec::with_capacity(n + 4);
    events.push(data(&chunk(choice(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
    ))));
    for i in 0..n {
        events.push(data(&chunk(choice(
            json!({"content": format!("t{i} ")}),
            Value::Null,
        ))));
    }
    events.push(data(&chunk(choice(json!({}), json!("stop")))));
    let mut last = chunk(json!([]));
    last["usage"] = json!({
        "prompt_tokens": INPUT_TOKENS,
        "completion_tokens": n,
        "total_tokens": INPUT_TOKENS + n as u64,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0,
        },
    });
    events.push(data(&last));
    events.push(Bytes::from_static(b"data: [DONE]\n\n"));
    events.into()
}

/// The answer's body: one frame per event, `Pending` (woken at once) before each, so that
/// hyper flushes what it has before the next event.
pub struct Events {
    events: Arc<[Bytes]>,
    next: usize,
    yielded: bool,
}

impl Events {
    pub fn new(events: Arc<[Bytes]>) -> Events {
        Events {
            events,
            next: 0,
            yielded: false,
        }
    }
}

impl Body for Events {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.next >= self.events.len() {
            return Poll::Ready(None);
        }
        if !self.yielded {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.yielded = false;
        let frame = self.events[self.next].clone();
        self.next += 1;
        Poll::Ready(Some(Ok(Frame::data(frame))))
    }

    fn is_end_stream(&self) -> bool {
        self.next >= self.events.len()
    }

    fn size_hint(&self) -> SizeHint {
        // Unknown length: sent chunked, as a model API streams.
        SizeHint::default()
    }
}
