//! The issuer's rules: a declared manifest narrowed against its parent's grant (or, for a
//! root, the issuer's root policy) into the manifest granted, or refused with the contract's
//! reserved reason codes.
//!
//! Invariant: pure, and nothing granted is wider than the parent. Every allowed host is one
//! the parent's patterns contain; every other allow entry is one of the parent's (a path glob:
//! one under a parent glob); every parent deny entry and approval is kept; every budget
//! ceiling is at most what the parent has left; `depth` is one less than the parent's and
//! `fan_out` no more; the lease ends no later than its parent. What was narrowed is said, one
//! clause per change, in the `narrowed` record's summary.

use super::lease::{Lease, Terms};
use super::schema::{Schema, SchemaIssue};
use super::Timestamp;
use crate::policy::HostPattern;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

/// The most a `narrowed` or `refused` record's `reason` holds (the contract's bound).
const SUMMARY_MAX_CHARS: usize = 500;

/// What the parent has left of each budget ceiling that spending lowers: the tightest along
/// its chain (`None`: no ceiling of that kind anywhere up the chain).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Remaining {
    pub tokens: Option<u64>,
    pub cost_usd: Option<f64>,
    pub steps: Option<u64>,
}

/// The parent a child is narrowed against, as the issuer found it at `now`.
#[derive(Debug, Clone, Copy)]
pub struct Parent<'a> {
    pub lease: &'a Lease,
    pub remaining: Remaining,
    /// Its children live now (what its `budget.fan_out` counts).
    pub live_children: u64,
}

/// What a root lease may ask for: the issuer's own ceilings (a root has no parent to be
/// narrowed against); a root that asks for none gets them. `None`: no ceiling (the
/// development `issue` into a journal file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootPolicy {
    pub max_depth: Option<u64>,
    pub max_fan_out: Option<u64>,
}

impl RootPolicy {
    /// No ceiling of the issuer's own.
    pub const OPEN: RootPolicy = RootPolicy {
        max_depth: None,
        max_fan_out: None,
    };
}

impl Default for RootPolicy {
    /// The contract's reference root policy: 4 generations, 8 live children.
    fn default() -> RootPolicy {
        RootPolicy {
            max_depth: Some(4),
            max_fan_out: Some(8),
        }
    }
}

/// One issuance to decide.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The declared manifest, whole (see [`completed`]).
    pub declared: &'a Value,
    pub parent: Option<Parent<'a>>,
    pub root: RootPolicy,
    /// The end the issuer was asked for.
    pub ends: Timestamp,
    pub now: Timestamp,
    /// An allow pattern that is a wildcard over a public suffix (`*.com`) is granted, not
    /// refused (`issue --force`).
    pub public_suffix_wildcards: bool,
}

/// A grant: the manifest to sign, its end, and what narrowing changed (empty: nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    pub manifest: Value,
    pub expires_at: Timestamp,
    pub narrowed: Vec<String>,
}

impl Grant {
    /// The `narrowed` record's `reason`: the clauses, joined, within the contract's bound.
    pub fn summary(&self) -> String {
        bounded(self.narrowed.join("; "))
    }
}

/// Why nothing is granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub kind: Refusal,
    /// The reserved codes (`R1`, `runtime_error:…`, `vendor:leasegate:…`).
    pub reasons: Vec<String>,
    /// Their reading, for the record's `reason` and the answer.
    pub reason: String,
}

/// Which answer a refusal gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The declaration is not one the contract grants (R1, R2, R4, schema).
    Declaration,
    /// The parent cannot have this child now (closed, `depth`, `fan_out`).
    Parent,
}

impl Refused {
    fn new(kind: Refusal, reasons: Vec<&str>, reason: String) -> Refused {
        Refused {
            kind,
            reasons: reasons.into_iter().map(str::to_owned).collect(),
            reason: bounded(reason),
        }
    }

    /// A parent that does not open anything now: no child of it is granted.
    pub fn parent_closed(parent: &str, why: &str) -> Refused {
        Refused::new(
            Refusal::Parent,
            vec!["vendor:leasegate:parent-closed"],
            format!("parent lease {parent} opens nothing: {why}"),
        )
    }

