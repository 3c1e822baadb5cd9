//! Refusal codes: what a refused request is told, and which refusals are policy checks.
//!
//! Invariant: pure and stable — a code's spelling and status never change, and a host verdict
//! becomes a refusal here only, naming the pattern and lease that decided it.

use super::verdict::Decider;
use super::{HostVerdict, Rule, TargetHost};
use http::StatusCode;

/// The stable refusal codes (docs/reference/refusal-codes.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    LeaseMissing,
    LeaseUnknown,
    LeaseConflict,
    BadTarget,
    NotAProxyRequest,
    LeaseNotYetValid,
    LeaseExpired,
    LeaseRevoked,
    LeaseClosed,
    AncestorClosed,
    HostDenied,
    HostNotAllowed,
    AddressNotAllowed,
    SniMismatch,
    TlsUnverifiable,
    HostMismatch,
    MethodNotAllowed,
    PortNotAllowed,
    TooManyConnections,
    DnsFailed,
    UpstreamUnreachable,
    UpstreamTimeout,
    UpstreamTlsFailed,
    RouteNotAllowed,
    SecretMisdirected,
    SecretExposed,
    CanaryTripped,
    BudgetExhausted,
    BodyTooLarge,
    PathAmbiguous,
    ToolNotAllowed,
    ApprovalDenied,
    ApprovalTimedOut,
    ApprovalUnavailable,
    McpUnreadable,
}

