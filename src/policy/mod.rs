//! Policy: host patterns and verdicts.
//!
//! Invariant: pure. Data and `now` come in as arguments; nothing here does I/O.

pub mod pattern;

pub use pattern::HostPattern;
