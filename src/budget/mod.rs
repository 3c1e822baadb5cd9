//! Model budgets: what each lease has spent on metered model calls — its own calls and its
//! descendants', from this replica and, folded from the egress stream, every other — what its
//! calls in flight have reserved, and whether a lease's chain has budget left for a new call.
//!
//! Invariants: a call reserves its bound ([`Bound`]: the most it may spend) along its chain
//! before it goes out and is charged exactly once when it ends — what its usage says, or its
//! bound when its usage could not be read (cut, hung up on, never answered, or the process
//! died: the durable spend log ([`log`]) charges a reservation left open at the next start);
//! a new model call is refused when any lease of its chain with a ceiling has spent, with
//! what its subtree's calls in flight reserved, at least that ceiling. So a ceiling is passed
//! by at most the last admitted call's bound, on one replica. Unmetered calls are counted as
//! such, never as zero tokens.

pub mod log;

use crate::policy::codes::{Code, Refusal};
use crate::registry::Registry;
use crate::telemetry::egress::{LoggedModel, ModelCall};
use crate::telemetry::egress_stream::Follower;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The ceilings of one lease's budget that model calls spend (`budget.tokens`,
/// `budget.cost_usd`); `None`: no ceiling of that kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ceilings {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
    /// `budget.steps`: model calls (each metered call is one step).
    pub steps: Option<u64>,
}

impl Ceilings {
    /// The ceilings of `lease`'s budget that model calls spend.
    pub fn of(lease: &crate::contract::Lease) -> Ceilings {
        lease
            .budget
            .as_deref()
            .map(|b| Ceilings {
                tokens: b.tokens,
                cost_usd: b.cost_usd,
                steps: b.steps,
            })
            .unwrap_or_default()
    }

    /// Whether any ceiling is set.
    pub fn any(&self) -> bool {
        self.tokens.is_some() || self.cost_usd.is_some() || self.steps.is_some()
    }
}

/// What a chain has left of each ceiling (`None`: no ceiling of that kind on it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Left {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
    pub steps: Option<u64>,
}

/// What one call reported, as charged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Charge {
    /// `false`: its usage could not be read; the token fields are then its bound, charged in
    /// its place (zero: no bound was known).
    pub metered: bool,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// `None`: the model is not in the price table (or, unmetered, its bound is not priced).
    pub cost_usd: Option<f64>,
    /// MCP tool calls: the charge is these steps only (no model call). Zero: a model call.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tool_calls: u64,
}

impl Charge {
    /// The charge of `calls` MCP tool calls that went out: steps, no tokens, no cost.
    pub fn tool_calls(calls: u64) -> Charge {
        Charge {
            metered: true,
            cost_usd: Some(0.0),
            tool_calls: calls,
            ..Charge::default()
        }
    }
}

/// The most one model call may spend, as its request says (its output cap, or the configured
/// default, and its input bounded by the request's size), reserved while it is in flight and
/// charged when its usage cannot be read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Bound {
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// `None`: the model is not priced; the bound holds no cost.
    pub cost_usd: Option<f64>,
    /// MCP `tools/call` requests (one POST may hold a batch of them): a bound of steps only,
    /// no tokens or cost. Zero: a model call (one step).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tool_calls: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Bound {
    pub fn tokens(&self) -> u64 {
        self.input_tokens.saturating_add(self.output_tokens)
    }

    /// The bound of `calls` MCP tool calls: that many steps, nothing else.
    pub fn tool_calls(calls: u64) -> Bound {
        Bound {
            cost_usd: Some(0.0),
            tool_calls: calls,
            ..Bound::default()
        }
    }

    /// The steps it takes: its tool calls, or the one model call it is.
    pub fn steps(&self) -> u64 {
        match self.tool_calls {
            0 => 1,
            calls => calls,
        }
    }

    fn cost(&self) -> f64 {
        self.cost_usd
            .filter(|c| c.is_finite() && *c >= 0.0)
            .unwrap_or(0.0)
    }

    /// The charge of a call whose usage could not be read: its bound.
    pub fn charge(&self) -> Charge {
        Charge {
            metered: false,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cached_tokens: 0,
            cost_usd: self.cost_usd,
            tool_calls: self.tool_calls,
        }
    }
}

