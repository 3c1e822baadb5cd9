//! The integration suite: one binary, modules by area.

mod boundary_guard;
mod boundary_ops;
mod boundary_tls;
mod bounded;
mod bridges;
mod cli;
mod clients;
mod compact;
mod conformance;
mod dashboard;
mod deploy;
mod fold;
mod fuzz_corpus;
mod harness;
mod live;
mod nats_support;
mod operate;
mod pipeline;
mod proxy;
mod scale_out;
mod suggest;
mod support;
mod tls_hello;
mod tunnels;
mod usage;
mod ux;
