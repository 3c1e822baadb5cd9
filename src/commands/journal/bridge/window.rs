//! The bridges' publishes in flight: many acknowledgements awaited at once, at most one line
//! per subject (per lease).
//!
//! Invariant: a line is sent only once every earlier line of its subject has landed (was
//! acknowledged) or was given up on, so that the lines of one lease reach the stream in file
//! order whatever is retried: a send retries inside its own future, and the next line of the
//! lease waits for that future. Lines of different leases may land in any order; the fold
//! does not depend on it (a closing record waits for its grant, a chain is checked when used).

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use std::collections::HashSet;
use std::future::Future;
use std::io;

/// How many lines the bridges have in flight at most.
pub const WINDOW: usize = 512;

/// A line that was in flight, and how it ended.
#[derive(Debug)]
pub struct Landed<T> {
    pub subject: String,
    /// What the caller attached to the line (its hash, its number).
    pub tag: T,
    pub result: io::Result<()>,
}

/// Sends in flight.
pub struct Window<F: Future> {
    limit: usize,
    in_flight: FuturesUnordered<F>,
    /// The subjects of the lines in flight.
    busy: HashSet<String>,
}

impl<T, F: Future<Output = Landed<T>>> Window<F> {
    pub fn new(limit: usize) -> Window<F> {
        Window {
            limit: limit.max(1),
            in_flight: FuturesUnordered::new(),
            busy: HashSet::new(),
        }
    }

    /// Waits until a line of `subject` may be sent (none of its subject in flight, room in the
    /// window); hands each line that lands meanwhile to `landed`.
    pub async fn ready(&mut self, subject: &str, mut landed: impl FnMut(Landed<T>)) {
        while self.busy.contains(subject) || self.in_flight.len() >= self.limit {
            let Some(done) = self.in_flight.next().await else {
                break;
            };
            self.busy.remove(&done.subject);
            landed(done);
        }
    }

    /// Sends a line of `subject` (after [`Window::ready`] for it): `send` resolves once it has
    /// landed or was given up on.
    pub fn send(&mut self, subject: String, send: F) {
        debug_assert!(!self.busy.contains(&subject));
        self.busy.insert(subject);
        self.in_flight.push(send);
    }

    /// Waits for every line in flight.
    pub async fn drain(&mut self, mut landed: impl FnMut(Landed<T>)) {
        while let Some(done) = self.in_flight.next().await {
            self.busy.remove(&done.subject);
            landed(done);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    type Send = Pin<Box<dyn Future<Output = Landed<usize>>>>;

    /// A send that lands after `ms` (retries included), recording its landing.
    fn send(order: &Arc<Mutex<Vec<usize>>>, subject: &str, line: usize, ms: u64) -> Send {
        let (order, subject) = (order.clone(), subject.to_owned());
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            order.lock().unwrap().push(line);
            Landed {
                subject,
                tag: line,
                result: Ok(()),
            }
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_lines_of_one_subject_land_in_order_whatever_their_delay() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut window: Window<Send> = Window::new(8);
        // Line 0 of lease a is slow (retried); line 2 of lease a is fast but must wait;
        // line 1 of lease b may overtake both.
        let lines = [("a", 500), ("b", 1), ("a", 1), ("b", 1), ("a", 1)];
        let mut landed = 0;
        for (line, (subject, ms)) in lines.into_iter().enumerate() {
            window.ready(subject, |_| landed += 1).await;
            window.send(subject.to_owned(), send(&order, subject, line, ms));
        }
        window.drain(|_| landed += 1).await;
        assert_eq!(landed, 5);
        let order = order.lock().unwrap().clone();
        let of = |s: &[usize]| -> Vec<usize> {
            order.iter().copied().filter(|l| s.contains(l)).collect()
        };
        assert_eq!(of(&[0, 2, 4]), vec![0, 2, 4], "lease a in file order");
        assert_eq!(of(&[1, 3]), vec![1, 3], "lease b in file order");
        assert_eq!(order[0], 1, "another lease is not held up by a slow one");
    }

    #[tokio::test(start_paused = true)]
    async fn no_more_than_the_window_is_in_flight() {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut window: Window<Send> = Window::new(3);
        let mut most = 0;
        for line in 0..10 {
            let subject = format!("s{line}");
            window.ready(&subject, |_| {}).await;
            window.send(subject.clone(), send(&order, &subject, line, 10));
            most = most.max(window.in_flight.len());
        }
        window.drain(|_| {}).await;
        assert_eq!(most, 3);
        assert_eq!(order.lock().unwrap().len(), 10);
    }
}
