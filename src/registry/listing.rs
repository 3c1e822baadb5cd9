//! Leases a page at a time: in grant order (oldest or newest first), filtered by status,
//! agent and parent, resumed from an opaque cursor. `GET /leases` and `leases` list through it.
//!
//! Invariant: a cursor names a position in grant order and the lease granted there; grant
//! order only grows at its end, so paging never repeats or skips a lease that existed when it
//! began (leases granted since come at the end of an oldest-first listing, never in a
//! newest-first one). One page examines at most [`SCAN_BUDGET`] positions, whatever the filter
//! matches: a page may then hold fewer than its limit, with a cursor to go on from.

use super::ledger::{Ledger, Status};
use crate::contract::{Lease, Timestamp};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use std::sync::Arc;

/// Positions one page examines at most.
pub const SCAN_BUDGET: usize = 20_000;

/// Which leases a listing shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    pub status: Option<Status>,
    /// The manifest's agent name, exactly.
    pub agent: Option<String>,
    /// The parent lease id, exactly: a lease's children.
    pub parent: Option<String>,
}

impl Filter {
    /// The lease's status at `now` if it passes the filter. The agent is checked first: it
    /// costs no walk up the chain.
    fn pass(&self, ledger: &Ledger, lease: &Lease, now: Timestamp) -> Option<Status> {
        if self.agent.as_ref().is_some_and(|a| *a != lease.agent_name) {
            return None;
        }
        if self.parent.is_some() && self.parent != lease.parent {
            return None;
        }
        let status = ledger.status(&lease.id, now)?;
        self.status.is_none_or(|s| s == status).then_some(status)
    }
}

/// Grant order, or its reverse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Order {
    #[default]
    OldestFirst,
    NewestFirst,
}

impl Order {
    pub fn parse(text: &str) -> Option<Order> {
        match text {
            "oldest" => Some(Order::OldestFirst),
            "newest" => Some(Order::NewestFirst),
            _ => None,
        }
    }

    /// The position after `position` in this order, if any.
    fn step(self, position: usize) -> Option<usize> {
        match self {
            Order::OldestFirst => position.checked_add(1),
            Order::NewestFirst => position.checked_sub(1),
        }
    }

    fn tag(self) -> char {
        match self {
            Order::OldestFirst => 'o',
            Order::NewestFirst => 'n',
        }
    }
}

/// A status by its name (`open`, `revoked`, ...).
pub fn parse_status(text: &str) -> Option<Status> {
    Status::ALL.into_iter().find(|s| s.as_str() == text)
}

/// Where the previous page stopped: the last position it examined, and the lease there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    order: Order,
    position: usize,
    lease_id: String,
}

/// Why a cursor cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    #[error("cursor {0:?} is not one this API gave out")]
    Malformed(String),
    #[error("the cursor is for order={0}: ask again with that order, or without the cursor")]
    OtherOrder(&'static str),
    #[error("the cursor names lease {0}, which is no longer listed (the journal was compacted?): start from the first page")]
    Gone(String),
}

impl Cursor {
    /// The opaque text form: base64url of `<order><position>.<lease id>`.
    pub fn encode(&self) -> String {
        URL_SAFE_NO_PAD.encode(format!(
            "{}{}.{}",
            self.order.tag(),
            self.position,
            self.lease_id
        ))
    }

    pub fn decode(text: &str) -> Result<Cursor, CursorError> {
        let malformed = || CursorError::Malformed(text.chars().take(64).collect());
        let bytes = URL_SAFE_NO_PAD.decode(text).map_err(|_| malformed())?;
        let plain = String::from_utf8(bytes).map_err(|_| malformed())?;
        let mut chars = plain.chars();
        let order = match chars.next() {
            Some('o') => Order::OldestFirst,
            Some('n') => Order::NewestFirst,
            _ => return Err(malformed()),
        };
        let (position, lease_id) = chars.as_str().split_once('.').ok_or_else(malformed)?;
        let position = position.parse().map_err(|_| malformed())?;
        if !crate::contract::lease::is_lease_id(lease_id) {
            return Err(malformed());
        }
        Ok(Cursor {
            order,
            position,
            lease_id: lease_id.to_owned(),
        })
    }