/// Totals of metered model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Spent {
    /// Model calls, metered or not.
    pub calls: u64,
    /// What `budget.tokens` counts: input plus output tokens of the metered calls, and the
    /// bound of each unmetered one.
    pub tokens: u64,
    /// Of the metered calls.
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// What `budget.cost_usd` counts: what the priced calls cost, and the priced bound of each
    /// unmetered one.
    pub cost_usd: f64,
    /// Calls whose usage could not be read (charged their bound).
    pub unmetered: u64,
    /// Metered calls of a model the price table does not name (their cost is not in `cost_usd`).
    pub unpriced: u64,
    /// MCP `tools/call` requests that went out. `budget.steps` counts these and `calls`.
    pub tool_calls: u64,
}

impl Spent {
    /// Counts one call.
    pub fn add(&mut self, charge: &Charge) {
        if charge.tool_calls > 0 {
            self.tool_calls = self.tool_calls.saturating_add(charge.tool_calls);
            return;
        }
        self.calls += 1;
        self.tokens = self
            .tokens
            .saturating_add(charge.input_tokens.saturating_add(charge.output_tokens));
        let cost = charge.cost_usd.filter(|c| c.is_finite() && *c >= 0.0);
        if !charge.metered {
            self.unmetered += 1;
            self.cost_usd += cost.unwrap_or(0.0);
            return;
        }
        self.input_tokens = self.input_tokens.saturating_add(charge.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(charge.output_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(charge.cached_tokens);
        match cost {
            Some(cost) => self.cost_usd += cost,
            None => self.unpriced += 1,
        }
    }
}

impl Charge {
    /// The charge of a call as this replica's egress line holds it: unmetered (at its bound,
    /// `charged_tokens`) when the line says so.
    pub fn of_call(call: &ModelCall) -> Charge {
        match call.unmetered {
            None => Charge {
                metered: true,
                input_tokens: call.input_tokens.unwrap_or(0),
                output_tokens: call.output_tokens.unwrap_or(0),
                cached_tokens: call.cached_tokens.unwrap_or(0),
                cost_usd: call.cost_usd.flatten(),
                tool_calls: 0,
            },
            Some(_) => Charge {
                metered: false,
                input_tokens: call.charged_tokens.unwrap_or(0),
                output_tokens: 0,
                cached_tokens: 0,
                cost_usd: call.charged_cost_usd,
                tool_calls: 0,
            },
        }
    }

    /// The charge of a call as its egress line tells it (another replica's, read from the
    /// egress stream): unmetered, at the bound the line charged, unless both token counts
    /// are there.
    pub fn of_line(model: &LoggedModel) -> Charge {
        match model.tokens() {
            Some((input_tokens, output_tokens)) => Charge {
                metered: true,
                input_tokens,
                output_tokens,
                cached_tokens: model.cached_tokens.unwrap_or(0),
                cost_usd: model.cost(),
                tool_calls: 0,
            },
            None => Charge {
                metered: false,
                input_tokens: model.charged_tokens.unwrap_or(0),
                output_tokens: 0,
                cached_tokens: 0,
                cost_usd: model
                    .charged_cost_usd
                    .filter(|c| c.is_finite() && *c >= 0.0),
                tool_calls: 0,
            },
        }
    }
}

impl Spent {
    /// Adds `other`'s figures (a sum over leases).
    pub fn merge(&mut self, other: &Spent) {
        self.calls += other.calls;
        self.tokens = self.tokens.saturating_add(other.tokens);
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(other.cached_tokens);
        self.cost_usd += other.cost_usd;
        self.unmetered += other.unmetered;
        self.unpriced += other.unpriced;
        self.tool_calls = self.tool_calls.saturating_add(other.tool_calls);
    }

    /// What `budget.steps` counts: model calls and MCP tool calls.
    pub fn steps(&self) -> u64 {
        self.calls.saturating_add(self.tool_calls)
    }
}

/// What a subtree's calls in flight have reserved.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct InFlight {
    pub calls: u64,
    pub tokens: u64,
    pub cost_usd: f64,
    /// MCP tool calls in flight.
    pub tool_calls: u64,
}

impl InFlight {
    /// What `budget.steps` counts of it.
    pub fn steps(&self) -> u64 {
        self.calls.saturating_add(self.tool_calls)
    }

    fn add(&mut self, bound: &Bound) {
        if bound.tool_calls > 0 {
            self.tool_calls = self.tool_calls.saturating_add(bound.tool_calls);
            return;
        }
        self.calls += 1;
        self.tokens = self.tokens.saturating_add(bound.tokens());
        self.cost_usd += bound.cost();
    }

