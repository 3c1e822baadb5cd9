//! `GET /leases/{id}/placeholders`: the stand-ins a lease's agent holds for the secrets it is
//! entitled to (with the variable each goes in), and the interception CA its clients must
//! trust.
//!
//! Invariant: answered only to a caller that presented the admin token or the lease's own
//! proxy token (the rule that shows credentials in lease views: a placeholder is the lease's
//! credential for a secret); the
//! answer holds secret ids, variable names, placeholders and the CA's certificate, never a
//! secret's value.

use super::{error, json_response, AdminState};
use crate::intercept::Broker;
use crate::proxy::Body;
use http::{Response, StatusCode};
use serde_json::json;

/// The answer for lease `id`; `authenticated`: the caller presented the admin token or this
/// lease's proxy token.
pub fn placeholders(state: &AdminState, id: &str, authenticated: bool) -> Response<Body> {
    if !authenticated {
        return error(
            StatusCode::FORBIDDEN,
            "a lease's placeholders are shown only to a caller with the admin token or the \
             lease's own proxy token: send Authorization: Bearer <token> (`leasegate token` \
             mints a lease's)",
        );
    }
    let snapshot = state.proxy.registry.snapshot();
    let Some(lease) = snapshot.ledger.lease(id) else {
        return error(StatusCode::NOT_FOUND, format!("no lease {id}"));
    };
    let Some(broker) = &state.proxy.broker else {
        return json_response(
            StatusCode::OK,
            json!({"lease": id, "placeholders": [], "ca": null}),
        );
    };
    // The key the lease is signed with derives its placeholders (as the proxy will check them).
    let Some(key) = snapshot.ledger.signing_key(id) else {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the signing key of lease {id} is not in the proxy's keyring"),
        );
    };
    let set = broker.secrets.current();
    json_response(
        StatusCode::OK,
        json!({
            "lease": id,
            "placeholders": Broker::placeholders(&set, lease, key),
            "ca": broker.ca_pem(),
        }),
    )
}
