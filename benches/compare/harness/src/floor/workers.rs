//! The floor's connection workers, as leasegate's (src/proxy/workers.rs): a thread per core,
//! each its own current-thread runtime with an accept loop; a connection lives on one worker
//! from accept to close, with everything it starts.
//!
//! Invariant: a worker keeps a connection it accepted unless it would then hold more than
//! [`SLACK`] connections above the least busy worker, which then takes it; a socket handed
//! over is taken off the accepting worker's event loop and registered on its new one.

use std::cell::Cell;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::runtime::Handle;

thread_local! {
    /// The index of the worker this thread is; `None` off the workers.
    static CURRENT: Cell<Option<usize>> = const { Cell::new(None) };
}

/// How many connections a worker may hold beyond the least busy one (leasegate's value).
const SLACK: usize = 1;

pub struct Workers {
    handles: Vec<Handle>,
    /// Connections living on each worker.
    open: Arc<[AtomicUsize]>,
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
    /// `count` (at least 1) worker threads, each running its runtime until the process ends.
    pub fn start(count: usize) -> std::io::Result<Workers> {
        let count = count.max(1);
        let mut handles = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(runtime.handle().clone());
            std::thread::Builder::new()
                .name(format!("floor-w{index}"))
                .spawn(move || {
                    CURRENT.with(|current| current.set(Some(index)));
                    runtime.block_on(std::future::pending::<()>());
                })?;
        }
        Ok(Workers {
            handles,
            open: (0..count).map(|_| AtomicUsize::new(0)).collect(),
        })
    }

    /// Makes one future per worker inside that worker's runtime (so a listener made there is
    /// registered with its event loop) and runs it there; an error runs none.
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
        for (handle, future) in self.handles.iter().zip(futures) {
            handle.spawn(future);
        }
        Ok(())
    }

    /// Where a new connection runs (`None`: the calling worker keeps it) and its place there.
    pub fn place(&self) -> (Option<&Handle>, Placed) {
        let (least, least_open) = self
            .open
            .iter()
            .map(|open| open.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, open)| open)
            .expect("at least one worker");
        let here = CURRENT.with(Cell::get);
        let (worker, handle) = match here {
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
        (handle, placed)
    }
}

/// An accepted socket on its way to the runtime that serves it (leasegate's
/// `listener::Accepted`): one handed to another worker is deregistered here and registered
/// again there, so its readiness reaches the thread that polls it.
pub enum Accepted {
    Here(TcpStream),
    Moving(std::net::TcpStream),
}

impl Accepted {
    pub fn moving(stream: TcpStream, moving: bool) -> std::io::Result<Accepted> {
        Ok(if moving {
            Accepted::Moving(stream.into_std()?)
        } else {
            Accepted::Here(stream)
        })
    }

    /// The socket, registered with the calling task's runtime.
    pub fn here(self) -> std::io::Result<TcpStream> {
        match self {
            Accepted::Here(stream) => Ok(stream),
            Accepted::Moving(stream) => TcpStream::from_std(stream),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Workers;
    use std::sync::atomic::Ordering;

    fn open(workers: &Workers) -> Vec<usize> {
        workers
            .open
            .iter()
            .map(|o| o.load(Ordering::Relaxed))
            .collect()
    }

    /// Off the workers every connection goes to the least busy one, and is given back when
    /// its place is dropped.
    #[test]
    fn connections_spread_to_the_least_busy_and_are_given_back() {
        let workers = Workers::start(3).unwrap();
        let held: Vec<_> = (0..6).map(|_| workers.place()).collect();
        assert_eq!(open(&workers), vec![2, 2, 2]);
        assert!(held.iter().all(|(handle, _)| handle.is_some()));
        drop(held);
        assert_eq!(open(&workers), vec![0, 0, 0]);
    }
}
