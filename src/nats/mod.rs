//! The NATS client, one for every user of NATS: the journal store, the egress stream, usage,
//! the bridges and compaction. [`connect`] makes the connection (auth, creds, TLS, options,
//! the start's retries); [`stream`] is the JetStream stream handle.
//!
//! Invariant: nothing else in the crate connects to NATS or opens a stream; every user holds a
//! [`NatsStream`] made here, so auth, timeouts and reconnect accounting are the same for all.

pub mod connect;
pub mod stream;

pub use connect::{NatsError, NatsOptions, REQUEST_TIMEOUT, START_TIMEOUT};
pub use stream::{
    subject_token, IfMissing, Incarnation, NatsStream, Span, StreamSpec, DUPLICATE_WINDOW,
    JOURNAL_SUBJECTS,
};
