//! The approval book: the lines an approval store holds — a call held for a human
//! ([`Request`]) and what was decided of it ([`Decision`]) — read, signed, checked, and folded
//! into what every replica agrees on.
//!
//! Invariant: pure (no I/O, no clock). A line is read one way or refused: unknown or repeated
//! members, an id that is not `apr-` and 32 hex digits, a time that is not the contract's UTC form, a text
//! over its bound; a line counts only once its signature verifies under the key of the lease
//! it names; the first verified decision of a request is its decision, whatever follows it
//! (the store's order is the one every replica reads, so every replica folds the same).

use crate::contract::{canonical, Key, Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::HashMap;

/// The longest line a store hands to [`read`].
pub const MAX_LINE: usize = 16 * 1024;
/// The most characters of a call's arguments kept on its request (for the human to read).
pub const ARGUMENTS_SHOWN: usize = 2048;
/// The most characters of a decision's reason.
pub const REASON_MAX: usize = 500;
/// The most characters of a tool's name (`<server>/<tool>`).
const TOOL_MAX: usize = 256;

/// One line of an approval store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    Requested(Request),
    Decided(Decision),
}

/// A call held until a human decides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Request {
    pub id: String,
    /// The lease that made the call (the chain's first).
    pub lease_id: String,
    /// `<server>/<tool>`.
    pub tool: String,
    /// The call's `arguments` as JSON text, cut to [`ARGUMENTS_SHOWN`] characters.
    pub arguments: String,
    /// The lease of the chain whose `approvals` names the tool.
    pub named_by: String,
    pub at: String,
    /// When the call is refused if nobody decided.
    pub deadline: String,
    /// The replica holding the call.
    pub replica: String,
    pub signature: String,
}

/// What was decided of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    pub id: String,
    pub lease_id: String,
    pub tool: String,
    pub outcome: Outcome,
    /// `lease`: every later call of this tool by this lease goes on without asking.
    pub scope: Scope,
    pub reason: String,
    /// `operator` (the admin API), `timeout`, `shutdown` or `lease-closed` (the holding
    /// replica).
    pub by: String,
    pub at: String,
    pub signature: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Approved,
    Denied,
    /// Nobody decided in time, or the holder stopped holding it (shutdown, the lease closed).
    Expired,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Approved => "approved",
            Outcome::Denied => "denied",
            Outcome::Expired => "expired",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// This call only.
    Once,
    /// This call and every later call of the tool by the lease.
    Lease,
}

/// Why a line is not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreadable {
    #[error("longer than {MAX_LINE} bytes")]
    TooLong,
    #[error("not an approval line: {0}")]
    Json(String),
    #[error("{0}")]
    Field(String),
}

