//! libFuzzer driver for `checks/issue_request.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/issue_request.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
