//! The meter on arbitrary bodies: never panics, reads the same whatever the chunks' sizes
//! (whole, byte by byte, and at split points drawn from the input), and a metered reading is
//! consistent (cached within input, a model name of at most 256 bytes).
//!
//! Input: one flags byte (bits 0-1: the call, Chat Completions, Responses, Messages, or Chat
//! Completions again; bit 2: an event stream rather than JSON; bit 3: status 500 rather than
//! 200), then the body.

use leasegate::meter::{Api, Meter, Reading};

const CALLS: [(Api, &str); 4] = [
    (Api::OpenAi, "/v1/chat/completions"),
    (Api::OpenAi, "/v1/responses"),
    (Api::Anthropic, "/v1/messages"),
    (Api::OpenAi, "/v1/chat/completions"),
];

fn reading(flags: u8, body: &[u8], cuts: &[usize]) -> Reading {
    let (api, path) = CALLS[usize::from(flags & 3)];
    let mut meter = Meter::for_call(api, &http::Method::POST, path).expect("a metered call");
    let mut headers = http::HeaderMap::new();
    let content_type = match flags & 4 {
        0 => "application/json",
        _ => "text/event-stream",
    };
    headers.insert("content-type", http::HeaderValue::from_static(content_type));
    let status = match flags & 8 {
        0 => http::StatusCode::OK,
        _ => http::StatusCode::INTERNAL_SERVER_ERROR,
    };
    meter.head(status, &headers);
    let mut from = 0;
    for &to in cuts.iter().chain(std::iter::once(&body.len())) {
        meter.feed(&body[from..to]);
        from = to;
        assert!(meter.held() <= Meter::MOST_HELD, "held {}", meter.held());
    }
    meter.finish()
}

pub fn check(data: &[u8]) {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    let whole = reading(flags, body, &[]);
    if let Reading::Metered(usage) = &whole {
        assert!(usage.cached <= usage.input, "{usage:?}");
        assert!(usage.model.as_ref().is_none_or(|m| m.len() <= 256));
    }
    let bytewise: Vec<usize> = (1..body.len()).collect();
    assert_eq!(reading(flags, body, &bytewise), whole, "byte by byte");
    // Split points from the input itself, so that a failure replays.
    let mut state = body.iter().fold(u64::from(flags) | 1, |h, &b| {
        h.wrapping_mul(31).wrapping_add(u64::from(b))
    });
    let mut cuts = Vec::new();
    for _ in 0..(body.len().min(16)) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        cuts.push((state % (body.len() as u64 + 1)) as usize);
    }
    cuts.sort_unstable();
    assert_eq!(reading(flags, body, &cuts), whole, "split at {cuts:?}");
}
