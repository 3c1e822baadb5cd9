//! The proxy: listeners, the decision pipeline shared by CONNECT tunnels and forwarded
//! requests, and what moves the bytes.
//!
//! Invariant: every CONNECT and forwarded request (and `check`) is decided by
//! [`decision::decide`] then [`decision::resolve_and_guard`], in [`pipeline`]'s fixed phases,
//! then dialled, then relayed; every exchange writes exactly one egress line; every answer the
//! proxy itself writes is built in [`answer`]. No two modules here import each other.

pub mod answer;
pub mod body;
pub mod congestion;
pub mod connect;
pub mod connection;
pub mod decision;
pub mod dialer;
pub mod exchange;
pub mod forward;
pub mod hello;
pub mod identify;
pub mod lease_ports;
pub mod listener;
pub mod pipeline;
#[cfg(target_os = "linux")]
pub mod splice;
pub mod state;
pub mod upstream;
pub mod workers;

pub use crate::config::{Mode, OnRefusal, ProxyConfig};
pub use body::{empty, full, Body, BoxError};
pub use connection::ClientConn;
pub use decision::Decision;
pub use listener::serve;
pub use pipeline::Cleared;
pub use state::Proxy;
pub use workers::Workers;
