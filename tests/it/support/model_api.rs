//! A fake model API on a loopback TLS origin: OpenAI Chat Completions and Responses, Anthropic
//! Messages, plain and streamed (SSE), in the shapes the real APIs send, so that the official
//! SDKs parse them. Its usage follows from the request alone ([`usage_for`]): a test knows the
//! tokens before the call. A request without the right key gets 401, and every request is
//! recorded with its headers ([`ModelApi::seen`]).
//!
//! The rules: input tokens = the words of the request's text (system prompt, instructions,
//! messages) + [`INPUT_OFFSET`]; output tokens = the number of text deltas a stream sends,
//! which is the request's maximum (`max_completion_tokens` / `max_tokens` /
//! `max_output_tokens`) or [`DEFAULT_OUTPUT`] — the model "stops on its own" after exactly that
//! many, so every answer is complete; a model of [`CACHING_MODELS`] reports half its input
//! (rounded down) as read from the cache. OpenAI names the dated snapshot of an alias it knows
//! ([`answered_model`]), as the real API does; Anthropic echoes the model asked for.
//! `GET /v1/models` lists the models (a call that is not a model call). A streamed request
//! with the header [`HOLD`] sends half its events, then waits for [`ModelApi::release`]: a
//! test knows the stream is in flight.

mod shapes;

use super::harness::{https_origin_named, Origin, OriginBody};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use leasegate::proxy::BoxError;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub const OPENAI_HOST: &str = "api.openai.test";
pub const ANTHROPIC_HOST: &str = "api.anthropic.test";
/// Added to the words of a request's text to make its input tokens.
pub const INPUT_OFFSET: u64 = 7;
/// Output tokens when the request names no maximum.
pub const DEFAULT_OUTPUT: u64 = 8;
/// The most output tokens one answer has (a larger maximum is cut to this).
pub const MAX_OUTPUT: u64 = 100_000;
/// Models whose answers report half their input tokens as cached.
pub const CACHING_MODELS: [&str; 2] = ["gpt-4o", "claude-sonnet-4-5"];
/// A streamed request with this header (any value) is held halfway until released.
pub const HOLD: &str = "x-fake-hold";
/// The largest request body read.
const MAX_BODY: usize = 1 << 20;
/// `created` / `created_at` of every answer: answers are byte-for-byte deterministic.
const CREATED: u64 = 1_767_225_600;

/// Which API a request is for, by its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages`
    Messages,
}

impl Api {
    fn of(path: &str) -> Option<Api> {
        match path {
            "/v1/chat/completions" => Some(Api::Chat),
            "/v1/responses" => Some(Api::Responses),
            "/v1/messages" => Some(Api::Messages),
            _ => None,
        }
    }

    fn openai(self) -> bool {
        self != Api::Messages
    }
}

/// Tokens as the metering agreement counts them: `input_tokens` every input token (cached
/// included), `cached_tokens` the cached part of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
}

/// One request the fake received, and what it answered.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub status: u16,
    pub stream: bool,
    /// The model named in the answer.
    pub model: Option<String>,
    /// The usage the answer reported (none for an error).
    pub usage: Option<Usage>,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// The keys the fake accepts: OpenAI's as `Authorization: Bearer <key>`, Anthropic's as
/// `x-api-key: <key>`.
#[derive(Clone, Debug)]
pub struct Keys {
    pub openai: String,
    pub anthropic: String,
}

/// The running fake: one origin for both hosts (one certificate names both).
pub struct ModelApi {
    pub origin: Origin,
    /// The origin's certificate, as a CA file.
    pub ca: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
    /// Opens the gate held streams wait at.
    gate: tokio::sync::watch::Sender<bool>,
}

impl ModelApi {
    /// Starts the fake on a loopback port, writing its CA file into `dir`.
    pub async fn start(dir: &Path, keys: Keys) -> ModelApi {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (gate, _) = tokio::sync::watch::channel(false);
        let state = Arc::new(State {
            keys,
            seen: seen.clone(),
            next_id: AtomicU64::new(1),
            gate: gate.clone(),
        });
        let service = move |req: Request<Incoming>| {
            let state = state.clone();
            async move { Ok::<_, Infallible>(state.answer(req).await) }
        };
        let (origin, ca) = https_origin_named(&[OPENAI_HOST, ANTHROPIC_HOST], dir, service).await;
        ModelApi {
            origin,
            ca,
            seen,
            gate,
        }
    }

