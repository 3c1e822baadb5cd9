//! `leasegate suggest`: the smallest allow list that covers the hosts each lease (or one
//! agent, or one credentials label) reached, read from egress lines (typically recorded with
//! `serve --mode report`).
//!
//! Invariant: every host a counted line reached is matched by its group's suggestion, or is
//! named as unlisted when no host pattern can spell it (an IPv6 literal); an entry `*.d` is
//! only made for a domain `d` that is not a public suffix (Public Suffix List, compiled in)
//! and under which at least `collapse` sibling names were reached; nothing else widens. An
//! agent group holds only leases whose signed manifest names that agent (never a label a
//! client chose); a label group names every lease that contributed to it.

use super::{load_ledger, require_journal, CliResult};
use crate::cli::{SuggestArgs, SuggestFormat};
use crate::commands::usage::Filter;
use crate::policy::pattern::HostPattern;
use anyhow::Context;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::ExitCode;

/// Codes whose line reached no upstream on the lease's behalf: the client was not identified,
/// the target could not be read or resolved, or the upstream never answered.
const NOT_REACHED: &[&str] = &[
    "lease-missing",
    "lease-unknown",
    "lease-conflict",
    "bad-target",
    "not-a-proxy-request",
    "too-many-connections",
    "dns-failed",
    "upstream-unreachable",
    "upstream-timeout",
];

/// What a group of lines is: one lease, the leases of one manifest agent, or the lines of one
/// credentials label.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    Lease(String),
    /// Leases whose manifest `agent.name` (signed, in the journal) is this.
    Agent(String),
    /// Lines whose client sent this label (the user part of the proxy credentials): any lease
    /// may choose any label.
    Label(String),
}

impl std::fmt::Display for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Group::Lease(id) => write!(f, "lease {id}"),
            Group::Agent(name) => write!(f, "agent {name}"),
            Group::Label(label) => write!(f, "label {label}"),
        }
    }
}

/// How lines are grouped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Grouping {
    /// One group per lease.
    #[default]
    ByLease,
    /// One group: the leases whose manifest names this agent (the journal's `agents`).
    Agent(String),
    /// One group: the lines with this credentials label, whatever their lease.
    Label(String),
}

/// Leases named, with their line counts, when a filter matched no line.
const LEASES_NAMED: usize = 5;

/// Counts reached hosts as lines come in.
#[derive(Debug, Default)]
pub struct Tally {
    filter: Filter,
    grouping: Grouping,
    /// The manifest agent of each lease the journal holds, when one was read: selects an
    /// agent's leases, and says which agents a label spans.
    agents: Option<HashMap<String, String>>,
    groups: BTreeMap<Group, Counted>,
    /// Lines that are not egress lines.
    pub unreadable: u64,
    /// Lines that passed the filter but reached nothing (refused, unidentified, failed).
    pub not_reached: u64,
    /// Egress lines that passed the filter (`--lease`, `--since`).
    pub matched: u64,
    /// Egress lines read, by lease (`None`: without one), filter or not: what the log holds.
    pub read: BTreeMap<Option<String>, u64>,
}

/// What one group's lines reached.
#[derive(Debug, Default)]
struct Counted {
    /// Host → calls.
    hosts: BTreeMap<String, u64>,
    /// The leases whose lines were counted.
    leases: BTreeSet<String>,
}

impl Tally {
    /// `agents`: lease id → manifest `agent.name`, from the journal (needed by
    /// [`Grouping::Agent`]: without it no lease is the agent's).
    pub fn new(
        filter: Filter,
        grouping: Grouping,
        agents: Option<HashMap<String, String>>,
    ) -> Tally {
        Tally {
            filter,
            grouping,
            agents,
            ..Tally::default()
        }
    }

