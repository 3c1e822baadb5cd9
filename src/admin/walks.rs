//! The admin routes that walk every lease (`GET /leases`, a `/metrics` render): a few at once,
//! on threads of their own.
//!
//! Invariant: at most [`AT_ONCE`] walks are admitted at a time — one more is refused at once,
//! never queued — and they run on at most [`THREADS`] threads of their own, never on a tokio
//! blocking pool that the journal, lease ports or connections use. Once walks have answered
//! [`TRIM_AFTER`] bytes and none is admitted, the freed heap goes back to the OS.

use crate::log_gate::{Flood, Say};
use crate::proxy::Body;
use http::Response;
use http_body::Body as _;
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Walks admitted at once: two running, two waiting for a thread. The dashboard polls one
/// page at a time and `/metrics` renders once a second ([`super::scrape`]).
pub const AT_ONCE: usize = 4;

/// Threads the walks run on (a walk of 100,000 leases takes one for ~60 ms).
pub const THREADS: usize = 2;

/// Bytes answered by walks after which an idle moment gives the freed heap back.
pub const TRIM_AFTER: usize = 16 << 20;

/// How long an idle walk thread is kept.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// A walk was not admitted: [`AT_ONCE`] are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// The lease-walking routes' limit and threads.
pub struct Walks {
    /// One permit per admitted walk.
    permits: Arc<Semaphore>,
    /// Its blocking pool is the walks' threads; nothing ever runs on the runtime itself.
    /// `None` only once dropped.
    pool: Option<tokio::runtime::Runtime>,
    /// Bytes answered since the heap was last trimmed.
    answered: AtomicUsize,
    /// Walks refused since start (`leasegate_admin_busy_total{limit="walks"}`).
    refused: AtomicU64,
    /// The episodes of refusals, for the log.
    refusals: Mutex<Flood>,
}

impl Walks {
    pub fn new() -> io::Result<Walks> {
        let pool = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(THREADS)
            .thread_keep_alive(KEEP_ALIVE)
            .thread_name("leasegate-admin-walk")
            .build()?;
        Ok(Walks {
            permits: Arc::new(Semaphore::new(AT_ONCE)),
            pool: Some(pool),
            answered: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            refusals: Mutex::new(Flood::default()),
        })
    }

    /// Runs `walk` on the walks' threads and returns its answer, or [`Busy`] at once when
    /// [`AT_ONCE`] walks are admitted already. A walk that panics is answered by `failed`.
    pub async fn run(
        &self,
        walk: impl FnOnce() -> Response<Body> + Send + 'static,
        failed: impl FnOnce(String) -> Response<Body>,
    ) -> Result<Response<Body>, Busy> {
        let Ok(_permit) = self.permits.clone().try_acquire_owned() else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            let mut refusals = self.refusals.lock().unwrap_or_else(|e| e.into_inner());
            match refusals.occurred(1, Instant::now()) {
                Say::Start => tracing::warn!(
                    at_once = AT_ONCE,
                    "admin API: lease-walking requests (/leases, /metrics) beyond the limit are answered 503"
                ),
                Say::Summary(s) => tracing::warn!(
                    refused = s.repeats,
                    since_first = s.total,
                    "admin API: lease-walking requests are still refused beyond the limit"
                ),
                Say::Quiet => {}
            }
            return Err(Busy);
        };
        let pool = self.pool.as_ref().expect("only gone once dropped");
        let answer = pool
            .spawn_blocking(walk)
            .await
            .unwrap_or_else(|panicked| failed(format!("the handler failed: {panicked}")));
        let size = answer.body().size_hint().exact().unwrap_or(0) as usize;
        self.answered.fetch_add(size, Ordering::Relaxed);
        Ok(answer)
    }

    /// Walks refused since start.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// When no walk is admitted and walks have answered [`TRIM_AFTER`] bytes since the last
    /// time: gives the freed heap back to the OS, on a walk thread. Called every second or so;
    /// also ends a quiet episode of refusals in the log.
    pub fn tidy(&self) {
        let now = Instant::now();
        let ended = self
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end_if_quiet(now);
        if let Some(s) = ended {
            tracing::info!(
                refused = s.total,
                lasted = ?s.lasted,
                "admin API: lease-walking requests are admitted again"
            );
        }
        if self.permits.available_permits() < AT_ONCE
            || self.answered.load(Ordering::Relaxed) < TRIM_AFTER
        {
            return;
        }
        self.answered.store(0, Ordering::Relaxed);
        if let Some(pool) = &self.pool {
            pool.spawn_blocking(crate::memory::release_freed);
        }
    }
}

impl Drop for Walks {
    /// Dropped on a runtime's thread (the admin API's state goes with its server): nothing
    /// waits for a walk still running.
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::full;
    use tokio::sync::oneshot;

    fn reply(text: &'static str) -> Response<Body> {
        Response::new(full(text))
    }

    #[tokio::test]
    async fn beyond_the_limit_a_walk_is_refused_at_once_and_runs_nowhere() {
        let walks = Arc::new(Walks::new().unwrap());
        let mut held = Vec::new();
        let mut started = Vec::new();
        let mut tasks = Vec::new();
        for _ in 0..AT_ONCE {
            let (release, wait) = oneshot::channel::<()>();
            let (began, begun) = oneshot::channel::<Option<String>>();
            let walks = walks.clone();
            started.push(begun);
            held.push(release);
            tasks.push(tokio::spawn(async move {
                walks
                    .run(
                        move || {
                            let _ = began.send(std::thread::current().name().map(str::to_owned));
                            let _ = wait.blocking_recv();
                            reply("done")
                        },
                        |_| reply("failed"),
                    )
                    .await
            }));
        }
        // The first THREADS run now, on the walks' own threads.
        for begun in started.drain(..THREADS) {
            assert_eq!(
                begun.await.unwrap().as_deref(),
                Some("leasegate-admin-walk")
            );
        }
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = ran.clone();
        let refused = walks.run(
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
                reply("ran")
            },
            |_| reply("failed"),
        );
        let refused = tokio::time::timeout(Duration::from_secs(5), refused)
            .await
            .expect("refused at once, not queued");
        assert_eq!(refused.err(), Some(Busy));
        assert_eq!(walks.refused(), 1);
        drop(held);
        // A permit goes back when its walk's answer is taken, after the walk itself.
        for task in tasks {
            assert!(task.await.unwrap().is_ok());
        }
        let answered = walks.run(|| reply("again"), |_| reply("failed")).await;
        assert!(answered.is_ok(), "admitted again once the others ended");
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the refused walk never ran");
    }

    #[tokio::test]
    async fn a_walk_that_panics_is_answered_by_failed() {
        let walks = Walks::new().unwrap();
        let answered = walks
            .run(|| panic!("walked off"), reply_owned)
            .await
            .unwrap();
        let body = http_body_util::BodyExt::collect(answered.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("the handler failed"));
        let again = walks.run(|| reply("fine"), |_| reply("failed")).await;
        assert!(again.is_ok(), "its permit went back");
    }

    fn reply_owned(text: String) -> Response<Body> {
        Response::new(full(text))
    }
}
