//! The meter on each API's shapes, whole and streamed, split every way.

use super::{reason, Api, Meter, Reading, Usage};
use http::{HeaderMap, HeaderValue, Method, StatusCode};
use rand::{Rng, SeedableRng};

const CHAT: &str = "/v1/chat/completions";
const RESPONSES: &str = "/v1/responses";
const MESSAGES: &str = "/v1/messages";
const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";

fn headers(content_type: Option<&str>, encoding: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(value) = content_type {
        headers.insert("content-type", HeaderValue::from_str(value).unwrap());
    }
    if let Some(value) = encoding {
        headers.insert("content-encoding", HeaderValue::from_str(value).unwrap());
    }
    headers
}

fn meter(api: Api, path: &str, status: u16, content_type: &str) -> Meter {
    let mut meter = Meter::for_call(api, &Method::POST, path).expect("a metered call");
    meter.head(
        StatusCode::from_u16(status).unwrap(),
        &headers(Some(content_type), None),
    );
    meter
}

/// The reading of `body` fed in the pieces `cuts` (ascending offsets) make.
fn read_split(api: Api, path: &str, status: u16, ct: &str, body: &[u8], cuts: &[usize]) -> Reading {
    let mut meter = meter(api, path, status, ct);
    let mut from = 0;
    for &to in cuts.iter().chain([body.len()].iter()) {
        meter.feed(&body[from..to]);
        from = to;
    }
    meter.finish()
}

/// The reading of `body` whole, checked to be the same byte by byte and in random splits.
fn read(api: Api, path: &str, status: u16, ct: &str, body: &str) -> Reading {
    let body = body.as_bytes();
    let whole = read_split(api, path, status, ct, body, &[]);
    let bytewise: Vec<usize> = (1..body.len()).collect();
    assert_eq!(
        read_split(api, path, status, ct, body, &bytewise),
        whole,
        "byte by byte"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(body.len() as u64);
    for _ in 0..64 {
        let mut cuts: Vec<usize> = (0..rng.random_range(1..8))
            .map(|_| rng.random_range(0..=body.len()))
            .collect();
        cuts.sort_unstable();
        assert_eq!(
            read_split(api, path, status, ct, body, &cuts),
            whole,
            "split at {cuts:?}"
        );
    }
    whole
}

fn metered(model: &str, input: u64, output: u64, cached: u64) -> Reading {
    Reading::Metered(Usage {
        model: Some(model.to_owned()),
        input,
        output,
        cached,
    })
}

fn unmetered(model: Option<&str>, reason: &'static str) -> Reading {
    Reading::Unmetered {
        model: model.map(str::to_owned),
        reason,
    }
}

const CHAT_JSON: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-4o-mini-2024-07-18","choices":[{"index":0,"message":{"role":"assistant","content":"Hi \"there\" \\ \u00e9 é {\"usage\":{\"prompt_tokens\":999}}","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42,"prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}},"system_fingerprint":"fp_1"}"#;

#[test]
fn chat_completions_whole() {
    let reading = read(Api::OpenAi, CHAT, 200, JSON, CHAT_JSON);
    assert_eq!(reading, metered("gpt-4o-mini-2024-07-18", 12, 30, 4));
    // Pretty-printed, with a charset, and no cached count: the same usage, cached 0.
    let pretty = serde_json::to_string_pretty(
        &serde_json::from_str::<serde_json::Value>(&CHAT_JSON.replace(
            r#","prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0}"#,
            "",
        ))
        .unwrap(),
    )
    .unwrap();
    let reading = read(
        Api::OpenAi,
        CHAT,
        200,
        "Application/JSON; charset=utf-8",
        &pretty,
    );
    assert_eq!(reading, metered("gpt-4o-mini-2024-07-18", 12, 30, 0));
}

fn chat_stream(usage: bool, line_end: &str) -> String {
    let mut events = vec![
        r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"usage":null}"#.to_owned(),
        r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":{"content":"data: [DONE]\n\n"}}],"usage":null}"#.to_owned(),
        r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#.to_owned(),
    ];
    if usage {
        events.push(r#"{"id":"c","object":"chat.completion.chunk","model":"gpt-4o","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":7,"total_tokens":107,"prompt_tokens_details":{"cached_tokens":64}}}"#.to_owned());
    }
    events.push("[DONE]".to_owned());
    events
        .iter()
        .map(|data| format!("data: {data}{line_end}{line_end}"))
        .collect()
}