    /// A parent this issuer does not know.
    pub fn parent_unknown(parent: &str) -> Refused {
        Refused::new(
            Refusal::Parent,
            vec!["runtime_error:parent_unknown"],
            format!("parent lease {parent} is unknown"),
        )
    }

    /// A budget that cannot be told (another replica's spending is not being read).
    pub fn budget_unknown(why: &str) -> Refused {
        Refused::new(
            Refusal::Parent,
            vec!["runtime_error:budget_unknown"],
            format!("the parent's remaining budget cannot be told: {why}"),
        )
    }

    /// The fold's own lineage check refused the grant (a child issued at the same time
    /// elsewhere took the last place).
    pub fn lineage(code: &str, why: String) -> Refused {
        Refused::new(Refusal::Parent, vec![code], why)
    }
}

fn bounded(text: String) -> String {
    if text.chars().count() <= SUMMARY_MAX_CHARS {
        return text;
    }
    let mut cut: String = text.chars().take(SUMMARY_MAX_CHARS - 1).collect();
    cut.push('…');
    cut
}

/// `given` completed into a whole manifest: every member the contract requires and the caller
/// left out takes its empty value (`schema_version` the version we write, `agent.kind`
/// `external`, `agent.runtime_agent` `unknown`, empty lists, an empty budget); what was given
/// is kept as given. Anything but an object is returned as is, for the schema to refuse.
pub fn completed(given: &Value, version: &str) -> Value {
    let Some(object) = given.as_object() else {
        return given.clone();
    };
    let mut manifest = object.clone();
    let fill = |object: &mut Map<String, Value>, key: &str, value: Value| {
        object.entry(key.to_owned()).or_insert(value);
    };
    fill(&mut manifest, "schema_version", version.into());
    for (key, members) in [
        ("agent", &[][..]),
        ("intent", &[]),
        (
            "allow",
            &["tools", "read_paths", "write_paths", "hosts", "commands"][..],
        ),
        ("deny", &["commands", "paths", "hosts"]),
        ("budget", &[]),
    ] {
        fill(&mut manifest, key, json!({}));
        if let Some(inner) = manifest.get_mut(key).and_then(Value::as_object_mut) {
            for member in members {
                fill(inner, member, json!([]));
            }
        }
    }
    if let Some(agent) = manifest.get_mut("agent").and_then(Value::as_object_mut) {
        fill(agent, "kind", "external".into());
        fill(agent, "runtime_agent", "unknown".into());
    }
    fill(&mut manifest, "approvals", json!([]));
    Value::Object(manifest)
}

/// Decides one issuance: the grant, narrowed, or why not.
pub fn narrow(ask: &Ask) -> Result<Grant, Refused> {
    check_declaration(ask.declared, ask.public_suffix_wildcards)?;
    let mut granted = ask.declared.clone();
    let mut narrowed = Vec::new();
    if let Some(tool_args) = granted["allow"]
        .as_object_mut()
        .and_then(|a| a.remove("tool_args"))
    {
        // A declaration, not a grant (the contract's 1.x rule): no gate here evaluates it.
        if tool_args.as_object().is_some_and(|o| !o.is_empty()) {
            narrowed.push("allow.tool_args dropped (a declaration, not a grant)".to_owned());
        }
    }
    let mut expires_at = ask.ends;
    match &ask.parent {
        Some(parent) => {
            granted["parent_lease_id"] = parent.lease.id.as_str().into();
            narrow_to_parent(&mut granted, parent, ask.now, &mut narrowed)?;
            if parent.lease.expires_at < expires_at {
                expires_at = parent.lease.expires_at;
                narrowed.push(format!(
                    "expires_at {} → {} (the parent's end)",
                    ask.ends, expires_at
                ));
            }
        }
        None => {
            if let Some(object) = granted.as_object_mut() {
                object.remove("parent_lease_id");
            }
            let budget = &mut granted["budget"];
            clamp_integer(budget, "depth", ask.root.max_depth, &mut narrowed);
            clamp_integer(budget, "fan_out", ask.root.max_fan_out, &mut narrowed);
        }
    }
    let opens_nothing = ["tools", "hosts"]
        .iter()
        .all(|list| granted["allow"][list].as_array().is_none_or(Vec::is_empty));
    if opens_nothing {
        return Err(Refused::new(
            Refusal::Declaration,
            vec!["R2"],
            match ask.parent {
                Some(parent) => format!(
                    "the granted manifest opens nothing: none of the tools and hosts asked for \
                     is within parent lease {}'s",
                    parent.lease.id
                ),
                None => "the granted manifest opens nothing: it names no tool and no host".into(),
            },
        ));
    }
    Ok(Grant {
        manifest: granted,
        expires_at,
        narrowed,
    })
}

