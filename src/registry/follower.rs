//! The journal follower's thread: an OS thread with a current-thread runtime of its own, on
//! which the proxy's journal store is opened (a stream's connection and consumer live there)
//! and [`Registry::follow`] runs: the tail that folds new lines and cancels the tokens of the
//! leases they close, the expiry timer, the retry of queued revocations, retirement.
//!
//! Invariant: nothing else is spawned on it, and its blocking pool is its own (the file store's
//! reads and the revocation queue's file I/O go there through `spawn_blocking`): no load on the
//! admin API, the connection workers or any other pool delays a read of the journal or the
//! teardown that follows it.

use super::live::Registry;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// How long a stopping follower waits for its blocking tasks (a journal read, say).
const STOP_WAIT: Duration = Duration::from_secs(1);

/// The follower's thread and runtime; both stop when this is dropped.
pub struct Follower {
    /// Spawns onto the follower's runtime.
    handle: Handle,
    /// Cancelled to stop the runtime (what it still runs is dropped).
    stop: CancellationToken,
}

impl Follower {
    /// Starts the thread, named `leasegate-journal`.
    pub fn start() -> io::Result<Follower> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("leasegate-journal-io")
            .build()?;
        let handle = runtime.handle().clone();
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        std::thread::Builder::new()
            .name("leasegate-journal".into())
            .spawn(move || {
                runtime.block_on(stopped.cancelled());
                runtime.shutdown_timeout(STOP_WAIT);
            })?;
        Ok(Follower { handle, stop })
    }

    /// Runs `future` on the follower's thread (opening the store, say) and returns its output.
    pub async fn run<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> io::Result<T> {
        self.handle.spawn(future).await.map_err(io::Error::other)
    }

    /// Follows `registry` on the follower's thread until `shutdown`.
    pub fn follow(&self, registry: Arc<Registry>, shutdown: CancellationToken) {
        self.handle.spawn(registry.follow(shutdown));
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn what_the_follower_runs_runs_on_its_own_thread() {
        let follower = Follower::start().unwrap();
        let (name, blocking) = follower
            .run(async {
                let name = std::thread::current().name().map(str::to_owned);
                let blocking = tokio::task::spawn_blocking(|| {
                    std::thread::current().name().map(str::to_owned)
                })
                .await
                .unwrap();
                (name, blocking)
            })
            .await
            .unwrap();
        assert_eq!(name.as_deref(), Some("leasegate-journal"));
        assert_eq!(blocking.as_deref(), Some("leasegate-journal-io"));
        drop(follower);
    }
}
