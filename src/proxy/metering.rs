//! Model calls inside terminated tunnels: the request read whole before a call to a metered
//! host goes out (its bound, and usage asked for where the API can be asked), the budget
//! reservation of that bound, and the tap that reads the call's usage from its response as it
//! is relayed, then settles the reservation and puts the call on the egress line.
//!
//! Invariants: the tap only reads — every byte goes to the client as it came, when it came —
//! but for one cut: a streamed answer during which its chain's spending reached a ceiling (the
//! other replicas' calls, or this one's that ended) ends at its next event boundary with the
//! API's own error event, so its SDK raises; a call is charged exactly once, when its exchange
//! ends (whole, cut or dropped); one whose usage could not be read — a cut one included — is
//! charged its bound, and counted unmetered, never as zero tokens.

use crate::budget::{Bound, Ceilings, Charge, Exhausted, Reservation, Spending};
use crate::contract::Lease;
use crate::meter::prices::Prices;
use crate::meter::request::CallRequest;
use crate::meter::{Api, Meter, Reading, Usage};
use crate::policy::codes::{Code, Refusal};
use crate::telemetry::egress::ModelCall;
use http::header::{HeaderValue, ACCEPT_ENCODING};
use std::sync::Arc;

/// The ceilings of a lease's budget that model calls spend.
pub fn ceilings(lease: &Lease) -> Ceilings {
    Ceilings::of(lease)
}

/// The most a call may spend: its request's output cap (or `default_output`), and as input
/// the request's size in bytes (no token is shorter than a byte of the text it encodes),
/// priced when its model is.
pub fn bound(
    request: &CallRequest,
    body_len: usize,
    default_output: u64,
    prices: Option<&Prices>,
) -> Bound {
    let input_tokens = body_len as u64;
    let output_tokens = request.output_cap.unwrap_or(default_output);
    let usage = Usage {
        model: request.model.clone(),
        input: input_tokens,
        output: output_tokens,
        cached: 0,
    };
    Bound {
        input_tokens,
        output_tokens,
        cost_usd: prices.and_then(|p| p.cost(&usage)),
        tool_calls: 0,
    }
}

/// Admits a new model call under `chain` (the lease first) and reserves its bound, or the
/// `budget-exhausted` refusal.
pub async fn reserve(
    spending: &Arc<Spending>,
    chain: &[Arc<Lease>],
    bound: Bound,
) -> Result<Reservation, Refusal> {
    let chain: Vec<(Arc<str>, Ceilings)> = chain
        .iter()
        .map(|lease| (Arc::from(lease.id.as_str()), ceilings(lease)))
        .collect();
    spending
        .reserve(&chain, bound)
        .await
        .map_err(|exhausted: Exhausted| exhausted.refusal())
}

/// Asks the origin for an uncompressed answer: the meter reads plain bytes (an answer that
/// comes compressed anyway is counted unmetered).
pub fn ask_identity(headers: &mut http::HeaderMap) {
    headers.insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
}

/// One metered call's response, being read.
pub struct Tap {
    api: Api,
    meter: Meter,
    /// The call's reservation: settled when the tap finishes (charged its bound if the tap is
    /// dropped instead).
    reservation: Reservation,
    prices: Option<Arc<Prices>>,
    /// The response's status, once its head came.
    status: Option<http::StatusCode>,
    /// The answer is an event stream (one that can be cut at an event's end).
    streamed: bool,
    /// The ceiling the chain reached while the answer was relayed: it is cut at the next
    /// event boundary.
    crossed: Option<Exhausted>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap")
            .field("api", &self.api)
            .field("reservation", &self.reservation)
            .finish_non_exhaustive()
    }
}

impl Tap {
    pub fn new(
        api: Api,
        meter: Meter,
        reservation: Reservation,
        prices: Option<Arc<Prices>>,
    ) -> Tap {
        Tap {
            api,
            meter,
            reservation,
            prices,
            status: None,
            streamed: false,
            crossed: None,
        }
    }

    /// The call never went out (its upstream was never reached): nothing is charged.
    pub fn release(self) {
        self.reservation.release();
    }

