//! Lease state folded from the journal, the journal store it lives in, and the live registry.

pub mod broadcast;
pub mod catch_up;
pub mod clock;
pub mod closed;
pub mod closing;
pub mod compact;
pub mod follower;
pub mod journal;
pub mod ledger;
pub mod listing;
pub mod live;
pub mod open;
pub mod pending;
pub mod prepared;
mod retired;
pub mod revocation;
mod shared_policies;
pub mod store;
pub mod tokens;

pub use clock::{Clock, ClockError, ClockHealth, WallClock};
pub use ledger::{
    Applied, ChainError, Closure, FoldStats, InvalidReason, Ledger, LineError, SignatureProblem,
    Status,
};
pub use live::{AppendError, Registry, RevokeError, Snapshot};
pub use open::{OpenError, StoreOptions};
pub use retired::Retired;
pub use store::{Batch, FileStore, JournalLocation, Position, Store};