#[test]
fn chat_completions_streamed() {
    for line_end in ["\n", "\r\n", "\r"] {
        let reading = read(Api::OpenAi, CHAT, 200, SSE, &chat_stream(true, line_end));
        assert_eq!(reading, metered("gpt-4o", 100, 7, 64), "{line_end:?}");
        let reading = read(Api::OpenAi, CHAT, 200, SSE, &chat_stream(false, line_end));
        assert_eq!(
            reading,
            unmetered(Some("gpt-4o"), reason::NO_USAGE_STREAM),
            "{line_end:?}"
        );
    }
}

#[test]
fn event_stream_framing_comments_fields_bom_and_data_split_over_lines() {
    // A byte order mark, a comment, `event:` and `id:` fields, `data:` without its space, and
    // one JSON document over three data lines (joined with LF, whitespace to JSON).
    let body = "\u{feff}: keep-alive\r\nevent: message_start\r\nid: 1\r\ndata:{\"type\":\"message_start\",\r\ndata: \"message\":{\"model\":\"claude-x\",\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}\ndata\r\ndata: }\n\n\
                data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":9}}\r\r\
                retry: 10\ndatum: {\"nothing\"\n\n\
                data: {\"type\":\"message_stop\"}\n\n";
    let reading = read(Api::Anthropic, MESSAGES, 200, SSE, body);
    assert_eq!(reading, metered("claude-x", 5, 9, 0));
}

const RESPONSES_JSON: &str = r#"{"id":"resp_1","object":"response","created_at":1,"status":"completed","model":"gpt-4.1-2025-04-14","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"usage: {\"input_tokens\": 1}","annotations":[]}]}],"usage":{"input_tokens":328,"input_tokens_details":{"cached_tokens":128},"output_tokens":52,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":380},"metadata":{"model":"not-this-one"}}"#;

#[test]
fn responses_whole() {
    let reading = read(Api::OpenAi, RESPONSES, 200, JSON, RESPONSES_JSON);
    assert_eq!(reading, metered("gpt-4.1-2025-04-14", 328, 52, 128));
}

fn responses_stream(text: &str) -> String {
    let created = r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","status":"in_progress","model":"gpt-4.1","output":[],"usage":null}}"#;
    let delta = format!(
        r#"{{"type":"response.output_text.delta","sequence_number":1,"item_id":"msg_1","output_index":0,"content_index":0,"delta":{}}}"#,
        serde_json::to_string(text).unwrap()
    );
    let completed = format!(
        r#"{{"type":"response.completed","sequence_number":2,"response":{{"id":"resp_1","status":"completed","model":"gpt-4.1","output":[{{"type":"message","content":[{{"type":"output_text","text":{}}}]}}],"usage":{{"input_tokens":20,"input_tokens_details":{{"cached_tokens":0}},"output_tokens":1000,"total_tokens":1020}}}}}}"#,
        serde_json::to_string(text).unwrap()
    );
    format!(
        "event: response.created\ndata: {created}\n\nevent: response.output_text.delta\ndata: {delta}\n\nevent: response.completed\ndata: {completed}\n\n"
    )
}

#[test]
fn responses_streamed() {
    let reading = read(
        Api::OpenAi,
        RESPONSES,
        200,
        SSE,
        &responses_stream("Hello, \"world\"\n\u{1F600}"),
    );
    assert_eq!(reading, metered("gpt-4.1", 20, 1000, 0));
}

#[test]
fn a_huge_response_completed_is_read_in_bounded_memory() {
    let text = "lorem ipsum \\ \"dolor\" sit amet ".repeat(400_000); // ~12 MB, twice
    let body = responses_stream(&text);
    let mut meter = meter(Api::OpenAi, RESPONSES, 200, SSE);
    let mut most = 0;
    for chunk in body.as_bytes().chunks(16 * 1024 + 3) {
        meter.feed(chunk);
        most = most.max(meter.held());
    }
    assert!(most <= Meter::MOST_HELD, "held {most} bytes");
    // An event held (sieved Chat Completions streams) and the rest under 2 KiB.
    assert!(
        std::mem::size_of::<Meter>() <= super::HOLD + 2048,
        "{}",
        std::mem::size_of::<Meter>()
    );
    assert_eq!(meter.finish(), metered("gpt-4.1", 20, 1000, 0));
}

