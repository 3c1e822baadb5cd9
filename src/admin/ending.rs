//! `POST /leases/{id}/complete` and `POST /leases/{id}/stop`: a lease ended by its issuer (or
//! by its own agent), with the usage the proxy measured.
//!
//! Invariant: a lease ends once (a second ending, or one after a revocation, writes nothing
//! and says what closed it); `completed` carries only what was measured (an unmeasured field
//! is absent, never zero); the lease's tunnels close before the answer, as a revocation's do.

use super::{error, json_response, read_body, AdminState, SMALL_BODY};
use crate::budget::LeaseSpending;
use crate::contract::record::Usage;
use crate::contract::Event;
use crate::proxy::Body;
use crate::registry::revocation::RevocationError;
use crate::registry::RevokeError;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Value};

/// What `completed` says a lease used: its subtree's metered model calls (what its budget
/// counts), tokens once any call was made, cost once every call was priced. A lease with no
/// metered call has nothing measured.
pub fn measured(spending: &LeaseSpending) -> Option<Usage> {
    let spent = spending.subtree;
    if spent.calls == 0 {
        return None;
    }
    Some(Usage {
        tokens: Some(spent.tokens),
        cost_usd: (spent.unpriced == 0).then_some(spent.cost_usd),
    })
}

/// `POST /leases/{id}/complete` (`event` completed) or `/stop` (stopped). The body is optional:
/// `{"reason": "..."}`.
pub async fn end(
    state: &AdminState,
    id: &str,
    event: Event,
    req: Request<Incoming>,
) -> Response<Body> {
    let body = match read_body(req, SMALL_BODY).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let reason = match body.is_empty() {
        true => None,
        false => match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(o)) => match o.get("reason") {
                None | Some(Value::Null) => None,
                Some(Value::String(r)) if !r.trim().is_empty() => Some(r.clone()),
                Some(_) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "\"reason\" must be a non-empty string",
                    )
                }
            },
            Ok(_) => return error(StatusCode::BAD_REQUEST, "the body must be a JSON object"),
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("body is not JSON: {e}")),
        },
    };
    // `stopped` needs a reason (the contract's rule); `completed` takes one if given.
    let reason = match (event, reason) {
        (Event::Stopped, None) => Some("stopped through the admin API".to_owned()),
        (_, reason) => reason,
    };
    let usage = match event {
        Event::Completed => measured(&state.proxy.telemetry.spending.of(id)),
        _ => None,
    };
    let registry = &state.proxy.registry;
    let done = event.as_str();
    match registry.end(id, event, reason.as_deref(), usage).await {
        Ok(true) => json_response(StatusCode::OK, answer(id, done, usage)),
        Ok(false) => {
            let closed = registry.snapshot().ledger.closed(id, registry.now());
            let mut body = json!({
                "error": format!("lease {id} is already closed: nothing was written"),
                "closed": closed,
            });
            body[done] = false.into();
            json_response(StatusCode::CONFLICT, body)
        }
        Err(RevokeError::Revocation(RevocationError::Unknown(_))) => {
            error(StatusCode::NOT_FOUND, format!("no lease {id}"))
        }
        Err(e) if e.revoked_in_memory() => {
            let mut body = answer(id, done, usage);
            body["queued"] = true.into();
            body["error"] = e.to_string().into();
            json_response(StatusCode::ACCEPTED, body)
        }
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn answer(id: &str, done: &str, usage: Option<Usage>) -> Value {
    let mut body = json!({"lease_id": id});
    body[done] = true.into();
    if done == "completed" {
        let usage = usage.unwrap_or_default();
        let mut measured = serde_json::Map::new();
        if let Some(tokens) = usage.tokens {
            measured.insert("tokens".into(), tokens.into());
        }
        if let Some(cost) = usage.cost_usd {
            measured.insert("cost_usd".into(), json!(cost));
        }
        body["usage"] = Value::Object(measured);
    }
    body
}