/// R1 (no purpose), R4 (a native agent that is `unknown`), then the schema and the host
/// patterns (`runtime_error:schema_invalid`); every reason found, not just the first.
fn check_declaration(declared: &Value, public_suffix_wildcards: bool) -> Result<(), Refused> {
    let mut reasons = Vec::new();
    let mut prose = Vec::new();
    let purpose = declared["intent"]["purpose"].as_str().unwrap_or_default();
    if purpose.trim().is_empty() {
        reasons.push("R1");
        prose.push("purpose is empty".to_owned());
    }
    if declared["agent"]["kind"] == "native" && declared["agent"]["runtime_agent"] == "unknown" {
        reasons.push("R4");
        prose.push("runtime_agent unknown is refused for a native agent".to_owned());
    }
    let issues: Vec<SchemaIssue> = match Schema::Manifest.validate(declared) {
        Ok(()) => Vec::new(),
        Err(issues) => issues
            .into_iter()
            // What R1 already says.
            .filter(|i| !i.path.starts_with("/intent/purpose") && !is_missing_purpose(i))
            .collect(),
    };
    let mut invalid: Vec<String> = issues.iter().map(ToString::to_string).collect();
    invalid.extend(unknown_members(declared));
    for list in ["allow", "deny"] {
        for host in declared[list]["hosts"].as_array().into_iter().flatten() {
            let Some(text) = host.as_str() else { continue };
            match HostPattern::parse(text) {
                Ok(pattern) if list == "allow" && !public_suffix_wildcards => {
                    if let Some(suffix) = pattern.public_suffix_wildcard() {
                        invalid.push(format!(
                            "/allow/hosts: {text:?} is a wildcard over the public suffix \
                             {suffix:?}: it reaches every name anyone may register there"
                        ));
                    }
                }
                Ok(_) => {}
                Err(e) => invalid.push(format!("/{list}/hosts: {e}")),
            }
        }
    }
    if !invalid.is_empty() {
        reasons.push("runtime_error:schema_invalid");
        invalid.dedup();
        prose.push(format!("the manifest is not valid: {}", invalid.join("; ")));
    }
    match reasons.is_empty() {
        true => Ok(()),
        false => Err(Refused::new(
            Refusal::Declaration,
            reasons,
            prose.join("; "),
        )),
    }
}

/// The members of the manifest's closed parts (its top level, `allow`, `deny`, `budget`) that
/// the contract (schema set 1.2) does not name. The schema carries unknown members, as a reader
/// must; an issuer deciding a grant refuses them, because a misspelt ceiling
/// (`budget.token`) would otherwise be a lease without that ceiling.
fn unknown_members(declared: &Value) -> Vec<String> {
    const PARTS: [(&str, &[&str]); 4] = [
        (
            "",
            &[
                "schema_version",
                "agent",
                "parent_lease_id",
                "intent",
                "allow",
                "deny",
                "budget",
                "approvals",
                "attestation",
            ],
        ),
        (
            "allow",
            &[
                "tools",
                "read_paths",
                "write_paths",
                "hosts",
                "commands",
                "tool_args",
            ],
        ),
        ("deny", &["commands", "paths", "hosts"]),
        (
            "budget",
            &[
                "steps",
                "wall_clock_ms",
                "tokens",
                "cost_usd",
                "depth",
                "fan_out",
            ],
        ),
    ];
    let mut unknown = Vec::new();
    for (part, known) in PARTS {
        let object = match part {
            "" => declared.as_object(),
            part => declared[part].as_object(),
        };
        for key in object.into_iter().flat_map(|o| o.keys()) {
            if !known.contains(&key.as_str()) {
                unknown.push(format!(
                    "/{part}{}{key}: not a member the contract names here (it has {})",
                    if part.is_empty() { "" } else { "/" },
                    known.join(", ")
                ));
            }
        }
    }
    unknown
}