const MESSAGES_JSON: &str = r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-20250514","content":[{"type":"text","text":"{\"usage\": {\"input_tokens\": 5}}"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":10,"cache_creation_input_tokens":200,"cache_read_input_tokens":1000,"output_tokens":55,"service_tier":"standard"}}"#;

#[test]
fn messages_whole() {
    let reading = read(Api::Anthropic, MESSAGES, 200, JSON, MESSAGES_JSON);
    // input = 10 + 1000 read + 200 written; cached = the 1000 read.
    assert_eq!(reading, metered("claude-sonnet-4-20250514", 1210, 55, 1000));
}

fn messages_stream(delta_usage: &str, stop: bool) -> String {
    let mut body = String::from(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-opus-4\",\"content\":[],\"stop_reason\":null,\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":40,\"output_tokens\":1}}}\n\n\
         event: ping\ndata: {\"type\": \"ping\"}\n\n\
         event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n\
         event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n\
         event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    );
    if !delta_usage.is_empty() {
        body.push_str(&format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\",\"stop_sequence\":null}},\"usage\":{delta_usage}}}\n\n"));
    }
    if stop {
        body.push_str("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    }
    body
}

#[test]
fn messages_streamed() {
    for (delta, stop, want) in [
        (r#"{"output_tokens":15}"#, true, (65, 15, 40)),
        // A newer delta that repeats the input counts: the latest wins.
        (
            r#"{"input_tokens":30,"cache_creation_input_tokens":5,"cache_read_input_tokens":40,"output_tokens":15}"#,
            true,
            (75, 15, 40),
        ),
        // Cut after the delta (its counts are final): still read.
        (r#"{"output_tokens":15}"#, false, (65, 15, 40)),
    ] {
        let reading = read(
            Api::Anthropic,
            MESSAGES,
            200,
            SSE,
            &messages_stream(delta, stop),
        );
        assert_eq!(
            reading,
            metered("claude-opus-4", want.0, want.1, want.2),
            "{delta}"
        );
    }
}

#[test]
fn a_cut_body_is_unmetered_as_cut() {
    let cut = &CHAT_JSON[..CHAT_JSON.len() - 30];
    let reading = read(Api::OpenAi, CHAT, 200, JSON, cut);
    assert_eq!(
        reading,
        unmetered(Some("gpt-4o-mini-2024-07-18"), reason::CUT)
    );
    // Streamed, cut before the delta: the start's counts are not the call's.
    let reading = read(
        Api::Anthropic,
        MESSAGES,
        200,
        SSE,
        &messages_stream("", false),
    );
    assert_eq!(reading, unmetered(Some("claude-opus-4"), reason::CUT));
    // Cut inside the event that carried the usage (no blank line after it).
    let stream = chat_stream(true, "\n");
    let at = stream.find("\"usage\":{\"prompt").unwrap() + 80;
    let reading = read(Api::OpenAi, CHAT, 200, SSE, &stream[..at]);
    assert_eq!(reading, unmetered(Some("gpt-4o"), reason::CUT));
    // The whole usage event, but not its blank line: an event is dispatched only at its end.
    let stream = chat_stream(true, "\n");
    let at = stream.rfind("\n\ndata: [DONE]").unwrap() + 1;
    let reading = read(Api::OpenAi, CHAT, 200, SSE, &stream[..at]);
    assert_eq!(reading, unmetered(Some("gpt-4o"), reason::CUT));
    // An empty body.
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, ""),
        unmetered(None, reason::NO_USAGE_BODY)
    );
}

#[test]
fn an_error_response_counts_nothing() {
    let body = r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
    assert_eq!(
        read(Api::OpenAi, CHAT, 429, JSON, body),
        unmetered(None, reason::ERROR_RESPONSE)
    );
    let body = r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#;
    assert_eq!(
        read(Api::Anthropic, MESSAGES, 529, JSON, body),
        unmetered(None, reason::ERROR_RESPONSE)
    );
    assert_eq!(
        read(
            Api::OpenAi,
            CHAT,
            502,
            "text/html",
            "<html>bad gateway</html>"
        ),
        unmetered(None, reason::ERROR_RESPONSE)
    );
    // An error event mid-stream, after the start.
    let mut stream = messages_stream("", false);
    stream.push_str("event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n");
    assert_eq!(
        read(Api::Anthropic, MESSAGES, 200, SSE, &stream),
        unmetered(Some("claude-opus-4"), reason::STREAM_ERROR)
    );
    // A non-2xx whose body does carry usage is metered.
    assert_eq!(
        read(Api::OpenAi, CHAT, 400, JSON, CHAT_JSON),
        metered("gpt-4o-mini-2024-07-18", 12, 30, 4)
    );
}

#[test]
fn a_compressed_or_unexpected_body_is_not_read() {
    for (status, encoding, want) in [
        (200, "gzip", reason::COMPRESSED),
        (200, "identity, br", reason::COMPRESSED),
        (500, "gzip", reason::ERROR_RESPONSE),
    ] {
        let mut meter = Meter::for_call(Api::OpenAi, &Method::POST, CHAT).unwrap();
        meter.head(
            StatusCode::from_u16(status).unwrap(),
            &headers(Some(JSON), Some(encoding)),
        );
        meter.feed(CHAT_JSON.as_bytes());
        assert_eq!(meter.finish(), unmetered(None, want), "{encoding}");
    }
    let mut meter = Meter::for_call(Api::OpenAi, &Method::POST, CHAT).unwrap();
    meter.head(StatusCode::OK, &headers(Some(JSON), Some("identity")));
    meter.feed(CHAT_JSON.as_bytes());
    assert_eq!(meter.finish(), metered("gpt-4o-mini-2024-07-18", 12, 30, 4));
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, "text/plain", CHAT_JSON),
        unmetered(None, reason::CONTENT_TYPE)
    );
    // No content type: read as JSON.
    let mut meter = Meter::for_call(Api::OpenAi, &Method::POST, CHAT).unwrap();
    meter.head(StatusCode::OK, &headers(None, None));
    meter.feed(CHAT_JSON.as_bytes());
    assert_eq!(meter.finish(), metered("gpt-4o-mini-2024-07-18", 12, 30, 4));
    // No head at all.
    let meter = Meter::for_call(Api::OpenAi, &Method::POST, CHAT).unwrap();
    assert_eq!(meter.finish(), unmetered(None, reason::NO_HEAD));
}

#[test]
fn odd_values_are_never_read_as_counts() {
    for (body, want) in [
        // A fraction, a negative, a string, a number past u64: unreadable, not zero.
        (
            CHAT_JSON.replace("\"completion_tokens\":30", "\"completion_tokens\":30.5"),
            reason::UNREADABLE,
        ),
        (
            CHAT_JSON.replace("\"completion_tokens\":30", "\"completion_tokens\":-30"),
            reason::UNREADABLE,
        ),
        (
            CHAT_JSON.replace("\"completion_tokens\":30", "\"completion_tokens\":\"30\""),
            reason::UNREADABLE,
        ),
        (
            CHAT_JSON.replace(
                "\"completion_tokens\":30",
                "\"completion_tokens\":18446744073709551616",
            ),
            reason::UNREADABLE,
        ),
        // More cached than input.
        (
            CHAT_JSON.replace("\"cached_tokens\":4", "\"cached_tokens\":13"),
            reason::UNREADABLE,
        ),
        // Missing output.
        (
            CHAT_JSON.replace("\"completion_tokens\":30,", ""),
            reason::NO_USAGE_BODY,
        ),
        // Trailing bytes, a broken document.
        (format!("{CHAT_JSON} x"), reason::MALFORMED),
        (
            CHAT_JSON.replace("\"usage\":{", "\"usage\"{"),
            reason::MALFORMED,
        ),
    ] {
        assert_eq!(
            read(Api::OpenAi, CHAT, 200, JSON, &body),
            unmetered(Some("gpt-4o-mini-2024-07-18"), want),
            "{body}"
        );
    }
    // The largest u64 is a count.
    let body = CHAT_JSON.replace(
        "\"completion_tokens\":30",
        "\"completion_tokens\":18446744073709551603",
    );
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, &body),
        metered("gpt-4o-mini-2024-07-18", 12, u64::MAX - 12, 4)
    );
}

