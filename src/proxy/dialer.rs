//! Phase 6: connecting to a checked address, behind a seam so tests can watch every dial.
//!
//! Invariant: a [`Dialer`] takes only [`UpstreamAddr`]s (built by the address guard), and
//! returns I/O-level errors; [`DialError::refusal`] is the one place they become refusals.

use crate::policy::codes::{Code, Refusal};
use crate::policy::UpstreamAddr;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;
use tokio::net::{TcpSocket, TcpStream};

/// A connect in flight.
pub type Dialing<'a> = Pin<Box<dyn Future<Output = std::io::Result<TcpStream>> + Send + 'a>>;

/// Opens TCP connections to checked addresses.
pub trait Dialer: Send + Sync + 'static {
    fn connect(&self, addr: UpstreamAddr) -> Dialing<'_>;
}

/// The real dialer: a TCP connect with Nagle off (and, to a loopback address, unpaced:
/// [`super::congestion`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct TcpDialer;

impl Dialer for TcpDialer {
    fn connect(&self, addr: UpstreamAddr) -> Dialing<'_> {
        Box::pin(async move {
            let target = addr.socket_addr();
            let socket = match target {
                SocketAddr::V4(_) => TcpSocket::new_v4()?,
                SocketAddr::V6(_) => TcpSocket::new_v6()?,
            };
            let _ = socket.set_nodelay(true);
            super::congestion::unpace_loopback(&socket, target.ip());
            socket.connect(target).await
        })
    }
}

/// Why no checked address could be connected to (the last attempt's reason).
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("no address to dial")]
    NoAddress,
    #[error("connecting to {addr}: {error}")]
    Failed {
        addr: UpstreamAddr,
        error: std::io::Error,
    },
    #[error("connecting to {addr} timed out after {after:?}")]
    TimedOut { addr: UpstreamAddr, after: Duration },
}

impl DialError {
    /// The refusal a failed dial answers with (pingora's `fail_to_connect`).
    pub fn refusal(&self) -> Refusal {
        let code = match self {
            DialError::TimedOut { .. } => Code::UpstreamTimeout,
            DialError::NoAddress | DialError::Failed { .. } => Code::UpstreamUnreachable,
        };
        Refusal::new(code, self.to_string())
    }
}

/// Connects to the first of `addrs` that answers; each attempt has `timeout`.
pub async fn dial_first(
    dialer: &dyn Dialer,
    addrs: &[UpstreamAddr],
    timeout: Duration,
) -> Result<(TcpStream, UpstreamAddr), DialError> {
    let mut last = DialError::NoAddress;
    for &addr in addrs {
        match tokio::time::timeout(timeout, dialer.connect(addr)).await {
            Ok(Ok(stream)) => return Ok((stream, addr)),
            Ok(Err(error)) => last = DialError::Failed { addr, error },
            Err(_) => {
                last = DialError::TimedOut {
                    addr,
                    after: timeout,
                }
            }
        }
    }
    Err(last)
}
