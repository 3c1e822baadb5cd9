//! The meter's cost per byte of a relayed answer: a streamed Chat Completions answer (many
//! small events, the meter's worst case: mostly structure, little text) and a streamed
//! Responses answer (its text twice, once in the deltas and once in `response.completed`), fed
//! in 16 KiB chunks as a relay would. `cargo bench --bench meter`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use leasegate::meter::{Api, Meter, Reading};

fn chat_stream(events: usize) -> String {
    let mut body = String::new();
    for i in 0..events {
        body.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_1\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token{i}\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n"
        ));
    }
    body.push_str("data: {\"id\":\"chatcmpl-1\",\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":20}}\n\ndata: [DONE]\n\n");
    body
}

fn responses_stream(text_len: usize) -> String {
    let text = "lorem ipsum dolor sit amet ".repeat(text_len / 27);
    format!(
        "event: response.output_text.delta\ndata: {{\"type\":\"response.output_text.delta\",\"delta\":\"{text}\"}}\n\n\
         event: response.completed\ndata: {{\"type\":\"response.completed\",\"response\":{{\"model\":\"gpt-4.1\",\"output\":[{{\"content\":[{{\"text\":\"{text}\"}}]}}],\"usage\":{{\"input_tokens\":1,\"output_tokens\":2}}}}}}\n\n"
    )
}

fn read(api: Api, path: &str, body: &[u8]) -> Reading {
    let mut meter = Meter::for_call(api, &http::Method::POST, path).unwrap();
    let mut headers = http::HeaderMap::new();
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("text/event-stream"),
    );
    meter.head(http::StatusCode::OK, &headers);
    for chunk in body.chunks(16 * 1024) {
        meter.feed(chunk);
    }
    meter.finish()
}

fn meter(c: &mut Criterion) {
    let mut group = c.benchmark_group("meter");
    for (name, path, body) in [
        ("chat_stream", "/v1/chat/completions", chat_stream(5_000)),
        (
            "responses_stream",
            "/v1/responses",
            responses_stream(1 << 20),
        ),
    ] {
        assert!(matches!(
            read(Api::OpenAi, path, body.as_bytes()),
            Reading::Metered(_)
        ));
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_function(name, |b| {
            b.iter(|| read(Api::OpenAi, path, body.as_bytes()))
        });
    }
    group.finish();
}

criterion_group!(benches, meter);
criterion_main!(benches);