#[test]
fn model_names_escaped_long_or_odd() {
    let escaped = CHAT_JSON.replace("\"gpt-4o-mini-2024-07-18\"", r#""gpt\u002d4o\/mini""#);
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, &escaped),
        metered("gpt-4o/mini", 12, 30, 4)
    );
    // Longer than 256 bytes, or a lone surrogate: metered, the model unknown (so unpriced).
    for name in ["m".repeat(257), r"gpt\ud800".to_owned(), "m".repeat(256)] {
        let body = CHAT_JSON.replace("gpt-4o-mini-2024-07-18", &name);
        let reading = read(Api::OpenAi, CHAT, 200, JSON, &body);
        let Reading::Metered(usage) = reading else {
            panic!("{reading:?}");
        };
        let want = (name.len() == 256).then_some(name.clone());
        assert_eq!(usage.model, want);
    }
}

#[test]
fn nesting_deeper_than_the_limit_is_malformed() {
    let depth = super::json::DEPTH;
    let deep = format!("{}{}", "[".repeat(depth + 1), "]".repeat(depth + 1));
    let body = CHAT_JSON.replace("\"system_fingerprint\":\"fp_1\"", &format!("\"x\":{deep}"));
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, &body),
        unmetered(Some("gpt-4o-mini-2024-07-18"), reason::MALFORMED)
    );
    let fits = format!("{}{}", "[".repeat(depth - 1), "]".repeat(depth - 1));
    let body = CHAT_JSON.replace("\"system_fingerprint\":\"fp_1\"", &format!("\"x\":{fits}"));
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, &body),
        metered("gpt-4o-mini-2024-07-18", 12, 30, 4)
    );
}

