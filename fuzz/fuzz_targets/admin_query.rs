//! libFuzzer driver for `checks/admin_query.rs` (the same check replays the seed corpus in
//! `cargo test`).
#![no_main]

#[path = "../checks/admin_query.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::check(data));