    /// Where to go on from in `ledger`: the position after the cursor's lease (found again if
    /// grant order moved under it, as after a restart on a compacted journal); `None` if the
    /// listing is over.
    fn resume(&self, ledger: &Ledger, order: Order) -> Result<Option<usize>, CursorError> {
        if order != self.order {
            return Err(CursorError::OtherOrder(match self.order {
                Order::OldestFirst => "oldest",
                Order::NewestFirst => "newest",
            }));
        }
        let is_here = |p: usize| ledger.granted_at(p).is_some_and(|l| l.id == self.lease_id);
        let position = match is_here(self.position) {
            true => self.position,
            false => (0..ledger.granted())
                .find(|&p| is_here(p))
                .ok_or_else(|| CursorError::Gone(self.lease_id.clone()))?,
        };
        Ok(order.step(position))
    }
}

/// One page of a listing.
#[derive(Debug)]
pub struct Page {
    /// The leases, with their status at the listing's `now`.
    pub leases: Vec<(Arc<Lease>, Status)>,
    /// Where the next page starts; `None` on the last page.
    pub next: Option<Cursor>,
}

/// Positions in `order` from `start` (the order's first when `None`), below `granted`.
fn positions(granted: usize, order: Order, start: Option<usize>) -> impl Iterator<Item = usize> {
    let first = match order {
        Order::OldestFirst => Some(0),
        Order::NewestFirst => granted.checked_sub(1),
    };
    std::iter::successors(start.or(first), move |&p| order.step(p))
        .take_while(move |&p| p < granted)
}

