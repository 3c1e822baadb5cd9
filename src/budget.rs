//! Model budgets: what each lease has spent on metered model calls — its own calls and its
//! descendants', from this replica and, folded from the egress stream, every other — and
//! whether a lease's chain has budget left for a new call.
//!
//! Invariants: a call is charged once, to its lease's own total and to the subtree total of the
//! lease and of every ancestor it names; a new model call is refused when any lease of its
//! chain with a ceiling has spent at least that ceiling (spent, not about to be: the call that
//! passes a ceiling finishes, and so does every call already in flight). Unmetered calls are
//! counted as such, never as zero tokens.

use crate::policy::codes::{Code, Refusal};
use crate::registry::Registry;
use crate::telemetry::egress::{LoggedModel, ModelCall};
use crate::telemetry::egress_stream::Follower;
use futures_util::StreamExt;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The ceilings of one lease's budget that model calls spend (`budget.tokens`,
/// `budget.cost_usd`); `None`: no ceiling of that kind.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ceilings {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
}

impl Ceilings {
    /// Whether either ceiling is set.
    pub fn any(&self) -> bool {
        self.tokens.is_some() || self.cost_usd.is_some()
    }
}

/// What one call reported, as charged.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Charge {
    /// `false`: its usage could not be read (the token fields are zero and mean nothing).
    pub metered: bool,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// `None`: the model is not in the price table (or the call was not metered).
    pub cost_usd: Option<f64>,
}

/// Totals of metered model calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spent {
    /// Model calls, metered or not.
    pub calls: u64,
    /// Input plus output tokens of the metered calls: what `budget.tokens` counts.
    pub tokens: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// What the priced calls cost: what `budget.cost_usd` counts.
    pub cost_usd: f64,
    /// Calls whose usage could not be read.
    pub unmetered: u64,
    /// Metered calls of a model the price table does not name (their cost is not in `cost_usd`).
    pub unpriced: u64,
}

impl Spent {
    /// Counts one call.
    pub fn add(&mut self, charge: &Charge) {
        self.calls += 1;
        if !charge.metered {
            self.unmetered += 1;
            return;
        }
        self.input_tokens = self.input_tokens.saturating_add(charge.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(charge.output_tokens);
        self.cached_tokens = self.cached_tokens.saturating_add(charge.cached_tokens);
        self.tokens = self
            .tokens
            .saturating_add(charge.input_tokens.saturating_add(charge.output_tokens));
        match charge.cost_usd {
            Some(cost) if cost.is_finite() && cost >= 0.0 => self.cost_usd += cost,
            _ => self.unpriced += 1,
        }
    }
}

impl Charge {
    /// The charge of a call as this replica's egress line holds it: unmetered when the line
    /// says so.
    pub fn of_call(call: &ModelCall) -> Charge {
        Charge {
            metered: call.unmetered.is_none(),
            input_tokens: call.input_tokens.unwrap_or(0),
            output_tokens: call.output_tokens.unwrap_or(0),
            cached_tokens: call.cached_tokens.unwrap_or(0),
            cost_usd: call.cost_usd.flatten(),
        }
    }

