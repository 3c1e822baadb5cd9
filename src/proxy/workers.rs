//! Connection workers: a thread per core, each running its own single-threaded runtime, on
//! which a client connection lives from accept to close — its HTTP exchanges, the tunnel it
//! becomes, the upstream connections it opens and its lease watchers.
//!
//! Invariant: a task spawned while serving a connection runs on the worker it was placed on
//! (so a request, its upstream connection and its response are polled on one thread, without a
//! cross-thread wake between them), and no worker holds more than `SLACK` connections above
//! the least busy one when it takes a new one; the main runtime keeps the control plane (the
//! journal, the admin API, lease ports' bookkeeping). Workers stop after the drain (or when
//! their server is dropped without one), once nothing of a connection is left to run on them.
//!
//! Why not tokio's multi-threaded scheduler for connections: a forwarded request's two halves
//! (the client connection's task and the upstream connection's) were mostly polled on two
//! different threads, with a futex wake between them for every request or two. Here the
//! client connection, and with it everything it starts, stays put: 13 % more keep-alive
//! requests/s and 21 % less proxy CPU per CONNECT tunnel on two cores
//! (docs/performance.md).

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

thread_local! {
    /// The index of the worker this thread is; `None` off the workers.
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// How many connections a worker may hold beyond the least busy one before it hands a new
/// one over.
const SLACK: usize = 1;

/// Blocking-pool threads (a system DNS lookup, a journal append) all workers share at most:
/// tokio's default for one runtime, split between the workers' runtimes (at least 8 each).
const BLOCKING_THREADS: usize = 512;

/// How long a stopping worker waits for its blocking tasks (a DNS lookup, say).
const STOP_WAIT: Duration = Duration::from_secs(1);

/// How often a worker's tick fires: below every per-connection timeout (header read, dial,
/// idle), so that a timer set for one never falls before the worker's next wake.
const TICK: Duration = Duration::from_millis(500);

/// Keeps a timer due within [`TICK`] on the worker, always.
///
/// tokio's timer driver wakes its own thread (a write to its eventfd, and a spurious turn of
/// its event loop) whenever a new timer falls before the wake it last planned — and with no
/// timer pending at the last park, every new timer does. A connection sets several (hyper's
/// header read, the dial's timeout); without this, that was half a write per CONNECT tunnel.
async fn tick(stop: CancellationToken) {
    let mut ticks = tokio::time::interval(TICK);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// The connection workers of one proxy (none: everything runs on the caller's runtime).
#[derive(Default)]
pub struct Workers {
    handles: Vec<Handle>,
    /// Connections living on each worker.
    open: Arc<[AtomicUsize]>,
    /// Cancelled to stop the workers' runtimes (after the drain, or when dropped).
    stop: CancellationToken,
    /// How many futures [`Workers::spawn_made`] has placed: the next goes to this modulo the
    /// workers.
    made: AtomicUsize,
}

/// A connection's place on a worker: counted there until dropped.
pub struct Placed {
    open: Arc<[AtomicUsize]>,
    worker: usize,
}

impl Drop for Placed {
    fn drop(&mut self) {
        self.open[self.worker].fetch_sub(1, Ordering::Relaxed);
    }
}

impl Workers {
    /// How many threads [`Workers::start`] starts for `count` (0: one per core).
    pub fn resolve(count: usize) -> usize {
        crate::config::worker_threads(count)
    }

    /// `count` worker threads (0: one per core), each with a runtime of its own.
    pub fn start(count: usize) -> io::Result<Workers> {
        let count = Workers::resolve(count);
        let stop = CancellationToken::new();
        // Threads already started end if a later one cannot be.
        let stop_on_error = stop.clone().drop_guard();
        let mut handles = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .max_blocking_threads(BLOCKING_THREADS.div_ceil(count).max(8))
                .thread_name(format!("leasegate-w{index}-blocking"))
                .build()?;
            handles.push(runtime.handle().clone());
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("leasegate-w{index}"))
                .spawn(move || {
                    CURRENT.with(|current| current.set(Some(index)));
                    runtime.spawn(tick(stop.clone()));
                    runtime.block_on(stop.cancelled());
                    // Whatever is left (a task past the drain's bound) is dropped here.
                    runtime.shutdown_timeout(STOP_WAIT);
                })?;
        }
        stop_on_error.disarm();
        Ok(Workers {
            handles,
            open: (0..count).map(|_| AtomicUsize::new(0)).collect(),
            stop,
            made: AtomicUsize::new(0),
        })
    }

    /// How many workers there are (0: connections run on the caller's runtime).
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Whether there are no workers.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The worker the calling thread is, if it is one.
    pub fn current() -> Option<usize> {
        CURRENT.with(Cell::get)
    }

    /// Runs one future on each worker, the first on the first (an accept loop per worker,
    /// say); each is first polled there, inside the worker's runtime.
    pub fn spawn_each<Fut>(&self, futures: Vec<Fut>)
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        for (handle, future) in self.handles.iter().zip(futures) {
            handle.spawn(future);
        }
    }

    /// Makes one future per worker inside that worker's runtime, so that what `make` registers
    /// (a listener's socket) is registered with that worker's event loop, then runs each on its
    /// worker as [`Workers::spawn_each`] does. An error from `make` returns before anything
    /// runs: a proxy whose workers cannot all accept does not start with fewer.
    pub fn spawn_each_made<Fut, E>(&self, mut make: impl FnMut() -> Result<Fut, E>) -> Result<(), E>
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        let futures = self
            .handles
            .iter()
            .map(|handle| {
                let _entered = handle.enter();
                make()
            })
            .collect::<Result<Vec<_>, E>>()?;
        self.spawn_each(futures);
        Ok(())
    }

    /// Makes one future inside a worker's runtime (the workers taken in turn), so that what
    /// `make` registers (a lease port's listener) is registered with that worker's event loop,
    /// and runs it there: the connections it accepts then start on that worker, as the main
    /// listener's do, instead of being handed over from another thread. No workers: made and
    /// spawned on the caller's runtime.
    pub fn spawn_made<Fut, E>(&self, make: impl FnOnce() -> Result<Fut, E>) -> Result<(), E>
    where
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self.handles.is_empty() {
            tokio::spawn(make()?);
            return Ok(());
        }
        let turn = self.made.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        let handle = &self.handles[turn];
        let future = {
            let _entered = handle.enter();
            make()?
        };
        handle.spawn(future);
        Ok(())
    }

    /// Where a new connection runs, and its place there (hold it as long as the connection).
    ///
    /// The calling worker keeps it unless that would leave it more than `SLACK` connections
    /// ahead of the least busy worker, which then takes it; off the workers the least busy
    /// worker takes it. Whichever worker's accept wins the race
    /// for a connection, the workers stay within `SLACK` of each other: a burst of
    /// connections all accepted by one idle worker does not leave them all on its core.
    /// `None` (no workers): the caller's runtime, uncounted. A socket handed over must be
    /// registered again on its new worker (`listener::Accepted`), or its readiness keeps
    /// arriving at the thread that accepted it.
    pub fn place(&self) -> Option<(Option<&Handle>, Placed)> {
        if self.handles.is_empty() {
            return None;
        }
        let (least, least_open) = self
            .open
            .iter()
            .map(|open| open.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, open)| open)?;
        let (worker, handle) = match Workers::current() {
            Some(here) if self.open[here].load(Ordering::Relaxed) <= least_open + SLACK => {
                (here, None)
            }
            _ => (least, Some(&self.handles[least])),
        };
        self.open[worker].fetch_add(1, Ordering::Relaxed);
        let placed = Placed {
            open: self.open.clone(),
            worker,
        };
        Some((handle, placed))
    }

    /// Stops the workers' runtimes: after the drain, when nothing of a connection is left.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // A server dropped without a drain (tests) still lets its threads go.
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::{Workers, SLACK};

    /// Runs `f` on worker `index` and returns what it returns.
    fn on_worker<T: Send + 'static>(
        workers: &Workers,
        index: usize,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut f = Some(f);
        workers.spawn_each(
            (0..workers.len())
                .map(|i| {
                    let (tx, f) = (tx.clone(), f.take_if(|_| i == index));
                    async move {
                        if let Some(f) = f {
                            let _ = tx.send(f());
                        }
                    }
                })
                .collect(),
        );
        rx.recv().unwrap()
    }

    #[test]
    fn off_the_workers_a_connection_goes_to_the_least_busy_and_is_given_back() {
        let workers = Workers::start(3).unwrap();
        let held: Vec<_> = (0..6).map(|_| workers.place().unwrap()).collect();
        let open = |w: &Workers| -> Vec<usize> {
            w.open
                .iter()
                .map(|o| o.load(std::sync::atomic::Ordering::Relaxed))
                .collect()
        };
        assert_eq!(open(&workers), vec![2, 2, 2]);
        assert!(held.iter().all(|(handle, _)| handle.is_some()));
        drop(held);
        assert_eq!(open(&workers), vec![0, 0, 0]);
        assert!(
            Workers::default().place().is_none(),
            "no workers: the caller's runtime"
        );
    }

    #[test]
    fn a_worker_keeps_what_it_accepts_until_it_is_ahead_by_more_than_the_slack() {
        let workers = std::sync::Arc::new(Workers::start(2).unwrap());
        let on = workers.clone();
        let (kept, handed, current) = on_worker(&workers, 1, move || {
            let mut held = Vec::new();
            let mut kept = 0;
            // Worker 0 is idle: worker 1 keeps SLACK + 1, then hands the next one over.
            for _ in 0..=SLACK {
                let placed = on.place().unwrap();
                kept += usize::from(placed.0.is_none());
                held.push(placed.1);
            }
            let handed = on.place().unwrap();
            (
                kept,
                handed.0.is_some() && handed.1.worker == 0,
                Workers::current(),
            )
        });
        assert_eq!(kept, SLACK + 1);
        assert!(handed, "the idle worker takes the connection");
        assert_eq!(current, Some(1));
        assert_eq!(Workers::current(), None, "a test thread is no worker");
    }

    #[test]
    fn a_task_spawned_on_a_worker_runs_there() {
        let workers = Workers::start(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        workers.spawn_each(
            (0..2)
                .map(|i| {
                    let tx = tx.clone();
                    async move {
                        let spawned = tokio::spawn(async { Workers::current() }).await.unwrap();
                        let _ = tx.send((i, spawned));
                    }
                })
                .collect(),
        );
        let mut seen: Vec<_> = (0..2).map(|_| rx.recv().unwrap()).collect();
        seen.sort();
        assert_eq!(seen, vec![(0, Some(0)), (1, Some(1))]);
    }

    /// What `spawn_each_made` makes is registered with its worker's event loop (a listener made
    /// there accepts there), and a failure to make one runs none of them.
    #[test]
    fn futures_made_in_each_worker_run_there_or_none_runs() {
        let workers = Workers::start(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut addrs = Vec::new();
        workers
            .spawn_each_made(|| {
                let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
                listener.set_nonblocking(true)?;
                addrs.push(listener.local_addr()?);
                let listener = tokio::net::TcpListener::from_std(listener)?;
                let tx = tx.clone();
                Ok::<_, std::io::Error>(async move {
                    let accepted = listener.accept().await.is_ok();
                    let _ = tx.send((accepted, Workers::current()));
                })
            })
            .unwrap();
        let _clients: Vec<_> = addrs
            .iter()
            .map(|addr| std::net::TcpStream::connect(addr).unwrap())
            .collect();
        let mut seen: Vec<_> = (0..2)
            .map(|_| rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap())
            .collect();
        seen.sort();
        assert_eq!(seen, vec![(true, Some(0)), (true, Some(1))]);

        let mut made = 0;
        let failed = workers.spawn_each_made(|| {
            made += 1;
            let tx = tx.clone();
            match made {
                1 => Ok(async move {
                    let _ = tx.send((true, Workers::current()));
                }),
                _ => Err("the second worker's listener"),
            }
        });
        assert_eq!(failed, Err("the second worker's listener"));
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_millis(300)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout),
            "nothing runs when one cannot be made"
        );
    }

    #[test]
    fn stopping_ends_the_worker_threads() {
        let workers = Workers::start(2).unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        // Each worker holds a sender until its runtime drops the task that holds it.
        workers.spawn_each(
            (0..2)
                .map(|_| {
                    let tx = tx.clone();
                    async move {
                        std::future::pending::<()>().await;
                        drop(tx);
                    }
                })
                .collect(),
        );
        drop(tx);
        workers.stop();
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(5)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        );
    }
}