fn is_missing_purpose(issue: &SchemaIssue) -> bool {
    issue.path == "/intent" && issue.message.contains("\"purpose\"")
}

/// Every rule against the parent: allow lists intersected, deny lists and approvals united,
/// the budget clamped, `depth` and `fan_out` checked and passed down.
fn narrow_to_parent(
    granted: &mut Value,
    parent: &Parent,
    now: Timestamp,
    narrowed: &mut Vec<String>,
) -> Result<(), Refused> {
    let lease = parent.lease;
    let budget = lease.budget.as_deref().cloned().unwrap_or_default();
    if let Some(depth) = budget.depth {
        if depth == 0 {
            return Err(Refused::lineage(
                "vendor:leasegate:depth-exhausted",
                format!(
                    "parent lease {} has budget.depth 0: it issues no children",
                    lease.id
                ),
            ));
        }
    }
    if let Some(fan_out) = budget.fan_out {
        if parent.live_children >= fan_out {
            return Err(Refused::lineage(
                "vendor:leasegate:fan-out-full",
                format!(
                    "parent lease {} has budget.fan_out {fan_out} and {} live children already",
                    lease.id, parent.live_children
                ),
            ));
        }
    }
    let empty = Terms::default();
    let terms = lease.terms.as_deref().unwrap_or(&empty);
    let allow = &mut granted["allow"];
    let exact = |list: &[String]| Exact(list.iter().cloned().collect());
    intersect(allow, "hosts", &Hosts::new(&lease.allow_hosts), narrowed);
    intersect(allow, "tools", &exact(&terms.tools), narrowed);
    intersect(allow, "commands", &exact(&terms.commands), narrowed);
    intersect(
        allow,
        "read_paths",
        &Paths::new(&terms.read_paths),
        narrowed,
    );
    intersect(
        allow,
        "write_paths",
        &Paths::new(&terms.write_paths),
        narrowed,
    );
    let deny = &mut granted["deny"];
    unite(deny, "hosts", "deny.hosts", &lease.deny_hosts, narrowed);
    unite(
        deny,
        "commands",
        "deny.commands",
        &terms.deny_commands,
        narrowed,
    );
    unite(deny, "paths", "deny.paths", &terms.deny_paths, narrowed);
    unite(
        granted,
        "approvals",
        "approvals",
        &terms.approvals,
        narrowed,
    );

    let child = &mut granted["budget"];
    let remaining = parent.remaining;
    clamp_integer(child, "tokens", remaining.tokens, narrowed);
    clamp_integer(child, "steps", remaining.steps, narrowed);
    clamp_cost(child, remaining.cost_usd, narrowed);
    // What the parent has left of its life, when its wall-clock budget is what ends it: the
    // child's end is clamped to the parent's anyway, so only a declared one is narrowed.
    if child.get("wall_clock_ms").is_some() {
        let left = lease
            .expires_at
            .as_millis()
            .saturating_sub(now.as_millis())
            .max(0);
        clamp_integer(child, "wall_clock_ms", Some(left as u64), narrowed);
    }
    clamp_integer(child, "depth", budget.depth.map(|d| d - 1), narrowed);
    clamp_integer(child, "fan_out", budget.fan_out, narrowed);
    Ok(())
}

