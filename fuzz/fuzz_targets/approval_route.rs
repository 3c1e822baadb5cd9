//! libFuzzer driver for `checks/approval_route.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/approval_route.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
