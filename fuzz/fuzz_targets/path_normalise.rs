//! libFuzzer driver for `checks/path_normalise.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/path_normalise.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
