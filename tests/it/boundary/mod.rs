//! The network boundary as an attacker meets it: deny patterns and the guard, credentials and
//! limits, TLS and Host spellings, a forged journal stream.

pub mod agent_under_run;
pub mod credentials_and_limits;
pub mod forged_stream;
pub mod guard;
pub mod tls_and_host;