/// Whether `id` is an approval id: `apr-` and 32 lower-case hex digits.
pub fn is_id(id: &str) -> bool {
    id.strip_prefix("apr-").is_some_and(|hex| {
        hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// A fresh approval id.
pub fn new_id() -> String {
    format!("apr-{}", uuid::Uuid::new_v4().simple())
}

/// Reads one line: an entry whose fields are each within bounds (its signature not checked).
pub fn read(line: &[u8]) -> Result<Entry, Unreadable> {
    if line.len() > MAX_LINE {
        return Err(Unreadable::TooLong);
    }
    let entry: Entry = serde_json::from_slice(line).map_err(|e| Unreadable::Json(e.to_string()))?;
    check(&entry)?;
    Ok(entry)
}

fn check(entry: &Entry) -> Result<(), Unreadable> {
    let bad = |what: &str| Err(Unreadable::Field(what.to_owned()));
    let (id, lease, tool, times): (&str, &str, &str, Vec<&str>) = match entry {
        Entry::Requested(r) => {
            if r.arguments.chars().count() > ARGUMENTS_SHOWN + 1 {
                return bad("arguments longer than kept");
            }
            if crate::contract::lease::lease_id(&r.named_by).is_err() {
                return bad("named_by is not a lease id");
            }
            (&r.id, &r.lease_id, &r.tool, vec![&r.at, &r.deadline])
        }
        Entry::Decided(d) => {
            if d.reason.chars().count() > REASON_MAX || d.by.len() > 32 {
                return bad("reason or by longer than kept");
            }
            (&d.id, &d.lease_id, &d.tool, vec![&d.at])
        }
    };
    if !is_id(id) {
        return bad("id is not apr- and 32 hex digits");
    }
    if crate::contract::lease::lease_id(lease).is_err() {
        return bad("lease_id is not a lease id");
    }
    let named = tool.contains('/') || super::route::parse(tool).is_some();
    if tool.is_empty() || tool.len() > TOOL_MAX || !named {
        return bad("tool is neither <server>/<tool> nor a route (METHOD:host/path)");
    }
    if times.iter().any(|t| Timestamp::parse(t).is_err()) {
        return bad("a time is not the contract's UTC form");
    }
    Ok(())
}

/// The entry as its line, signed under `key` (the signature over the canonical bytes of the
/// entry without it).
pub fn signed(mut entry: Entry, key: &Key) -> Vec<u8> {
    let mac = key.sign(&unsigned_bytes(&entry));
    match &mut entry {
        Entry::Requested(r) => r.signature = mac,
        Entry::Decided(d) => d.signature = mac,
    }
    serde_json::to_vec(&entry).expect("an entry serialises")
}

/// Whether `entry`'s signature verifies under `key`.
pub fn verifies(entry: &Entry, key: &Key) -> bool {
    let signature = match entry {
        Entry::Requested(r) => &r.signature,
        Entry::Decided(d) => &d.signature,
    };
    key.verify(&unsigned_bytes(entry), signature)
}

fn unsigned_bytes(entry: &Entry) -> Vec<u8> {
    let value = serde_json::to_value(entry).expect("an entry serialises");
    canonical::canonical_bytes_without(&value, "signature").expect("an entry is canonical JSON")
}

/// The lease an entry must verify under.
pub fn lease_of(entry: &Entry) -> &str {
    match entry {
        Entry::Requested(r) => &r.lease_id,
        Entry::Decided(d) => &d.lease_id,
    }
}

/// What folding one verified entry did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// A request, or the first decision of one.
    Taken,
    /// Seen before (a line read twice), or a decision after the first: nothing changed.
    Ignored,
}

/// What every replica agrees on: the requests, the first decision of each, and the standing
/// approvals (`scope: lease`) by lease and tool.
#[derive(Debug, Default)]
pub struct Book {
    requests: HashMap<String, Request>,
    decisions: HashMap<String, Decision>,
    standing: HashMap<(String, String), Decision>,
    /// Request ids in the order read, to list and to forget the oldest first.
    order: Vec<String>,
}

impl Book {
    /// Folds a verified entry.
    pub fn apply(&mut self, entry: Entry) -> Applied {
        match entry {
            Entry::Requested(r) => {
                if self.requests.contains_key(&r.id) {
                    return Applied::Ignored;
                }
                self.order.push(r.id.clone());
                self.requests.insert(r.id.clone(), r);
                Applied::Taken
            }
            Entry::Decided(d) => {
                if self.decisions.contains_key(&d.id) {
                    return Applied::Ignored;
                }
                // A decision is of a request read before it (the store's order), and names
                // its lease and tool: it cannot approve anything else.
                let names_request = self
                    .requests
                    .get(&d.id)
                    .is_some_and(|r| r.lease_id == d.lease_id && r.tool == d.tool);
                if !names_request {
                    return Applied::Ignored;
                }
                if d.outcome == Outcome::Approved && d.scope == Scope::Lease {
                    self.standing
                        .entry((d.lease_id.clone(), d.tool.clone()))
                        .or_insert_with(|| d.clone());
                }
                self.decisions.insert(d.id.clone(), d);
                Applied::Taken
            }
        }
    }

    pub fn request(&self, id: &str) -> Option<&Request> {
        self.requests.get(id)
    }

    pub fn decision(&self, id: &str) -> Option<&Decision> {
        self.decisions.get(id)
    }

    /// The standing approval of `tool` for `lease_id`, if one was given.
    pub fn standing(&self, lease_id: &str, tool: &str) -> Option<&Decision> {
        self.standing.get(&(lease_id.to_owned(), tool.to_owned()))
    }

    /// Requests in the order read, each with its decision if it has one.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = (&Request, Option<&Decision>)> {
        self.order
            .iter()
            .filter_map(|id| Some((self.requests.get(id)?, self.decisions.get(id))))
    }

    /// Forgets decided requests (and decisions) beyond the newest `keep` decided ones; standing
    /// approvals stay. Pending requests always stay.
    pub fn forget_oldest(&mut self, keep: usize) {
        let decided = self
            .order
            .iter()
            .filter(|id| self.decisions.contains_key(*id))
            .count();
        let mut drop = decided.saturating_sub(keep);
        if drop == 0 {
            return;
        }
        let (requests, decisions) = (&mut self.requests, &mut self.decisions);
        self.order.retain(|id| {
            if drop > 0 && decisions.contains_key(id) {
                drop -= 1;
                requests.remove(id);
                decisions.remove(id);
                return false;
            }
            true
        });
    }
}

/// The JSON the admin API shows of a request and its decision.
pub fn view(request: &Request, decision: Option<&Decision>, now: Timestamp) -> Value {
    let status = match decision {
        Some(d) => d.outcome.as_str(),
        None if Timestamp::parse(&request.deadline).is_ok_and(|t| t <= now) => "expired",
        None => "pending",
    };
    let mut view = serde_json::json!({
        "id": request.id,
        "status": status,
        "lease_id": request.lease_id,
        "tool": request.tool,
        "arguments": request.arguments,
        "named_by": request.named_by,
        "requested_at": request.at,
        "deadline": request.deadline,
        "replica": request.replica,
    });
    if let Some(d) = decision {
        view["decision"] = serde_json::json!({
            "outcome": d.outcome.as_str(),
            "scope": d.scope,
            "reason": d.reason,
            "by": d.by,
            "at": d.at,
        });
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    const OTHER: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

    fn request(id: &str) -> Entry {
        Entry::Requested(Request {
            id: id.to_owned(),
            lease_id: LEASE.to_owned(),
            tool: "notes/send_mail".to_owned(),
            arguments: r#"{"to":"a@b.test"}"#.to_owned(),
            named_by: LEASE.to_owned(),
            at: "2026-12-07T10:00:00.000Z".to_owned(),
            deadline: "2026-12-07T10:02:00.000Z".to_owned(),
            replica: "r1".to_owned(),
            signature: String::new(),
        })
    }

    fn decision(id: &str, outcome: Outcome, scope: Scope) -> Entry {
        Entry::Decided(Decision {
            id: id.to_owned(),
            lease_id: LEASE.to_owned(),
            tool: "notes/send_mail".to_owned(),
            outcome,
            scope,
            reason: "ok".to_owned(),
            by: "operator".to_owned(),
            at: "2026-12-07T10:01:00.000Z".to_owned(),
            signature: String::new(),
        })
    }

    #[test]
    fn a_signed_line_reads_back_and_verifies_only_under_its_key() {
        let key = Key::generate();
        let id = new_id();
        let line = signed(request(&id), &key);
        let entry = read(&line).unwrap();
        assert!(verifies(&entry, &key));
        assert!(!verifies(&entry, &Key::generate()));
        let tampered = String::from_utf8(line)
            .unwrap()
            .replace("send_mail", "read_note");
        assert!(!verifies(&read(tampered.as_bytes()).unwrap(), &key));
    }

    #[test]
    fn lines_read_one_way_or_not_at_all() {
        let key = Key::generate();
        let good = String::from_utf8(signed(request(&new_id()), &key)).unwrap();
        let twice = good.replacen("{", r#"{"tool":"notes/x","#, 1);
        let extra = good.replacen("{", r#"{"extra":1,"#, 1);
        for bad in [
            twice.as_str(),
            extra.as_str(),
            &good.replace("apr-", "apx-"),
            &good.replace(LEASE, "not-a-lease"),
            &good.replace("notes/send_mail", "send_mail"),
            &good.replace("2026-12-07T10:02:00.000Z", "tomorrow"),
            "[]",
            "{\"kind\":\"other\"}",
        ] {
            assert!(read(bad.as_bytes()).is_err(), "{bad}");
        }
        assert_eq!(read(&vec![b' '; MAX_LINE + 1]), Err(Unreadable::TooLong));
    }

    #[test]
    fn the_first_decision_is_the_decision_and_a_standing_one_is_its_leases_tool() {
        let (a, b) = (new_id(), new_id());
        let mut book = Book::default();
        assert_eq!(book.apply(request(&a)), Applied::Taken);
        assert_eq!(book.apply(request(&a)), Applied::Ignored);
        assert_eq!(
            book.apply(decision(&a, Outcome::Denied, Scope::Once)),
            Applied::Taken
        );
        assert_eq!(
            book.apply(decision(&a, Outcome::Approved, Scope::Lease)),
            Applied::Ignored
        );
        assert_eq!(book.decision(&a).unwrap().outcome, Outcome::Denied);
        assert!(book.standing(LEASE, "notes/send_mail").is_none());
        book.apply(request(&b));
        // A decision naming another lease or tool than its request's changes nothing.
        let mut other = decision(&b, Outcome::Approved, Scope::Lease);
        if let Entry::Decided(d) = &mut other {
            d.lease_id = OTHER.to_owned();
        }
        assert_eq!(book.apply(other), Applied::Ignored);
        book.apply(decision(&b, Outcome::Approved, Scope::Lease));
        assert!(book.standing(LEASE, "notes/send_mail").is_some());
        assert!(book.standing(OTHER, "notes/send_mail").is_none());
        assert!(book.standing(LEASE, "notes/read_note").is_none());
    }

    #[test]
    fn forgetting_keeps_pending_requests_and_standing_approvals() {
        let mut book = Book::default();
        let ids: Vec<String> = (0..5).map(|_| new_id()).collect();
        for id in &ids {
            book.apply(request(id));
        }
        book.apply(decision(&ids[0], Outcome::Approved, Scope::Lease));
        book.apply(decision(&ids[1], Outcome::Denied, Scope::Once));
        book.apply(decision(&ids[2], Outcome::Expired, Scope::Once));
        book.forget_oldest(1);
        let left: Vec<&str> = book.entries().map(|(r, _)| r.id.as_str()).collect();
        assert_eq!(left, [&ids[2], &ids[3], &ids[4]]);
        assert!(book.standing(LEASE, "notes/send_mail").is_some());
    }
}
