//! libFuzzer driver for `checks/mcp_filter.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/mcp_filter.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
