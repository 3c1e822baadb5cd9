//! The development issuer: sign a lease for given hosts and append `granted`; append a signed
//! `revoked`.
//!
//! Invariant: every lease we sign loads under our own checks (schema, L1, L2, signature)
//! before it is appended, and a child's hosts are contained in its parent's.

use super::{dev, CliResult};
use crate::cli::{IssueArgs, IssuePrint};
use crate::contract::canonical::canonical_bytes;
use crate::contract::keys::sha256_hex;
use crate::contract::lease::sign;
use crate::contract::record;
use crate::contract::schema::WRITTEN_VERSION;
use crate::contract::token;
use crate::contract::{Key, Keyring, Lease, LeaseError, RecordError, Timestamp};
use crate::policy::pattern::MalformedPattern;
use crate::policy::target::{parse_host, TargetHost};
use crate::policy::HostPattern;
use crate::registry::revocation::{issuer_revocation, RevocationError};
use crate::registry::{journal, store, ChainError, Ledger};
use serde_json::{json, Map, Value};
use std::io::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("journal {path}: {error}")]
    Journal { path: String, error: std::io::Error },
    #[error("parent lease: {0}")]
    Parent(#[from] ChainError),
    #[error("host {host:?} is not contained in parent {parent}'s allow.hosts ({allowed})")]
    NotContained {
        host: String,
        parent: String,
        allowed: String,
    },
    #[error(
        "lease {lease} is not in the journal under the key {key} (a lease signed with another \
         key, or a mistyped id)"
    )]
    UnknownLease { lease: String, key: String },
    #[error("lease would not load: {0}")]
    Lease(#[from] LeaseError),
    #[error("record: {0}")]
    Record(#[from] RecordError),
    #[error("TTL {0:?} is too long")]
    Ttl(Duration),
    #[error("{list} host {0}", list = .1)]
    Pattern(MalformedPattern, &'static str),
    #[error(
        "allow host '{pattern}' is a wildcard over the public suffix '{suffix}': it reaches \
         every name anyone may register there. List the domains (e.g. '*.example.{suffix}'), \
         or pass --force to accept it"
    )]
    PublicSuffix { pattern: String, suffix: String },
    #[error(
        "the grant would be {0} bytes, more than the {max} a journal record may be (a NATS \
         message with the default max_payload): split the lease, or use wildcard patterns",
        max = record::MAX_RECORD_BYTES
    )]
    TooLarge(usize),
}

/// What to issue.
#[derive(Debug, Clone)]
pub struct IssueRequest {
    pub allow_hosts: Vec<String>,
    pub deny_hosts: Vec<String>,
    pub parent: Option<String>,
    pub ttl: Duration,
    pub name: String,
    pub purpose: String,
    pub now: Timestamp,
}

/// A lease that was appended.
#[derive(Debug, Clone)]
pub struct Issued {
    pub lease_id: String,
    pub expires_at: Timestamp,
}

fn fold(journal_path: &Path, key: &Key) -> Result<Ledger, IssueError> {
    let mut keyring = Keyring::new(false);
    keyring.insert(key.clone());
    journal::load(journal_path, Ledger::new(keyring))
        .map(|(ledger, _)| ledger)
        .map_err(|error| IssueError::Journal {
            path: journal_path.display().to_string(),
            error,
        })
}

/// The patterns as the lease will carry them: each checked (a spelling that is not a pattern
/// is refused, saying why) and written in its normal form (lower case, no trailing dot, an
/// international name as A-labels, an IPv4 literal as a dotted quad).
fn normalise_hosts(hosts: &[String], list: &'static str) -> Result<Vec<String>, IssueError> {
    hosts
        .iter()
        .map(|host| {
            let text = host.trim();
            HostPattern::parse(&to_a_labels(text))
                .map(|pattern| pattern.to_string())
                .map_err(|mut e| {
                    e.pattern = text.to_owned();
                    IssueError::Pattern(e, list)
                })
        })
        .collect()
}

