//! leasegate: an egress HTTP proxy for AI-agent processes, governed by signed leases.
// No unsafe code, with two exceptions the compiler can see, in `memory`: FFI calls to glibc's
// `malloc_trim` and `mallopt`, which take no pointer (no crate wraps them).
#![deny(unsafe_code)]

pub mod admin;
pub mod approvals;
pub mod budget;
pub mod cli;
pub mod commands;
pub mod config;
pub mod contract;
pub mod descriptors;
pub mod durable;
pub mod fast_hash;
pub mod intercept;
pub mod issuer;
pub mod log_gate;
pub mod mcp;
pub mod memory;
pub mod meter;
pub mod nats;
pub mod policy;
pub mod proxy;
pub mod registry;
pub mod resolve;
pub mod secrets;
pub mod server;
pub mod table;
pub mod telemetry;
