//! Model calls inside terminated tunnels: the budget check before a call to a metered host
//! goes out, and the tap that reads the call's usage from its response as it is relayed, then
//! charges it to the lease's chain and puts it on the egress line.
//!
//! Invariants: the tap only reads — every byte goes to the client as it came, when it came; a
//! call is charged exactly once, when its exchange ends (whole, cut or dropped), and one whose
//! usage could not be read is charged as unmetered, never as zero tokens.

use crate::budget::{Ceilings, Charge, Spending};
use crate::contract::Lease;
use crate::meter::prices::Prices;
use crate::meter::{Api, Meter, Reading};
use crate::policy::codes::Refusal;
use crate::telemetry::egress::ModelCall;
use http::header::{HeaderValue, ACCEPT_ENCODING};
use std::sync::Arc;

/// The ceilings of a lease's budget that model calls spend.
pub fn ceilings(lease: &Lease) -> Ceilings {
    lease
        .budget
        .as_deref()
        .map(|b| Ceilings {
            tokens: b.tokens,
            cost_usd: b.cost_usd,
        })
        .unwrap_or_default()
}

/// Whether a new model call under `chain` (the lease first) may go.
pub fn check(spending: &Spending, chain: &[Arc<Lease>]) -> Result<(), Refusal> {
    spending
        .check(
            chain
                .iter()
                .map(|lease| (lease.id.as_str(), ceilings(lease))),
        )
        .map_err(|exhausted| exhausted.refusal())
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
    /// The lease first, then its ancestors: who the call is charged to.
    chain: Vec<Arc<str>>,
    spending: Arc<Spending>,
    prices: Option<Arc<Prices>>,
    /// The response's status, once its head came.
    status: Option<http::StatusCode>,
}

impl std::fmt::Debug for Tap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tap")
            .field("api", &self.api)
            .field("chain", &self.chain)
            .finish_non_exhaustive()
    }
}

impl Tap {
    pub fn new(
        api: Api,
        meter: Meter,
        chain: &[Arc<Lease>],
        spending: Arc<Spending>,
        prices: Option<Arc<Prices>>,
    ) -> Tap {
        Tap {
            api,
            meter,
            chain: chain
                .iter()
                .map(|lease| Arc::from(lease.id.as_str()))
                .collect(),
            spending,
            prices,
            status: None,
        }
    }

    /// The response head, before any of its body.
    pub fn head(&mut self, status: http::StatusCode, headers: &http::HeaderMap) {
        self.status = Some(status);
        self.meter.head(status, headers);
    }

    /// A chunk of the response body, as relayed.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.meter.feed(chunk);
    }

    /// The response ended (or was cut, or never came): the call is charged, and its line's
    /// `model` object returned.
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
        };
        let call = match self.meter.finish() {
            // An error answer spends nothing: a call of no tokens, costing nothing.
            Reading::Unmetered { model, .. } if answered_in_error => {
                metered(model, 0, 0, 0, Some(0.0))
            }
            Reading::Metered(usage) => {
                let cost = self.prices.as_ref().and_then(|p| p.cost(&usage));
                metered(usage.model, usage.input, usage.output, usage.cached, cost)
            }
            Reading::Unmetered { model, reason } => ModelCall {
                api,
                name: model,
                input_tokens: None,
                output_tokens: None,
                cached_tokens: None,
                cost_usd: None,
                unpriced: None,
                unmetered: Some(reason),
            },
        };
        self.spending
            .charge(self.chain.iter().map(|id| &**id), &Charge::of_call(&call));
        call
    }
}

/// The API's name as the egress line spells it.
pub fn api_name(api: Api) -> &'static str {
    match api {
        Api::OpenAi => "openai",
        Api::Anthropic => "anthropic",
    }
}
