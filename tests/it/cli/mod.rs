//! The command line as a user runs it: the lease lifecycle, messages, suggest, run, the deployment
//! files, the secrets file.

pub mod ca;
pub mod deploy;
pub mod lifecycle;
pub mod messages;
pub mod messages_operator;
pub mod run_brokered;
pub mod run_deno_bun;
pub mod run_issued;
pub mod run_java;
pub mod run_node;
pub mod run_trust;
pub mod secrets;
pub mod suggest;
pub mod usage_model;
