//! libFuzzer driver for `checks/secrets_file.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/secrets_file.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
