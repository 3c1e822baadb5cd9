//! Requests held for a human: a request a route of its chain's `approvals` takes
//! ([`crate::approvals::route`]) waits, unsent, until it is approved, denied or its time is up.
//!
//! Invariant: called after the request's body start is read and before anything of it reaches
//! the origin, a step or a budget; a request goes on only with the approval
//! [`crate::approvals::Approvals::hold`] returns, written on its egress line, and a path the
//! chain names routes for that origins read differently is refused, never let by.

use super::decision::Decision;
use super::exchange::Exchange;
use super::Proxy;
use crate::approvals::{route, Call};
use crate::policy::codes::{Code, Refusal};
use crate::policy::path;
use tokio_util::sync::CancellationToken;

/// What of a request a human deciding on it is shown.
pub struct Shown<'a> {
    /// `https` or `http`.
    pub scheme: &'a str,
    /// The request's target as logged (query values redacted where secrets are configured).
    pub target: &'a str,
    /// The body's start, as read ahead.
    pub body: &'a [u8],
}

/// Holds a request (`method`, `uri`) of `decision`'s lease while a route its chain names
/// takes it.
pub async fn route(
    proxy: &Proxy,
    decision: &Decision,
    (method, uri): (&http::Method, &http::Uri),
    shown: Shown<'_>,
    lease_closed: &CancellationToken,
    ex: &mut Exchange,
) -> Result<(), Refusal> {
    let chain = &decision.chain;
    let host = decision.target.host.as_text();
    let method = method.as_str();
    let normal = path::normalise(uri.path());
    let named = match route::named(chain, method, &host, normal.as_deref().map_err(|&why| why)) {
        Ok(Some(named)) => named,
        Ok(None) => return Ok(()),
        Err(why) => {
            return Err(Refusal::new(
                Code::PathAmbiguous,
                format!(
                    "{method} {}: a lease of the chain names routes of {host} that need a \
                     human's approval, and origins resolve this path differently, as {why}",
                    shown.target
                ),
            ))
        }
    };
    let arguments = format!(
        "{method} {}://{host}{}\n\n{}",
        shown.scheme,
        shown.target,
        String::from_utf8_lossy(shown.body)
    );
    let call = Call {
        chain,
        named_by: &named.lease_id,
        tool: &named.entry,
        arguments: &arguments,
    };
    let approval = proxy.approvals.hold(call, lease_closed).await?;
    ex.approval = Some(approval);
    Ok(())
}

/// Whether tunnels of `decision` must be read: a route its chain names is of the host.
pub fn names_host(decision: &Decision) -> bool {
    route::names_host(&decision.chain, &decision.target.host.as_text())
}