    /// The charge of a call as its egress line tells it (another replica's, read from the
    /// egress stream): unmetered unless both token counts are there.
    pub fn of_line(model: &LoggedModel) -> Charge {
        match model.tokens() {
            Some((input_tokens, output_tokens)) => Charge {
                metered: true,
                input_tokens,
                output_tokens,
                cached_tokens: model.cached_tokens.unwrap_or(0),
                cost_usd: model.cost(),
            },
            None => Charge::default(),
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
    }
}

/// One lease's figures: its own calls, and its subtree's (its own and its descendants').
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LeaseSpending {
    pub own: Spent,
    pub subtree: Spent,
}

/// Why a model call may not go: a spent budget (which lease's, which ceiling, how much was
/// spent), or budgets that cannot be checked.
#[derive(Debug, Clone, PartialEq)]
pub enum Exhausted {
    Spent {
        lease_id: String,
        /// `tokens` or `cost_usd`.
        ceiling: &'static str,
        spent: f64,
        limit: f64,
    },
    /// The chain has a budget, and the other replicas' usage is not being read (the egress
    /// stream is down, or not read up to its end yet): spending is unknown, so it is refused.
    OthersUnknown,
}

impl Exhausted {
    /// The `budget-exhausted` refusal: the detail names the lease, the ceiling and the figures.
    pub fn refusal(&self) -> Refusal {
        let detail = match self {
            Exhausted::Spent {
                lease_id,
                ceiling,
                spent,
                limit,
            } => format!("lease {lease_id}'s budget.{ceiling} is spent: {spent} of {limit}"),
            Exhausted::OthersUnknown => "the budget cannot be checked: the other replicas' usage is not being read from the egress stream".to_owned(),
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
}

impl Spending {
    /// Charges one call of `chain`'s first lease: its own total, and the subtree total of it
    /// and of every ancestor after it.
    pub fn charge<'a>(&self, chain: impl IntoIterator<Item = &'a str>, charge: &Charge) {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        for (i, id) in chain.into_iter().enumerate() {
            let entry = match leases.get_mut(id) {
                Some(entry) => entry,
                None => leases.entry(Arc::from(id)).or_default(),
            };
            if i == 0 {
                entry.own.add(charge);
            }
            entry.subtree.add(charge);
        }
    }

    /// What `lease_id` (and its subtree) has spent; zero for a lease with no calls.
    pub fn of(&self, lease_id: &str) -> LeaseSpending {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.get(lease_id).copied().unwrap_or_default()
    }

    /// Whether a new model call under `chain` (the lease first, then its ancestors, each with
    /// its budget) may go: the first lease of the chain whose subtree has spent a ceiling, if
    /// any.
    pub fn check<'a>(
        &self,
        chain: impl IntoIterator<Item = (&'a str, Ceilings)>,
    ) -> Result<(), Exhausted> {
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        for (id, budget) in chain.into_iter().filter(|(_, c)| c.any()) {
            if self
                .others
                .get()
                .is_some_and(|live| !live.load(Ordering::Acquire))
            {
                return Err(Exhausted::OthersUnknown);
            }
            let spent = leases.get(id).map(|s| s.subtree).unwrap_or_default();
            if let Some(limit) = budget.tokens {
                if spent.tokens >= limit {
                    return Err(Exhausted::Spent {
                        lease_id: id.to_owned(),
                        ceiling: "tokens",
                        spent: spent.tokens as f64,
                        limit: limit as f64,
                    });
                }
            }
            if let Some(limit) = budget.cost_usd {
                if spent.cost_usd >= limit {
                    return Err(Exhausted::Spent {
                        lease_id: id.to_owned(),
                        ceiling: "cost_usd",
                        spent: spent.cost_usd,
                        limit,
                    });
                }
            }
        }
        Ok(())
    }

    /// From now on budgets are checked only while `live` says every other replica's usage
    /// is being folded in (the egress stream's follower is connected and caught up).
    pub fn follow_others(&self, live: Arc<AtomicBool>) {
        let _ = self.others.set(live);
    }

    /// Forgets leases `keep` says no to (closed long ago): the map holds only leases that may
    /// still spend or be asked about.
    pub fn retain(&self, mut keep: impl FnMut(&str) -> bool) {
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        leases.retain(|id, _| keep(id));
    }
}

/// Folds the metered calls other replicas (and this one's earlier runs) published on the
/// egress stream into `spending`, each charged to its lease and the ancestors the registry
/// knows for it; `own`: this process's publisher id, whose calls were charged as they ended.
/// Budgets are checked only while the follower is live: set before this returns its future,
/// so no model call is checked before the gate is in place.
pub fn fold_others(
    mut follower: Follower,
    own: Option<String>,
    spending: Arc<Spending>,
    registry: Arc<Registry>,
) -> impl std::future::Future<Output = ()> {
    spending.follow_others(follower.live());
    async move { fold(&mut follower, own, &spending, &registry).await }
}

async fn fold(
    follower: &mut Follower,
    own: Option<String>,
    spending: &Spending,
    registry: &Registry,
) {
    while let Some(followed) = follower.next().await {
        if own.as_deref() == Some(followed.publisher.as_str()) {
            continue;
        }
        let (Some(lease_id), Some(model)) = (&followed.line.lease_id, &followed.line.model) else {
            continue;
        };
        let ancestors = registry.snapshot().ledger.ancestor_ids(lease_id);
        let chain = std::iter::once(lease_id.as_str()).chain(ancestors.iter().map(String::as_str));
        spending.charge(chain, &Charge::of_line(model));
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
        }
    }

    fn budget(tokens: Option<u64>, cost_usd: Option<f64>) -> Ceilings {
        Ceilings { tokens, cost_usd }
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
        };
        let priced = Charge::of_call(&call(Some(3), Some(Some(0.5)), None));
        assert_eq!(
            priced,
            Charge {
                metered: true,
                input_tokens: 3,
                output_tokens: 3,
                cached_tokens: 3,
                cost_usd: Some(0.5)
            }
        );
        let unpriced = Charge::of_call(&call(Some(3), Some(None), None));
        assert_eq!((unpriced.metered, unpriced.cost_usd), (true, None));
        assert_eq!(
            Charge::of_call(&call(None, None, Some("cut"))),
            Charge::default()
        );
    }

    #[test]
    fn a_zero_ceiling_refuses_the_first_call() {
        let spending = Spending::default();
        let none = budget(Some(0), None);
        assert!(spending.check([("a", none)]).is_err());
        assert_eq!(spending.check([("a", Ceilings::default())]), Ok(()));
    }
}
