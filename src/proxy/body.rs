//! Streaming bodies and upgraded streams that count their bytes and stop when their lease closes.
//!
//! Invariant: bodies are never buffered whole — frames pass through as they come; a body whose
//! lease token fires ends with an error at its next poll, and a response body carries its
//! exchange so the egress line is written when the body ends (or is dropped).

use super::exchange::{Counter, Exchange};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Empty, Full};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type of every response we send and every request we forward.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body of fixed bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// An empty body.
pub fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// A body wrapper: counts data bytes into `counter`, ends on cancellation, and drops its
/// exchange (logging it) when the body is done.
pub struct Metered<B> {
    inner: B,
    counter: Counter,
    token: CancellationToken,
    /// The wait for `token`, made the first time the inner body is pending (a body whose
    /// frames are all ready at once, the common small response, never boxes one).
    cancelled: Option<Pin<Box<WaitForCancellationFutureOwned>>>,
    exchange: Option<Exchange>,
    /// Told when the body has ended (the request was sent whole).
    ended: Option<tokio::sync::oneshot::Sender<()>>,
    /// A metered stream cut for its budget: the body has ended.
    cut: bool,
}

impl<B> Metered<B> {
    pub fn new(
        inner: B,
        counter: Counter,
        token: CancellationToken,
        exchange: Option<Exchange>,
    ) -> Metered<B> {
        Metered {
            inner,
            counter,
            token,
            cancelled: None,
            exchange,
            ended: None,
            cut: false,
        }
    }

    /// The body's end when its lease closed: an error frame, and the exchange logged.
    fn end_cancelled(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.exchange.take();
        Poll::Ready(Some(Err("the lease no longer opens anything".into())))
    }

    /// Resolves the returned receiver when the body has ended (or is dropped unfinished).
    pub fn on_end(&mut self) -> tokio::sync::oneshot::Receiver<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.ended = Some(tx);
        rx
    }
}