    /// The response head, before any of its body.
    pub fn head(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        self.status = Some(status);
        self.streamed = status.is_success()
            && headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| {
                    v.trim_start()
                        .to_ascii_lowercase()
                        .starts_with("text/event-stream")
                });
        self.meter.head(status, headers);
    }

    /// After `chunk` was fed: when the chain's budget has been crossed while this streamed
    /// answer is relayed, how much of `chunk` still goes (up to its last event boundary), the
    /// API's error event that ends the stream, and why. `None`: relay on (a chunk without an
    /// event boundary is relayed whole, and the cut waits for one).
    pub fn cut(&mut self, chunk: &[u8]) -> Option<(usize, bytes::Bytes, String)> {
        if !self.streamed {
            return None;
        }
        if self.crossed.is_none() {
            self.crossed = self.reservation.crossed();
        }
        let detail = self.crossed.as_ref()?.refusal().detail;
        let at = event_boundary(chunk)?;
        Some((at, error_event(self.api, &detail), detail))
    }

    /// A chunk of the response body, as relayed.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.meter.feed(chunk);
    }

    /// The response ended (or was cut, or never came): the call is charged — what its usage
    /// says, or its bound — and its line's `model` object returned.
    pub fn finish(self) -> ModelCall {
        let api = api_name(self.api);
        let answered_in_error = self.status.is_some_and(|s| !s.is_success());
        let metered = |name, input, output, cached, cost: Option<f64>| ModelCall {
            api,
            name,
            input_tokens: Some(input),
            output_tokens: Some(output),
            cached_tokens: Some(cached),
            cost_usd: Some(cost),
            unpriced: cost.is_none().then_some(true),
            unmetered: None,
            charged_tokens: None,
            charged_cost_usd: None,
        };
        let bound = self.reservation.bound();
        let call = match self.meter.finish() {
            // An error answer spends nothing: a call of no tokens, costing nothing.
            Reading::Unmetered { model, .. } if answered_in_error => {
                metered(model, 0, 0, 0, Some(0.0))
            }
            Reading::Metered(usage) => {
                // An answer naming a model the table does not price, to a request naming one
                // it does (an alias resolved), costs the request's bound: never nothing.
                let cost = self
                    .prices
                    .as_ref()
                    .and_then(|p| p.cost(&usage))
                    .or(bound.cost_usd);
                metered(usage.model, usage.input, usage.output, usage.cached, cost)
            }
            // Unread (cut, hung up on, never answered, compressed): charged its bound.
            Reading::Unmetered { model, reason } => ModelCall {
                api,
                name: model,
                input_tokens: None,
                output_tokens: None,
                cached_tokens: None,
                cost_usd: None,
                unpriced: None,
                unmetered: Some(reason),
                charged_tokens: Some(bound.tokens()),
                charged_cost_usd: bound.cost_usd,
            },
        };
        self.reservation.settle(Charge::of_call(&call));
        call
    }
}

/// Just after the last event of `chunk` that ends in it (a blank line), if one does.
fn event_boundary(chunk: &[u8]) -> Option<usize> {
    let lf = chunk.windows(2).rposition(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = chunk
        .windows(4)
        .rposition(|w| w == b"\r\n\r\n")
        .map(|i| i + 4);
    lf.max(crlf)
}

/// The event a stream cut for its budget ends with, as the API writes its own errors: OpenAI's
/// SDK raises `APIError` on a data event holding `error`, Anthropic's on an `error` event.
fn error_event(api: Api, detail: &str) -> bytes::Bytes {
    let message = format!("leasegate cut this stream: budget-exhausted ({detail})");
    let data = error_json(api, Code::BudgetExhausted, &message);
    let event = match api {
        Api::OpenAi => format!("data: {data}\n\n"),
        Api::Anthropic => format!("event: error\ndata: {data}\n\n"),
    };
    bytes::Bytes::from(event)
}

/// An error as `api` writes its own, naming `code` and saying `message`: what the SDK's
/// exception shows (OpenAI's takes `error.message`, Anthropic's too).
pub fn error_json(api: Api, code: Code, message: &str) -> serde_json::Value {
    let kind = code.as_str().replace('-', "_");
    match api {
        Api::OpenAi => serde_json::json!({"error": {"message": message, "type": kind,
            "param": null, "code": code.as_str()}}),
        Api::Anthropic => {
            serde_json::json!({"type": "error", "error": {"type": kind, "message": message}})
        }
    }
}

/// The API's name as the egress line spells it.
pub fn api_name(api: Api) -> &'static str {
    match api {
        Api::OpenAi => "openai",
        Api::Anthropic => "anthropic",
    }
}
