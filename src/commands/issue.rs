//! `leasegate issue`: a lease from flags or a manifest file, signed and appended to a journal
//! file (the development issuer), or asked of a running proxy's admin API (`--admin`); and a
//! signed `revoked` appended for `revoke`.
//!
//! Invariant: every lease we sign loads under our own checks (schema, L1, L2, signature)
//! before it is appended, and is what the issuer's rules (`contract::narrow`) grant: a child
//! is narrowed to its parent's lists, ceilings and end, never wider.

use super::{dev, CliResult};
use crate::cli::{IssueArgs, IssuePrint};
use crate::contract::canonical::canonical_bytes;
use crate::contract::keys::sha256_hex;
use crate::contract::lease::sign;
use crate::contract::narrow::{self, Ask, Parent, Refused, Remaining, RootPolicy};
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
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("journal {path}: {error}")]
    Journal { path: String, error: std::io::Error },
    #[error("parent lease: {0}")]
    Parent(#[from] ChainError),
    #[error("refused ({}): {}", .0.reasons.join(", "), .0.reason)]
    Refused(Refused),
    #[error("{path}: {reason}")]
    Manifest { path: String, reason: String },
    #[error("the admin API at {url}: {reason}")]
    Admin { url: String, reason: String },
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
    /// The declared manifest the flags go into (`{}`: only what the fields below say); its
    /// hosts are added to, its name and purpose replaced.
    pub manifest: Value,
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
    /// What the issuer's rules changed (empty: nothing).
    pub narrowed: Vec<String>,
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

/// The declared manifest of `request`: its `manifest` with the hosts added (each in its normal
/// form), the name and purpose set.
fn declared(request: &IssueRequest) -> Result<Value, IssueError> {
    let mut given = match &request.manifest {
        Value::Object(_) => request.manifest.clone(),
        _ => json!({}),
    };
    for (list, flags, name) in [
        ("allow", &request.allow_hosts, "allow"),
        ("deny", &request.deny_hosts, "deny"),
    ] {
        let mut hosts: Vec<String> = given[list]["hosts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h.as_str().map(str::to_owned))
            .collect();
        hosts.extend(flags.iter().cloned());
        if !given[list].is_object() {
            given[list] = json!({});
        }
        given[list]["hosts"] = normalise_hosts(&hosts, name)?.into();
    }
    if !given["agent"].is_object() {
        given["agent"] = json!({});
    }
    given["agent"]["name"] = request.name.as_str().into();
    if !given["intent"].is_object() {
        given["intent"] = json!({});
    }
    given["intent"]["purpose"] = request.purpose.as_str().into();
    Ok(narrow::completed(&given, WRITTEN_VERSION))
}

/// What `chain` (a lease, then its ancestors) leaves of each ceiling, from the ceilings alone:
/// a journal file's issuer does not see what was spent (issue through `--admin` for that).
fn ceilings(chain: &[Arc<Lease>]) -> Remaining {
    let least_u64 = |f: fn(&crate::contract::lease::Budget) -> Option<u64>| {
        chain
            .iter()
            .filter_map(|l| l.budget.as_deref().and_then(f))
            .min()
    };
    Remaining {
        tokens: least_u64(|b| b.tokens),
        steps: least_u64(|b| b.steps),
        cost_usd: chain
            .iter()
            .filter_map(|l| l.budget.as_ref().and_then(|b| b.cost_usd))
            .reduce(f64::min),
    }
}

/// Signs a lease and appends its `granted` record (and `narrowed`, when the rules changed
/// anything); a refusal appends its `refused` record and is returned as the error.
pub fn issue(journal_path: &Path, key: &Key, request: &IssueRequest) -> Result<Issued, IssueError> {
    let ttl_ms =
        i64::try_from(request.ttl.as_millis()).map_err(|_| IssueError::Ttl(request.ttl))?;
    let declared = declared(request)?;
    let ends = request.now.saturating_add_millis(ttl_ms);
    let declared_hash = sha256_hex(&canonical_bytes(&declared).map_err(LeaseError::from)?);
    let ledger;
    let mut parent = None;
    if let Some(parent_id) = &request.parent {
        ledger = fold(journal_path, key)?;
        let chain = ledger.check_chain(parent_id, request.now)?;
        let live_children = ledger.live_children(parent_id, request.now).count() as u64;
        parent = Some((chain[0].clone(), ceilings(&chain), live_children));
    }
    let decided = narrow::narrow(&Ask {
        declared: &declared,
        parent: parent.as_ref().map(|(lease, remaining, live)| Parent {
            lease,
            remaining: *remaining,
            live_children: *live,
        }),
        root: RootPolicy::OPEN,
        ends,
        now: request.now,
        // `exec` refuses them without --force, saying how.
        public_suffix_wildcards: true,
    });
    let grant = match decided {
        Ok(grant) => grant,
        Err(refused) => {
            let refusal_id = uuid::Uuid::new_v4().to_string();
            let record = record::refused(
                &record::Refusal {
                    refusal_id: &refusal_id,
                    parent_lease_id: request.parent.as_deref(),
                    reasons: &refused.reasons,
                    reason: &refused.reason,
                    declared_hash: &declared_hash,
                },
                request.now,
            )?;
            append(journal_path, &record)?;
            return Err(IssueError::Refused(refused));
        }
    };
    let lease_id = uuid::Uuid::new_v4().to_string();
    let mut lease = json!({
        "schema_version": WRITTEN_VERSION,
        "lease_id": lease_id,
        "manifest": grant.manifest,
        "declared_hash": declared_hash,
        "issued_at": request.now.to_string(),
        "expires_at": grant.expires_at.to_string(),
        "issuer_session_id": "leasegate-issue",
    });
    if let Some(parent) = &request.parent {
        lease["parent_lease_id"] = parent.as_str().into();
    }
    sign(&mut lease, key).map_err(LeaseError::from)?;

    let mut keyring = Keyring::new(key.is_test_key());
    keyring.insert(key.clone());
    Lease::load(lease.clone(), &keyring)?;
    let granted = record::granted(&lease, &declared, request.now)?;
    let size = serde_json::to_vec(&granted).map_or(usize::MAX, |line| line.len());
    if size > record::MAX_RECORD_BYTES {
        return Err(IssueError::TooLarge(size));
    }
    append(journal_path, &granted)?;
    if !grant.narrowed.is_empty() {
        let summary = grant.summary();
        append(
            journal_path,
            &record::narrowed(&lease_id, request.parent.as_deref(), &summary, request.now)?,
        )?;
    }
    Ok(Issued {
        lease_id,
        expires_at: grant.expires_at,
        narrowed: grant.narrowed,
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

/// The declared manifest `args` give: `--manifest`'s, with the flags' tools, approvals and
/// budget added.
fn manifest_of(args: &IssueArgs) -> Result<Value, IssueError> {
    let mut manifest = match &args.manifest {
        Some(path) => {
            let bad = |reason: String| IssueError::Manifest {
                path: path.display().to_string(),
                reason,
            };
            let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
            let value: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            if !value.is_object() {
                return Err(bad("a manifest is a JSON object".into()));
            }
            value
        }
        None => json!({}),
    };
    let add = |manifest: &mut Value, part: &str, list: &str, items: &[String]| {
        if items.is_empty() {
            return;
        }
        let target = match part {
            "" => manifest,
            part => {
                if !manifest[part].is_object() {
                    manifest[part] = json!({});
                }
                &mut manifest[part]
            }
        };
        let mut all: Vec<Value> = target[list].as_array().cloned().unwrap_or_default();
        all.extend(items.iter().map(|i| Value::from(i.as_str())));
        target[list] = all.into();
    };
    add(&mut manifest, "allow", "tools", &args.tools);
    add(&mut manifest, "", "approvals", &args.approvals);
    let budget = [
        ("tokens", args.tokens.map(Value::from)),
        ("cost_usd", args.cost_usd.map(Value::from)),
        ("steps", args.steps.map(Value::from)),
        ("depth", args.depth.map(Value::from)),
        ("fan_out", args.fan_out.map(Value::from)),
    ];
    for (field, value) in budget {
        if let Some(value) = value {
            if !manifest["budget"].is_object() {
                manifest["budget"] = json!({});
            }
            manifest["budget"][field] = value;
        }
    }
    Ok(manifest)
}

/// `args`' name and purpose: the flag's, else the manifest's, else the defaults.
fn name_and_purpose(args: &IssueArgs, manifest: &Value) -> (String, String) {
    let name = args
        .name
        .clone()
        .or_else(|| manifest["agent"]["name"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "agent".to_owned());
    let purpose = args
        .purpose
        .clone()
        .or_else(|| manifest["intent"]["purpose"].as_str().map(str::to_owned))
        .unwrap_or_else(|| "development lease issued by leasegate".to_owned());
    (name, purpose)
}

/// What `args` ask for, with `manifest` (see [`manifest_of`]), now.
fn request_of(args: &IssueArgs, manifest: Value) -> IssueRequest {
    let (name, purpose) = name_and_purpose(args, &manifest);
    IssueRequest {
        manifest,
        allow_hosts: args.allow_hosts.clone(),
        deny_hosts: args.deny_hosts.clone(),
        parent: args.parent.clone(),
        ttl: args.ttl,
        name,
        purpose,
        now: Timestamp::now(),
    }
}

/// `issue --admin`: `POST /leases` to a running proxy.
fn through_admin(
    args: &IssueArgs,
    admin: &str,
    manifest: Value,
) -> Result<(Issued, String), IssueError> {
    let request = request_of(args, manifest);
    let mut manifest = declared(&request)?;
    // The proxy completes it itself; the parent goes beside it.
    if let Some(object) = manifest.as_object_mut() {
        object.remove("parent_lease_id");
    }
    let mut body = json!({"manifest": manifest, "lifetime_seconds": args.ttl.as_secs_f64()});
    if let Some(parent) = &args.parent {
        body["parent_lease_id"] = parent.as_str().into();
    }
    let failed = |reason: String| IssueError::Admin {
        url: admin.to_owned(),
        reason,
    };
    let token = match &args.admin_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| failed(format!("reading {}: {e}", path.display())))?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let api = super::run::AdminApi::new(admin, None).map_err(|e| failed(e.to_string()))?;
    let mut headers = Vec::new();
    if let Some(key) = &args.idempotency_key {
        headers.push(("Idempotency-Key", key.as_str()));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| failed(e.to_string()))?;
    let (status, answer) = runtime
        .block_on(api.post(&["leases"], token.as_deref(), &headers, &body))
        .map_err(|e| failed(e.to_string()))?;
    if !status.is_success() {
        let reasons = answer["reasons"]
            .as_array()
            .map(|r| {
                let codes: Vec<&str> = r.iter().filter_map(Value::as_str).collect();
                format!(" ({})", codes.join(", "))
            })
            .unwrap_or_default();
        return Err(failed(format!(
            "{status}{reasons}: {}",
            answer["error"].as_str().unwrap_or_default()
        )));
    }
    let text = |key: &str| answer[key].as_str().unwrap_or_default().to_owned();
    let issued = Issued {
        lease_id: text("lease_id"),
        expires_at: Timestamp::parse(&text("expires_at"))
            .map_err(|e| failed(format!("expires_at: {e}")))?,
        narrowed: answer["narrowed"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect(),
    };
    Ok((issued, text("token")))
}

/// `issue`: sign a lease, append its `granted` record (or ask the admin API for one), print
/// what `--print` asks for.
pub fn exec(args: IssueArgs) -> CliResult {
    for warning in public_suffix_wildcards(&args.allow_hosts, args.force)? {
        eprintln!("leasegate issue: {warning}");
    }
    let manifest = manifest_of(&args)?;
    let (issued, token) = match (&args.admin, &args.journal, &args.key_file) {
        (Some(admin), _, _) => through_admin(&args, admin, manifest)?,
        (None, Some(journal), Some(key_file)) => {
            let key = dev::signing_key(key_file)?;
            let issued = issue(journal, &key, &request_of(&args, manifest))?;
            let token = token::mint(&key, &issued.lease_id);
            (issued, token)
        }
        // clap requires --journal and --key-file without --admin.
        _ => return Ok(ExitCode::from(2)),
    };
    for clause in &issued.narrowed {
        eprintln!("leasegate issue: narrowed: {clause}");
    }
    // `leasegate issue ... | head -1` closes the pipe after the first line: not an error.
    let mut out = std::io::stdout().lock();
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
            manifest: json!({}),
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