#[test]
fn a_chat_stream_is_read_at_its_usage_chunk_only() {
    // The chunks between the first (which names the model) and the one with usage are not
    // read: a broken one there does not matter.
    let stream = chat_stream(true, "\n").replace("{\"content\":\"data", "{\"content\":[[\"data");
    assert!(stream.contains("[[\""));
    let reading = read(Api::OpenAi, CHAT, 200, SSE, &stream);
    assert_eq!(reading, metered("gpt-4o", 100, 7, 64));
    // The usage object spelled with spaces, or in an event longer than the meter holds (read
    // as it comes), still counts.
    let spaced = chat_stream(true, "\n").replace("\"usage\":{", "\"usage\" :\t{");
    assert_ne!(spaced, chat_stream(true, "\n"));
    assert_eq!(read(Api::OpenAi, CHAT, 200, SSE, &spaced), reading);
    let padding = format!("\"pad\":\"{}\",\"usage\":{{", "x".repeat(super::HOLD));
    let long = chat_stream(true, "\n").replace("\"usage\":{", &padding);
    assert_eq!(read(Api::OpenAi, CHAT, 200, SSE, &long), reading);
}

#[test]
fn the_sieve_reads_the_last_usage_key_and_no_text() {
    // Text the model writes cannot pass for a usage key: its quotes are escaped.
    let text = chat_stream(false, "\n").replace(
        "\"content\":\"data",
        r#""content":"\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1} data"#,
    );
    assert_ne!(text, chat_stream(false, "\n"));
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, SSE, &text),
        unmetered(Some("gpt-4o"), reason::NO_USAGE_STREAM)
    );
    // The usage chunk's key is its last: found from the end, and read.
    let stream = chat_stream(true, "\n");
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, SSE, &stream),
        metered("gpt-4o", 100, 7, 64)
    );
    // A chunk whose last `usage` key is not an object is not read, whatever came before it
    // (a key the format does not have): the call reads as unmetered, never as zero.
    let twice = stream.replace(
        r#""prompt_tokens_details":{"cached_tokens":64}}}"#,
        r#""prompt_tokens_details":{"cached_tokens":64}},"choices_x":{"usage":null}}"#,
    );
    assert_ne!(twice, stream);
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, SSE, &twice),
        unmetered(Some("gpt-4o"), reason::NO_USAGE_STREAM)
    );
}

#[test]
fn a_skipped_subtree_is_passed_over_but_still_checked() {
    // `choices` holds nothing the meter reads: it is skipped whole, brackets and quotes inside
    // its strings (escaped or not) included.
    let tricky = r#""choices":[{"delta":{"content":"}]\"{[\\"},"x":[[{}],{"y":"]"}]}]"#;
    let body = CHAT_JSON.replace("\"system_fingerprint\":\"fp_1\"", tricky);
    assert_ne!(body, CHAT_JSON);
    assert_eq!(
        read(Api::OpenAi, CHAT, 200, JSON, &body),
        metered("gpt-4o-mini-2024-07-18", 12, 30, 4)
    );
    // Its brackets must still pair up, and it must end.
    for broken in [r#""choices":[{"a":1]}"#, r#""choices":[{"a":"1"}}"#] {
        let body = CHAT_JSON.replace("\"system_fingerprint\":\"fp_1\"", broken);
        assert_eq!(
            read(Api::OpenAi, CHAT, 200, JSON, &body),
            unmetered(Some("gpt-4o-mini-2024-07-18"), reason::MALFORMED),
            "{broken}"
        );
    }
}