    /// Lets every held stream (see [`HOLD`]) go on to its end, now and from now on.
    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    /// Every request so far, in order of arrival.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The SDK's `base_url` for OpenAI (`…/v1`) or Anthropic (the host alone).
    pub fn base_url(&self, openai: bool) -> String {
        let port = self.origin.addr.port();
        match openai {
            true => format!("https://{OPENAI_HOST}:{port}/v1"),
            false => format!("https://{ANTHROPIC_HOST}:{port}"),
        }
    }
}

/// The usage the fake reports for `body` sent to `api` (see the module's rules).
pub fn usage_for(api: Api, body: &Value) -> Usage {
    let mut words = 0;
    match api {
        Api::Chat => words += messages_words(&body["messages"]),
        Api::Responses => {
            words += content_words(&body["instructions"]);
            words += match &body["input"] {
                Value::Array(items) => items.iter().map(|i| content_words(&i["content"])).sum(),
                other => content_words(other),
            };
        }
        Api::Messages => {
            words += content_words(&body["system"]) + messages_words(&body["messages"])
        }
    }
    let input_tokens = words + INPUT_OFFSET;
    let model = body["model"].as_str().unwrap_or_default();
    let cached_tokens = match CACHING_MODELS.contains(&model) {
        true => input_tokens / 2,
        false => 0,
    };
    let max = match api {
        Api::Chat => body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens")),
        Api::Responses => body.get("max_output_tokens"),
        Api::Messages => body.get("max_tokens"),
    };
    let output_tokens = max
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_OUTPUT)
        .min(MAX_OUTPUT);
    Usage {
        input_tokens,
        cached_tokens,
        output_tokens,
    }
}

/// The model OpenAI's answer names: the dated snapshot of an alias it knows.
pub fn answered_model(api: Api, asked: &str) -> String {
    match (api.openai(), asked) {
        (true, "gpt-4o-mini") => "gpt-4o-mini-2024-07-18".into(),
        (true, "gpt-4o") => "gpt-4o-2024-08-06".into(),
        _ => asked.into(),
    }
}

fn messages_words(messages: &Value) -> u64 {
    let messages = messages.as_array().map(Vec::as_slice).unwrap_or_default();
    messages.iter().map(|m| content_words(&m["content"])).sum()
}

/// Words of a content: a string, or an array of parts whose `text` counts.
fn content_words(content: &Value) -> u64 {
    let count = |s: &str| s.split_whitespace().count() as u64;
    match content {
        Value::String(s) => count(s),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .map(count)
            .sum(),
        _ => 0,
    }
}

/// The text of output token `i` (each delta is one).
fn token(i: u64) -> String {
    format!("t{i} ")
}

struct State {
    keys: Keys,
    seen: Arc<Mutex<Vec<Seen>>>,
    next_id: AtomicU64,
    gate: tokio::sync::watch::Sender<bool>,
}

/// What one request asked for, once read and checked.
struct Call {
    api: Api,
    id: u64,
    model: String,
    usage: Usage,
    stream: bool,
    body: Value,
    /// Held halfway until the gate opens (see [`HOLD`]).
    hold: Option<tokio::sync::watch::Receiver<bool>>,
}

impl State {
    async fn answer(&self, req: Request<Incoming>) -> Response<OriginBody> {
        let (parts, body) = req.into_parts();
        let mut seen = Seen {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            headers: parts.headers.clone(),
            status: 200,
            stream: false,
            model: None,
            usage: None,
        };
        let listing = parts.method == "GET" && parts.uri.path() == "/v1/models";
        let called = match listing {
            true => Err(json_response(StatusCode::OK, &models())),
            false => self.call(&parts, body).await,
        };
        let answer = match called {
            Ok(call) => {
                seen.stream = call.stream;
                seen.model = Some(call.model.clone());
                seen.usage = Some(call.usage);
                respond(&call)
            }
            Err(error) => error,
        };
        seen.status = answer.status().as_u16();
        self.seen.lock().unwrap().push(seen);
        answer
    }

