//! `leasegate journal`: move a journal between a file and a stream, or compact it.

pub mod bridge;
