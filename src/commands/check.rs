//! `leasegate check`: the verdict for a lease and a target, without network I/O (unless
//! `--resolve-names`).
//!
//! Invariant: prints `allow` and exits 0, or `refuse <code> <status>` and exits 1; the notes
//! follow, indented.

use super::{inspect, require_journal, CliResult};
use crate::cli::CheckArgs;
use crate::config::ProxyConfig;
use crate::contract::Keyring;
use crate::registry::StoreOptions;
use anyhow::Context;
use std::process::ExitCode;

pub fn exec(args: CheckArgs) -> CliResult {
    require_journal(&args.ledger.journal)?;
    let keyring = Keyring::load(&args.ledger.key_files, args.ledger.allow_test_key)?
        .requiring_record_signatures(args.ledger.require_record_signatures);
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
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let explanation = runtime
        .block_on(inspect::check(
            &args.ledger.journal,
            &StoreOptions::from(&args.ledger.store),
            keyring,
            config,
            &args.lease,
            &args.target,
        ))
        .with_context(|| format!("reading {}", args.ledger.journal))?;
    match &explanation.refusal {
        None => println!("allow"),
        Some(r) => println!("refuse {} {}", r.code, r.code.status().as_u16()),
    }
    for note in std::iter::once(&explanation.reason).chain(&explanation.notes) {
        println!("  {note}");
    }
    Ok(match explanation.refusal {
        None => ExitCode::SUCCESS,
        Some(_) => ExitCode::FAILURE,
    })
}
