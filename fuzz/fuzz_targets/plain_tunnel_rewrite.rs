//! libFuzzer driver for `checks/plain_tunnel_rewrite.rs` (the same check replays the seed
//! corpus in `cargo test`).
#![no_main]

#[path = "../checks/plain_tunnel_rewrite.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
