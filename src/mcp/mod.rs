//! MCP at the edge: which origins are MCP servers ([`servers`]), what a client's POST asks
//! ([`message`]), the tool lists of a server's answers cut to what a lease may call
//! ([`filter`]), and the verdict on one tool along a lease's chain ([`judge`]).
//!
//! Invariant: pure (no I/O, no clock); a tool is named `<server>/<tool>` and may be called only
//! when every lease of the chain lists exactly that name in `allow.tools` (there is no pattern:
//! the contract refuses `*`), and needs a human first when any lease of the chain names it in
//! `approvals`.

pub mod filter;
pub mod message;
pub mod servers;

use crate::contract::Lease;
use std::sync::Arc;

pub use servers::{McpServer, McpServers};

/// What a lease's chain says of one tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolVerdict {
    Allowed,
    /// Every lease lists it, and this one names it in `approvals`.
    NeedsApproval {
        lease_id: String,
    },
    /// This lease (the first of the chain that does not) leaves it out of `allow.tools`.
    NotAllowed {
        lease_id: String,
    },
}

/// The verdict on `tool` (`<server>/<tool>`) under `chain` (the lease first).
pub fn judge(chain: &[Arc<Lease>], tool: &str) -> ToolVerdict {
    if let Some(lacking) = chain
        .iter()
        .find(|lease| !tools(lease).iter().any(|t| t == tool))
    {
        return ToolVerdict::NotAllowed {
            lease_id: lacking.id.clone(),
        };
    }
    match chain
        .iter()
        .find(|lease| approvals(lease).iter().any(|a| a == tool))
    {
        Some(lease) => ToolVerdict::NeedsApproval {
            lease_id: lease.id.clone(),
        },
        None => ToolVerdict::Allowed,
    }
}

/// Whether a tools/list answer shows `tool` (`<server>/<tool>`): the chain may call it, with
/// an approval or without.
pub fn listed(chain: &[Arc<Lease>], tool: &str) -> bool {
    !matches!(judge(chain, tool), ToolVerdict::NotAllowed { .. })
}

fn tools(lease: &Lease) -> &[String] {
    lease.terms.as_deref().map_or(&[][..], |t| &t.tools[..])
}

fn approvals(lease: &Lease) -> &[String] {
    lease.terms.as_deref().map_or(&[][..], |t| &t.approvals[..])
}