#[test]
fn which_requests_are_metered_calls() {
    let post = Method::POST;
    for (api, method, path, metered) in [
        (Api::OpenAi, &post, "/v1/chat/completions", true),
        (Api::OpenAi, &post, "/v1/chat/completions?x=1", true),
        (Api::OpenAi, &post, "/v1/responses/", true),
        (Api::OpenAi, &post, "/openai/v1/chat/completions", true),
        (Api::OpenAi, &Method::GET, "/v1/models", false),
        (Api::OpenAi, &Method::GET, "/v1/chat/completions", false),
        (Api::OpenAi, &post, "/v1/messages", false),
        (Api::OpenAi, &post, "/v1/embeddings", false),
        (Api::Anthropic, &post, "/v1/messages", true),
        (Api::Anthropic, &post, "/v1/messages/count_tokens", false),
        (Api::Anthropic, &post, "/v1/chat/completions", false),
        // What some origin still routes to the call is metered.
        (Api::OpenAi, &post, "/v1//chat/completions", true),
        (Api::OpenAi, &post, "/v1/chat/completions;x=1", true),
        (Api::OpenAi, &post, "/v1;v=2/chat/completions/", true),
        (Api::OpenAi, &post, "/V1/Chat/Completions", true),
        (Api::Anthropic, &post, "//v1/MESSAGES//", true),
        (Api::OpenAi, &post, "/v1/chat/completions2", false),
    ] {
        assert_eq!(
            Meter::for_call(api, method, path).is_some(),
            metered,
            "{api} {method} {path}"
        );
    }
}

#[test]
fn a_meter_moves_between_threads() {
    fn is_send<T: Send + 'static>() {}
    is_send::<Meter>();
}

#[test]
fn api_names() {
    for api in [Api::OpenAi, Api::Anthropic] {
        assert_eq!(api.to_string().parse::<Api>(), Ok(api));
        let json = serde_json::to_string(&api).unwrap();
        assert_eq!(json, format!("\"{api}\""));
        assert_eq!(serde_json::from_str::<Api>(&json).unwrap(), api);
    }
    let error = "OpenAI".parse::<Api>().unwrap_err();
    assert_eq!(
        error.to_string(),
        "unknown model API \"OpenAI\": expected \"openai\" or \"anthropic\""
    );
}

/// Bodies built from pieces the APIs use (and a few that break them), split anywhere: the
/// reading never depends on the chunks, and never panics.
mod split_invariance {
    use super::*;
    use proptest::prelude::*;

    const PIECES: [&str; 27] = [
        "\"choices\":",
        "\"x\\\"]}\"",
        "\"\\\\\"",
        "data: ",
        "data:",
        "\n",
        "\r\n",
        "\r",
        "\n\n",
        ": c\n",
        "event: x\n",
        "[DONE]",
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        "\"usage\"",
        "\"model\"",
        "\"m\\u0041\"",
        "\"prompt_tokens\"",
        "\"completion_tokens\"",
        "12",
        "-1.5e3",
        "\"type\":\"message_delta\"",
        "null",
    ];

    proptest! {
        #[test]
        fn any_body_reads_the_same_whatever_the_chunks(
            pieces in proptest::collection::vec(0..PIECES.len(), 0..40),
            call in 0..3usize,
            sse in any::<bool>(),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..6),
        ) {
            let body: String = pieces.iter().map(|&i| PIECES[i]).collect();
            let body = body.as_bytes();
            let (api, path) = [(Api::OpenAi, CHAT), (Api::OpenAi, RESPONSES), (Api::Anthropic, MESSAGES)][call];
            let ct = if sse { SSE } else { JSON };
            let whole = read_split(api, path, 200, ct, body, &[]);
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(body.len() + 1)).collect();
            cuts.sort_unstable();
            prop_assert_eq!(read_split(api, path, 200, ct, body, &cuts), whole.clone());
            let bytewise: Vec<usize> = (1..body.len()).collect();
            prop_assert_eq!(read_split(api, path, 200, ct, body, &bytewise), whole);
        }
    }
}
