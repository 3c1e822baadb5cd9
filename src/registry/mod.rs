//! Lease state folded from the journal, and the journal file itself.

pub mod journal;
pub mod ledger;

pub use ledger::{Applied, ChainError, Closure, FoldStats, Ledger, LineError, Status};
