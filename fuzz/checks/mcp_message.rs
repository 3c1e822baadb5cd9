//! An MCP client's POST body as the edge reads it, on arbitrary bytes: never panics; a body
//! it accepts reads the same to serde_json (which keeps the last of a duplicate key, as many
//! servers do): every message's method and every `tools/call`'s tool are what the server
//! will see, so no duplicate or escape slipped a call past the judgement.

use leasegate::mcp::message::{read, TOOLS_CALL};
use serde_json::Value;

pub fn check(data: &[u8]) {
    let Ok(read) = read(data) else {
        return;
    };
    let value: Value = serde_json::from_slice(data).expect("an accepted body is JSON");
    let messages: Vec<&Value> = match &value {
        Value::Array(items) => {
            assert!(read.batch);
            items.iter().collect()
        }
        one => {
            assert!(!read.batch);
            vec![one]
        }
    };
    assert_eq!(messages.len(), read.messages.len());
    for (seen, message) in messages.iter().zip(&read.messages) {
        let method = seen.get("method").and_then(Value::as_str);
        assert_eq!(method, message.method.as_deref(), "method read apart");
        if method == Some(TOOLS_CALL) {
            let tool = seen["params"]["name"].as_str();
            assert!(tool.is_some(), "a call without a tool was accepted");
            assert_eq!(tool, message.tool.as_deref(), "tool read apart");
            assert!(seen
                .get("id")
                .is_some_and(|id| id.is_string() || id.is_number()));
        } else {
            assert_eq!(message.tool, None);
        }
    }
}
