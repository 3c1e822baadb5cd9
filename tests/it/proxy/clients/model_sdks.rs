//! The official OpenAI and Anthropic Python SDKs, unmodified, through terminated hosts for the
//! fake model API ([`ModelProxy`]), set up as `leasegate run` sets up an agent (the lease in
//! `HTTPS_PROXY`, the CA in `SSL_CERT_FILE`, the placeholders as the SDKs' keys): every call
//! reaches the origin with the real key, the SDK never sees it, and what the SDK's response
//! objects report is the fake's known usage. One Python process makes all six calls.

use super::{client_for, python_finds, text};
use crate::support::harness::{curl, eventually, CurlOutput};
use crate::support::model_api::{Usage, ANTHROPIC_HOST, OPENAI_HOST};
use crate::support::model_proxy::{ModelProxy, ANTHROPIC_KEY, OPENAI_KEY};
use crate::support::netns::in_loopback_only_namespace;
use crate::support::skip;
use serde_json::{json, Value};
use std::time::Duration;

/// One call as the script printed it: the usage normalised as the metering agreement counts
/// (input with cached included), the model, and the text deltas of a stream.
#[derive(Debug, PartialEq)]
pub struct Reported {
    pub call: String,
    pub model: String,
    pub usage: Usage,
    pub deltas: Option<u64>,
}

/// The per-call usages the SDKs reported, in the order of the calls.
pub fn sdk_usages(printed: &str) -> Vec<Reported> {
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a token count: {v}"));
    printed
        .lines()
        .map(|line| {
            let line: Value = serde_json::from_str(line).unwrap();
            let u = &line["usage"];
            let usage = match line["call"].as_str().unwrap() {
                "chat" | "chat_stream" => Usage {
                    input_tokens: n(&u["prompt_tokens"]),
                    cached_tokens: n(&u["cached_tokens"]),
                    output_tokens: n(&u["completion_tokens"]),
                },
                "responses" | "responses_stream" => Usage {
                    input_tokens: n(&u["input_tokens"]),
                    cached_tokens: n(&u["cached_tokens"]),
                    output_tokens: n(&u["output_tokens"]),
                },
                // Anthropic's `input_tokens` leaves out the cache's part.
                _ => Usage {
                    input_tokens: n(&u["input_tokens"])
                        + n(&u["cache_read_input_tokens"])
                        + n(&u["cache_creation_input_tokens"]),
                    cached_tokens: n(&u["cache_read_input_tokens"]),
                    output_tokens: n(&u["output_tokens"]),
                },
            };
            Reported {
                call: line["call"].as_str().unwrap().to_owned(),
                model: line["model"].as_str().unwrap().to_owned(),
                usage,
                deltas: line["deltas"].as_u64(),
            }
        })
        .collect()
}