    fn remove(&mut self, bound: &Bound) {
        if bound.tool_calls > 0 {
            self.tool_calls = self.tool_calls.saturating_sub(bound.tool_calls);
            return;
        }
        self.calls = self.calls.saturating_sub(1);
        self.tokens = self.tokens.saturating_sub(bound.tokens());
        self.cost_usd = match self.calls {
            0 => 0.0,
            _ => (self.cost_usd - bound.cost()).max(0.0),
        };
    }
}

/// One lease's figures: its own calls, its subtree's (its own and its descendants'), and what
/// its subtree's calls in flight reserved (on this replica).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LeaseSpending {
    pub own: Spent,
    pub subtree: Spent,
    pub in_flight: InFlight,
}

/// Why a model call may not go: a spent budget (which lease's, which ceiling, how much was
/// spent and reserved), or budgets that cannot be checked or kept.
#[derive(Debug, Clone, PartialEq)]
pub enum Exhausted {
    Spent {
        lease_id: String,
        /// `tokens` or `cost_usd`.
        ceiling: &'static str,
        spent: f64,
        /// What calls in flight under the lease reserved.
        reserved: f64,
        limit: f64,
    },
    /// The chain has a budget, and the other replicas' usage is not being read (the egress
    /// stream is down, or not read up to its end yet): spending is unknown, so it is refused.
    OthersUnknown,
    /// The chain has a budget, and the call's reservation could not be written to the spend
    /// log: what it spends would not survive a restart, so it is refused.
    Unrecorded(String),
    /// A lease of the chain has a `budget.cost_usd`, and the call's model has no price (or
    /// there is no price table): its cost could not be counted, so it is refused.
    Unpriced { lease_id: String },
}

impl Exhausted {
    /// The `budget-exhausted` refusal: the detail names the lease, the ceiling and the figures.
    pub fn refusal(&self) -> Refusal {
        let detail = match self {
            Exhausted::Spent {
                lease_id,
                ceiling,
                spent,
                reserved,
                limit,
            } if *reserved > 0.0 => format!(
                "lease {lease_id}'s budget.{ceiling} is spent: {spent} of {limit}, and {reserved} reserved by calls in flight"
            ),
            Exhausted::Spent {
                lease_id,
                ceiling,
                spent,
                limit,
                ..
            } => format!("lease {lease_id}'s budget.{ceiling} is spent: {spent} of {limit}"),
            Exhausted::OthersUnknown => "the budget cannot be checked: the other replicas' usage is not being read from the egress stream".to_owned(),
            Exhausted::Unpriced { lease_id } => format!("lease {lease_id} has a budget.cost_usd, and the price table (--prices) gives this call's model no price: its cost could not be counted (give the model a price, or a `*` entry)"),
            Exhausted::Unrecorded(why) => format!("the budget cannot be kept: the call's reservation could not be written to the spend log ({why})"),
        };
        Refusal::new(Code::BudgetExhausted, detail)
    }
}

/// Every lease's spending (only leases that made model calls, or whose descendants did).
#[derive(Debug, Default)]
pub struct Spending {
    leases: Mutex<HashMap<Arc<str>, LeaseSpending>>,
    /// With replicas: whether every other replica's usage is being folded in (see
    /// [`Spending::follow_others`]); unset: this proxy is the only one.
    others: OnceLock<Arc<AtomicBool>>,
    /// Where what is spent is kept across restarts (`serve`); unset: in memory only.
    log: OnceLock<log::SpendLog>,
    /// Bumped whenever what some lease spent grows: a stream in flight looks at its chain's
    /// spending again only then ([`Reservation::crossed`]).
    changes: AtomicU64,
}

