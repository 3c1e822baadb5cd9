//! Cancellation tokens of leases with traffic, and when the next of them reaches its end.
//!
//! Invariant: after [`LeaseTokens::close_where_not_open`] at `now`, every token of a lease
//! whose chain opens nothing at `now` is cancelled and forgotten, and `next_deadline` is at or
//! before the earliest `expires_at` in the chains of the tokens kept (and of any handed out
//! since); each time it may have moved earlier, `rearm` is notified. A child's token is a child
//! of its parent's, so cancelling a lease cancels its subtree.

use super::ledger::{Ledger, MAX_CHAIN_DEPTH};
use super::Snapshot;
use crate::contract::Timestamp;
use arc_swap::ArcSwap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The tokens of a running proxy and the deadline the expiry timer sleeps until.
#[derive(Debug)]
pub struct LeaseTokens {
    tokens: Mutex<Tokens>,
    /// Milliseconds since the epoch when the next lease with a token reaches `expires_at`
    /// (`i64::MAX`: none). Written only under the `tokens` lock.
    next_deadline: AtomicI64,
    /// Wakes the expiry timer when `next_deadline` may have moved.
    rearm: Notify,
}

#[derive(Debug, Default)]
struct Tokens {
    /// Keyed by lease id.
    live: HashMap<String, CancellationToken>,
}

impl Default for LeaseTokens {
    fn default() -> LeaseTokens {
        LeaseTokens {
            tokens: Mutex::default(),
            next_deadline: AtomicI64::new(i64::MAX),
            rearm: Notify::new(),
        }
    }
}

impl LeaseTokens {
    fn lock(&self) -> std::sync::MutexGuard<'_, Tokens> {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The token of `lease_id` at `now`: already cancelled if its chain opens nothing in the
    /// newest snapshot.
    pub fn token(
        &self,
        current: &ArcSwap<Snapshot>,
        lease_id: &str,
        now: Timestamp,
    ) -> CancellationToken {
        let mut tokens = self.lock();
        // Loaded under the lock: a concurrent `close_where_not_open` either ran before (and we
        // see at least what it saw) or runs after (and cancels what we hand out).
        let snapshot = current.load();
        let Ok(chain) = snapshot.ledger.check_chain(lease_id, now) else {
            let token = CancellationToken::new();
            token.cancel();
            return token;
        };
        let deadline = chain
            .iter()
            .map(|l| l.expires_at.as_millis())
            .min()
            .unwrap_or(i64::MAX);
        if self.next_deadline.fetch_min(deadline, Ordering::SeqCst) > deadline {
            self.rearm.notify_one();
        }
        token_for(&mut tokens.live, &snapshot.ledger, lease_id, 0)
    }

    /// Cancels the tokens of every lease that opens nothing at `now`, and notes when the next
    /// remaining one reaches its end.
    /// The newest snapshot is loaded under the lock, so a caller that published one and then
    /// calls this never acts on an older one.
    pub fn close_where_not_open(&self, current: &ArcSwap<Snapshot>, now: Timestamp) {
        let mut tokens = self.lock();
        let live = &mut tokens.live;
        let snapshot = current.load();
        let ledger = &snapshot.ledger;
        let mut next_deadline = i64::MAX;
        live.retain(|id, token| match ledger.check_chain(id, now) {
            Ok(chain) => {
                for lease in &chain {
                    next_deadline = next_deadline.min(lease.expires_at.as_millis());
                }
                true
            }
            Err(_) => {
                token.cancel();
                false
            }
        });
        self.next_deadline.store(next_deadline, Ordering::SeqCst);
        drop(tokens);
        self.rearm.notify_one();
    }

    /// When (ms since the epoch) the next lease with a token reaches its end.
    pub fn next_deadline(&self) -> i64 {
        self.next_deadline.load(Ordering::SeqCst)
    }

    /// Resolves once `next_deadline` may have moved since the last time it resolved.
    pub async fn rearmed(&self) {
        self.rearm.notified().await
    }
}

fn token_for(
    tokens: &mut HashMap<String, CancellationToken>,
    ledger: &Ledger,
    lease_id: &str,
    depth: usize,
) -> CancellationToken {
    if let Some(token) = tokens.get(lease_id) {
        return token.clone();
    }
    let parent = ledger.lease(lease_id).and_then(|l| l.parent.clone());
    let token = match parent {
        Some(parent) if depth < MAX_CHAIN_DEPTH => {
            token_for(tokens, ledger, &parent, depth + 1).child_token()
        }
        _ => CancellationToken::new(),
    };
    tokens.insert(lease_id.to_owned(), token.clone());
    token
}
