//! `POST /leases`: a lease issued through the admin API, answered with everything an agent
//! needs to run under it.
//!
//! Invariant: the answer comes only after the grant is folded (so a request or a `run` right
//! after it is served); a credential goes only to the caller that asked (the operator, or the
//! parent lease's own token); the body is read within [`MAX_BODY`] bytes and
//! the admin API's body timeout (10 s), and a caller over its rate is answered 429 before anything is
//! read or written.

use super::caller::Caller;
use super::{error, json_response, lease_view, read_body, AdminState};
use crate::contract::lease::lease_id;
use crate::contract::narrow::Refusal;
use crate::contract::Timestamp;
use crate::intercept::ca::{BUNDLE_VARS, CA_VAR};
use crate::intercept::Broker;
use crate::issuer::{Ends, IssueError, Issued, Issuer, Outcome, Request as IssueRequest};
use crate::proxy::Body;
use http::{header, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{json, Map, Value};
use std::time::Duration;

/// The largest `POST /leases` body: a manifest of several thousand hosts fits.
pub const MAX_BODY: usize = 256 * 1024;

/// The longest `Idempotency-Key`.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The lifetime of a root lease that asks for none (a child that asks for none ends with its
/// parent).
pub const DEFAULT_LIFETIME: Duration = Duration::from_secs(3600);

/// How long a lease's own port may take to open after its grant is folded.
const PORT_WAIT: Duration = Duration::from_secs(2);

/// The members a `POST /leases` body may have.
const MEMBERS: [&str; 4] = [
    "manifest",
    "parent_lease_id",
    "lifetime_seconds",
    "expires_at",
];

/// The issuance `body` asks for, or why it is not one (400).
pub fn parse(
    body: &[u8],
    idempotency_key: Option<&str>,
    issuer: Issuer,
) -> Result<IssueRequest, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Some(object) = value.as_object() else {
        return Err("the body must be a JSON object: {\"manifest\": {...}, ...}".into());
    };
    if let Some(unknown) = object.keys().find(|k| !MEMBERS.contains(&k.as_str())) {
        return Err(format!(
            "unknown member {unknown:?}: a body has {} (the manifest's own members go inside \
             \"manifest\")",
            MEMBERS.join(", ")
        ));
    }
    let manifest = match object.get("manifest") {
        Some(m @ Value::Object(_)) => m.clone(),
        Some(_) => return Err("\"manifest\" must be an object".into()),
        None => return Err("the body needs a \"manifest\" (the declared manifest)".into()),
    };
    let parent = match object.get("parent_lease_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(lease_id(id).map_err(|e| format!("parent_lease_id {e}"))?),
        Some(_) => return Err("\"parent_lease_id\" must be a lease id".into()),
    };
    let ends = match (object.get("lifetime_seconds"), object.get("expires_at")) {
        (Some(_), Some(_)) => {
            return Err("give \"lifetime_seconds\" or \"expires_at\", not both".into())
        }
        (Some(seconds), None) => {
            let seconds = seconds
                .as_f64()
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= 10.0 * 365.0 * 86400.0)
                .ok_or(
                    "\"lifetime_seconds\" must be a number of seconds above 0 (at most ten years)",
                )?;
            Ends::After(Duration::from_secs_f64(seconds))
        }
        (None, Some(at)) => Ends::At(
            at.as_str()
                .and_then(|t| Timestamp::parse_lenient(t).ok())
                .ok_or("\"expires_at\" must be a UTC time like 2026-01-01T10:00:00.000Z")?,
        ),
        (None, None) => Ends::Unasked(DEFAULT_LIFETIME),
    };
    let idempotency_key = match idempotency_key {
        None => None,
        Some(key)
            if !key.is_empty()
                && key.len() <= MAX_IDEMPOTENCY_KEY
                && key.bytes().all(|b| b.is_ascii_graphic()) =>
        {
            Some(key.to_owned())
        }
        Some(_) => {
            return Err(format!(
                "Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} visible ASCII characters"
            ))
        }
    };
    Ok(IssueRequest {
        manifest,
        parent,
        ends,
        idempotency_key,
        issuer,
    })
}

/// `POST /leases`.
pub async fn issue(state: &AdminState, caller: &Caller, req: Request<Incoming>) -> Response<Body> {
    let issuer = match caller {
        Caller::Operator | Caller::Anyone => Issuer::Operator,
        Caller::Lease(id) => Issuer::Lease(id.clone()),
    };
    let scope = match &issuer {
        Issuer::Operator => "operator".to_owned(),
        Issuer::Lease(id) => id.clone(),
    };
    if let Err(wait) = state.authority.rate.take(&scope) {
        state.authority.count(Outcome::RateLimited);
        let mut response = error(
            StatusCode::TOO_MANY_REQUESTS,
            format!(
                "this caller issues at most {} leases a second (--max-issue-rate): try again \
                 in {} ms",
                state.authority.rate.per_second(),
                wait.as_millis().max(1)
            ),
        );
        let seconds = wait.as_secs() + 1;
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(seconds));
        return response;
    }
    let key = match req.headers().get("idempotency-key").map(|v| v.to_str()) {
        None => None,
        Some(Ok(text)) => Some(text.to_owned()),
        Some(Err(_)) => {
            state.authority.count(Outcome::Rejected);
            return error(
                StatusCode::BAD_REQUEST,
                "Idempotency-Key must be visible ASCII",
            );
        }
    };
    let body = match read_body(req, MAX_BODY).await {
        Ok(body) => body,
        Err(answer) => {
            state.authority.count(Outcome::Rejected);
            return answer;
        }
    };
    let request = match parse(&body, key.as_deref(), issuer) {
        Ok(request) => request,
        Err(message) => {
            state.authority.count(Outcome::Rejected);
            return error(StatusCode::BAD_REQUEST, message);
        }
    };
    let issued = state
        .authority
        .issue(
            &state.proxy.registry,
            &state.proxy.telemetry.spending,
            request,
        )
        .await;
    state.authority.count(Outcome::of(&issued));
    match issued {
        Ok(issued) => granted(state, issued).await,
        Err(e) => refused(e),
    }
}