impl Code {
    pub const ALL: [Code; 35] = [
        Code::LeaseMissing,
        Code::LeaseUnknown,
        Code::LeaseConflict,
        Code::BadTarget,
        Code::NotAProxyRequest,
        Code::LeaseNotYetValid,
        Code::LeaseExpired,
        Code::LeaseRevoked,
        Code::LeaseClosed,
        Code::AncestorClosed,
        Code::HostDenied,
        Code::HostNotAllowed,
        Code::AddressNotAllowed,
        Code::SniMismatch,
        Code::TlsUnverifiable,
        Code::HostMismatch,
        Code::MethodNotAllowed,
        Code::PortNotAllowed,
        Code::TooManyConnections,
        Code::DnsFailed,
        Code::UpstreamUnreachable,
        Code::UpstreamTimeout,
        Code::UpstreamTlsFailed,
        Code::RouteNotAllowed,
        Code::SecretMisdirected,
        Code::SecretExposed,
        Code::CanaryTripped,
        Code::BudgetExhausted,
        Code::BodyTooLarge,
        Code::PathAmbiguous,
        Code::ToolNotAllowed,
        Code::ApprovalDenied,
        Code::ApprovalTimedOut,
        Code::ApprovalUnavailable,
        Code::McpUnreadable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Code::LeaseMissing => "lease-missing",
            Code::LeaseUnknown => "lease-unknown",
            Code::LeaseConflict => "lease-conflict",
            Code::BadTarget => "bad-target",
            Code::NotAProxyRequest => "not-a-proxy-request",
            Code::LeaseNotYetValid => "lease-not-yet-valid",
            Code::LeaseExpired => "lease-expired",
            Code::LeaseRevoked => "lease-revoked",
            Code::LeaseClosed => "lease-closed",
            Code::AncestorClosed => "ancestor-closed",
            Code::HostDenied => "host-denied",
            Code::HostNotAllowed => "host-not-allowed",
            Code::AddressNotAllowed => "address-not-allowed",
            Code::SniMismatch => "sni-mismatch",
            Code::TlsUnverifiable => "tls-unverifiable",
            Code::HostMismatch => "host-mismatch",
            Code::MethodNotAllowed => "method-not-allowed",
            Code::PortNotAllowed => "port-not-allowed",
            Code::TooManyConnections => "too-many-connections",
            Code::DnsFailed => "dns-failed",
            Code::UpstreamUnreachable => "upstream-unreachable",
            Code::UpstreamTimeout => "upstream-timeout",
            Code::UpstreamTlsFailed => "upstream-tls-failed",
            Code::RouteNotAllowed => "route-not-allowed",
            Code::SecretMisdirected => "secret-misdirected",
            Code::SecretExposed => "secret-exposed",
            Code::CanaryTripped => "canary-tripped",
            Code::BudgetExhausted => "budget-exhausted",
            Code::BodyTooLarge => "body-too-large",
            Code::PathAmbiguous => "path-ambiguous",
            Code::ToolNotAllowed => "tool-not-allowed",
            Code::ApprovalDenied => "approval-denied",
            Code::ApprovalTimedOut => "approval-timed-out",
            Code::ApprovalUnavailable => "approval-unavailable",
            Code::McpUnreadable => "mcp-unreadable",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Code::LeaseMissing | Code::LeaseUnknown => StatusCode::PROXY_AUTHENTICATION_REQUIRED,
            Code::LeaseConflict
            | Code::BadTarget
            | Code::NotAProxyRequest
            | Code::PathAmbiguous
            | Code::McpUnreadable => StatusCode::BAD_REQUEST,
            Code::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Code::LeaseNotYetValid
            | Code::LeaseExpired
            | Code::LeaseRevoked
            | Code::LeaseClosed
            | Code::AncestorClosed
            | Code::HostDenied
            | Code::HostNotAllowed
            | Code::AddressNotAllowed
            | Code::SniMismatch
            | Code::TlsUnverifiable
            | Code::PortNotAllowed
            | Code::RouteNotAllowed
            | Code::SecretMisdirected
            | Code::SecretExposed
            | Code::CanaryTripped
            | Code::ToolNotAllowed
            | Code::ApprovalDenied
            | Code::ApprovalTimedOut => StatusCode::FORBIDDEN,
            Code::HostMismatch => StatusCode::MISDIRECTED_REQUEST,
            Code::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Code::TooManyConnections | Code::BudgetExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::DnsFailed | Code::UpstreamUnreachable | Code::UpstreamTlsFailed => {
                StatusCode::BAD_GATEWAY
            }
            Code::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Code::ApprovalUnavailable => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// A policy check: refused in enforce mode (and revoking by default), reported only in
    /// report mode. `port-not-allowed` is none: the operator's port lists bound every lease
    /// alike, in every mode, and a lease is not revoked for asking.
    pub fn is_policy(self) -> bool {
        matches!(
            self,
            Code::HostDenied
                | Code::HostNotAllowed
                | Code::AddressNotAllowed
                | Code::SniMismatch
                | Code::TlsUnverifiable
                | Code::HostMismatch
        )
    }

    /// Misuse of a brokered credential: a lease's placeholder sent where its secret is not for,
    /// a secret's real value or a canary in an agent's request. Refused and revoking in every
    /// mode and whatever `--on-refusal` says: it is evidence, not a policy being tried out.
    pub fn is_misuse(self) -> bool {
        matches!(
            self,
            Code::SecretMisdirected | Code::SecretExposed | Code::CanaryTripped
        )
    }

    /// A challenge, not a refusal: the 407 that asks a client for the credentials it has not
    /// sent yet (git and Java send their first request without them). A credential that
    /// does not prove a lease (`lease-unknown`) is a refusal.
    pub fn is_challenge(self) -> bool {
        self == Code::LeaseMissing
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refusal: its code and a human reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: Code,
    pub detail: String,
    /// The pattern, guard range or port list that refused, when one did.
    pub rule: Option<Rule>,
}

impl Refusal {
    pub fn new(code: Code, detail: impl Into<String>) -> Refusal {
        Refusal {
            code,
            detail: detail.into(),
            rule: None,
        }
    }

    /// The same refusal, naming the rule that decided it.
    pub fn with_rule(self, rule: Rule) -> Refusal {
        Refusal {
            rule: Some(rule),
            ..self
        }
    }
}

/// A host verdict as a result: the allowing decider, or the refusal naming the pattern and
/// lease that decided it.
pub fn host_refusal<'a>(
    verdict: HostVerdict<'a>,
    host: &TargetHost,
) -> Result<Decider<'a>, Refusal> {
    match verdict {
        HostVerdict::Allowed(by) => Ok(by),
        HostVerdict::Denied(by) => {
            let pattern = by.pattern(host);
            let shown = pattern.as_ref().map(|p| p.to_string()).unwrap_or_default();
            let refusal = Refusal::new(
                Code::HostDenied,
                format!("{host} is denied by {shown} in lease {}", by.lease_id),
            );
            Err(Refusal {
                rule: pattern.map(Rule::Deny),
                ..refusal
            })
        }
        HostVerdict::NotAllowed(by) => Err(Refusal::new(
            Code::HostNotAllowed,
            format!(
                "{host} matches no pattern of lease {}'s allow.hosts",
                by.lease_id
            ),
        )
        .with_rule(Rule::NotInAllow)),
    }
}

#[cfg(test)]
mod tests {
    use super::Code;

    /// The egress log's schema names exactly the codes there are.
    #[test]
    fn the_egress_schema_lists_every_code() {
        let schema: serde_json::Value =
            serde_json::from_str(include_str!("../../schemas/egress-event.schema.json")).unwrap();
        let listed: Vec<&str> = schema["properties"]["code"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|code| code.as_str())
            .collect();
        let codes: Vec<&str> = Code::ALL.iter().map(|code| code.as_str()).collect();
        assert_eq!(listed, codes);
    }
}
