//! `GET /approvals`, `GET /approvals/{id}` and `POST /approvals/{id}`: the calls waiting for a
//! human, and their decisions.
//!
//! Invariant: only the operator (the configured admin token) decides — a lease's own token is
//! refused like on every route not its lease's, and without an admin token configured nobody
//! can decide, since the agent could reach the API too; a decision body is read one way or
//! refused ([`asked`]), and the answer says the decision only once it is read back from the
//! store as the request's first.

use super::caller::Caller;
use super::query::{limit_of, query_pairs};
use super::{error, json_response, read_body, AdminState, SMALL_BODY};
use crate::approvals::book::{self, Outcome, Scope};
use crate::approvals::DecideError;
use crate::proxy::Body;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::json;

/// Requests `GET /approvals` answers at most.
pub const MAX_LIST: usize = 500;

/// What a `POST /approvals/{id}` asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    pub outcome: Outcome,
    pub scope: Scope,
    pub reason: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    decision: String,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default, rename = "for")]
    scope: Option<String>,
}

/// Reads a decision's body: `{"decision": "approve"|"deny", "reason": "...", "for":
/// "call"|"lease"}` (`for` only with approve; a denial needs a reason).
pub fn asked(body: &[u8]) -> Result<Asked, String> {
    let body: DecisionBody = serde_json::from_slice(body).map_err(|e| {
        format!(
            "the body is {{\"decision\": \"approve\" or \"deny\", \"reason\": \"...\", \
             \"for\": \"call\" or \"lease\"}}: {e}"
        )
    })?;
    let reason = body.reason.unwrap_or_default();
    if reason.chars().count() > book::REASON_MAX {
        return Err(format!(
            "reason is longer than {} characters",
            book::REASON_MAX
        ));
    }
    let outcome = match body.decision.as_str() {
        "approve" => Outcome::Approved,
        "deny" => Outcome::Denied,
        other => return Err(format!("decision {other:?} is neither approve nor deny")),
    };
    let scope = match (body.scope.as_deref(), outcome) {
        (None | Some("call"), _) => Scope::Once,
        (Some("lease"), Outcome::Approved) => Scope::Lease,
        (Some("lease"), _) => return Err("for: lease goes with approve only".to_owned()),
        (Some(other), _) => return Err(format!("for {other:?} is neither call nor lease")),
    };
    if outcome == Outcome::Denied && reason.trim().is_empty() {
        return Err("a denial needs a reason: the agent is told it".to_owned());
    }
    Ok(Asked {
        outcome,
        scope,
        reason: match reason.trim().is_empty() {
            true => "approved".to_owned(),
            false => reason,
        },
    })
}

/// `GET /approvals?status=pending|all&limit=N`, newest first.
pub fn list(state: &AdminState, query: Option<&str>) -> Response<Body> {
    let pairs = match query_pairs(query, &["status", "limit"]) {
        Ok(pairs) => pairs,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let limit = match limit_of(&pairs, 100, MAX_LIST) {
        Ok(limit) => limit,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let pending_only = match pairs.iter().find(|(k, _)| k == "status") {
        None => true,
        Some((_, v)) if v == "pending" => true,
        Some((_, v)) if v == "all" => false,
        Some((_, v)) => {
            return error(
                StatusCode::BAD_REQUEST,
                format!("status {v:?} is neither pending nor all"),
            )
        }
    };
    let approvals = &state.proxy.approvals;
    json_response(
        StatusCode::OK,
        json!({
            "approvals": approvals.list(pending_only, limit),
            "store": approvals.describe(),
            "held_here": approvals.held_now(),
        }),
    )
}

/// `GET /approvals/{id}`.
pub fn one(state: &AdminState, id: &str) -> Response<Body> {
    if !book::is_id(id) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("{id:?} is not an approval id (apr- and 32 hex digits)"),
        );
    }
    match state.proxy.approvals.view(id) {
        Some(view) => json_response(StatusCode::OK, view),
        None => error(StatusCode::NOT_FOUND, format!("no approval {id}")),
    }
}

/// `POST /approvals/{id}`: approve or deny.
pub async fn decide(
    state: &AdminState,
    caller: &Caller,
    id: &str,
    req: Request<Incoming>,
) -> Response<Body> {
    if *caller != Caller::Operator {
        return error(
            StatusCode::FORBIDDEN,
            "deciding an approval needs the admin token (serve --admin-token-file): without one, \
             the agent itself could approve its own calls",
        );
    }
    if !book::is_id(id) {
        return error(
            StatusCode::BAD_REQUEST,
            format!("{id:?} is not an approval id (apr- and 32 hex digits)"),
        );
    }
    let body = match read_body(req, SMALL_BODY).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let asked = match asked(&body) {
        Ok(asked) => asked,
        Err(message) => return error(StatusCode::BAD_REQUEST, message),
    };
    let approvals = &state.proxy.approvals;
    match approvals
        .decide(id, asked.outcome, asked.scope, &asked.reason)
        .await
    {
        Ok(_) => json_response(
            StatusCode::OK,
            approvals.view(id).unwrap_or_else(|| json!({"id": id})),
        ),
        Err(DecideError::Unknown(_)) => error(StatusCode::NOT_FOUND, format!("no approval {id}")),
        Err(e @ (DecideError::Decided(_) | DecideError::PastDeadline(_))) => {
            let mut answer = json!({"error": e.to_string()});
            if let Some(view) = approvals.view(id) {
                answer["approval"] = view;
            }
            json_response(StatusCode::CONFLICT, answer)
        }
        Err(e @ DecideError::NoStore) => error(StatusCode::NOT_FOUND, e.to_string()),
        Err(e @ DecideError::NoKey(_)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e @ (DecideError::Store(_) | DecideError::NotReadBack)) => {
            let mut answer = error(StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            answer.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
            answer
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_body_reads_one_way() {
        let ok = |body: &str| asked(body.as_bytes()).unwrap();
        assert_eq!(
            ok(r#"{"decision":"approve"}"#),
            Asked {
                outcome: Outcome::Approved,
                scope: Scope::Once,
                reason: "approved".to_owned()
            }
        );
        assert_eq!(
            ok(r#"{"decision":"approve","for":"lease"}"#).scope,
            Scope::Lease
        );
        assert_eq!(
            ok(r#"{"decision":"deny","reason":"not today"}"#).outcome,
            Outcome::Denied
        );
        for bad in [
            r#"{"decision":"deny"}"#,
            r#"{"decision":"deny","reason":"  "}"#,
            r#"{"decision":"deny","reason":"x","for":"lease"}"#,
            r#"{"decision":"approve","decision":"deny","reason":"x"}"#,
            r#"{"decision":"maybe"}"#,
            r#"{"decision":"approve","for":"ever"}"#,
            r#"{"decision":"approve","extra":1}"#,
            r#"{"decision":"approve","reason":1}"#,
            "",
            "[]",
        ] {
            assert!(asked(bad.as_bytes()).is_err(), "{bad}");
        }
        let long = format!(r#"{{"decision":"approve","reason":"{}"}}"#, "x".repeat(501));
        assert!(asked(long.as_bytes()).is_err());
    }
}