/// The leases of `ledger` matching `filter` at `now`, in `order` from the first, each with
/// its status: what `leases` prints, streamed.
pub fn matching<'a>(
    ledger: &'a Ledger,
    now: Timestamp,
    filter: &'a Filter,
    order: Order,
) -> impl Iterator<Item = (&'a Arc<Lease>, Status)> + 'a {
    positions(ledger.granted(), order, None).filter_map(move |p| {
        let lease = ledger.granted_at(p)?;
        Some((lease, filter.pass(ledger, lease, now)?))
    })
}

/// Up to `limit` leases matching `filter` at `now`, in `order`, after `after` (from the
/// first when `None`).
pub fn page(
    ledger: &Ledger,
    now: Timestamp,
    filter: &Filter,
    order: Order,
    after: Option<&Cursor>,
    limit: usize,
) -> Result<Page, CursorError> {
    page_within(ledger, now, filter, order, after, limit, SCAN_BUDGET)
}

/// [`page`], examining at most `budget` positions.
fn page_within(
    ledger: &Ledger,
    now: Timestamp,
    filter: &Filter,
    order: Order,
    after: Option<&Cursor>,
    limit: usize,
    budget: usize,
) -> Result<Page, CursorError> {
    let start = match after {
        None => None,
        Some(cursor) => match cursor.resume(ledger, order)? {
            Some(position) => Some(position),
            None => {
                return Ok(Page {
                    leases: Vec::new(),
                    next: None,
                })
            }
        },
    };
    let mut leases = Vec::new();
    // The last position examined that holds a lease: where a next page goes on from.
    let mut last = None;
    let go_on = |last: Option<(usize, &Arc<Lease>)>| {
        last.map(|(position, lease): (usize, &Arc<Lease>)| Cursor {
            order,
            position,
            lease_id: lease.id.clone(),
        })
    };
    for (examined, p) in positions(ledger.granted(), order, start).enumerate() {
        if examined == budget {
            return Ok(Page {
                leases,
                next: go_on(last),
            });
        }
        let Some(lease) = ledger.granted_at(p) else {
            continue;
        };
        match filter.pass(ledger, lease, now) {
            // One more matches: the next page starts after the last one shown.
            Some(_) if leases.len() == limit => {
                return Ok(Page {
                    leases,
                    next: go_on(last),
                })
            }
            Some(status) => leases.push((lease.clone(), status)),
            None => {}
        }
        last = Some((p, lease));
    }
    Ok(Page { leases, next: None })
}

/// How many leases have each status at `now`, in [`Status::ALL`] order.
pub fn counts(ledger: &Ledger, now: Timestamp) -> [(Status, u64); 7] {
    let mut counts = Status::ALL.map(|s| (s, 0));
    for lease in ledger.leases() {
        if let Some(status) = ledger.status(&lease.id, now) {
            if let Some(slot) = counts.iter_mut().find(|(s, _)| *s == status) {
                slot.1 += 1;
            }
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::{counts, matching, page, page_within, Cursor, CursorError, Filter, Order, Page};
    use crate::commands::issue::{issue, revoke, IssueRequest};
    use crate::contract::{Key, Keyring, Timestamp};
    use crate::registry::journal;
    use crate::registry::{Ledger, Status};
    use std::path::Path;
    use std::time::Duration;

    struct Journal {
        dir: tempfile::TempDir,
        key: Key,
    }

    impl Journal {
        fn new() -> Journal {
            Journal {
                dir: tempfile::tempdir().unwrap(),
                key: Key::generate(),
            }
        }

        fn path(&self) -> std::path::PathBuf {
            self.dir.path().join("journal.jsonl")
        }

        fn issue(&self, agent: &str) -> String {
            issue_into(&self.path(), &self.key, agent)
        }

        fn ledger(&self) -> Ledger {
            let mut keyring = Keyring::new(false);
            keyring.insert(self.key.clone());
            journal::load(&self.path(), Ledger::new(keyring)).unwrap().0
        }
    }

    fn issue_into(path: &Path, key: &Key, agent: &str) -> String {
        let request = IssueRequest {
            manifest: serde_json::json!({}),
            allow_hosts: vec!["example.com".into()],
            deny_hosts: vec![],
            parent: None,
            ttl: Duration::from_secs(3600),
            name: agent.into(),
            purpose: "listing test".into(),
            now: Timestamp::now(),
        };
        issue(path, key, &request).unwrap().lease_id
    }

    fn ids(page: &Page) -> Vec<String> {
        page.leases.iter().map(|(l, _)| l.id.clone()).collect()
    }

    #[test]
    fn paging_shows_every_lease_once_while_leases_are_added() {
        let journal = Journal::new();
        let first: Vec<String> = (0..25).map(|_| journal.issue("a")).collect();
        let all = Filter::default();
        let now = Timestamp::now();
        let mut seen = Vec::new();
        let mut cursor: Option<Cursor> = None;
        let mut added = Vec::new();
        let mut pages = 0;
        loop {
            let ledger = journal.ledger();
            let page = page(&ledger, now, &all, Order::OldestFirst, cursor.as_ref(), 10).unwrap();
            pages += 1;
            assert!(page.leases.len() <= 10);
            seen.extend(ids(&page));
            // Leases granted while paging: they come at the end.
            if pages == 1 {
                added.extend((0..5).map(|_| journal.issue("a")));
            }
            match page.next {
                Some(next) => cursor = Some(Cursor::decode(&next.encode()).unwrap()),
                None => break,
            }
        }
        let want: Vec<String> = first.iter().chain(&added).cloned().collect();
        assert_eq!(seen, want);
        assert_eq!(
            pages, 3,
            "30 leases in pages of 10: the last full page says it is last"
        );
    }

    /// A page of every lease, at the present.
    fn any(
        ledger: &Ledger,
        order: Order,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, CursorError> {
        page(
            ledger,
            Timestamp::now(),
            &Filter::default(),
            order,
            after,
            limit,
        )
    }

    #[test]
    fn newest_first_pages_never_show_leases_granted_since() {
        let journal = Journal::new();
        let first: Vec<String> = (0..7).map(|_| journal.issue("a")).collect();
        let one = any(&journal.ledger(), Order::NewestFirst, None, 4).unwrap();
        let newest: Vec<String> = first.iter().rev().cloned().collect();
        assert_eq!(ids(&one), newest[..4]);
        journal.issue("a");
        let ledger = journal.ledger();
        let next = one.next.unwrap();
        let two = any(&ledger, Order::NewestFirst, Some(&next), 4).unwrap();
        assert_eq!(ids(&two), newest[4..]);
        assert!(two.next.is_none());
        assert_eq!(
            any(&ledger, Order::OldestFirst, Some(&next), 4).unwrap_err(),
            CursorError::OtherOrder("newest")
        );
    }

    #[test]
    fn filters_pick_by_status_and_agent() {
        let journal = Journal::new();
        let a: Vec<String> = (0..4).map(|_| journal.issue("alpha")).collect();
        let b: Vec<String> = (0..3).map(|_| journal.issue("beta")).collect();
        for id in [&a[1], &b[0]] {
            assert!(revoke(&journal.path(), &journal.key, id, "test", Timestamp::now()).unwrap());
        }
        let ledger = journal.ledger();
        let now = Timestamp::now();
        let revoked = Filter {
            status: Some(Status::Revoked),
            agent: None,
            ..Filter::default()
        };
        let found = page(&ledger, now, &revoked, Order::OldestFirst, None, 100).unwrap();
        assert_eq!(ids(&found), vec![a[1].clone(), b[0].clone()]);
        assert!(found.next.is_none());
        let open_beta = Filter {
            status: Some(Status::Open),
            agent: Some("beta".into()),
            ..Filter::default()
        };
        let found = page(&ledger, now, &open_beta, Order::OldestFirst, None, 1).unwrap();
        assert_eq!(ids(&found), vec![b[1].clone()]);
        let rest = page(
            &ledger,
            now,
            &open_beta,
            Order::OldestFirst,
            found.next.as_ref(),
            1,
        )
        .unwrap();
        assert_eq!(ids(&rest), vec![b[2].clone()]);
        assert!(rest.next.is_none());
        let streamed: Vec<String> = matching(&ledger, now, &open_beta, Order::NewestFirst)
            .map(|(l, _)| l.id.clone())
            .collect();
        assert_eq!(streamed, vec![b[2].clone(), b[1].clone()]);
        let counts = counts(&ledger, now);
        assert_eq!(counts[0], (Status::Open, 5));
        assert_eq!(counts[3], (Status::Revoked, 2));
    }

    #[test]
    fn a_page_out_of_budget_holds_fewer_and_goes_on_from_where_it_stopped() {
        let journal = Journal::new();
        let leases: Vec<String> = (0..7)
            .map(|i| journal.issue(if i == 5 { "rare" } else { "common" }))
            .collect();
        let ledger = journal.ledger();
        let rare = Filter {
            status: None,
            agent: Some("rare".into()),
            ..Filter::default()
        };
        let now = Timestamp::now();
        let mut after = None;
        let mut found = Vec::new();
        let mut pages = 0;
        loop {
            let page = page_within(
                &ledger,
                now,
                &rare,
                Order::OldestFirst,
                after.as_ref(),
                10,
                3,
            )
            .unwrap();
            pages += 1;
            found.extend(ids(&page));
            match page.next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(found, vec![leases[5].clone()]);
        assert_eq!(pages, 3, "positions 0-2, 3-5, 6");
    }

    #[test]
    fn a_cursor_that_was_not_given_out_is_refused_in_words() {
        for bad in [
            "",
            "!!",
            "bzEyLng",
            "eDEuMDAwMDAwMDAtMDAwMC00MDAwLTgwMDAtMDAwMDAwMDAwMDAw",
        ] {
            assert!(
                matches!(Cursor::decode(bad), Err(CursorError::Malformed(_))),
                "{bad}"
            );
        }
        // A cursor into another journal names a lease this one does not list.
        let journal = Journal::new();
        let leases: Vec<String> = (0..4).map(|_| journal.issue("a")).collect();
        let other = Journal::new();
        other.issue("a");
        other.issue("a");
        let next = any(&other.ledger(), Order::OldestFirst, None, 1)
            .unwrap()
            .next
            .unwrap();
        assert!(matches!(
            any(&journal.ledger(), Order::OldestFirst, Some(&next), 1),
            Err(CursorError::Gone(_))
        ));
        // A lease that moved in grant order (a journal without an earlier grant) is found
        // again, and paging goes on after it.
        let next = any(&journal.ledger(), Order::OldestFirst, None, 2)
            .unwrap()
            .next
            .unwrap();
        let text = std::fs::read_to_string(journal.path()).unwrap();
        let without_first: String = text.split_inclusive('\n').skip(1).collect();
        std::fs::write(journal.path(), without_first).unwrap();
        let rest = any(&journal.ledger(), Order::OldestFirst, Some(&next), 10).unwrap();
        assert_eq!(ids(&rest), leases[2..]);
    }
}
