//! libFuzzer driver for `checks/journal_fold.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/journal_fold.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