/// The allow list's wildcards over a public suffix (`*.com`): refused unless `force`; with
/// it, one warning line each for stderr. Spellings that are not patterns are left to
/// [`issue`] to refuse.
pub fn public_suffix_wildcards(hosts: &[String], force: bool) -> Result<Vec<String>, IssueError> {
    let mut warnings = Vec::new();
    for host in hosts {
        let text = host.trim();
        let Ok(pattern) = HostPattern::parse(&to_a_labels(text)) else {
            continue;
        };
        let Some(suffix) = pattern.public_suffix_wildcard() else {
            continue;
        };
        if !force {
            return Err(IssueError::PublicSuffix {
                pattern: text.to_owned(),
                suffix: suffix.to_owned(),
            });
        }
        warnings.push(format!(
            "warning: allow host '{text}' is a wildcard over the public suffix '{suffix}' \
             (every name anyone may register there); accepted because of --force"
        ));
    }
    Ok(warnings)
}

/// `text` with an international name (after an optional `*.`) written as A-labels; anything
/// else unchanged, for [`HostPattern::parse`] to judge.
fn to_a_labels(text: &str) -> String {
    if text.is_ascii() {
        return text.to_owned();
    }
    let (wildcard, name) = match text.strip_prefix("*.") {
        Some(name) => ("*.", name),
        None => ("", text),
    };
    match parse_host(name) {
        Ok(TargetHost::Name(name)) => format!("{wildcard}{name}"),
        _ => text.to_owned(),
    }
}

/// Signs a lease and appends its `granted` record.
pub fn issue(journal_path: &Path, key: &Key, request: &IssueRequest) -> Result<Issued, IssueError> {
    let ttl_ms =
        i64::try_from(request.ttl.as_millis()).map_err(|_| IssueError::Ttl(request.ttl))?;
    let allow = normalise_hosts(&request.allow_hosts, "allow")?;
    let deny = normalise_hosts(&request.deny_hosts, "deny")?;
    let mut expires_at = request.now.saturating_add_millis(ttl_ms);
    if let Some(parent_id) = &request.parent {
        let ledger = fold(journal_path, key)?;
        let chain = ledger.check_chain(parent_id, request.now)?;
        let parent = &chain[0];
        // A malformed entry of the parent contains nothing.
        let parent_allow: Vec<HostPattern> = parent
            .allow_hosts
            .iter()
            .filter_map(|h| HostPattern::parse(h).ok())
            .collect();
        for host in &allow {
            let pattern = HostPattern::parse(host).map_err(|e| IssueError::Pattern(e, "allow"))?;
            if !parent_allow.iter().any(|p| p.contains(&pattern)) {
                return Err(IssueError::NotContained {
                    host: host.clone(),
                    parent: parent_id.clone(),
                    allowed: parent.allow_hosts.join(", "),
                });
            }
        }
        // A child never outlives its parent.
        expires_at = expires_at.min(parent.expires_at);
    }

    let mut manifest = json!({
        "schema_version": WRITTEN_VERSION,
        "agent": {"name": request.name, "kind": "external", "runtime_agent": "unknown"},
        "intent": {"purpose": request.purpose},
        "allow": {"tools": [], "read_paths": [], "write_paths": [], "hosts": allow, "commands": []},
        "deny": {"commands": [], "paths": [], "hosts": deny},
        "budget": {},
        "approvals": [],
    });
    let lease_id = uuid::Uuid::new_v4().to_string();
    let mut lease = json!({
        "schema_version": WRITTEN_VERSION,
        "lease_id": lease_id,
        "declared_hash": "",
        "issued_at": request.now.to_string(),
        "expires_at": expires_at.to_string(),
        "issuer_session_id": "leasegate-issue",
    });
    if let Some(parent) = &request.parent {
        manifest["parent_lease_id"] = parent.as_str().into();
        lease["parent_lease_id"] = parent.as_str().into();
    }
    lease["declared_hash"] =
        sha256_hex(&canonical_bytes(&manifest).map_err(LeaseError::from)?).into();
    lease["manifest"] = manifest.clone();
    sign(&mut lease, key).map_err(LeaseError::from)?;

    let mut keyring = Keyring::new(key.is_test_key());
    keyring.insert(key.clone());
    Lease::load(lease.clone(), &keyring)?;
    let granted = record::granted(&lease, &manifest, request.now)?;
    let size = serde_json::to_vec(&granted).map_or(usize::MAX, |line| line.len());
    if size > record::MAX_RECORD_BYTES {
        return Err(IssueError::TooLarge(size));
    }
    append(journal_path, &granted)?;
    Ok(Issued {
        lease_id,
        expires_at,
    })
}