    /// Counts one egress line (without its newline; an empty line is skipped silently).
    pub fn add(&mut self, line: &[u8]) {
        let Some((time, line)) = Filter::default().take(line, &mut self.unreadable) else {
            return;
        };
        *self.read.entry(line.lease_id.clone()).or_default() += 1;
        if !self.filter.admits(line.lease_id.as_deref(), time) {
            return;
        }
        self.matched += 1;
        let agent_of = |id: &str| self.agents.as_ref().and_then(|a| a.get(id));
        let group = match (&self.grouping, line.label, line.lease_id.as_deref()) {
            (Grouping::ByLease, _, Some(id)) => Group::Lease(id.to_owned()),
            (Grouping::Agent(name), _, Some(id)) if agent_of(id) == Some(name) => {
                Group::Agent(name.clone())
            }
            (Grouping::Label(wanted), Some(label), _) if *wanted == label => Group::Label(label),
            (Grouping::ByLease, _, None) => {
                self.not_reached += 1;
                return;
            }
            _ => return,
        };
        let reached = matches!(line.verdict.as_str(), "allow" | "report")
            && line
                .code
                .as_deref()
                .is_none_or(|code| !NOT_REACHED.contains(&code));
        match line.host {
            Some(host) if reached => {
                let counted = self.groups.entry(group).or_default();
                *counted.hosts.entry(host).or_default() += 1;
                counted.leases.extend(line.lease_id);
            }
            _ => self.not_reached += 1,
        }
    }

    /// Why there is nothing to suggest, once [`Tally::finish`] found no group: the log holds
    /// no egress line; no line passed the filter (`filter` in words), naming the leases the
    /// log does hold, the most lines first, at most `LEASES_NAMED`; or no line that passed
    /// reached a host.
    pub fn nothing_because(&self, name: &str, filter: &str) -> String {
        if self.read.is_empty() {
            return format!("{name} holds no egress line; nothing to suggest");
        }
        if self.matched > 0 {
            return format!("no line of {name} reached a host; nothing to suggest");
        }
        let mut held: Vec<(&Option<String>, &u64)> = self.read.iter().collect();
        // Ties by lease id, lines without a lease last.
        held.sort_by_key(|&(lease, lines)| (std::cmp::Reverse(*lines), lease.is_none(), lease));
        let named: Vec<String> = held
            .iter()
            .take(LEASES_NAMED)
            .map(|(lease, lines)| match lease {
                Some(id) => format!("{id} ({lines})"),
                None => format!("no lease ({lines})"),
            })
            .collect();
        let more = match held.len().saturating_sub(LEASES_NAMED) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        format!(
            "no line of {name} matches {filter}; its lines are of {}{more}; nothing to suggest",
            named.join(", ")
        )
    }

    /// One suggestion per group, most calls first (ties by group). `collapse`: how many sibling
    /// names under one domain make `*.domain` (`None`: never).
    pub fn finish(self, collapse: Option<usize>) -> Vec<Suggestion> {
        let agents = self.agents;
        let mut out: Vec<Suggestion> = self
            .groups
            .into_iter()
            .map(|(group, counted)| {
                let warning = match (&group, &agents) {
                    (Group::Label(label), Some(agents)) => {
                        spanned_agents(label, &counted.leases, agents)
                    }
                    _ => None,
                };
                Suggestion {
                    leases: counted.leases.into_iter().collect(),
                    warning,
                    ..suggest(group, &counted.hosts, collapse)
                }
            })
            .collect();
        out.sort_by(|a, b| b.calls.cmp(&a.calls).then_with(|| a.group.cmp(&b.group)));
        out
    }
}

/// A warning when the leases that sent `label` do not all have one manifest agent (a lease
/// the journal does not hold counts as an agent of its own, "not in the journal").
fn spanned_agents(
    label: &str,
    leases: &BTreeSet<String>,
    agents: &HashMap<String, String>,
) -> Option<String> {
    let mut by_agent: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for lease in leases {
        let agent = match agents.get(lease) {
            Some(name) => format!("agent {name:?}"),
            None => "not in the journal".to_owned(),
        };
        by_agent.entry(agent).or_default().push(lease);
    }
    if by_agent.len() < 2 {
        return None;
    }
    let parts: Vec<String> = by_agent
        .iter()
        .map(|(agent, leases)| format!("{agent}: {}", leases.join(", ")))
        .collect();
    Some(format!(
        "label {label:?} spans leases of different manifest agents ({}); any lease may send any label",
        parts.join("; ")
    ))
}

