//! Revocation on refusal: what a revoking refusal writes to the journal about itself.
//!
//! Invariant: the `revoked` record of a refusal names method, target and code in its `reason`
//! and carries the same facts in an `egress` object; it goes through [`Registry::revoke`], the
//! one revoke path, so it is signed under the lease's own key and applied once.

use super::live::{Registry, RevokeError};
use crate::policy::refusal::Refusal;
use crate::policy::Target;
use serde_json::{json, Map};
use std::net::SocketAddr;

/// The facts of one refused request, as its revocation records them.
pub struct RefusedEgress<'a> {
    pub method: &'a str,
    /// The normalised target, when the request got that far.
    pub target: Option<&'a Target>,
    /// The target as the refusal names it (the raw authority when it did not parse).
    pub shown_target: String,
    pub refusal: &'a Refusal,
    pub client: SocketAddr,
    pub listener: SocketAddr,
}

impl Registry {
    /// Revokes `lease_id` for a refusal. Returns `false` if it already was revoked.
    pub async fn revoke_for_refusal(
        &self,
        lease_id: &str,
        egress: &RefusedEgress<'_>,
    ) -> Result<bool, RevokeError> {
        let refusal = egress.refusal;
        let mut extra = Map::new();
        extra.insert(
            "egress".into(),
            json!({
                "method": egress.method,
                "host": egress.target.map(|t| t.host.as_text()),
                "port": egress.target.map(|t| t.port),
                "code": refusal.code.as_str(),
                "detail": refusal.detail,
                "client": egress.client.to_string(),
                "listener": egress.listener.to_string(),
            }),
        );
        let reason = format!(
            "leasegate refused {} {}: {} ({})",
            egress.method, egress.shown_target, refusal.code, refusal.detail
        );
        self.revoke(lease_id, &reason, extra).await
    }
}