/// Appends a signed `revoked` record (`by: "issuer"`) for a lease of the journal. Returns
/// `false`, writing nothing, if the lease is already revoked.
pub fn revoke(
    journal_path: &Path,
    key: &Key,
    lease_id: &str,
    reason: &str,
    now: Timestamp,
) -> Result<bool, IssueError> {
    let ledger = fold(journal_path, key)?;
    let revocation = match issuer_revocation(&ledger, lease_id, reason, Map::new(), now) {
        Ok(Some(revocation)) => revocation,
        Ok(None) => return Ok(false),
        // Our fold holds only leases signed by `key`, so both mean "not ours".
        Err(RevocationError::Unknown(_) | RevocationError::NoKey(_)) => {
            return Err(IssueError::UnknownLease {
                lease: lease_id.to_owned(),
                key: key.fingerprint().to_owned(),
            })
        }
        Err(RevocationError::Record(e)) => return Err(e.into()),
    };
    append(journal_path, &revocation.record)?;
    Ok(true)
}

fn append(journal_path: &Path, record: &Value) -> Result<(), IssueError> {
    store::file::append(journal_path, record, true)
        .map(drop)
        .map_err(|error| IssueError::Journal {
            path: journal_path.display().to_string(),
            error,
        })
}

/// `issue`: sign a lease, append its `granted` record, print what `--print` asks for.
pub fn exec(args: IssueArgs) -> CliResult {
    for warning in public_suffix_wildcards(&args.allow_hosts, args.force)? {
        eprintln!("leasegate issue: {warning}");
    }
    let key = dev::signing_key(&args.key_file)?;
    let issued = issue(
        &args.journal,
        &key,
        &IssueRequest {
            allow_hosts: args.allow_hosts,
            deny_hosts: args.deny_hosts,
            parent: args.parent,
            ttl: args.ttl,
            name: args.name,
            purpose: args.purpose,
            now: Timestamp::now(),
        },
    )?;
    // `leasegate issue ... | head -1` closes the pipe after the first line: not an error.
    let mut out = std::io::stdout().lock();
    let token = token::mint(&key, &issued.lease_id);
    let _ = match args.print {
        // Line 1 the lease id, line 2 its proxy token (`--credentials token`), line 3 expiry.
        IssuePrint::All => writeln!(out, "{}", issued.lease_id)
            .and_then(|()| writeln!(out, "{token}"))
            .and_then(|()| writeln!(out, "expires_at {}", issued.expires_at)),
        IssuePrint::Id => writeln!(out, "{}", issued.lease_id),
        IssuePrint::Token => writeln!(out, "{token}"),
    };
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_larger_than_a_record_may_be_is_refused_and_nothing_written() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join("journal.jsonl");
        let key = Key::generate();
        let request = |hosts: usize| IssueRequest {
            allow_hosts: (0..hosts).map(|i| format!("h{i:06}.example.com")).collect(),
            deny_hosts: Vec::new(),
            parent: None,
            ttl: Duration::from_secs(60),
            name: "big".into(),
            purpose: "size".into(),
            now: Timestamp::now(),
        };
        match issue(&journal, &key, &request(30_000)) {
            Err(IssueError::TooLarge(size)) => assert!(size > record::MAX_RECORD_BYTES),
            other => panic!("{other:?}"),
        }
        assert!(!journal.exists(), "nothing appended");
        issue(&journal, &key, &request(20_000)).unwrap();
        let line = std::fs::read(&journal).unwrap();
        assert!(line.len() <= record::MAX_RECORD_BYTES + 1, "{}", line.len());
    }
}