/// One group's allow list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Suggestion {
    pub group: Group,
    /// The leases whose lines were counted, in id order.
    pub leases: Vec<String>,
    /// Said when a label group spans leases of different manifest agents.
    pub warning: Option<String>,
    /// Counted calls, listed or not.
    pub calls: u64,
    /// Most calls first, ties by pattern.
    pub entries: Vec<Entry>,
    /// Hosts reached that no `allow.hosts` pattern can name.
    pub unlisted: Vec<Unlisted>,
}

/// One `allow.hosts` pattern.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Entry {
    pub pattern: String,
    pub calls: u64,
    /// The hosts reached that it stands for, by name (for an exact entry, the host itself).
    pub hosts: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Unlisted {
    pub host: String,
    pub calls: u64,
    pub why: String,
}

/// What one base name stands for while collapsing: itself, and a wildcard over its subdomains.
#[derive(Debug, Default)]
struct Node {
    exact: Option<u64>,
    /// Hosts `*.base` covers, with their calls.
    below: BTreeMap<String, u64>,
}

/// The parent domain of a name (`None` for a single label).
fn parent(name: &str) -> Option<&str> {
    name.split_once('.').map(|(_, rest)| rest)
}

/// Whether `*.domain` may be suggested: `domain` has a label beyond its public suffix.
fn is_collapsible(domain: &str) -> bool {
    psl::suffix_str(domain).is_some_and(|suffix| suffix.len() < domain.len())
}

/// The smallest list covering `hosts` (host → calls) under the collapse rule.
pub fn suggest(group: Group, hosts: &BTreeMap<String, u64>, collapse: Option<usize>) -> Suggestion {
    let calls = hosts.values().sum();
    let mut entries = Vec::new();
    let mut unlisted = Vec::new();
    let mut nodes: BTreeMap<String, Node> = BTreeMap::new();
    for (host, &n) in hosts {
        match HostPattern::parse(host) {
            Ok(HostPattern::Exact(name)) if host.parse::<IpAddr>().is_ok() => entries.push(Entry {
                pattern: name,
                calls: n,
                hosts: vec![host.clone()],
            }),
            Ok(HostPattern::Exact(name)) => {
                *nodes.entry(name).or_default().exact.get_or_insert(0) += n;
            }
            Ok(other) => unlisted.push(Unlisted {
                host: host.clone(),
                calls: n,
                why: format!("'{other}' is a pattern, not a host"),
            }),
            Err(e) => unlisted.push(Unlisted {
                host: host.clone(),
                calls: n,
                why: e.why,
            }),
        }
    }
    if let Some(at_least) = collapse {
        while let Some(domain) = next_collapse(&nodes, at_least.max(1)) {
            let children: Vec<String> = nodes
                .keys()
                .filter(|k| parent(k) == Some(domain.as_str()))
                .cloned()
                .collect();
            let mut below = BTreeMap::new();
            for child in children {
                let Some(node) = nodes.remove(&child) else {
                    continue;
                };
                if let Some(n) = node.exact {
                    below.insert(child, n);
                }
                below.extend(node.below);
            }
            nodes.entry(domain).or_default().below.extend(below);
        }
    }
    for (base, node) in nodes {
        if !node.below.is_empty() {
            entries.push(Entry {
                pattern: format!("*.{base}"),
                calls: node.below.values().sum(),
                hosts: node.below.into_keys().collect(),
            });
        }
        if let Some(n) = node.exact {
            entries.push(Entry {
                pattern: base.clone(),
                calls: n,
                hosts: vec![base],
            });
        }
    }
    entries.sort_by(|a, b| {
        b.calls
            .cmp(&a.calls)
            .then_with(|| a.pattern.cmp(&b.pattern))
    });
    unlisted.sort_by(|a, b| b.calls.cmp(&a.calls).then_with(|| a.host.cmp(&b.host)));
    Suggestion {
        group,
        leases: Vec::new(),
        warning: None,
        calls,
        entries,
        unlisted,
    }
}

