//! How leasegate connects to NATS: the options every user shares (`--nats-*`), the
//! credentials of the URL or a creds file, TLS, timeouts, reconnect accounting, and the
//! patience of a start (`--store-start-timeout`).
//!
//! Invariants:
//! - Every connection is made here (`connect`), with the same request timeout
//!   ([`REQUEST_TIMEOUT`]) and name; credentials from the URL are handed to the client, never
//!   logged; each reconnection after a disconnect is counted once.
//! - A start is retried for `--store-start-timeout` whatever the error (`patiently`), except
//!   those waiting cannot mend; giving up names the last error.

use crate::registry::store::location::{NatsAuth, NatsLocation};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one NATS request may take before it counts as failed.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Connection settings shared by every NATS user (`--nats-*`).
#[derive(Debug, Clone)]
pub struct NatsOptions {
    /// `--nats-creds`: a credentials file (JWT and NKey seed).
    pub creds: Option<PathBuf>,
    /// `--nats-tls-ca`: trust these roots for the servers' certificates (TLS required).
    pub tls_ca: Option<PathBuf>,
    /// `--nats-replicas`: replicas of a stream we create.
    pub replicas: usize,
    /// `--store-stale-after`: without contact this long, the store reports a problem.
    pub stale_after: Duration,
    /// `--store-start-timeout`: how long a replica keeps trying to open its journal stream at
    /// start.
    pub start_timeout: Duration,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            creds: None,
            tls_ca: None,
            replicas: 1,
            stale_after: Duration::from_secs(5),
            start_timeout: START_TIMEOUT,
        }
    }
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum NatsError {
    #[error("reading {path}: {error}")]
    Creds { path: String, error: io::Error },
    #[error("cannot reach NATS at {location}: {reason}")]
    Connect { location: String, reason: String },
    #[error("{location}: {reason}")]
    Stream { location: String, reason: String },
    /// The stream exists but is not one leasegate may use (other subjects; purged with no
    /// snapshot covering what is gone).
    #[error("{location}: {reason}")]
    Foreign { location: String, reason: String },
    /// The stream does not exist, and a command that only reads does not create it.
    #[error("{location}: the stream {stream} does not exist (a command that only reads does not create it)")]
    Missing { location: String, stream: String },
    /// The stream could not be opened within `--store-start-timeout`.
    #[error("{location}: not open after {waited:.1?} of retries (--store-start-timeout); the last error: {last}")]
    GaveUp {
        location: String,
        waited: Duration,
        last: Box<NatsError>,
    },
}

/// A client connected to `location` with `options`; `reconnects` counts its reconnections.
pub(crate) async fn connect(
    location: &NatsLocation,
    options: &NatsOptions,
    reconnects: Arc<AtomicU64>,
) -> Result<async_nats::Client, NatsError> {
    let mut connect = async_nats::ConnectOptions::new();
    if let Some(path) = &options.creds {
        connect = connect
            .credentials_file(path)
            .await
            .map_err(|error| NatsError::Creds {
                path: path.display().to_string(),
                error,
            })?;
    }
    match &location.auth {
        Some(NatsAuth::UserPassword { user, password }) => {
            connect = connect.user_and_password(user.clone(), password.clone());
        }
        Some(NatsAuth::Token(token)) => connect = connect.token(token.clone()),
        None => {}
    }
    if let Some(ca) = &options.tls_ca {
        connect = connect.add_root_certificates(ca.clone()).require_tls(true);
    }
    if location.tls {
        connect = connect.require_tls(true);
    }
    let was_disconnected = Arc::new(AtomicBool::new(false));
    let described = location.to_string();
    connect = connect
        .connection_timeout(REQUEST_TIMEOUT)
        .request_timeout(Some(REQUEST_TIMEOUT))
        .name("leasegate")
        .event_callback(move |event| {
            let (reconnects, was_disconnected) = (reconnects.clone(), was_disconnected.clone());
            let described = described.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        was_disconnected.store(true, Ordering::Relaxed);
                        tracing::warn!(store = %described, "disconnected from NATS; reconnecting");
                    }
                    async_nats::Event::Connected => {
                        if was_disconnected.swap(false, Ordering::Relaxed) {
                            reconnects.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(store = %described, "reconnected to NATS");
                        }
                    }
                    other => tracing::debug!(store = %described, event = %other, "NATS"),
                }
            }
        });
    let servers: Vec<async_nats::ServerAddr> = location
        .servers
        .iter()
        .map(|s| {
            let scheme = if location.tls { "tls" } else { "nats" };
            format!("{scheme}://{s}")
                .parse()
                .map_err(|e: io::Error| NatsError::Connect {
                    location: location.to_string(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    connect
        .connect(servers)
        .await
        .map_err(|e| NatsError::Connect {
            location: location.to_string(),
            reason: e.to_string(),
        })
}

/// How long a replica keeps trying to open its journal stream at start, by default (a cluster
/// that is itself starting, or that has lost its quorum, elects its leaders first).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `attempt` until it succeeds, with backoff, for `options.start_timeout` whatever the
/// error, except those that waiting cannot mend (credentials that cannot be read, a stream
/// leasegate may not use or is not to create): those are returned at once. Past the timeout
/// the error names the last attempt's.
pub(crate) async fn patiently<T, F, Fut>(
    location: &NatsLocation,
    options: &NatsOptions,
    mut attempt: F,
) -> Result<T, NatsError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, NatsError>>,
{
    let started = Instant::now();
    let deadline = started + options.start_timeout;
    let mut backoff = Duration::from_millis(250);
    loop {
        let error = match attempt().await {
            Ok(done) => return Ok(done),
            Err(
                error @ (NatsError::Creds { .. }
                | NatsError::Foreign { .. }
                | NatsError::Missing { .. }),
            ) => return Err(error),
            Err(error) => error,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NatsError::GaveUp {
                location: location.to_string(),
                waited: started.elapsed(),
                last: Box::new(error),
            });
        }
        let wait = backoff.min(left);
        tracing::warn!(%error, retry_in = ?wait, "the journal stream cannot be opened yet");
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(Duration::from_secs(4));
    }
}