impl Spending {
    /// The per-lease map; a panic elsewhere while it was held leaves sums that are still whole.
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, LeaseSpending>> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Charges one call of `chain`'s first lease: its own total, and the subtree total of it
    /// and of every ancestor after it.
    pub fn charge<'a>(&self, chain: impl IntoIterator<Item = &'a str>, charge: &Charge) {
        self.along(chain, |spent| spent.add(charge));
    }

    /// Adds totals an earlier run kept (the spend log's): `spent` of `chain`'s first lease,
    /// counted as [`Spending::charge`] counts a call.
    pub fn restore<'a>(&self, chain: impl IntoIterator<Item = &'a str>, spent: &Spent) {
        self.along(chain, |total| total.merge(spent));
    }

    /// `add` to the own total of `chain`'s first lease and to the subtree total of each.
    fn along<'a>(&self, chain: impl IntoIterator<Item = &'a str>, add: impl Fn(&mut Spent)) {
        self.changes.fetch_add(1, Ordering::Release);
        let mut leases = self.lock();
        for (i, id) in chain.into_iter().enumerate() {
            let entry = entry(&mut leases, id);
            if i == 0 {
                add(&mut entry.own);
            }
            add(&mut entry.subtree);
        }
    }

    /// What `lease_id` (and its subtree) has spent; zero for a lease with no calls.
    pub fn of(&self, lease_id: &str) -> LeaseSpending {
        let leases = self.lock();
        leases.get(lease_id).copied().unwrap_or_default()
    }

    /// Whether a new model call under `chain` (the lease first, then its ancestors, each with
    /// its budget) may go, as [`Spending::reserve`] decides it, without reserving anything.
    pub fn check<'a>(
        &self,
        chain: impl IntoIterator<Item = (&'a str, Ceilings)>,
    ) -> Result<(), Exhausted> {
        let leases = self.lock();
        self.admit(&leases, chain, 1)
    }

    /// Whether other replicas spend, and their spending is not being read now.
    fn others_unknown(&self) -> bool {
        self.others
            .get()
            .is_some_and(|live| !live.load(Ordering::Acquire))
    }

    /// What `chain` (a lease first, then its ancestors, each with its budget) has left of
    /// each ceiling: the least, along the chain, of a ceiling less its subtree's spending and
    /// what its calls in flight reserved (`None`: no ceiling of that kind on the chain). What
    /// a new child's budget is clamped to; refused, like a call, when other replicas'
    /// spending is not being read.
    pub fn remaining<'a>(
        &self,
        chain: impl IntoIterator<Item = (&'a str, Ceilings)>,
    ) -> Result<Left, Exhausted> {
        let leases = self.lock();
        let (mut tokens, mut cost, mut steps): (Option<u64>, Option<f64>, Option<u64>) =
            (None, None, None);
        for (id, budget) in chain.into_iter().filter(|(_, c)| c.any()) {
            if self.others_unknown() {
                return Err(Exhausted::OthersUnknown);
            }
            let known = leases.get(id).copied().unwrap_or_default();
            if let Some(limit) = budget.tokens {
                let used = known.subtree.tokens.saturating_add(known.in_flight.tokens);
                let left = limit.saturating_sub(used);
                tokens = Some(tokens.map_or(left, |t| t.min(left)));
            }
            if let Some(limit) = budget.cost_usd {
                let left = (limit - known.subtree.cost_usd - known.in_flight.cost_usd).max(0.0);
                cost = Some(cost.map_or(left, |c| c.min(left)));
            }
            if let Some(limit) = budget.steps {
                let used = known
                    .subtree
                    .steps()
                    .saturating_add(known.in_flight.steps());
                let left = limit.saturating_sub(used);
                steps = Some(steps.map_or(left, |s| s.min(left)));
            }
        }
        Ok(Left {
            tokens,
            cost_usd: cost,
            steps,
        })
    }

    /// The first lease of `chain` whose subtree has spent, with its calls in flight, a
    /// ceiling, if any.
    fn admit<'a>(
        &self,
        leases: &HashMap<Arc<str>, LeaseSpending>,
        chain: impl IntoIterator<Item = (&'a str, Ceilings)>,
        steps: u64,
    ) -> Result<(), Exhausted> {
        for (id, budget) in chain.into_iter().filter(|(_, c)| c.any()) {
            if self.others_unknown() {
                return Err(Exhausted::OthersUnknown);
            }
            let ceilings = figures(budget, leases.get(id).copied().unwrap_or_default());
            for (ceiling, limit, spent, reserved) in ceilings {
                // A call is admitted while what it counts fits under the ceiling: one step
                // each (a batch of tool calls, all of them), any tokens or cost at all.
                let over = |limit: &f64| match ceiling {
                    "steps" => spent + reserved + steps as f64 > *limit,
                    _ => spent + reserved >= *limit,
                };
                if let Some(limit) = limit.filter(over) {
                    return Err(Exhausted::Spent {
                        lease_id: id.to_owned(),
                        ceiling,
                        spent,
                        reserved,
                        limit,
                    });
                }
            }
        }
        Ok(())
    }

    /// Admits a new model call under `chain` (the lease first, then its ancestors, each with
    /// its budget) and reserves `bound` along it, or says which budget is spent. Under a
    /// budget, the reservation is on disk (the spend log) before this returns: a call that
    /// goes out is charged even if the process dies while it is in flight.
    pub async fn reserve(
        self: &Arc<Self>,
        chain: &[(Arc<str>, Ceilings)],
        bound: Bound,
    ) -> Result<Reservation, Exhausted> {
        // A cost ceiling counts what calls cost: one whose cost cannot be told is refused,
        // never let through uncounted.
        if bound.cost_usd.is_none() {
            if let Some((id, _)) = chain.iter().find(|(_, c)| c.cost_usd.is_some()) {
                return Err(Exhausted::Unpriced {
                    lease_id: id.to_string(),
                });
            }
        }
        let ids: Vec<Arc<str>> = chain.iter().map(|(id, _)| id.clone()).collect();
        {
            let mut leases = self.lock();
            self.admit(
                &leases,
                chain.iter().map(|(id, c)| (&**id, *c)),
                bound.steps(),
            )?;
            for id in &ids {
                entry(&mut leases, id).in_flight.add(&bound);
            }
        }
        let mut reservation = Reservation {
            spending: self.clone(),
            chain: ids,
            ceilings: chain.iter().map(|(_, c)| *c).collect(),
            bound,
            logged: None,
            settled: false,
            seen_changes: self.changes.load(Ordering::Acquire),
        };
        let budgeted = chain.iter().any(|(_, c)| c.any());
        if let (true, Some(log)) = (budgeted, self.log.get()) {
            match log.reserve(&reservation.chain, &bound).await {
                Ok(id) => reservation.logged = Some(id),
                Err(why) => {
                    // Never sent: nothing is charged, the reservation goes.
                    reservation.release_now();
                    return Err(Exhausted::Unrecorded(why));
                }
            }
        }
        Ok(reservation)
    }

    /// From now on budgets are checked only while `live` says every other replica's usage
    /// is being folded in (the egress stream's follower is connected and caught up).
    pub fn follow_others(&self, live: Arc<AtomicBool>) {
        let _ = self.others.set(live);
    }

    /// From now on what is reserved and spent is kept in `log` too.
    pub fn keep_in(&self, log: log::SpendLog) {
        let _ = self.log.set(log);
    }

    /// Forgets leases `keep` says no to (closed long ago): the map holds only leases that may
    /// still spend or be asked about. A lease with calls in flight is kept.
    pub fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        let mut leases = self.lock();
        leases.retain(|id, spending| spending.in_flight.steps() > 0 || keep(id));
    }
}