/// The deepest collapsible domain (ties by name) with at least `at_least` child names.
fn next_collapse(nodes: &BTreeMap<String, Node>, at_least: usize) -> Option<String> {
    let mut children: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for base in nodes.keys() {
        if let Some(p) = parent(base) {
            children.entry(p).or_default().insert(base);
        }
    }
    children
        .into_iter()
        .filter(|(domain, kids)| kids.len() >= at_least && is_collapsible(domain))
        .max_by(|(a, _), (b, _)| {
            let depth = |d: &str| d.matches('.').count();
            depth(a).cmp(&depth(b)).then_with(|| b.cmp(a))
        })
        .map(|(domain, _)| domain.to_owned())
}

/// `--format flags`: per group, commented counts, then one line of `--allow-host` flags
/// (wildcards single-quoted for the shell). Groups are separated by a blank line.
pub fn render_flags(suggestions: &[Suggestion]) -> String {
    let mut out = String::new();
    for (i, s) in suggestions.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "# {}: {} call(s), {} entr{}",
            s.group,
            s.calls,
            s.entries.len(),
            if s.entries.len() == 1 { "y" } else { "ies" }
        );
        if !matches!(s.group, Group::Lease(_)) {
            let _ = writeln!(out, "# leases: {}", s.leases.join(", "));
        }
        if let Some(warning) = &s.warning {
            let _ = writeln!(out, "# warning: {warning}");
        }
        let width = s
            .entries
            .iter()
            .map(|e| e.calls.to_string().len())
            .chain(s.unlisted.iter().map(|u| u.calls.to_string().len()))
            .max()
            .unwrap_or(1);
        for e in &s.entries {
            let covers = match e.pattern.starts_with("*.") {
                true => format!("  ({})", e.hosts.join(", ")),
                false => String::new(),
            };
            let _ = writeln!(out, "# {:>width$}  {}{covers}", e.calls, e.pattern);
        }
        for u in &s.unlisted {
            let _ = writeln!(
                out,
                "# {:>width$}  {}  not listable: {}",
                u.calls, u.host, u.why
            );
        }
        if !s.entries.is_empty() {
            let flags: Vec<String> = s
                .entries
                .iter()
                .map(|e| match e.pattern.starts_with('*') {
                    true => format!("--allow-host '{}'", e.pattern),
                    false => format!("--allow-host {}", e.pattern),
                })
                .collect();
            let _ = writeln!(out, "{}", flags.join(" "));
        }
    }
    out
}

/// `--format json`: one JSON line per group; `allow` is a manifest `allow` fragment.
pub fn render_json(suggestions: &[Suggestion]) -> String {
    /// The line's fields, in the order they are written.
    #[derive(Serialize)]
    struct Line<'a> {
        lease_id: Option<&'a str>,
        agent: Option<&'a str>,
        label: Option<&'a str>,
        leases: &'a [String],
        warning: Option<&'a str>,
        calls: u64,
        allow: Allow<'a>,
        entries: &'a [Entry],
        unlisted: &'a [Unlisted],
    }
    #[derive(Serialize)]
    struct Allow<'a> {
        hosts: Vec<&'a str>,
    }
    let mut out = String::new();
    for s in suggestions {
        let (lease_id, agent, label) = match &s.group {
            Group::Lease(id) => (Some(id.as_str()), None, None),
            Group::Agent(name) => (None, Some(name.as_str()), None),
            Group::Label(label) => (None, None, Some(label.as_str())),
        };
        let line = Line {
            lease_id,
            agent,
            label,
            leases: &s.leases,
            warning: s.warning.as_deref(),
            calls: s.calls,
            allow: Allow {
                hosts: s.entries.iter().map(|e| e.pattern.as_str()).collect(),
            },
            entries: &s.entries,
            unlisted: &s.unlisted,
        };
        if let Ok(text) = serde_json::to_string(&line) {
            let _ = writeln!(out, "{text}");
        }
    }
    out
}

