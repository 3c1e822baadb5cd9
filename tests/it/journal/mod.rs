//! The journal: the fold of every event, and compaction (a file or a stream).

pub mod compact;
pub mod fold;
