//! The upstream connection a terminated tunnel keeps between its requests.
//!
//! Invariant: it holds at most one connection, of the tunnel's own lease, to one of the
//! tunnel's checked addresses; one is given out only ready for a request and not idle past the
//! pool's idle time, and dies with the tunnel.
//!
//! Why not the pool alone: an HTTP/1.1 client sends a tunnel's requests one after another, so
//! the connection its last request used is the one ready for the next. Through the pool, each
//! request paid its lock and key hashes twice and a task that waited for the connection to be
//! ready again (some 6,000 instructions, most of them before the answer went out).

use crate::policy::UpstreamAddr;
use crate::proxy::body::Body;
use hyper::client::conn::http1::SendRequest;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A connection put back, where, and since when.
type Kept = (SendRequest<Body>, UpstreamAddr, Instant);

/// One kept connection (HTTP/2 streams of a tunnel run side by side: the others use the pool).
#[derive(Default)]
pub struct Held {
    kept: Mutex<Option<Kept>>,
}

/// What [`Held::take`] found.
pub enum Taken {
    /// Nothing kept, or a connection closed or idle too long (dropped).
    Nothing,
    /// Ready for a request.
    Ready(SendRequest<Body>, UpstreamAddr),
    /// Still busy with an answer (another stream's): for the pool, which waits for it.
    Busy(SendRequest<Body>, UpstreamAddr),
}

impl Held {
    /// Keeps `sender` (its request answered, its body maybe still coming) for the next
    /// request; gives back the one it displaces.
    pub fn put(
        &self,
        sender: SendRequest<Body>,
        addr: UpstreamAddr,
    ) -> Option<(SendRequest<Body>, UpstreamAddr)> {
        let mut kept = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        kept.replace((sender, addr, Instant::now()))
            .map(|(sender, addr, _)| (sender, addr))
    }

    /// The kept connection, taken out.
    pub fn take(&self, idle_for: Duration) -> Taken {
        let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((sender, addr, since)) = kept else {
            return Taken::Nothing;
        };
        if sender.is_closed() || since.elapsed() >= idle_for {
            Taken::Nothing
        } else if sender.is_ready() {
            Taken::Ready(sender, addr)
        } else {
            Taken::Busy(sender, addr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::upstream::pool::tests::connection;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const IDLE: Duration = Duration::from_secs(60);

    fn taken(held: &Held, idle_for: Duration) -> &'static str {
        match held.take(idle_for) {
            Taken::Nothing => "nothing",
            Taken::Ready(..) => "ready",
            Taken::Busy(..) => "busy",
        }
    }

    #[tokio::test]
    async fn a_kept_idle_connection_is_given_out_once_and_ready() {
        let held = Held::default();
        assert_eq!(taken(&held, IDLE), "nothing");
        let (key, mut sender, _upstream) = connection().await;
        sender.ready().await.unwrap();
        assert!(held.put(sender, key.addr).is_none());
        match held.take(IDLE) {
            Taken::Ready(_, addr) => assert_eq!(addr, key.addr),
            _ => panic!("an idle connection is ready"),
        }
        assert_eq!(taken(&held, IDLE), "nothing", "taken out, not copied");
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_or_idle_too_long_is_dropped() {
        let held = Held::default();
        let (key, sender, upstream) = connection().await;
        held.put(sender, key.addr);
        drop(upstream);
        // Given out only while it is not known closed; once it is, dropped.
        let dropped = async {
            loop {
                match held.take(IDLE) {
                    Taken::Nothing => return,
                    Taken::Ready(sender, addr) | Taken::Busy(sender, addr) => {
                        held.put(sender, addr);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), dropped)
            .await
            .expect("a connection the upstream closed is dropped");

        let (key, sender, _upstream) = connection().await;
        held.put(sender, key.addr);
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(taken(&held, Duration::from_millis(20)), "nothing");
    }

    #[tokio::test]
    async fn a_connection_still_answering_is_busy_and_a_put_gives_back_the_one_it_displaces() {
        let held = Held::default();
        let (key, mut sender, mut upstream) = connection().await;
        let request = http::Request::get("/")
            .header("host", "upstream.test")
            .body(crate::proxy::body::empty())
            .unwrap();
        let answered = tokio::spawn(sender.send_request(request));
        // The request reached the upstream, which has not answered: the connection is busy.
        let mut buf = [0u8; 512];
        let n = upstream.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"GET / HTTP/1.1"));
        held.put(sender, key.addr);
        assert_eq!(taken(&held, IDLE), "busy");

        let (other, second, _upstream2) = connection().await;
        let (_, first, _upstream3) = connection().await;
        held.put(first, key.addr);
        let displaced = held
            .put(second, other.addr)
            .expect("the first is given back");
        assert_eq!(displaced.1, key.addr);
        upstream
            .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(answered.await.unwrap().unwrap().status(), 204);
    }
}
