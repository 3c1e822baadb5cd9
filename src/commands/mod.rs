//! One module per subcommand (cargo's `src/bin/cargo/commands/`), each an `exec` from its
//! parsed arguments to the process's exit code, and the code only commands use: the
//! development issuer, `serve --dev`'s set-up, the journal bridges, the reports.
//!
//! Invariant: a command returns its exit code or an error and never exits the process itself
//! (`main` does, once); nothing outside `commands` (and `main`) imports from it, except tests.

pub mod approvals;
pub mod ca;
pub mod check;
pub mod completions;
pub mod dev;
pub mod health;
pub mod inspect;
pub mod issue;
pub mod journal;
pub mod keygen;
pub mod leases;
pub mod reference;
pub mod revoke;
pub mod run;
pub mod serve;
pub mod suggest;
pub mod token;
pub mod usage;
pub mod verify;

use crate::cli::LedgerArgs;
use crate::contract::{Keyring, Timestamp};
use crate::registry::{open, JournalLocation, Ledger, StoreOptions};
use std::process::ExitCode;

/// What every command returns: its exit code, or an error `main` prints on one line (exit 2
/// for a [`MissingJournal`], 1 otherwise).
pub type CliResult = anyhow::Result<ExitCode>;

/// A report on a journal file that is not there: a mistyped path, not an empty journal.
#[derive(Debug, thiserror::Error)]
#[error("no journal at {0} (check --journal; `serve` creates it)")]
pub struct MissingJournal(String);

/// `leases` and `check` read a journal that must exist (the proxy's follower, by contrast,
/// waits for a missing file to appear).
pub fn require_journal(location: &JournalLocation) -> anyhow::Result<()> {
    match location {
        JournalLocation::File(path) if !path.exists() => {
            Err(MissingJournal(path.display().to_string()).into())
        }
        _ => Ok(()),
    }
}

/// An error and its causes on one line, each cause once: many of our messages already embed
/// their cause, which `{:#}` would print a second time.
pub fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// Folds a journal under its keys.
pub fn load_ledger(args: &LedgerArgs) -> anyhow::Result<Ledger> {
    let keyring = Keyring::load(&args.key_files, args.allow_test_key)?
        .requiring_record_signatures(args.require_record_signatures);
    let options = StoreOptions::from(&args.store);
    let (ledger, problems) =
        block_on(open::fold(&args.journal, options.ledger(keyring), &options))?;
    if let Some(why) = crate::registry::journal::nothing_verifies(&ledger, &problems) {
        anyhow::bail!(why);
    }
    let (n, keys) = crate::registry::journal::unverified(&problems);
    if n > 0 {
        eprintln!(
            "leasegate: {n} grant(s) of the journal not verified (signed with {}): left out",
            keys.join(", ")
        );
    }
    Ok(ledger)
}

/// The instant `ago` before now (`--since`).
pub fn ago(ago: std::time::Duration) -> Timestamp {
    let ms = i64::try_from(ago.as_millis()).unwrap_or(i64::MAX);
    Timestamp::now().saturating_add_millis(-ms)
}

/// Runs `future` on a current-thread runtime (the read-only commands).
pub fn block_on<T, E, F>(future: F) -> anyhow::Result<T>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: Into<anyhow::Error>,
{
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(future)
        .map_err(Into::into)
}

/// Resolves on SIGINT or SIGTERM (`serve` drains, `journal mirror` stops).
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}
