//! The integration suite: one binary, modules by area; helpers in `support/`.

mod admin;
mod boundary;
mod cli;
mod cluster;
mod contract;
mod docs;
mod journal;
mod live;
mod proxy;
mod support;
