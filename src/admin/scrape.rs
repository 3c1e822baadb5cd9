//! `/metrics` as scrapes see it: rendered at most once per [`FRESH_FOR`], every scrape within
//! that time answered with the same bytes.
//!
//! Invariant: renders never overlap — a scrape that finds the answer stale renders it under a
//! lock, and the scrapes that waited for that lock take its result — and the time a render is
//! fresh from is the time its scrape asked, so a render never counts as fresher than it is.

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long one render answers every scrape.
pub const FRESH_FOR: Duration = Duration::from_secs(1);

/// One render and when its scrape asked.
struct Rendered {
    at: Instant,
    body: Bytes,
}

/// The last `/metrics` render.
#[derive(Default)]
pub struct Scrapes {
    /// Read without a lock by every scrape.
    last: ArcSwapOption<Rendered>,
    /// Held while rendering.
    rendering: Mutex<()>,
    /// Renders since start.
    renders: AtomicU64,
}

impl Scrapes {
    /// The last render, if it is fresh at `now`.
    pub fn fresh(&self, now: Instant) -> Option<Bytes> {
        let last = self.last.load();
        let last = last.as_ref()?;
        (now.saturating_duration_since(last.at) < FRESH_FOR).then(|| last.body.clone())
    }

    /// The answer to a scrape that asked at `now`: the last render if it is fresh then, else
    /// `render`'s (kept for the next scrapes). Blocks while another render runs.
    pub fn answer(&self, now: Instant, render: impl FnOnce() -> String) -> Bytes {
        let _rendering = self.rendering.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(body) = self.fresh(now) {
            return body;
        }
        let body = Bytes::from(render());
        self.renders.fetch_add(1, Ordering::Relaxed);
        self.last.store(Some(Arc::new(Rendered {
            at: now,
            body: body.clone(),
        })));
        body
    }

    /// Renders since start.
    pub fn renders(&self) -> u64 {
        self.renders.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrapes_within_a_second_share_one_render() {
        let scrapes = Scrapes::default();
        let start = Instant::now();
        let mut rendered = 0;
        let render = |n: &mut i32| {
            *n += 1;
            format!("render {n}")
        };
        assert_eq!(scrapes.fresh(start), None, "nothing rendered yet");
        let first = scrapes.answer(start, || render(&mut rendered));
        assert_eq!(first, "render 1");
        let later = start + Duration::from_millis(999);
        assert_eq!(scrapes.fresh(later), Some(first.clone()));
        assert_eq!(scrapes.answer(later, || render(&mut rendered)), first);
        assert_eq!(scrapes.renders(), 1);
        let stale = start + FRESH_FOR;
        assert_eq!(scrapes.fresh(stale), None);
        assert_eq!(scrapes.answer(stale, || render(&mut rendered)), "render 2");
        assert_eq!(scrapes.renders(), 2);
        // A scrape that asked before the render it waited for is answered by it.
        assert_eq!(scrapes.answer(start, || render(&mut rendered)), "render 2");
        assert_eq!(rendered, 2);
    }

    #[test]
    fn concurrent_stale_scrapes_render_once() {
        let scrapes = Arc::new(Scrapes::default());
        let now = Instant::now();
        let (entered, wait) = std::sync::mpsc::channel::<()>();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let first = {
            let scrapes = scrapes.clone();
            std::thread::spawn(move || {
                scrapes.answer(now, || {
                    entered.send(()).unwrap();
                    released.recv().unwrap();
                    "slow render".to_owned()
                })
            })
        };
        wait.recv().unwrap();
        let second = {
            let scrapes = scrapes.clone();
            std::thread::spawn(move || scrapes.answer(now, || "second render".to_owned()))
        };
        release.send(()).unwrap();
        assert_eq!(first.join().unwrap(), "slow render");
        assert_eq!(second.join().unwrap(), "slow render");
        assert_eq!(scrapes.renders(), 1);
    }
}
