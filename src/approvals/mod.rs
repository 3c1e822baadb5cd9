//! Approvals that hold the request: a call some lease of its chain names in `approvals` (an MCP
//! tool, or a request of a route, [`route`]) waits, unsent, until a human approves or denies it (the admin API, the dashboard, the CLI) or its
//! time is up; every replica of the journal reads the same book of requests and decisions
//! ([`book`]) from the same store ([`store`]), so a decision made on one replica releases the
//! call held on another.
//!
//! Invariant: a held call goes on only on a verified `approved` decision that is the first
//! decision of its request in the store's order (or a standing one of its lease and tool);
//! everything else — a denial, the time running out, the lease closing, the proxy stopping,
//! a store that cannot be written or read back — refuses it, and a call is never held without
//! its request being durable first. A held call costs no step and no budget until it goes on,
//! and at most [`MAX_HELD_PER_LEASE`] calls of one lease (and [`MAX_HELD`] in all) wait at once.

pub mod book;
pub mod route;
pub mod store;
pub mod webhook;

use crate::contract::{Lease, Timestamp};
use crate::policy::codes::{Code, Refusal};
use crate::registry::Registry;
use book::{Applied, Book, Decision, Entry, Outcome, Request, Scope};
use serde_json::Value;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use store::ApprovalStore;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

pub use webhook::Webhook;

/// How long a call waits for a decision by default (`--approval-timeout`): well under the
/// five minutes the MCP SDK's client waits for an answer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
/// The longest `--approval-timeout`.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// Calls of one lease held at once; one more is refused `approval-unavailable`.
pub const MAX_HELD_PER_LEASE: usize = 16;
/// Calls held at once on this replica.
pub const MAX_HELD: usize = 1024;
/// How long a holder or a decider waits to read its own decision back.
const READ_BACK: Duration = Duration::from_secs(5);
/// Decided requests kept in memory for the admin API to show.
const DECIDED_KEPT: usize = 4096;
/// Lines queued from the store's follower to the book.
const FOLLOW_BUFFER: usize = 1024;

/// What an operator sets.
#[derive(Debug, Clone)]
pub struct Settings {
    pub timeout: Duration,
    pub webhook: Option<Webhook>,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            timeout: DEFAULT_TIMEOUT,
            webhook: None,
        }
    }
}

/// A call to hold.
#[derive(Debug)]
pub struct Call<'a> {
    /// The calling lease first.
    pub chain: &'a [Arc<Lease>],
    /// The lease whose `approvals` names the tool.
    pub named_by: &'a str,
    /// `<server>/<tool>`, or the route entry (`METHOD:host/path`) that holds a request.
    pub tool: &'a str,
    /// The call's arguments, as JSON text (a request: its method, target and body's start).
    pub arguments: &'a str,
}

/// Why a decision was not taken.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("no approval {0}")]
    Unknown(String),
    #[error("approval {} was already decided: {} by {} ({})", .0.id, .0.outcome.as_str(), .0.by, .0.reason)]
    Decided(Box<Decision>),
    #[error("approval {0} is past its deadline")]
    PastDeadline(String),
    #[error("no key in the keyring signs lease {0}'s records")]
    NoKey(String),
    #[error("the decision could not be recorded in the {0}")]
    Store(String),
    #[error("the decision was recorded but not read back within {READ_BACK:?}")]
    NotReadBack,
    #[error("this proxy has no approval store")]
    NoStore,
}

/// The book every replica reads, this replica's held calls, and where decisions go.
pub struct Approvals {
    store: Option<ApprovalStore>,
    book: Mutex<Book>,
    changed: watch::Sender<u64>,
    held: Mutex<HashMap<String, usize>>,
    settings: Settings,
    registry: Option<Arc<Registry>>,
    replica: String,
    /// Cancelled when the proxy stops: every held call is answered at once.
    closing: CancellationToken,
    /// Lines of the store that did not read or verify.
    set_aside: AtomicU64,
}

impl std::fmt::Debug for Approvals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Approvals")
            .field("store", &self.store.as_ref().map(ApprovalStore::describe))
            .finish()
    }
}

impl Approvals {
    /// Approvals without a store: a call that needs one is refused `approval-unavailable`.
    pub fn none() -> Approvals {
        Approvals::new(None, Settings::default(), None)
    }

