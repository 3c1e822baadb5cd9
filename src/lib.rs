//! leasegate: an egress HTTP proxy for AI-agent processes, governed by signed leases.
// No unsafe code, with two exceptions the compiler can see, in `memory`: FFI calls to glibc's
// `malloc_trim` and `mallopt`, which take no pointer (no crate wraps them).
#![deny(unsafe_code)]

pub mod admin;
pub mod bridge;
pub mod cli;
pub mod config;
pub mod contract;
pub mod descriptors;
pub mod dev;
pub mod durable;
pub mod health;
pub mod inspect;
pub mod issue;
pub mod log_gate;
pub mod memory;
pub mod nats;
pub mod policy;
pub mod proxy;
pub mod registry;
pub mod run;
pub mod server;
pub mod suggest;
pub mod table;
pub mod telemetry;
pub mod usage;
