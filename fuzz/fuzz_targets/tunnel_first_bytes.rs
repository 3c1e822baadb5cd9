//! libFuzzer driver for `checks/tunnel_first_bytes.rs` (the same check replays the seed corpus
//! in `cargo test`).
#![no_main]

#[path = "../checks/tunnel_first_bytes.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