/// Each ceiling of `budget` with what counts against it in `known`: spent by its subtree, and
/// reserved by the subtree's calls in flight.
fn figures(budget: Ceilings, known: LeaseSpending) -> [(&'static str, Option<f64>, f64, f64); 3] {
    let (spent, held) = (known.subtree, known.in_flight);
    [
        (
            "tokens",
            budget.tokens.map(|t| t as f64),
            spent.tokens as f64,
            held.tokens as f64,
        ),
        (
            "steps",
            budget.steps.map(|s| s as f64),
            spent.steps() as f64,
            held.steps() as f64,
        ),
        ("cost_usd", budget.cost_usd, spent.cost_usd, held.cost_usd),
    ]
}

fn entry<'m>(leases: &'m mut HashMap<Arc<str>, LeaseSpending>, id: &str) -> &'m mut LeaseSpending {
    // One lookup for a lease already there, which is nearly every call.
    if leases.contains_key(id) {
        return leases.get_mut(id).expect("just seen");
    }
    leases.entry(Arc::from(id)).or_default()
}

/// A model call's bound, reserved along its chain while it is in flight: settled with what it
/// spent when it ends, or, dropped unsettled (a path that lost it), charged its bound.
#[derive(Debug)]
pub struct Reservation {
    spending: Arc<Spending>,
    chain: Vec<Arc<str>>,
    /// The budget of each lease of `chain`.
    ceilings: Vec<Ceilings>,
    bound: Bound,
    /// [`Spending::changes`] when the chain's spending was last looked at.
    seen_changes: u64,
    /// The spend log's id for it, when it was written there.
    logged: Option<u64>,
    settled: bool,
}

impl Reservation {
    /// What was reserved.
    pub fn bound(&self) -> Bound {
        self.bound
    }

    /// Whether, while this call is in flight, what its chain spent (this replica's calls that
    /// ended, and the other replicas' folded in) has reached a ceiling of `tokens` or
    /// `cost_usd`: the first such lease. Costs an atomic load unless some spending grew since
    /// the last look.
    pub fn crossed(&mut self) -> Option<Exhausted> {
        let now = self.spending.changes.load(Ordering::Acquire);
        if now == self.seen_changes {
            return None;
        }
        self.seen_changes = now;
        let leases = self.spending.lock();
        for (id, budget) in self.chain.iter().zip(&self.ceilings) {
            let known = leases.get(&**id).copied().unwrap_or_default();
            // Steps were all taken at admission: a stream in flight spends no more of them.
            let crossed = figures(*budget, known)
                .into_iter()
                .find(|(ceiling, limit, spent, _)| {
                    *ceiling != "steps" && limit.is_some_and(|limit| *spent >= limit)
                });
            if let Some((ceiling, Some(limit), spent, reserved)) = crossed {
                return Some(Exhausted::Spent {
                    lease_id: id.to_string(),
                    ceiling,
                    spent,
                    reserved,
                    limit,
                });
            }
        }
        None
    }

