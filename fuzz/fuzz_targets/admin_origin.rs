//! libFuzzer driver for `checks/admin_origin.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/admin_origin.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