/// What the script prints, as the fake's rules make it: input 5 words + 7; the maximum asked
/// for as output; half the input cached for gpt-4o and claude-sonnet-4-5; OpenAI's dated
/// model names.
fn expected_lines() -> Vec<Value> {
    let chat = |prompt: u64, completion: u64, cached: u64| {
        json!({"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "cached_tokens": cached})
    };
    let responses = |input: u64, output: u64, cached: u64| {
        json!({"input_tokens": input, "cached_tokens": cached, "output_tokens": output,
            "total_tokens": input + output})
    };
    let messages = |input: u64, cache_read: u64, output: u64| {
        json!({"input_tokens": input, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cache_read, "output_tokens": output})
    };
    let line = |call: &str, model: &str, usage: Value, deltas: Value| json!({"call": call, "model": model, "usage": usage, "deltas": deltas});
    let (mini, four) = ("gpt-4o-mini-2024-07-18", "gpt-4o-2024-08-06");
    vec![
        line("chat", mini, chat(12, 5, 0), Value::Null),
        line("chat_stream", four, chat(12, 9, 6), json!(9)),
        line("responses", mini, responses(12, 6, 0), Value::Null),
        line("responses_stream", four, responses(12, 12, 6), json!(12)),
        line(
            "messages",
            "claude-haiku-4-5",
            messages(12, 0, 4),
            Value::Null,
        ),
        line(
            "messages_stream",
            "claude-sonnet-4-5",
            messages(6, 6, 20),
            json!(20),
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_and_anthropic_sdks_through_terminated_hosts() {
    if !python_finds(&["openai", "anthropic"]) {
        return skip("the Python SDKs openai and anthropic are missing (python3 -m pip install openai anthropic; .ci/run does)");
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let m = ModelProxy::start().await;
    let env = m.agent_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(n, v)| (*n, v.as_str())).collect();
    let script = crate::support::data("clients/brokered/model_sdks.py");
    // Importing the two SDKs takes seconds of CPU, many more on a busy machine.
    let limit = Duration::from_secs(120);
    let args = [script.to_str().unwrap()];
    let out = client_for(limit, "python3", &args, &env, m.h.dir.path()).await;
    let (printed, warned) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{printed}{warned}");
    for key in [OPENAI_KEY, ANTHROPIC_KEY] {
        assert!(
            !printed.contains(key) && !warned.contains(key),
            "the SDK saw a key"
        );
    }
    let lines: Vec<Value> = printed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, expected_lines(), "{printed}");

    // The origin saw each call once, with the real key where the placeholder was.
    let seen = m.api.seen();
    let calls: Vec<_> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.path.as_str(), s.stream))
        .collect();
    assert_eq!(
        calls,
        [
            ("POST", "/v1/chat/completions", false),
            ("POST", "/v1/chat/completions", true),
            ("POST", "/v1/responses", false),
            ("POST", "/v1/responses", true),
            ("POST", "/v1/messages", false),
            ("POST", "/v1/messages", true),
        ]
    );
    let port = m.api.origin.addr.port();
    for s in &seen[..4] {
        assert_eq!(s.status, 200, "{s:?}");
        assert_eq!(
            s.header("authorization"),
            Some(&*format!("Bearer {OPENAI_KEY}"))
        );
        assert_eq!(s.header("host"), Some(&*format!("{OPENAI_HOST}:{port}")));
    }
    for s in &seen[4..] {
        assert_eq!(s.status, 200, "{s:?}");
        assert_eq!(s.header("x-api-key"), Some(ANTHROPIC_KEY));
        assert_eq!(s.header("host"), Some(&*format!("{ANTHROPIC_HOST}:{port}")));
    }

    // What the SDKs reported is what the fake answered.
    let reported = sdk_usages(&printed);
    let answered: Vec<_> = seen.iter().map(|s| (s.model.clone(), s.usage)).collect();
    let got: Vec<_> = reported
        .iter()
        .map(|r| (Some(r.model.clone()), Some(r.usage)))
        .collect();
    assert_eq!(got, answered);

    // One egress line per call (kind https), in the order of the calls.
    let inside = calls_in_egress(&m, 6).await;
    let recorded: Vec<_> = inside
        .iter()
        .map(|l| {
            (
                l["path"].as_str().unwrap_or_default(),
                l["secrets"][0].as_str(),
            )
        })
        .collect();
    let (chat, responses) = ("/v1/chat/completions", "/v1/responses");
    let (openai, anthropic) = (Some("openai"), Some("anthropic"));
    assert_eq!(
        recorded,
        [
            (chat, openai),
            (chat, openai),
            (responses, openai),
            (responses, openai),
            ("/v1/messages", anthropic),
            ("/v1/messages", anthropic),
        ],
        "{inside:?}"
    );
    // leasegate read the same usage from the answers it relayed, call for call: each line's
    // `model` object holds what the SDK's response object reported.
    let metered: Vec<_> = inside
        .iter()
        .map(|l| {
            let m = &l["model"];
            let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("a count in {l}"));
            (
                m["name"].as_str().unwrap_or_default().to_owned(),
                Usage {
                    input_tokens: n(&m["input_tokens"]),
                    cached_tokens: n(&m["cached_tokens"]),
                    output_tokens: n(&m["output_tokens"]),
                },
            )
        })
        .collect();
    let reported: Vec<_> = reported
        .iter()
        .map(|r| (r.model.clone(), r.usage))
        .collect();
    assert_eq!(metered, reported, "{inside:?}");
}

/// The egress lines of the requests inside the tunnels (kind `https`), once there are `n`
/// (waiting up to 10 s; fewer if they never come).
async fn calls_in_egress(m: &ModelProxy, n: usize) -> Vec<Value> {
    let read = || async {
        let log = tokio::fs::read_to_string(&m.h.egress)
            .await
            .unwrap_or_default();
        let lines = log
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap());
        lines.filter(|l| l["kind"] == "https").collect::<Vec<_>>()
    };
    let enough = eventually(Duration::from_secs(10), || async {
        Some(read().await).filter(|lines| lines.len() >= n)
    });
    match enough.await {
        Some(lines) => lines,
        None => read().await,
    }
}