/// `suggest`: the allow list each lease's recorded traffic needs.
pub fn exec(args: SuggestArgs) -> CliResult {
    let since = args.since.map(super::ago);
    // The manifest agent of every lease the journal holds, signatures verified.
    let agents = match args.lease_journal.ledger(&args.store) {
        Some(ledger) => {
            require_journal(&ledger.journal)?;
            let ledger = load_ledger(&ledger)?;
            let agents = ledger
                .leases()
                .map(|l| (l.id.clone(), l.agent_name.clone()));
            Some(agents.collect())
        }
        None => None,
    };
    let grouping = match (args.agent, args.label) {
        (Some(agent), _) => Grouping::Agent(agent),
        (None, Some(label)) => Grouping::Label(label),
        (None, None) => Grouping::ByLease,
    };
    let filter_words = [
        args.lease.as_ref().map(|lease| format!("--lease {lease}")),
        args.since
            .map(|since| format!("--since {}", humantime::format_duration(since))),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(" ");
    let mut tally = Tally::new(
        crate::commands::usage::Filter {
            lease: args.lease,
            since,
        },
        grouping,
        agents,
    );
    let name = args.from.display().to_string();
    match name.as_str() {
        "-" => {
            crate::commands::usage::for_each_line(std::io::stdin().lock(), |line| tally.add(line))
                .context("reading stdin")?
        }
        _ => std::fs::File::open(&args.from)
            .and_then(|file| {
                crate::commands::usage::for_each_line(std::io::BufReader::new(file), |line| {
                    tally.add(line)
                })
            })
            .with_context(|| format!("reading {name}"))?,
    }
    if tally.unreadable > 0 {
        eprintln!(
            "leasegate suggest: {} line(s) of {name} are not egress lines; skipped",
            tally.unreadable
        );
    }
    let nothing = tally.nothing_because(&name, &filter_words);
    let suggestions = tally.finish(args.collapse.map(|n| n as usize));
    for warning in suggestions.iter().filter_map(|s| s.warning.as_deref()) {
        eprintln!("leasegate suggest: warning: {warning}");
    }
    if suggestions.is_empty() {
        eprintln!("leasegate suggest: {nothing}");
    }
    let text = match args.format {
        SuggestFormat::Flags => render_flags(&suggestions),
        SuggestFormat::Json => render_json(&suggestions),
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::Timestamp;

    const A: &str = "00000001-0000-4000-8000-000000000000";
    const B: &str = "00000002-0000-4000-8000-000000000000";

    fn line(lease: Option<&str>, label: Option<&str>, host: &str, verdict: &str) -> String {
        let code = match verdict {
            "allow" => None,
            "report" => Some("host-not-allowed"),
            other => Some(other),
        };
        serde_json::json!({
            "time": "2026-01-01T10:00:00.000Z",
            "lease_id": lease,
            "label": label,
            "client": "127.0.0.1:5000",
            "listener": "127.0.0.1:3128",
            "kind": "http",
            "method": "GET",
            "host": host,
            "port": 80,
            "dialed": null,
            "verdict": match verdict { "allow" | "report" => verdict, _ => "refuse" },
            "code": code,
            "status": 200,
            "bytes_up": 0,
            "bytes_down": 0,
            "duration_ms": 1.5,
        })
        .to_string()
    }

    fn tally(lines: &[String], grouping: Grouping, collapse: Option<usize>) -> Vec<Suggestion> {
        let mut t = Tally::new(Filter::default(), grouping, None);
        for l in lines {
            t.add(l.as_bytes());
        }
        t.finish(collapse)
    }

    /// A filter that matched nothing says so, and names the leases the log holds.
    #[test]
    fn a_filter_that_matched_no_line_says_so() {
        let said = |filter: Filter, lines: &[String]| {
            let mut t = Tally::new(filter, Grouping::ByLease, None);
            for l in lines {
                t.add(l.as_bytes());
            }
            t.nothing_because("egress.jsonl", "--lease x")
        };
        let nope = "00000009-0000-4000-8000-000000000000";
        let only = |lease: &str| Filter {
            lease: Some(lease.into()),
            since: None,
        };
        let lines = [
            line(Some(A), None, "a.test", "allow"),
            line(Some(B), None, "b.test", "allow"),
            line(Some(B), None, "b.test", "allow"),
            line(None, None, "c.test", "lease-missing"),
        ];
        assert_eq!(
            said(only(nope), &lines),
            format!(
                "no line of egress.jsonl matches --lease x; its lines are of {B} (2), {A} (1), \
                 no lease (1); nothing to suggest"
            )
        );
        assert_eq!(
            said(only(A), &[line(Some(A), None, "a.test", "host-denied")]),
            "no line of egress.jsonl reached a host; nothing to suggest"
        );
        assert_eq!(
            said(only(A), &[]),
            "egress.jsonl holds no egress line; nothing to suggest"
        );
        let many: Vec<String> = (0..7)
            .map(|i| {
                line(
                    Some(&format!("0000000{i}-0000-4000-8000-000000000000")),
                    None,
                    "a.test",
                    "allow",
                )
            })
            .collect();
        assert!(said(only(nope), &many).ends_with(" (1) and 2 more; nothing to suggest"));
    }

    fn hosts(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
        pairs.iter().map(|(h, n)| ((*h).to_owned(), *n)).collect()
    }

    fn patterns(s: &Suggestion) -> Vec<(&str, u64)> {
        s.entries
            .iter()
            .map(|e| (e.pattern.as_str(), e.calls))
            .collect()
    }

    #[test]
    fn only_reached_hosts_count_per_lease() {
        let lines = vec![
            line(Some(A), None, "a.example.test", "allow"),
            line(Some(A), None, "a.example.test", "allow"),
            line(Some(A), None, "b.example.test", "report"),
            line(Some(A), None, "gone.test", "dns-failed"),
            line(Some(A), None, "down.test", "upstream-unreachable"),
            line(Some(A), None, "evil.test", "host-not-allowed"),
            line(None, None, "anon.test", "lease-missing"),
            line(Some(B), None, "c.test", "allow"),
            "not json".to_owned(),
            String::new(),
        ];
        let mut t = Tally::new(Filter::default(), Grouping::ByLease, None);
        for l in &lines {
            t.add(l.as_bytes());
        }
        assert_eq!((t.unreadable, t.not_reached), (1, 4));
        let out = t.finish(None);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].group, Group::Lease(A.into()));
        assert_eq!(out[0].calls, 3);
        assert_eq!(
            patterns(&out[0]),
            [("a.example.test", 2), ("b.example.test", 1)]
        );
        assert_eq!(out[1].group, Group::Lease(B.into()));
        assert_eq!(patterns(&out[1]), [("c.test", 1)]);
    }

    const C: &str = "00000003-0000-4000-8000-000000000000";

    /// A journal's manifest agents: A and B are the crawler's, C is another agent's.
    fn agents() -> HashMap<String, String> {
        [(A, "crawler"), (B, "crawler"), (C, "evil")]
            .into_iter()
            .map(|(id, name)| (id.to_owned(), name.to_owned()))
            .collect()
    }

    #[test]
    fn a_label_groups_across_leases_and_names_them() {
        let lines = vec![
            line(Some(A), Some("crawler"), "a.test", "allow"),
            line(Some(B), Some("crawler"), "b.test", "allow"),
            line(Some(B), Some("other"), "c.test", "allow"),
            line(Some(B), None, "d.test", "allow"),
        ];
        let out = tally(&lines, Grouping::Label("crawler".into()), None);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].group, Group::Label("crawler".into()));
        assert_eq!(patterns(&out[0]), [("a.test", 1), ("b.test", 1)]);
        assert_eq!(out[0].leases, [A, B]);
        assert_eq!(out[0].warning, None);
    }

    #[test]
    fn an_agent_is_the_manifests_not_the_label_a_client_sent() {
        // C's manifest names "evil", but its client sends the label "crawler".
        let lines = vec![
            line(Some(A), Some("crawler"), "a.test", "allow"),
            line(Some(B), Some("anything"), "b.test", "allow"),
            line(Some(C), Some("crawler"), "evil.test", "allow"),
        ];
        let run = |grouping: Grouping| {
            let mut t = Tally::new(Filter::default(), grouping, Some(agents()));
            for l in &lines {
                t.add(l.as_bytes());
            }
            t.finish(None)
        };
        let crawler = run(Grouping::Agent("crawler".into()));
        assert_eq!(crawler.len(), 1);
        assert_eq!(crawler[0].group, Group::Agent("crawler".into()));
        assert_eq!(patterns(&crawler[0]), [("a.test", 1), ("b.test", 1)]);
        assert_eq!(crawler[0].leases, [A, B]);
        assert!(run(Grouping::Agent("nobody".into())).is_empty());
        // Without a journal no lease is an agent's.
        let mut blind = Tally::new(Filter::default(), Grouping::Agent("crawler".into()), None);
        for l in &lines {
            blind.add(l.as_bytes());
        }
        assert!(blind.finish(None).is_empty());

        // The label spans two manifest agents: said, with the leases of each.
        let label = run(Grouping::Label("crawler".into()));
        assert_eq!(label[0].leases, [A, C]);
        assert_eq!(
            label[0].warning.as_deref(),
            Some(format!(
                "label \"crawler\" spans leases of different manifest agents (agent \"crawler\": {A}; \
                 agent \"evil\": {C}); any lease may send any label"
            ))
            .as_deref()
        );
        let flags = render_flags(&label);
        assert!(flags.contains(&format!("# leases: {A}, {C}\n")), "{flags}");
        assert!(
            flags.contains("# warning: label \"crawler\" spans"),
            "{flags}"
        );
        let json: serde_json::Value = serde_json::from_str(&render_json(&label)).unwrap();
        assert_eq!(json["label"], "crawler");
        assert_eq!(json["agent"], serde_json::Value::Null);
        assert_eq!(json["leases"], serde_json::json!([A, C]));
        assert_eq!(json["warning"], label[0].warning.as_deref().unwrap());
    }

    #[test]
    fn the_filter_selects_a_lease_and_a_start() {
        let mut late = line(Some(B), None, "late.test", "allow");
        late = late.replace("10:00:00.000Z", "11:00:00.000Z");
        let lines = [
            line(Some(A), None, "a.test", "allow"),
            line(Some(B), None, "early.test", "allow"),
            late,
        ];
        let run = |filter: Filter| {
            let mut t = Tally::new(filter, Grouping::ByLease, None);
            for l in &lines {
                t.add(l.as_bytes());
            }
            t.finish(None)
        };
        let only_b = run(Filter {
            lease: Some(B.into()),
            since: None,
        });
        assert_eq!(only_b.len(), 1);
        assert_eq!(patterns(&only_b[0]), [("early.test", 1), ("late.test", 1)]);
        let recent = run(Filter {
            lease: None,
            since: Some(Timestamp::parse("2026-01-01T10:30:00.000Z").unwrap()),
        });
        assert_eq!(recent.len(), 1);
        assert_eq!(patterns(&recent[0]), [("late.test", 1)]);
    }

    #[test]
    fn without_collapse_every_host_stays_exact() {
        let s = suggest(
            Group::Lease(A.into()),
            &hosts(&[("a.x.test", 1), ("b.x.test", 1), ("c.x.test", 1)]),
            None,
        );
        assert_eq!(
            patterns(&s),
            [("a.x.test", 1), ("b.x.test", 1), ("c.x.test", 1)]
        );
    }

    #[test]
    fn collapse_needs_that_many_siblings_and_keeps_the_domain_itself() {
        let seen = hosts(&[
            ("a.x.test", 2),
            ("b.x.test", 3),
            ("x.test", 1),
            ("solo.y.test", 4),
        ]);
        let two = suggest(Group::Lease(A.into()), &seen, Some(2));
        assert_eq!(
            patterns(&two),
            [("*.x.test", 5), ("solo.y.test", 4), ("x.test", 1)]
        );
        assert_eq!(two.entries[0].hosts, ["a.x.test", "b.x.test"]);
        let three = suggest(Group::Lease(A.into()), &seen, Some(3));
        assert_eq!(
            patterns(&three),
            [
                ("solo.y.test", 4),
                ("b.x.test", 3),
                ("a.x.test", 2),
                ("x.test", 1)
            ]
        );
    }

    #[test]
    fn collapse_climbs_from_the_deepest_domain() {
        let seen = hosts(&[("a.cdn.x.test", 1), ("b.cdn.x.test", 1), ("api.x.test", 1)]);
        let s = suggest(Group::Lease(A.into()), &seen, Some(2));
        assert_eq!(patterns(&s), [("*.x.test", 3)]);
        assert_eq!(
            s.entries[0].hosts,
            ["a.cdn.x.test", "api.x.test", "b.cdn.x.test"]
        );
    }

    #[test]
    fn never_a_wildcard_over_a_public_suffix() {
        let seen = hosts(&[
            ("a.co.uk", 1),
            ("b.co.uk", 1),
            ("one.github.io", 1),
            ("two.github.io", 1),
            ("a.test", 1),
            ("b.test", 1),
            ("www.example.co.uk", 1),
            ("api.example.co.uk", 1),
        ]);
        let s = suggest(Group::Lease(A.into()), &seen, Some(2));
        assert_eq!(
            patterns(&s),
            [
                ("*.example.co.uk", 2),
                ("a.co.uk", 1),
                ("a.test", 1),
                ("b.co.uk", 1),
                ("b.test", 1),
                ("one.github.io", 1),
                ("two.github.io", 1),
            ]
        );
    }

    #[test]
    fn ip_literals_stay_exact_and_ipv6_is_unlisted() {
        let seen = hosts(&[
            ("127.0.0.1", 2),
            ("127.0.0.2", 1),
            ("::1", 1),
            ("a.x.test", 1),
        ]);
        let s = suggest(Group::Lease(A.into()), &seen, Some(2));
        assert_eq!(
            patterns(&s),
            [("127.0.0.1", 2), ("127.0.0.2", 1), ("a.x.test", 1)]
        );
        assert_eq!(s.unlisted.len(), 1);
        assert_eq!(s.unlisted[0].host, "::1");
        assert_eq!(s.calls, 5);
    }

    #[test]
    fn flags_render_counts_as_comments_then_one_line_of_flags() {
        let lines = vec![
            line(Some(A), None, "a.x.test", "allow"),
            line(Some(A), None, "b.x.test", "allow"),
            line(Some(A), None, "b.x.test", "report"),
            line(Some(A), None, "x.test", "allow"),
            line(Some(A), None, "::1", "allow"),
            line(Some(B), None, "c.test", "allow"),
        ];
        let out = render_flags(&tally(&lines, Grouping::ByLease, Some(2)));
        assert_eq!(
            out,
            format!(
                "# lease {A}: 5 call(s), 2 entries\n\
                 # 3  *.x.test  (a.x.test, b.x.test)\n\
                 # 1  x.test\n\
                 # 1  ::1  not listable: {}\n\
                 --allow-host '*.x.test' --allow-host x.test\n\
                 \n\
                 # lease {B}: 1 call(s), 1 entry\n\
                 # 1  c.test\n\
                 --allow-host c.test\n",
                HostPattern::parse("::1").unwrap_err().why
            )
        );
    }

    #[test]
    fn json_renders_an_allow_fragment_per_group() {
        let lines = vec![
            line(Some(A), None, "a.x.test", "allow"),
            line(Some(A), None, "b.x.test", "allow"),
        ];
        let out = render_json(&tally(&lines, Grouping::ByLease, Some(2)));
        assert_eq!(
            out,
            format!(
                "{{\"lease_id\":\"{A}\",\"agent\":null,\"label\":null,\"leases\":[\"{A}\"],\"warning\":null,\"calls\":2,\"allow\":{{\"hosts\":[\"*.x.test\"]}},\
                 \"entries\":[{{\"pattern\":\"*.x.test\",\"calls\":2,\"hosts\":[\"a.x.test\",\"b.x.test\"]}}],\
                 \"unlisted\":[]}}\n"
            )
        );
    }
}