/// 201 (200 for a replay): the lease, its credential, where its proxy is and what an agent's
/// environment needs.
async fn granted(state: &AdminState, issued: Issued) -> Response<Body> {
    let id = issued.lease.id.clone();
    if let Some(ports) = &state.ports {
        // A lease's own port opens as the port keeper sees the fold: within moments.
        let deadline = tokio::time::Instant::now() + PORT_WAIT;
        while ports.port_of(&id).is_none() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    let now = state.proxy.registry.now();
    // The caller asked for it: the operator, or the parent's own token.
    let Some(view) = lease_view(state, &id, now, 0, true) else {
        let mut response = error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("lease {id} was granted but is not in the registry any more"),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        return response;
    };
    let snapshot = state.proxy.registry.snapshot();
    let token = snapshot
        .ledger
        .signing_key(&id)
        .map(|key| crate::contract::token::mint(key, &id));
    let credential = match state.proxy.config.credentials {
        crate::config::Credentials::Id => Some(id.clone()),
        crate::config::Credentials::Token => token.clone(),
    };
    let proxy_url = view["proxy_url"].clone();
    let mut env = Map::new();
    for var in [
        "HTTPS_PROXY",
        "HTTP_PROXY",
        "ALL_PROXY",
        "https_proxy",
        "http_proxy",
        "all_proxy",
    ] {
        env.insert(var.into(), proxy_url.clone());
    }
    // Nothing goes around the proxy.
    env.insert("NO_PROXY".into(), "".into());
    env.insert("no_proxy".into(), "".into());
    let (ca, placeholders) = match (&state.proxy.broker, snapshot.ledger.signing_key(&id)) {
        (Some(broker), Some(key)) => {
            let set = broker.secrets.current();
            let placeholders = Broker::placeholders(&set, &issued.lease, key);
            for p in &placeholders {
                env.insert(p.env.clone(), p.value.clone().into());
            }
            let mut files = Map::new();
            for var in BUNDLE_VARS {
                files.insert(var.into(), "bundle".into());
            }
            files.insert(CA_VAR.into(), "ca".into());
            (
                json!({"pem": broker.ca_pem(), "variables": files}),
                serde_json::to_value(&placeholders).unwrap_or_default(),
            )
        }
        _ => (Value::Null, json!([])),
    };
    let status = match issued.replayed {
        true => StatusCode::OK,
        false => StatusCode::CREATED,
    };
    json_response(
        status,
        json!({
            "lease_id": id,
            "parent_lease_id": issued.lease.parent,
            "credential": credential,
            "token": token,
            "credentials": view["credentials"],
            "issued_at": issued.lease.issued_at,
            "expires_at": issued.lease.expires_at,
            "proxy_url": proxy_url,
            "port": view["port"],
            "env": env,
            "ca": ca,
            "placeholders": placeholders,
            "manifest": issued.manifest,
            "narrowed": issued.narrowed,
            "replayed": issued.replayed,
        }),
    )
}

/// The answer for a lease not granted.
fn refused(e: IssueError) -> Response<Body> {
    let status = match &e {
        IssueError::BadRequest(_) => StatusCode::BAD_REQUEST,
        IssueError::Forbidden(_) => StatusCode::FORBIDDEN,
        IssueError::Refused { refused, .. } => match refused.kind {
            Refusal::Declaration => StatusCode::UNPROCESSABLE_ENTITY,
            Refusal::Parent
                if refused
                    .reasons
                    .iter()
                    .any(|r| r == "runtime_error:parent_unknown") =>
            {
                StatusCode::NOT_FOUND
            }
            Refusal::Parent
                if refused
                    .reasons
                    .iter()
                    .any(|r| r == "runtime_error:budget_unknown") =>
            {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Refusal::Parent => StatusCode::CONFLICT,
        },
        IssueError::KeyReused(_) => StatusCode::UNPROCESSABLE_ENTITY,
        IssueError::KeyClosed { .. } => StatusCode::CONFLICT,
        IssueError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        IssueError::Journal(_) => StatusCode::SERVICE_UNAVAILABLE,
        IssueError::NoKey(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let mut body = json!({"error": e.to_string()});
    if let IssueError::Refused {
        refused,
        refusal_id,
        recorded,
    } = &e
    {
        body["reasons"] = refused.reasons.clone().into();
        body["refusal_id"] = refusal_id.as_str().into();
        body["recorded"] = (*recorded).into();
    }
    let mut response = json_response(status, body);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    response
}
