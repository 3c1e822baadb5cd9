//! The integration suite: one binary, modules by area.

mod boundary;
mod cli;
mod conformance;
mod fold;
mod harness;
mod live;
mod operate;
mod pipeline;
mod proxy;
mod support;
