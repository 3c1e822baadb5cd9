//! Lease state folded from the journal, the journal file itself, and the live registry.

pub mod journal;
pub mod ledger;
pub mod live;
pub mod revocation;
pub mod tail;

pub use ledger::{Applied, ChainError, Closure, FoldStats, Ledger, LineError, Status};
pub use live::{Registry, RevokeError, Snapshot};