/// A POST of `body` straight to the fake (no proxy) at `host` and `path`, with `key` as
/// `header`.
async fn post(
    m: &ModelProxy,
    host: &str,
    path: &str,
    key: (&str, &str),
    body: Value,
) -> CurlOutput {
    let port = m.api.origin.addr.port();
    let resolve = format!("{host}:{port}:127.0.0.1");
    let header = format!("{}: {}", key.0, key.1);
    let body = body.to_string();
    let url = format!("https://{host}:{port}{path}");
    let ca = m.api.ca.to_str().unwrap();
    let args = [
        "--resolve",
        &resolve,
        "--cacert",
        ca,
        "-H",
        &header,
        "-d",
        &body,
        &url,
    ];
    curl(&args, &[]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fake_model_api_wants_its_key_and_streams_what_is_asked() {
    let m = ModelProxy::start().await;
    let chat = json!({"model": "gpt-4o-mini", "stream": true, "max_tokens": 3,
        "messages": [{"role": "user", "content": "one two"}]});
    let wrong = ("Authorization", "Bearer sk-wrong");
    let out = post(&m, OPENAI_HOST, "/v1/chat/completions", wrong, chat.clone()).await;
    assert_eq!(out.status, 401, "{out:?}");
    assert_eq!(
        serde_json::from_slice::<Value>(&out.body).unwrap()["error"]["code"],
        "invalid_api_key"
    );
    let out = post(
        &m,
        ANTHROPIC_HOST,
        "/v1/messages",
        ("x-api-key", OPENAI_KEY),
        json!({}),
    )
    .await;
    assert_eq!(out.status, 401, "{out:?}");

    // A chat stream without include_usage: no usage anywhere, three deltas, then [DONE].
    let bearer = format!("Bearer {OPENAI_KEY}");
    let key = ("Authorization", bearer.as_str());
    let out = post(&m, OPENAI_HOST, "/v1/chat/completions", key, chat).await;
    assert_eq!(out.status, 200, "{out:?}");
    assert!(out
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let body = out.body_text();
    let events: Vec<&str> = body.split_terminator("\n\n").collect();
    assert_eq!(events.len(), 1 + 3 + 1 + 1, "{body}");
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    assert!(!body.contains("usage"), "{body}");

    // A 2,000-token Messages stream: 2,000 deltas, and the last count says so.
    let long = json!({"model": "claude-haiku-4-5", "stream": true, "max_tokens": 2000,
        "messages": [{"role": "user", "content": "go on"}]});
    let out = post(
        &m,
        ANTHROPIC_HOST,
        "/v1/messages",
        ("x-api-key", ANTHROPIC_KEY),
        long,
    )
    .await;
    assert_eq!(out.status, 200, "{out:?}");
    let body = out.body_text();
    assert_eq!(body.matches("event: content_block_delta\n").count(), 2000);
    let usage = r#""usage":{"output_tokens":2000}"#;
    assert!(body.contains(usage), "{body}");
    let seen = m.api.seen();
    assert_eq!(
        seen.iter().map(|s| s.status).collect::<Vec<_>>(),
        [401, 401, 200, 200]
    );
    let last = Usage {
        input_tokens: 2 + 7,
        cached_tokens: 0,
        output_tokens: 2000,
    };
    assert_eq!(seen[3].usage, Some(last));
}