/// A parent's list, indexed so that a child's list of n entries is intersected with it in
/// O(n × labels), not O(n × the parent's length): a request may name thousands of entries
/// against a parent of thousands (a grant holds up to a record's size).
trait Within {
    /// Whether a parent entry covers all of `child`.
    fn covers(&self, child: &str) -> bool;
    /// The parent entries `child` covers (where `child` is wider than what the parent has).
    fn under(&self, child: &str) -> Vec<String>;
}

/// Exact entries (tools, commands): equal or nothing.
struct Exact(HashSet<String>);

impl Within for Exact {
    fn covers(&self, child: &str) -> bool {
        self.0.contains(child)
    }

    fn under(&self, _: &str) -> Vec<String> {
        Vec::new()
    }
}

/// Host patterns, as [`HostPattern::contains`] orders them: `*` covers all, `*.x` its strict
/// subdomains and `*.sub.x` (and itself), a name only itself. A malformed entry covers nothing.
struct Hosts {
    any: bool,
    names: HashSet<String>,
    /// `x` of each `*.x`.
    wildcards: HashSet<String>,
    /// By each domain strictly above an entry (and `x` itself for `*.x`): the entries there.
    below: HashMap<String, Vec<String>>,
    all: Vec<String>,
}

/// The proper label suffixes of `name` (`a.b.c` → `b.c`, `c`).
fn suffixes(name: &str) -> impl Iterator<Item = &str> {
    name.match_indices('.').map(move |(i, _)| &name[i + 1..])
}

impl Hosts {
    fn new(parent: &[String]) -> Hosts {
        let mut hosts = Hosts {
            any: false,
            names: HashSet::new(),
            wildcards: HashSet::new(),
            below: HashMap::new(),
            all: Vec::new(),
        };
        for entry in parent {
            let Ok(pattern) = HostPattern::parse(entry) else {
                continue;
            };
            let text = pattern.to_string();
            let domain = match &pattern {
                HostPattern::Any => {
                    hosts.any = true;
                    hosts.all.push(text);
                    continue;
                }
                HostPattern::Exact(name) => {
                    hosts.names.insert(name.clone());
                    name.clone()
                }
                HostPattern::Subdomains(x) => {
                    hosts.wildcards.insert(x.clone());
                    hosts.below.entry(x.clone()).or_default().push(text.clone());
                    x.clone()
                }
            };
            for above in suffixes(&domain) {
                hosts
                    .below
                    .entry(above.to_owned())
                    .or_default()
                    .push(text.clone());
            }
            hosts.all.push(text);
        }
        hosts
    }
}

impl Within for Hosts {
    fn covers(&self, child: &str) -> bool {
        if self.any {
            return HostPattern::parse(child).is_ok();
        }
        match HostPattern::parse(child) {
            Ok(HostPattern::Exact(name)) => {
                self.names.contains(&name) || suffixes(&name).any(|s| self.wildcards.contains(s))
            }
            Ok(HostPattern::Subdomains(x)) => {
                self.wildcards.contains(&x) || suffixes(&x).any(|s| self.wildcards.contains(s))
            }
            _ => false,
        }
    }

