//! `verify`, `leases` and `check`: reading a lease or journal and reporting on it.
//!
//! Invariant: read-only; every problem found is reported with where it is and why, and
//! `check` decides through the proxy's own decision ([`explain`]), never a copy of it.

use crate::config::ProxyConfig;
use crate::contract::lease::WALL_CLOCK_BUDGET;
use crate::contract::rules::Lifetime;
use crate::contract::{Keyring, Lease, Timestamp};
use crate::policy::pattern::MalformedPattern;
use crate::policy::HostPattern;
pub use crate::proxy::explain::{explain, Explanation};
use crate::registry::closed::ClosedView;
use crate::registry::open::open_registry;
use crate::registry::{
    journal, ChainError, JournalLocation, Ledger, OpenError, Status, StoreOptions,
};
use serde::Serialize;
use serde_json::Value;

/// One problem `verify` found.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// `line N` for a journal, the JSON path for a lease.
    pub place: String,
    pub reason: String,
}

/// Verifies a lease document or a journal. `keyring` `None` checks schema and rules only.
/// `max_line`: a journal line longer than this is a problem (`too-long`), as `serve` skips it.
pub fn verify(
    text: &[u8],
    keyring: Option<&Keyring>,
    now: Timestamp,
    max_line: usize,
) -> Vec<Problem> {
    let single: Option<Value> = serde_json::from_slice(text).ok();
    match single {
        Some(value) if value.get("manifest").is_some() && value.get("event").is_none() => {
            verify_lease(value, keyring, now)
        }
        _ => verify_journal(text, keyring, max_line),
    }
}

fn verify_lease(value: Value, keyring: Option<&Keyring>, now: Timestamp) -> Vec<Problem> {
    let loaded = match keyring {
        Some(keyring) => Lease::load(value, keyring),
        None => Lease::check(value),
    };
    let problem = |place: &str, reason: String| Problem {
        place: place.to_owned(),
        reason,
    };
    match loaded {
        Err(crate::contract::LeaseError::Schema(issues)) => issues
            .into_iter()
            .map(|i| problem(if i.path.is_empty() { "/" } else { &i.path }, i.message))
            .collect(),
        Err(e) => vec![problem("/", e.to_string())],
        Ok(lease) => {
            let mut problems: Vec<Problem> = malformed_patterns(&lease)
                .map(|(list, index, bad)| {
                    problem(
                        &format!("/manifest/{list}/hosts/{index}"),
                        malformed_reason(&lease.id, list, &bad),
                    )
                })
                .collect();
            match lease.lifetime(now) {
                Lifetime::Live => {}
                Lifetime::NotYetValid => problems.push(problem(
                    "/issued_at",
                    format!("not valid until {} (now {now})", lease.issued_at),
                )),
                Lifetime::Expired if lease.ends_by_wall_clock() => problems.push(problem(
                    "/manifest/budget/wall_clock_ms",
                    format!(
                        "expired at {} (now {now}): {}",
                        lease.expires_at,
                        lease.wall_clock_note().unwrap_or_default()
                    ),
                )),
                Lifetime::Expired => problems.push(problem(
                    "/expires_at",
                    format!("expired at {} (now {now})", lease.expires_at),
                )),
            }
            problems
        }
    }
}

