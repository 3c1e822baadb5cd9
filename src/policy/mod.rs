//! Policy: target and path normalisation, request framing, host patterns, verdicts, port lists, the address guard and
//! refusal codes.
//!
//! Invariant: pure. Data and `now` come in as arguments; nothing here does I/O.

pub mod chained;
pub mod codes;
pub mod framing;
pub mod guard;
pub mod path;
pub mod pattern;
pub mod ports;
pub mod rule;
pub mod target;
pub mod verdict;

#[cfg(test)]
mod tests;

pub use codes::{Code, Refusal};
pub use guard::{Guard, UpstreamAddr};
pub use pattern::HostPattern;
pub use ports::Ports;
pub use rule::Rule;
pub use target::{Target, TargetHost};
pub use verdict::{HostPolicy, HostVerdict};