    /// Checks the path, the key (before the body, as the real APIs do) and the body.
    async fn call(
        &self,
        parts: &http::request::Parts,
        body: Incoming,
    ) -> Result<Call, Response<OriginBody>> {
        let Some(api) = Api::of(parts.uri.path()).filter(|_| parts.method == "POST") else {
            let error = json!({"error": {"message": "Unknown request URL", "type": "invalid_request_error", "param": null, "code": "unknown_url"}});
            return Err(json_response(StatusCode::NOT_FOUND, &error));
        };
        let header = |name| parts.headers.get(name).map(|v| v.as_bytes());
        let keyed = match api.openai() {
            true => {
                header("authorization") == Some(format!("Bearer {}", self.keys.openai).as_bytes())
            }
            false => header("x-api-key") == Some(self.keys.anthropic.as_bytes()),
        };
        if !keyed {
            return Err(error(api, StatusCode::UNAUTHORIZED, "invalid api key"));
        }
        let bytes = match Limited::new(body, MAX_BODY).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return Err(error(
                    api,
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request too large",
                ))
            }
        };
        let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
            return Err(error(api, StatusCode::BAD_REQUEST, "the body is not JSON"));
        };
        let Some(model) = body["model"].as_str() else {
            return Err(error(api, StatusCode::BAD_REQUEST, "model: Field required"));
        };
        if api == Api::Messages && body["max_tokens"].as_u64().is_none() {
            return Err(error(
                api,
                StatusCode::BAD_REQUEST,
                "max_tokens: Field required",
            ));
        }
        Ok(Call {
            api,
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            model: answered_model(api, model),
            usage: usage_for(api, &body),
            stream: body["stream"] == true,
            body,
            hold: parts
                .headers
                .contains_key(HOLD)
                .then(|| self.gate.subscribe()),
        })
    }
}

/// The model list `GET /v1/models` answers (OpenAI's shape).
fn models() -> Value {
    let model =
        |id: &str| json!({"id": id, "object": "model", "created": CREATED, "owned_by": "system"});
    json!({"object": "list", "data": [model("gpt-4o-mini"), model("gpt-4o")]})
}

/// An error in the API's own shape.
fn error(api: Api, status: StatusCode, message: &str) -> Response<OriginBody> {
    let body = match api.openai() {
        true => {
            let code = (status == StatusCode::UNAUTHORIZED).then_some("invalid_api_key");
            json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": code}})
        }
        false => {
            let kind = match status {
                StatusCode::UNAUTHORIZED => "authentication_error",
                StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                _ => "invalid_request_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    };
    json_response(status, &body)
}

fn json_response(status: StatusCode, body: &Value) -> Response<OriginBody> {
    let bytes = Bytes::from(serde_json::to_vec(body).unwrap());
    let mut response = Response::new(Full::new(bytes).map_err(|e| match e {}).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    response
}

fn respond(call: &Call) -> Response<OriginBody> {
    if !call.stream {
        let body = match call.api {
            Api::Chat => shapes::chat(call),
            Api::Responses => shapes::response(call, true),
            Api::Messages => shapes::message(call),
        };
        return json_response(StatusCode::OK, &body);
    }
    let events = match call.api {
        Api::Chat => shapes::chat_events(call),
        Api::Responses => shapes::response_events(call),
        Api::Messages => shapes::message_events(call),
    };
    let mut frames: Vec<_> = events
        .into_iter()
        .map(|event| Ok::<_, BoxError>(Frame::data(Bytes::from(event))))
        .collect();
    let rest = frames.split_off(match call.hold {
        Some(_) => frames.len() / 2,
        None => frames.len(),
    });
    let gate = call.hold.clone();
    let wait = futures_util::stream::once(async move {
        if let Some(mut gate) = gate {
            let _ = gate.wait_for(|open| *open).await;
        }
    })
    .filter_map(|()| async { None });
    let events = futures_util::stream::iter(frames)
        .chain(wait)
        .chain(futures_util::stream::iter(rest));
    let body = StreamBody::new(events);
    let mut response = Response::new(BodyExt::boxed(body));
    let headers = response.headers_mut();
    headers.insert(
        "content-type",
        "text/event-stream; charset=utf-8".parse().unwrap(),
    );
    headers.insert("cache-control", "no-cache".parse().unwrap());
    response
}
