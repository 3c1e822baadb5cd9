//! libFuzzer driver for `checks/target_parser.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/target_parser.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