    fn new(
        store: Option<ApprovalStore>,
        settings: Settings,
        registry: Option<Arc<Registry>>,
    ) -> Approvals {
        Approvals {
            store,
            book: Mutex::default(),
            changed: watch::Sender::new(0),
            held: Mutex::default(),
            settings,
            registry,
            replica: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
            closing: CancellationToken::new(),
            set_aside: AtomicU64::new(0),
        }
    }

    /// Opens `store`: reads everything it holds (verified under `registry`'s keys) before it
    /// returns, then follows it on the current runtime until `stop`.
    pub async fn open(
        store: ApprovalStore,
        settings: Settings,
        registry: Arc<Registry>,
        stop: CancellationToken,
    ) -> std::io::Result<Arc<Approvals>> {
        let (lines, next) = store.read_all().await?;
        let approvals = Arc::new(Approvals::new(
            Some(store.clone()),
            settings,
            Some(registry),
        ));
        for line in &lines {
            approvals.take(line);
        }
        tracing::info!(store = %store.describe(), lines = lines.len(), "approvals read");
        let (tx, mut rx) = mpsc::channel(FOLLOW_BUFFER);
        tokio::spawn(store.follow(next, tx));
        let reader = approvals.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    line = rx.recv() => match line {
                        Some(line) => reader.take(&line),
                        None => return,
                    },
                    _ = stop.cancelled() => return,
                }
            }
        });
        Ok(approvals)
    }

    /// What the store describes itself as (`None`: no store).
    pub fn describe(&self) -> Option<String> {
        self.store.as_ref().map(ApprovalStore::describe)
    }

    /// Lines of the store that did not read or verify, since start.
    pub fn set_aside(&self) -> u64 {
        self.set_aside.load(Ordering::Relaxed)
    }

    /// Calls held on this replica now.
    pub fn held_now(&self) -> usize {
        self.held().values().sum()
    }

    /// Answers every held call now (the proxy is stopping).
    pub fn close(&self) {
        self.closing.cancel();
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn held(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Folds one line of the store, if it reads and verifies under its lease's key.
    fn take(&self, line: &[u8]) {
        let entry = match book::read(line) {
            Ok(entry) => entry,
            Err(why) => return self.set_aside_line(&why.to_string()),
        };
        let Some(registry) = &self.registry else {
            return;
        };
        let snapshot = registry.snapshot();
        // A lease this proxy does not hold (retired long ago, or never in its journal): none of
        // its calls can be held or decided here, so its lines are skipped, not set aside.
        let Some(key) = snapshot.ledger.signing_key(book::lease_of(&entry)) else {
            return;
        };
        if !book::verifies(&entry, key) {
            return self.set_aside_line("its signature does not verify under its lease's key");
        }
        let mut book = self.book();
        if book.apply(entry) == Applied::Taken {
            let count = *self.changed.borrow() + 1;
            if count % 256 == 0 {
                book.forget_oldest(DECIDED_KEPT);
            }
            drop(book);
            self.changed.send_replace(count);
        }
    }

    fn set_aside_line(&self, why: &str) {
        let n = self.set_aside.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!(%why, set_aside = n, "a line of the approval store was set aside");
        }
    }

    /// Holds `call` until it is decided: `Ok` with the approval that lets it go on (its own, or
    /// a standing one of its lease), else the refusal it is answered with. `lease_closed`: the connection's lease token.
    pub async fn hold(
        &self,
        call: Call<'_>,
        lease_closed: &CancellationToken,
    ) -> Result<String, Refusal> {
        let lease_id = call.chain[0].id.clone();
        if let Some(standing) = self.book().standing(&lease_id, call.tool) {
            return Ok(standing.id.clone());
        }
        let Some(store) = &self.store else {
            return Err(unavailable(format!(
                "{} needs a human's approval (lease {}'s approvals), and this proxy keeps no approval store",
                action(call.tool), call.named_by
            )));
        };
        let _slot = self.slot(&lease_id)?;
        let key = self
            .registry
            .as_ref()
            .and_then(|r| r.snapshot().ledger.signing_key(&lease_id).cloned())
            .ok_or_else(|| unavailable(format!("no key signs lease {lease_id}'s records")))?;
        let now = Timestamp::now();
        let timeout = self.settings.timeout;
        let request = Request {
            id: book::new_id(),
            lease_id: lease_id.clone(),
            tool: call.tool.to_owned(),
            arguments: shown(call.arguments),
            named_by: call.named_by.to_owned(),
            at: now.to_string(),
            deadline: Timestamp::from_millis(now.as_millis() + timeout.as_millis() as i64)
                .to_string(),
            replica: self.replica.clone(),
            signature: String::new(),
        };
        let id = request.id.clone();
        let mut changed = self.changed.subscribe();
        let line = book::signed(Entry::Requested(request.clone()), &key);
        if let Err(error) = store.append(line).await {
            tracing::error!(%error, store = %store.describe(), "a call needing approval could not be recorded: refused");
            return Err(unavailable(format!(
                "{} needs a human's approval, and the request for it could not be recorded: {error}",
                action(call.tool)
            )));
        }
        tracing::info!(approval = %id, lease = %lease_id, tool = %call.tool, "a call waits for approval");
        if let Some(webhook) = &self.settings.webhook {
            webhook.tell(book::view(&request, None, now));
        }
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        loop {
            if let Some(decision) = self.book().decision(&id).cloned() {
                return self.outcome(&request, decision);
            }
            let (by, why) = tokio::select! {
                seen = changed.changed() => match seen {
                    Ok(()) => continue,
                    Err(_) => ("shutdown", "the proxy stopped".to_owned()),
                },
                _ = &mut deadline => ("timeout", format!("nobody decided within {}", humantime::format_duration(timeout))),
                _ = lease_closed.cancelled() => ("lease-closed", "the lease closed while the call waited".to_owned()),
                _ = self.closing.cancelled() => ("shutdown", "the proxy stopped before anybody decided".to_owned()),
            };
            return self.expire(store, &request, &key, by, &why).await;
        }
    }

    /// Ends a held call nobody decided: an `expired` decision is recorded, and the first
    /// decision read back is the outcome (an approval recorded just before ours still wins).
    async fn expire(
        &self,
        store: &ApprovalStore,
        request: &Request,
        key: &crate::contract::Key,
        by: &str,
        why: &str,
    ) -> Result<String, Refusal> {
        let decision = self.decision_of(request, Outcome::Expired, Scope::Once, why, by);
        let line = book::signed(Entry::Decided(decision.clone()), key);
        let first = match store.append(line).await {
            Ok(()) => self.read_back(&request.id).await,
            Err(error) => {
                tracing::warn!(approval = %request.id, %error, "the end of a held call could not be recorded");
                None
            }
        };
        self.outcome(request, first.unwrap_or(decision))
    }

    /// The first decision of `id`, once read back (at most [`READ_BACK`]).
    async fn read_back(&self, id: &str) -> Option<Decision> {
        let mut changed = self.changed.subscribe();
        let wait = async {
            loop {
                if let Some(decision) = self.book().decision(id).cloned() {
                    return Some(decision);
                }
                if changed.changed().await.is_err() {
                    return None;
                }
            }
        };
        tokio::time::timeout(READ_BACK, wait).await.ok().flatten()
    }

    fn outcome(&self, request: &Request, decision: Decision) -> Result<String, Refusal> {
        let tool = action(&request.tool);
        let lease = &request.lease_id;
        match (decision.outcome, decision.by.as_str()) {
            (Outcome::Approved, _) => {
                tracing::info!(approval = %request.id, lease = %lease, tool = %tool, "approved: the call goes on");
                Ok(decision.id)
            }
            (Outcome::Denied, _) => Err(Refusal::new(
                Code::ApprovalDenied,
                format!(
                    "{tool} was denied for lease {lease} (approval {}): {}",
                    request.id, decision.reason
                ),
            )),
            (Outcome::Expired, "timeout") => Err(Refusal::new(
                Code::ApprovalTimedOut,
                format!(
                    "{tool} needs a human's approval for lease {lease} (approval {}): {}",
                    request.id, decision.reason
                ),
            )),
            (Outcome::Expired, "lease-closed") => Err(Refusal::new(
                Code::LeaseClosed,
                format!("approval {}: {}", request.id, decision.reason),
            )),
            (Outcome::Expired, _) => Err(unavailable(format!(
                "{tool} waited for approval {}: {}",
                request.id, decision.reason
            ))),
        }
    }

    fn decision_of(
        &self,
        request: &Request,
        outcome: Outcome,
        scope: Scope,
        reason: &str,
        by: &str,
    ) -> Decision {
        Decision {
            id: request.id.clone(),
            lease_id: request.lease_id.clone(),
            tool: request.tool.clone(),
            outcome,
            scope,
            reason: reason.chars().take(book::REASON_MAX).collect(),
            by: by.to_owned(),
            at: Timestamp::now().to_string(),
            signature: String::new(),
        }
    }

    /// A slot for one more held call of `lease_id`, freed when dropped.
    fn slot(&self, lease_id: &str) -> Result<Slot<'_>, Refusal> {
        let mut held = self.held();
        let all: usize = held.values().sum();
        let of_lease = held.get(lease_id).copied().unwrap_or(0);
        if of_lease >= MAX_HELD_PER_LEASE || all >= MAX_HELD {
            return Err(unavailable(format!(
                "{of_lease} calls of lease {lease_id} and {all} in all already wait for approval (at most {MAX_HELD_PER_LEASE} and {MAX_HELD})"
            )));
        }
        *held.entry(lease_id.to_owned()).or_default() += 1;
        Ok(Slot {
            approvals: self,
            lease_id: lease_id.to_owned(),
        })
    }

    /// Decides request `id` (the admin API): the decision, once it is read back as the first.
    pub async fn decide(
        &self,
        id: &str,
        outcome: Outcome,
        scope: Scope,
        reason: &str,
    ) -> Result<Decision, DecideError> {
        let Some(store) = &self.store else {
            return Err(DecideError::NoStore);
        };
        let request = {
            let book = self.book();
            let request = book
                .request(id)
                .cloned()
                .ok_or_else(|| DecideError::Unknown(id.to_owned()))?;
            if let Some(decided) = book.decision(id) {
                return Err(DecideError::Decided(Box::new(decided.clone())));
            }
            request
        };
        let past = Timestamp::parse(&request.deadline).map_or(true, |d| d <= Timestamp::now());
        if past {
            return Err(DecideError::PastDeadline(id.to_owned()));
        }
        let key = self
            .registry
            .as_ref()
            .and_then(|r| r.snapshot().ledger.signing_key(&request.lease_id).cloned())
            .ok_or_else(|| DecideError::NoKey(request.lease_id.clone()))?;
        let ours = self.decision_of(&request, outcome, scope, reason, "operator");
        let line = book::signed(Entry::Decided(ours.clone()), &key);
        store
            .append(line)
            .await
            .map_err(|e| DecideError::Store(format!("{}: {e}", store.describe())))?;
        let first = self.read_back(id).await.ok_or(DecideError::NotReadBack)?;
        let same = (
            &first.at,
            first.outcome,
            first.scope,
            &first.reason,
            &first.by,
        ) == (&ours.at, ours.outcome, ours.scope, &ours.reason, &ours.by);
        match same {
            true => {
                tracing::info!(approval = %id, outcome = outcome.as_str(), scope = ?scope, "approval decided");
                Ok(first)
            }
            false => Err(DecideError::Decided(Box::new(first))),
        }
    }

    /// The admin API's view of request `id`.
    pub fn view(&self, id: &str) -> Option<Value> {
        let book = self.book();
        let request = book.request(id)?;
        Some(book::view(request, book.decision(id), Timestamp::now()))
    }

    /// The requests, newest first: pending ones only, or all that are kept; at most `limit`.
    pub fn list(&self, pending_only: bool, limit: usize) -> Vec<Value> {
        let now = Timestamp::now();
        self.book()
            .entries()
            .rev()
            .map(|(request, decision)| book::view(request, decision, now))
            .filter(|view| !pending_only || view["status"] == "pending")
            .take(limit)
            .collect()
    }
}

struct Slot<'a> {
    approvals: &'a Approvals,
    lease_id: String,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut held = self.approvals.held();
        if let Some(n) = held.get_mut(&self.lease_id) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.lease_id);
            }
        }
    }
}

/// How a message names what waited: `tool <server>/<tool>` or `route METHOD:host/path`.
fn action(name: &str) -> String {
    match route::parse(name) {
        Some(_) => format!("route {name}"),
        None => format!("tool {name}"),
    }
}

fn unavailable(detail: String) -> Refusal {
    Refusal::new(Code::ApprovalUnavailable, detail)
}

/// The arguments as a human is shown them: at most [`book::ARGUMENTS_SHOWN`] characters, and
/// `…` when cut.
fn shown(arguments: &str) -> String {
    let mut cut: String = arguments.chars().take(book::ARGUMENTS_SHOWN).collect();
    if cut.len() < arguments.len() {
        cut.push('…');
    }
    cut
}