impl<B> HttpBody for Metered<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.cut {
            self.exchange.take();
            return Poll::Ready(None);
        }
        if self.token.is_cancelled() {
            return self.end_cancelled();
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.counter.fetch_add(data.len() as u64, Ordering::Relaxed);
                    if let Some(ex) = self.exchange.as_mut() {
                        if let Some(tap) = ex.model.as_mut() {
                            tap.feed(data);
                            // A stream its chain's budget ran out under: ended at an event's
                            // end with the API's error event; the upstream is let go.
                            if let Some((at, ending, why)) = tap.cut(data) {
                                ex.error = Some(format!("cut for the budget: {why}"));
                                let mut out = Vec::with_capacity(at + ending.len());
                                out.extend_from_slice(&data[..at]);
                                out.extend_from_slice(&ending);
                                self.cut = true;
                                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                            }
                        }
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                let error: BoxError = error.into();
                if let Some(ex) = self.exchange.as_mut() {
                    ex.error = Some(format!("body: {error}"));
                }
                self.exchange.take();
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(None) => {
                self.exchange.take();
                if let Some(ended) = self.ended.take() {
                    let _ = ended.send(());
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                let this = &mut *self;
                let cancelled = this
                    .cancelled
                    .get_or_insert_with(|| Box::pin(this.token.clone().cancelled_owned()));
                if cancelled.as_mut().poll(cx).is_ready() {
                    return self.end_cancelled();
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.cut || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A stream that counts the bytes read from it.
pub struct Counted<S> {
    pub inner: S,
    read: Counter,
    /// Counts the bytes written to it too, when set.
    written: Option<Counter>,
}

impl<S> Counted<S> {
    pub fn new(inner: S, read: Counter) -> Counted<S> {
        Counted {
            inner,
            read,
            written: None,
        }
    }

    /// Counts both ways: what is read from it into `read`, what is written into `written`.
    pub fn both(inner: S, read: Counter, written: Counter) -> Counted<S> {
        Counted {
            inner,
            read,
            written: Some(written),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len() - before;
        self.read.fetch_add(read as u64, Ordering::Relaxed);
        result
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let (Some(written), Poll::Ready(Ok(n))) = (&self.written, &result) {
            written.fetch_add(*n as u64, Ordering::Relaxed);
        }
        result
    }

    /// Vectored when the inner stream is: TLS over a counted stream hands it every record
    /// ready at once, which would otherwise go out one write call each.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let (Some(written), Poll::Ready(Ok(n))) = (&self.written, &result) {
            written.fetch_add(*n as u64, Ordering::Relaxed);
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Why a relay ended, when it was not one side closing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayEnd {
    /// Either side closed (or failed, with the reason).
    Closed(Option<String>),
    /// The lease closed (the exchange's token says so in its line).
    LeaseClosed,
    /// A drain ran out of time.
    Drained,
    /// No byte moved either way for the idle timeout.
    Idle,
}

impl RelayEnd {
    /// The egress line's `error`, if the end was not a plain close.
    pub fn describe(self) -> Option<String> {
        match self {
            RelayEnd::Closed(error) => error.map(|e| format!("tunnel: {e}")),
            RelayEnd::LeaseClosed => None,
            RelayEnd::Drained => Some("closed: shutdown drain timed out".into()),
            RelayEnd::Idle => Some("closed: idle timeout".into()),
        }
    }
}

/// Bytes each direction of a relay copies per system call. tokio's default (8 KiB) made
/// bulk tunnels syscall-bound; 32 KiB per direction keeps an idle tunnel under 64 KiB.
pub const RELAY_BUFFER: usize = 32 * 1024;

/// What a relay counts into and what ends it besides either side: `up` counts client →
/// upstream bytes, `down` the others; `lease` or `hard_stop` firing, or neither counter
/// moving for `idle`, ends it.
pub struct Watch<'a> {
    pub up: Counter,
    pub down: Counter,
    pub lease: &'a CancellationToken,
    pub hard_stop: &'a CancellationToken,
    pub idle: std::time::Duration,
}

/// Copies bytes both ways, counted, until either side ends or `watch` ends it.
pub async fn relay<C, U>(client: C, upstream: U, watch: Watch<'_>) -> RelayEnd
where
    C: AsyncRead + AsyncWrite + Unpin,
    U: AsyncRead + AsyncWrite + Unpin,
{
    let mut client = Counted::new(client, watch.up.clone());
    let mut upstream = Counted::new(upstream, watch.down.clone());
    let copy = async {
        tokio::io::copy_bidirectional_with_sizes(
            &mut client,
            &mut upstream,
            RELAY_BUFFER,
            RELAY_BUFFER,
        )
        .await
        .map(|_| ())
    };
    let end = watch.run(copy).await;
    use tokio::io::AsyncWriteExt;
    // Bounded: behind the TLS listener, a shutdown writes a close_notify that a client which
    // stopped reading would hold forever.
    let _ = tokio::time::timeout(SHUTDOWN_WAIT, client.inner.shutdown()).await;
    end
}

impl Watch<'_> {
    /// Runs `copy` (which counts into `up` and `down`) until it ends or the watch ends it;
    /// says which.
    pub async fn run(&self, copy: impl Future<Output = std::io::Result<()>>) -> RelayEnd {
        let moved = || self.up.load(Ordering::Relaxed) + self.down.load(Ordering::Relaxed);
        let idle = self.idle;
        let watchdog = async {
            let tick = (idle / 4).max(std::time::Duration::from_millis(10));
            let (mut seen, mut since) = (moved(), tokio::time::Instant::now());
            loop {
                tokio::time::sleep(tick).await;
                let now = moved();
                if now != seen {
                    (seen, since) = (now, tokio::time::Instant::now());
                } else if since.elapsed() >= idle {
                    return;
                }
            }
        };
        tokio::select! {
            result = copy => RelayEnd::Closed(result.err().map(|e| e.to_string())),
            _ = self.lease.cancelled() => RelayEnd::LeaseClosed,
            _ = self.hard_stop.cancelled() => RelayEnd::Drained,
            _ = watchdog => RelayEnd::Idle,
        }
    }
}

/// How long a finished tunnel waits for the client side's shutdown before dropping it.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// A body whose first frames were read ahead (to be looked at) and are given out again first.
pub struct Prefixed<B> {
    held: std::collections::VecDeque<Frame<Bytes>>,
    inner: B,
}

impl<B> Prefixed<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    /// Reads frames of `inner` until at least `limit` data bytes were read or it ends; returns
    /// the body (those frames, then the rest) and the data read, for looking at.
    pub async fn read_ahead(mut inner: B, limit: usize) -> Result<(Prefixed<B>, Bytes), B::Error> {
        use http_body_util::BodyExt;
        let mut held = std::collections::VecDeque::new();
        let mut seen = bytes::BytesMut::new();
        while seen.len() < limit && !inner.is_end_stream() {
            match inner.frame().await {
                None => break,
                Some(frame) => {
                    let frame = frame?;
                    if let Some(data) = frame.data_ref() {
                        seen.extend_from_slice(data);
                    }
                    held.push_back(frame);
                }
            }
        }
        Ok((Prefixed { held, inner }, seen.freeze()))
    }

    /// The body read whole ahead, its data replaced by `data` (its trailers, if any, kept).
    pub fn replaced(self, data: Bytes) -> Prefixed<B> {
        let mut held: std::collections::VecDeque<_> =
            self.held.into_iter().filter(|f| !f.is_data()).collect();
        held.push_front(Frame::data(data));
        Prefixed {
            held,
            inner: self.inner,
        }
    }
}

impl<B> HttpBody for Prefixed<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if let Some(frame) = self.held.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .held
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A body whose frames never come.
    struct Silent;

    impl HttpBody for Silent {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Pending
        }
    }

    #[tokio::test]
    async fn a_waiting_body_ends_when_its_lease_closes() {
        let token = CancellationToken::new();
        let mut body = Metered::new(Silent, Counter::default(), token.clone(), None);
        let closing = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            token.cancel();
        });
        let started = std::time::Instant::now();
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("the body ends when its lease closes, not when the upstream speaks");
        // Woken by the lease closing, not by the timeout's own wake polling it again.
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(
            frame.unwrap().unwrap_err().to_string(),
            "the lease no longer opens anything"
        );
        closing.await.unwrap();
    }

    #[tokio::test]
    async fn a_counted_stream_writes_vectored_and_counts_what_went() {
        use tokio::io::AsyncWriteExt;
        let (read, written) = (Counter::default(), Counter::default());
        let mut counted = Counted::both(Vec::<u8>::new(), read, written.clone());
        assert!(counted.is_write_vectored());
        let bufs = [
            std::io::IoSlice::new(b"head "),
            std::io::IoSlice::new(b"and body"),
        ];
        // One call takes every buffer (a TLS stream's records), not the first alone.
        let n = counted.write_vectored(&bufs).await.unwrap();
        assert_eq!(n, 13);
        assert_eq!(written.load(Ordering::Relaxed), 13);
        assert_eq!(counted.inner, b"head and body");
    }

    #[tokio::test]
    async fn a_body_of_a_closed_lease_ends_at_its_next_poll() {
        let token = CancellationToken::new();
        token.cancel();
        let mut body = Metered::new(full("ready"), Counter::default(), token, None);
        let frame = body.frame().await.unwrap();
        assert!(
            frame.is_err(),
            "a ready frame is not passed on after the lease closed"
        );
    }
}
