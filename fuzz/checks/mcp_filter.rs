//! An MCP server's answer through the tool-list filter, on arbitrary bytes cut at an
//! arbitrary place: never panics; the output does not depend on where the answer was cut;
//! no tool list in the output (a JSON answer, or any event's data) holds a tool the lease may
//! not call; an answer that names no tool list passes byte for byte.
//!
//! Input: one flags byte (bit 0: an event stream, else JSON; the rest: where to cut), then the
//! answer. The lease may call the tools whose names start with `a`.

use leasegate::mcp::filter::{Filter, Framing};
use serde_json::Value;

fn allowed(name: &str) -> bool {
    name.starts_with('a')
}

fn run(framing: Framing, chunks: &[&[u8]]) -> Option<Vec<u8>> {
    let mut filter = Filter::new(framing, allowed);
    let mut out = Vec::new();
    for chunk in chunks {
        filter.feed(chunk, &mut out).ok()?;
    }
    filter.finish(&mut out).ok()?;
    Some(out)
}

fn lists_only_allowed(value: &Value) {
    let messages: Vec<&Value> = match value {
        Value::Array(items) => items.iter().collect(),
        one => vec![one],
    };
    for message in messages {
        if let Some(Value::Array(tools)) = message.get("result").and_then(|r| r.get("tools")) {
            for tool in tools {
                let name = tool.get("name").and_then(Value::as_str);
                assert!(name.is_some_and(allowed), "{tool} passed the filter");
            }
        }
    }
}

pub fn check(data: &[u8]) {
    let Some((&flags, answer)) = data.split_first() else {
        return;
    };
    let framing = match flags & 1 {
        0 => Framing::Json,
        _ => Framing::Events,
    };
    let cut = usize::from(flags >> 1).min(answer.len());
    let whole = run(framing, &[answer]);
    let (a, b) = answer.split_at(cut);
    assert_eq!(
        whole,
        run(framing, &[a, b]),
        "the output depends on the cut"
    );
    let Some(out) = whole else {
        return;
    };
    match framing {
        Framing::Json => {
            let value: Value = serde_json::from_slice(&out).expect("what passed is JSON");
            lists_only_allowed(&value);
            let escaped = memchr::memmem::find(answer, b"\\u").is_some();
            if memchr::memmem::find(answer, b"tools").is_none() && !escaped {
                assert_eq!(out, answer, "an answer without a list changed");
            }
        }
        Framing::Events => {
            let text = String::from_utf8_lossy(&out)
                .replace("\r\n", "\n")
                .replace('\r', "\n");
            for event in text.split("\n\n") {
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data"))
                    .map(|v| v.strip_prefix(':').unwrap_or(v))
                    .map(|v| v.strip_prefix(' ').unwrap_or(v))
                    .collect();
                if let Ok(value) = serde_json::from_str::<Value>(&data.join("\n")) {
                    lists_only_allowed(&value);
                }
            }
        }
    }
}