/// The entries of a lease's host lists that are not patterns: (list, index, why).
fn malformed_patterns(
    lease: &Lease,
) -> impl Iterator<Item = (&'static str, usize, MalformedPattern)> + '_ {
    let list = |name: &'static str, hosts: &'_ [String]| {
        hosts
            .iter()
            .enumerate()
            .filter_map(move |(i, h)| HostPattern::parse(h).err().map(|bad| (name, i, bad)))
            .collect::<Vec<_>>()
    };
    list("allow", &lease.allow_hosts)
        .into_iter()
        .chain(list("deny", &lease.deny_hosts))
}

fn malformed_reason(lease_id: &str, list: &str, bad: &MalformedPattern) -> String {
    format!(
        "lease {lease_id}: {list}.hosts entry '{}' is not a host pattern and matches nothing: {}",
        bad.pattern, bad.why
    )
}

fn verify_journal(text: &[u8], keyring: Option<&Keyring>, max_line: usize) -> Vec<Problem> {
    let mut ledger = match keyring {
        Some(k) => Ledger::new(k.clone()),
        None => Ledger::unverified(),
    }
    .limiting_lines(max_line);
    let mut problems: Vec<Problem> = journal::fold_bytes(&mut ledger, text)
        .into_iter()
        .map(|p| Problem {
            place: format!("line {}", p.line),
            reason: p.error.to_string(),
        })
        .collect();
    // A lease that loaded may still carry entries that are not patterns (its signer's
    // mistake): they match nothing, which narrows the grant silently unless said here.
    for lease in ledger.leases() {
        for (list, index, bad) in malformed_patterns(lease) {
            problems.push(Problem {
                place: format!("lease {} {list}.hosts[{index}]", lease.id),
                reason: malformed_reason(&lease.id, list, &bad),
            });
        }
    }
    problems
}

/// One row of `leases`.
#[derive(Debug, Clone, Serialize)]
pub struct LeaseRow {
    pub lease_id: String,
    pub parent_lease_id: Option<String>,
    pub agent: String,
    pub status: &'static str,
    pub expires_at: Timestamp,
    /// `budget.wall_clock_ms` when that, not the signed `expires_at`, sets the end.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_by: Option<&'static str>,
    pub allow_hosts: Vec<String>,
    pub deny_hosts: Vec<String>,
    /// Entries of either list that are not host patterns (they match nothing).
    pub malformed_hosts: Vec<String>,
    /// What closed it, when, by whom and why; `None` while it opens or may open.
    pub closed: Option<ClosedView>,
    /// The same, shortened for the table.
    #[serde(skip)]
    pub closed_cell: Option<String>,
}

/// One row of the status table: `lease` with its `status` at `now` in `ledger`.
pub fn lease_row(ledger: &Ledger, lease: &Lease, status: Status, now: Timestamp) -> LeaseRow {
    let closing = ledger.check_chain(&lease.id, now).err();
    LeaseRow {
        lease_id: lease.id.clone(),
        parent_lease_id: lease.parent.clone(),
        agent: lease.agent_name.clone(),
        status: status.as_str(),
        expires_at: lease.expires_at,
        expires_by: lease.ends_by_wall_clock().then_some(WALL_CLOCK_BUDGET),
        allow_hosts: lease.allow_hosts.clone(),
        deny_hosts: lease.deny_hosts.clone(),
        malformed_hosts: malformed_patterns(lease)
            .map(|(_, _, bad)| bad.pattern)
            .collect(),
        closed: closing.as_ref().and_then(ChainError::closed_view),
        closed_cell: closing.as_ref().and_then(ChainError::closed_cell),
    }
}

/// The marker `leases` puts before a host entry that is not a pattern.
pub const MALFORMED_MARKER: char = '!';

const HEADER: [&str; 8] = [
    "LEASE",
    "PARENT",
    "AGENT",
    "STATUS",
    "EXPIRES_AT",
    "ALLOW",
    "DENY",
    "CLOSED",
];

fn cells(r: &LeaseRow) -> [String; 8] {
    [
        r.lease_id.clone(),
        r.parent_lease_id.clone().unwrap_or_else(|| "-".into()),
        r.agent.clone(),
        r.status.to_owned(),
        r.expires_at.to_string(),
        join_marked(&r.allow_hosts, &r.malformed_hosts),
        join_marked(&r.deny_hosts, &r.malformed_hosts),
        r.closed_cell.clone().unwrap_or_else(|| "-".into()),
    ]
}

/// Writes the rows `rows()` yields as an aligned text table, one line at a time: `rows` is
/// called twice (column widths, then lines), so no table is held in memory, whatever its size.
pub fn write_table<I: Iterator<Item = LeaseRow>>(
    out: &mut impl std::io::Write,
    rows: impl Fn() -> I,
) -> std::io::Result<()> {
    let mut any_malformed = false;
    let widths = crate::table::widths(
        HEADER,
        rows().map(|r| {
            any_malformed |= !r.malformed_hosts.is_empty();
            cells(&r)
        }),
    );
    out.write_all(crate::table::line(&widths, HEADER).as_bytes())?;
    for row in rows() {
        out.write_all(crate::table::line(&widths, cells(&row)).as_bytes())?;
    }
    if any_malformed {
        writeln!(
            out,
            "{MALFORMED_MARKER} not a host pattern: it matches nothing (`leasegate verify` says why)"
        )?;
    }
    Ok(())
}

/// The hosts, comma-separated, each malformed one behind the marker; `-` for none.
fn join_marked(hosts: &[String], malformed: &[String]) -> String {
    if hosts.is_empty() {
        return "-".into();
    }
    let shown: Vec<String> = hosts
        .iter()
        .map(|h| match malformed.contains(h) {
            true => format!("{MALFORMED_MARKER}{h}"),
            false => h.clone(),
        })
        .collect();
    shown.join(",")
}

/// [`explain`] over the journal at `journal`, opened for this check alone.
pub async fn check(
    journal: &JournalLocation,
    store: &StoreOptions,
    keyring: Keyring,
    config: ProxyConfig,
    lease_id: &str,
    target: &str,
) -> Result<Explanation, OpenError> {
    let registry = open_registry(journal, keyring, store, false).await?;
    Ok(explain(&registry, &config, lease_id, target).await)
}