    /// The call ended: `charge` replaces its reservation, along its chain and in the spend log.
    pub fn settle(mut self, charge: Charge) {
        self.settle_with(&charge);
    }

    fn settle_with(&mut self, charge: &Charge) {
        self.settled = true;
        self.spending.changes.fetch_add(1, Ordering::Release);
        {
            let mut leases = self.spending.lock();
            for (i, id) in self.chain.iter().enumerate() {
                let entry = entry(&mut leases, id);
                entry.in_flight.remove(&self.bound);
                if i == 0 {
                    entry.own.add(charge);
                }
                entry.subtree.add(charge);
            }
        }
        if let Some(log) = self.spending.log.get() {
            log.settle(self.logged, &self.chain, charge);
        }
    }

    /// The call never went out: its reservation goes, nothing is charged.
    pub fn release(mut self) {
        self.release_now();
    }

    fn release_now(&mut self) {
        self.settled = true;
        let mut leases = self.spending.lock();
        for id in &self.chain {
            entry(&mut leases, id).in_flight.remove(&self.bound);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            let charge = self.bound.charge();
            self.settle_with(&charge);
        }
    }
}

/// Folds the metered calls other replicas published on the egress stream into `spending`,
/// each charged to its lease and the ancestors the registry knows for it; `own`: the
/// publisher ids of this process and of its earlier runs (the spend log's), whose calls are
/// counted from the spend log. Budgets are checked only while the follower is live: set
/// before this returns its future, so no model call is checked before the gate is in place.
pub fn fold_others(
    mut follower: Follower,
    own: HashSet<String>,
    spending: Arc<Spending>,
    registry: Arc<Registry>,
) -> impl std::future::Future<Output = ()> {
    spending.follow_others(follower.live());
    async move { fold(&mut follower, own, &spending, &registry).await }
}

