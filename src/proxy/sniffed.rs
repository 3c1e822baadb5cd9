//! A plain listener's client socket, watched for one mistake: a client told that the proxy is
//! `https://` (`HTTPS_PROXY=https://…`) opens with a TLS ClientHello where a request line
//! should be.
//!
//! Invariant: every byte read and written is the socket's, unchanged, unless the first byte the
//! client sent is a TLS record's (a handshake, 22): then nothing the HTTP server writes reaches
//! the client, which gets one fatal TLS `protocol_version` alert instead — its TLS stack fails
//! at once, instead of reading an HTTP answer as a record ("wrong version number") — and the
//! operator a warning naming the client and the fix.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The alert record: fatal (2), protocol_version (70), in a TLS 1.0 record as every TLS stack
/// reads before a handshake.
const ALERT: [u8; 7] = [21, 3, 1, 0, 2, 2, 70];

/// Clients that spoke TLS to a plain listener, since start (a warning at the 1st, 2nd, 4th…).
static SEEN: AtomicU64 = AtomicU64::new(0);

/// A client socket of a plain listener, its first byte watched.
pub struct Sniffed {
    inner: TcpStream,
    client: SocketAddr,
    first: Option<u8>,
    /// Bytes of [`ALERT`] written.
    alerted: usize,
}

impl Sniffed {
    pub fn new(inner: TcpStream, client: SocketAddr) -> Sniffed {
        Sniffed {
            inner,
            client,
            first: None,
            alerted: 0,
        }
    }

    pub fn into_inner(self) -> TcpStream {
        self.inner
    }

    fn speaks_tls(&self) -> bool {
        self.first == Some(crate::proxy::hello::HANDSHAKE)
    }
}

impl AsyncRead for Sniffed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if this.first.is_none() && buf.filled().len() > before {
            this.first = Some(buf.filled()[before]);
            if this.speaks_tls() {
                let n = SEEN.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    tracing::warn!(
                        client = %this.client,
                        since_start = n,
                        "a client spoke TLS to this plain-HTTP proxy listener: its proxy URL says \
                         https://, which needs serve --tls-cert; give it http://HOST:PORT instead \
                         (its tunnels are TLS end to end all the same)"
                    );
                }
            }
        }
        polled
    }
}

impl AsyncWrite for Sniffed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if !this.speaks_tls() {
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        while this.alerted < ALERT.len() {
            match Pin::new(&mut this.inner).poll_write(cx, &ALERT[this.alerted..]) {
                Poll::Ready(Ok(n)) if n > 0 => this.alerted += n,
                Poll::Ready(Ok(_)) => return Poll::Ready(Ok(buf.len())),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        // What the HTTP server says is not for a TLS client's ears.
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