    fn under(&self, child: &str) -> Vec<String> {
        match HostPattern::parse(child) {
            Ok(HostPattern::Any) => self.all.clone(),
            Ok(HostPattern::Subdomains(x)) => self.below.get(&x).cloned().unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

/// Path globs: `**` covers all, `dir/**` anything under `dir/`, any other glob only itself.
/// Anything else is not known to be covered, so not granted.
struct Paths {
    any: bool,
    globs: HashSet<String>,
    /// `dir/` of each `dir/**`.
    dirs: HashSet<String>,
    /// By each `dir/` an entry lies under: the entries there.
    below: HashMap<String, Vec<String>>,
    all: Vec<String>,
}

impl Paths {
    fn new(parent: &[String]) -> Paths {
        let mut paths = Paths {
            any: false,
            globs: HashSet::new(),
            dirs: HashSet::new(),
            below: HashMap::new(),
            all: parent.to_vec(),
        };
        for entry in parent {
            paths.globs.insert(entry.clone());
            if entry == "**" {
                paths.any = true;
            } else if let Some(dir) = entry.strip_suffix("**").filter(|d| d.ends_with('/')) {
                paths.dirs.insert(dir.to_owned());
            }
            for (i, _) in entry.match_indices('/') {
                paths
                    .below
                    .entry(entry[..=i].to_owned())
                    .or_default()
                    .push(entry.clone());
            }
        }
        paths
    }
}

impl Within for Paths {
    fn covers(&self, child: &str) -> bool {
        self.any
            || self.globs.contains(child)
            || child
                .match_indices('/')
                .any(|(i, _)| self.dirs.contains(&child[..=i]))
    }

    fn under(&self, child: &str) -> Vec<String> {
        if child == "**" {
            return self.all.clone();
        }
        match child.strip_suffix("**").filter(|d| d.ends_with('/')) {
            Some(dir) => self.below.get(dir).cloned().unwrap_or_default(),
            None => Vec::new(),
        }
    }
}

/// `value[list]` intersected with the parent's list: a child entry within a parent entry is
/// kept; a child entry wider than parent entries gives way to them; anything else is dropped.
/// Each change is said.
fn intersect(value: &mut Value, list: &str, parent: &impl Within, narrowed: &mut Vec<String>) {
    let asked: Vec<String> = strings(&value[list]);
    let mut kept: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    let mut dropped = 0;
    let mut keep = |entry: String, kept: &mut Vec<String>| {
        if seen.insert(entry.clone()) {
            kept.push(entry);
        }
    };
    for entry in asked {
        if parent.covers(&entry) {
            keep(entry, &mut kept);
            continue;
        }
        let within = parent.under(&entry);
        if within.is_empty() {
            dropped += 1;
            continue;
        }
        narrowed.push(format!("allow.{list} {entry} → {}", within.join(", ")));
        for p in within {
            keep(p, &mut kept);
        }
    }
    if dropped > 0 {
        narrowed.push(format!("allow.{list} -{dropped}"));
    }
    value[list] = kept.into();
}

/// `value[list]` united with the parent's: every parent entry is kept, the child's own after.
fn unite(value: &mut Value, list: &str, name: &str, parent: &[String], narrowed: &mut Vec<String>) {
    let mut united: Vec<String> = strings(&value[list]);
    let before = united.len();
    let mut seen: HashSet<String> = united.iter().cloned().collect();
    for entry in parent {
        if seen.insert(entry.clone()) {
            united.push(entry.clone());
        }
    }
    if united.len() > before {
        narrowed.push(format!("{name} +{}", united.len() - before));
    }
    value[list] = united.into();
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect()
}

/// `budget[field]` at most `ceiling` (set to it where absent); `None`: left as declared.
fn clamp_integer(
    budget: &mut Value,
    field: &str,
    ceiling: Option<u64>,
    narrowed: &mut Vec<String>,
) {
    let Some(ceiling) = ceiling else { return };
    match budget[field].as_u64() {
        Some(asked) if asked <= ceiling => {}
        Some(asked) => {
            narrowed.push(format!("budget.{field} {asked}→{ceiling}"));
            budget[field] = ceiling.into();
        }
        None => {
            narrowed.push(format!("budget.{field} set to {ceiling}"));
            budget[field] = ceiling.into();
        }
    }
}

fn clamp_cost(budget: &mut Value, ceiling: Option<f64>, narrowed: &mut Vec<String>) {
    let Some(ceiling) = ceiling.filter(|c| c.is_finite()).map(|c| c.max(0.0)) else {
        return;
    };
    match budget["cost_usd"].as_f64() {
        Some(asked) if asked <= ceiling => {}
        asked => {
            narrowed.push(match asked {
                Some(asked) => format!("budget.cost_usd {asked}→{ceiling}"),
                None => format!("budget.cost_usd set to {ceiling}"),
            });
            budget["cost_usd"] = json!(ceiling);
        }
    }
}

#[cfg(test)]
mod tests;
