//! The journal file: the fold of every event, and compaction.

pub mod compact;
pub mod fold;
