//! libFuzzer driver for `checks/mcp_message.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/mcp_message.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
