//! `leasegate check`: the verdict for a lease and a target, without network I/O (unless
//! `--resolve-names`).
//!
//! Invariant: prints `allow` and exits 0, or `refuse <code> <status>` and exits 1; the notes
//! follow, indented. With `--admin` the running proxy decides (`GET /check`), with its own
//! configuration and state; else the journal, with this command's policy flags.

use super::run::AdminApi;
use super::{inspect, require_journal, CliResult};
use crate::cli::CheckArgs;
use crate::config::ProxyConfig;
use crate::contract::Keyring;
use crate::registry::{JournalLocation, StoreOptions};
use anyhow::Context;
use serde_json::{json, Value};
use std::process::ExitCode;

pub fn exec(args: CheckArgs) -> CliResult {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let explanation = match (&args.admin, &args.journal) {
        (Some(admin), _) => runtime.block_on(ask_the_proxy(&args, admin))?,
        (None, Some(journal)) => runtime.block_on(from_the_journal(&args, journal))?,
        // clap requires --journal and --key-file without --admin.
        (None, None) => return Ok(ExitCode::from(2)),
    };
    match &explanation.refusal {
        None => println!("allow"),
        Some((code, status)) => println!("refuse {code} {status}"),
    }
    for note in std::iter::once(&explanation.reason).chain(&explanation.notes) {
        println!("  {note}");
    }
    Ok(match explanation.refusal {
        None => ExitCode::SUCCESS,
        Some(_) => ExitCode::FAILURE,
    })
}

/// What a check found, as printed: the refusal's code and status, if any.
struct Found {
    refusal: Option<(String, u16)>,
    reason: String,
    notes: Vec<String>,
}

/// `GET /check` on the running proxy's admin API.
async fn ask_the_proxy(args: &CheckArgs, admin: &str) -> anyhow::Result<Found> {
    let token = super::approvals::admin_token(args.admin_token_file.as_deref())?;
    let api = AdminApi::new(admin, None)?;
    let query: String = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("lease", &args.lease)
        .append_pair("target", &args.target)
        .finish();
    let (status, body) = api.get_query(&["check"], &query, token.as_deref()).await?;
    let answer: Value = serde_json::from_slice(&body).unwrap_or_else(|_| json!({}));
    if status != http::StatusCode::OK {
        anyhow::bail!(
            "the admin API at {admin} answered {status}: {}",
            answer["error"].as_str().unwrap_or_default()
        );
    }
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let refusal = match answer["verdict"].as_str() {
        Some("allow") => None,
        Some("refuse") => Some((
            text(&answer["code"]),
            answer["status"].as_u64().unwrap_or_default() as u16,
        )),
        _ => anyhow::bail!("the admin API at {admin} answered no verdict: {answer}"),
    };
    let notes = answer["notes"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    Ok(Found {
        refusal,
        reason: text(&answer["reason"]),
        notes: notes.iter().map(text).collect(),
    })
}

/// The decision over the journal, with this command's policy flags.
async fn from_the_journal(args: &CheckArgs, journal: &JournalLocation) -> anyhow::Result<Found> {
    require_journal(journal)?;
    let keyring = Keyring::load(&args.key_files, args.allow_test_key)?
        .requiring_record_signatures(args.require_record_signatures);
    if !args.policy.resolve.is_empty() && !args.resolve_names {
        eprintln!(
            "leasegate check: warning: --resolve (or LEASEGATE_RESOLVE) is not used: check \
             resolves no name without --resolve-names"
        );
    }
    let config = ProxyConfig {
        resolve_names: args.resolve_names,
        ..ProxyConfig::try_from(&args.policy)?
    };
    let explanation = inspect::check(
        journal,
        &StoreOptions::from(&args.store),
        keyring,
        config,
        &args.lease,
        &args.target,
    )
    .await
    .with_context(|| format!("reading {journal}"))?;
    Ok(Found {
        refusal: explanation
            .refusal
            .map(|r| (r.code.to_string(), r.code.status().as_u16())),
        reason: explanation.reason,
        notes: explanation.notes,
    })
}