async fn fold(
    follower: &mut Follower,
    own: HashSet<String>,
    spending: &Spending,
    registry: &Registry,
) {
    while let Some(followed) = follower.next().await {
        if own.contains(followed.publisher.as_str()) {
            continue;
        }
        let Some(lease_id) = &followed.line.lease_id else {
            continue;
        };
        let charge = match (&followed.line.model, &followed.line.mcp) {
            (Some(model), _) => Charge::of_line(model),
            // An MCP line that does not say its steps is none that went out.
            (None, Some(mcp)) => match mcp.steps.filter(|steps| *steps > 0) {
                Some(steps) => Charge::tool_calls(steps),
                None => continue,
            },
            (None, None) => continue,
        };
        let ancestors = registry.snapshot().ledger.ancestor_ids(lease_id);
        let chain = std::iter::once(lease_id.as_str()).chain(ancestors.iter().map(String::as_str));
        spending.charge(chain, &charge);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(input: u64, output: u64, cost: Option<f64>) -> Charge {
        Charge {
            metered: true,
            input_tokens: input,
            output_tokens: output,
            cached_tokens: 0,
            cost_usd: cost,
            tool_calls: 0,
        }
    }

    fn budget(tokens: Option<u64>, cost_usd: Option<f64>) -> Ceilings {
        Ceilings {
            tokens,
            cost_usd,
            steps: None,
        }
    }

    #[test]
    fn a_call_counts_against_its_lease_and_every_ancestor() {
        let spending = Spending::default();
        spending.charge(["child", "parent", "root"], &call(10, 5, Some(0.5)));
        spending.charge(["parent", "root"], &call(1, 1, None));
        assert_eq!(spending.of("child").own.tokens, 15);
        assert_eq!(spending.of("parent").own.tokens, 2);
        assert_eq!(spending.of("parent").subtree.tokens, 17);
        assert_eq!(spending.of("root").subtree.calls, 2);
        assert_eq!(spending.of("root").subtree.cost_usd, 0.5);
        assert_eq!(spending.of("root").subtree.unpriced, 1);
        assert_eq!(spending.of("root").own, Spent::default());
    }

    #[test]
    fn an_unmetered_call_is_counted_as_such_not_as_zero_tokens() {
        let spending = Spending::default();
        let unmetered = Charge::default();
        spending.charge(["a"], &unmetered);
        let spent = spending.of("a").own;
        assert_eq!((spent.calls, spent.unmetered, spent.tokens), (1, 1, 0));
    }

    #[test]
    fn steps_count_model_calls_along_the_chain_in_flight_included() {
        let spending = Arc::new(Spending::default());
        let parent = Ceilings {
            steps: Some(3),
            ..Ceilings::default()
        };
        let chain: Vec<(Arc<str>, Ceilings)> = vec![
            ("child".into(), Ceilings::default()),
            ("parent".into(), parent),
        ];
        let ids = || chain.iter().map(|(id, c)| (&**id, *c));
        spending.charge(["child", "parent"], &call(1, 1, None));
        spending.charge(["sibling", "parent"], &Charge::default());
        assert_eq!(spending.check(ids()), Ok(()), "2 of 3");
        assert_eq!(spending.remaining(ids()).unwrap().steps, Some(1));
        // The third, in flight, takes the last step: a fourth is refused while it runs.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let third = runtime
            .block_on(spending.reserve(&chain, Bound::default()))
            .unwrap();
        let refused = spending.check(ids()).unwrap_err();
        assert_eq!(
            refused.refusal().detail,
            "lease parent's budget.steps is spent: 2 of 3, and 1 reserved by calls in flight"
        );
        assert_eq!(spending.remaining(ids()).unwrap().steps, Some(0));
        third.settle(call(1, 1, None));
        assert!(spending.check(ids()).is_err(), "3 of 3");
    }

    #[tokio::test]
    async fn tool_calls_are_steps_a_batch_all_of_them_and_nothing_else() {
        let spending = Arc::new(Spending::default());
        let budget = Ceilings {
            steps: Some(4),
            tokens: Some(10),
            cost_usd: Some(1.0),
        };
        let chain: Vec<(Arc<str>, Ceilings)> = vec![("lease".into(), budget)];
        spending.charge(["lease"], &call(2, 2, Some(0.1)));
        // A batch of three fits the three steps left; a batch of four would not.
        let four = spending
            .reserve(&chain, Bound::tool_calls(4))
            .await
            .unwrap_err();
        assert_eq!(
            four.refusal().detail,
            "lease lease's budget.steps is spent: 1 of 4"
        );
        let three = spending
            .reserve(&chain, Bound::tool_calls(3))
            .await
            .unwrap();
        assert_eq!(spending.of("lease").in_flight.steps(), 3);
        three.settle(Charge::tool_calls(3));
        let spent = spending.of("lease").subtree;
        assert_eq!((spent.calls, spent.tool_calls, spent.tokens), (1, 3, 4));
        assert_eq!(spent.cost_usd, 0.1);
        assert!(spending
            .reserve(&chain, Bound::tool_calls(1))
            .await
            .is_err());
        // Dropped unsettled (a path that lost it): charged its steps, as a call its bound.
        let spending = Arc::new(Spending::default());
        drop(
            spending
                .reserve(&chain, Bound::tool_calls(2))
                .await
                .unwrap(),
        );
        assert_eq!(spending.of("lease").own.tool_calls, 2);
    }

    #[tokio::test]
    async fn a_call_in_flight_sees_its_chains_ceiling_crossed_by_what_others_spent() {
        let spending = Arc::new(Spending::default());
        let tokens = |t| Ceilings {
            tokens: Some(t),
            cost_usd: None,
            steps: None,
        };
        let chain: Vec<(Arc<str>, Ceilings)> = vec![
            ("child".into(), Ceilings::default()),
            ("parent".into(), tokens(100)),
        ];
        let bound = Bound {
            input_tokens: 10,
            output_tokens: 40,
            cost_usd: None,
            tool_calls: 0,
        };
        let mut flying = spending.reserve(&chain, bound).await.unwrap();
        // Its own reservation is no crossing; nor is what others spent below the ceiling.
        assert!(flying.crossed().is_none());
        spending.charge(["sibling", "parent"], &call(30, 29, None));
        assert!(flying.crossed().is_none());
        // Another replica's call, folded in, reaches the parent's ceiling.
        spending.charge(["other", "parent"], &call(40, 1, None));
        let crossed = flying.crossed().expect("the parent's ceiling is reached");
        assert_eq!(
            crossed.refusal().detail,
            "lease parent's budget.tokens is spent: 100 of 100, and 50 reserved by calls in flight"
        );
        // Nothing changed since: an atomic load, no lock, no answer.
        assert!(flying.crossed().is_none());
        flying.settle(bound.charge());
    }

    #[test]
    fn the_check_refuses_once_any_ceiling_of_the_chain_is_reached() {
        let spending = Spending::default();
        let parent = budget(Some(1000), None);
        let child = budget(None, Some(1.0));
        let chain = || [("child", child), ("parent", parent)];
        assert_eq!(spending.check(chain()), Ok(()));
        spending.charge(["child", "parent"], &call(600, 399, Some(0.1)));
        assert_eq!(spending.check(chain()), Ok(()), "999 of 1000");
        spending.charge(["sibling", "parent"], &call(1, 0, Some(0.1)));
        let exhausted = spending.check(chain()).unwrap_err();
        assert!(matches!(
            &exhausted,
            Exhausted::Spent { lease_id, ceiling: "tokens", .. } if lease_id == "parent"
        ));
        assert_eq!(exhausted.refusal().code, Code::BudgetExhausted);
        assert_eq!(
            exhausted.refusal().detail,
            "lease parent's budget.tokens is spent: 1000 of 1000"
        );

        let spending = Spending::default();
        spending.charge(["child", "parent"], &call(1, 1, Some(1.0)));
        assert!(matches!(
            spending.check(chain()),
            Err(Exhausted::Spent {
                ceiling: "cost_usd",
                ..
            })
        ));
    }

    #[test]
    fn with_replicas_a_budget_is_not_checked_blind() {
        let spending = Spending::default();
        let live = Arc::new(AtomicBool::new(false));
        spending.follow_others(live.clone());
        let ceiling = budget(Some(10), None);
        assert_eq!(
            spending.check([("a", ceiling)]),
            Err(Exhausted::OthersUnknown)
        );
        assert_eq!(
            spending.check([("a", Ceilings::default())]),
            Ok(()),
            "no budget, nothing to check"
        );
        live.store(true, Ordering::Release);
        assert_eq!(spending.check([("a", ceiling)]), Ok(()));
    }

    #[test]
    fn a_lines_model_call_charges_what_it_says() {
        let call = |tokens: Option<u64>, cost, unmetered| ModelCall {
            api: "openai",
            name: None,
            input_tokens: tokens,
            output_tokens: tokens,
            cached_tokens: tokens,
            cost_usd: cost,
            unpriced: None,
            unmetered,
            charged_tokens: None,
            charged_cost_usd: None,
        };
        let priced = Charge::of_call(&call(Some(3), Some(Some(0.5)), None));
        assert_eq!(
            priced,
            Charge {
                metered: true,
                input_tokens: 3,
                output_tokens: 3,
                cached_tokens: 3,
                cost_usd: Some(0.5),
                tool_calls: 0,
            }
        );
        let unpriced = Charge::of_call(&call(Some(3), Some(None), None));
        assert_eq!((unpriced.metered, unpriced.cost_usd), (true, None));
        assert_eq!(
            Charge::of_call(&call(None, None, Some("cut"))),
            Charge::default()
        );
    }

    #[tokio::test]
    async fn a_call_in_flight_holds_its_bound_until_it_ends() {
        let spending = Arc::new(Spending::default());
        let chain = [
            (Arc::from("child"), Ceilings::default()),
            (Arc::from("parent"), budget(Some(100), None)),
        ];
        let bound = Bound {
            input_tokens: 40,
            output_tokens: 60,
            cost_usd: None,
            tool_calls: 0,
        };
        let first = spending.reserve(&chain, bound).await.unwrap();
        assert_eq!(spending.of("parent").in_flight.tokens, 100);
        let second = spending.reserve(&chain, bound).await.unwrap_err();
        assert!(matches!(
            &second,
            Exhausted::Spent { lease_id, reserved, spent, .. }
                if lease_id == "parent" && *reserved == 100.0 && *spent == 0.0
        ));
        assert!(second
            .refusal()
            .detail
            .contains("100 reserved by calls in flight"));
        first.settle(call(10, 20, None));
        assert_eq!(spending.of("parent").in_flight, InFlight::default());
        assert_eq!(spending.of("child").own.tokens, 30);
        // 30 spent: the next goes, and is lost unsettled: charged its bound.
        drop(spending.reserve(&chain, bound).await.unwrap());
        let spent = spending.of("parent").subtree;
        assert_eq!((spent.tokens, spent.unmetered, spent.calls), (130, 1, 2));
        assert!(spending.reserve(&chain, bound).await.is_err());
        // A call that never went out is released: nothing charged.
        let spending = Arc::new(Spending::default());
        spending.reserve(&chain, bound).await.unwrap().release();
        assert_eq!(spending.of("parent"), LeaseSpending::default());
    }

    #[test]
    fn a_zero_ceiling_refuses_the_first_call() {
        let spending = Spending::default();
        let none = budget(Some(0), None);
        assert!(spending.check([("a", none)]).is_err());
        assert_eq!(spending.check([("a", Ceilings::default())]), Ok(()));
    }
}
