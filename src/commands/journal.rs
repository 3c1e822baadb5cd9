//! `leasegate journal`: move a journal between a file and a stream (`import`, `export`,
//! `mirror`, through [`bridge`]), or compact it (`compact`).
//!
//! Invariant: `import` exits 0 only when every line of the file is in the stream; `compact`
//! prints one summary line on stdout and what it skipped on stderr.

pub mod bridge;

use super::{block_on, require_journal, shutdown_signal, CliResult};
use crate::cli::{CompactArgs, JournalArgs, JournalCommand, SnapshotKeyArgs};
use crate::contract::{Keyring, Timestamp};
use crate::registry::{compact, InvalidReason, JournalLocation, StoreOptions};
use bridge::MirrorEvent;
use std::io::Write;
use std::process::ExitCode;

/// `journal import | export | mirror | compact`.
pub fn exec(args: JournalArgs) -> CliResult {
    match args.command {
        JournalCommand::Compact(args) => compact(args),
        JournalCommand::Import(args) => {
            let options = StoreOptions::from(&args.store).nats;
            let keyring = snapshot_keys(&args.keys)?;
            let imported = block_on(bridge::import(
                &args.file,
                &args.to,
                &options,
                keyring.as_ref(),
            ))?;
            let unterminated = match imported.unterminated {
                true => "; the last line has no newline and was left out",
                false => "",
            };
            println!(
                "imported {} lines, {} already in the stream{unterminated}",
                imported.published, imported.already
            );
            if imported.skipped.is_empty() {
                return Ok(ExitCode::SUCCESS);
            }
            let lines: Vec<String> = imported
                .skipped
                .iter()
                .map(|s| format!("line {} of {}: {}", s.line, args.file.display(), s.why))
                .collect();
            anyhow::bail!(
                "{} line(s) can never be published and were skipped (every other line is in the stream):\n  {}",
                lines.len(),
                lines.join("\n  ")
            )
        }
        JournalCommand::Export(args) => {
            let options = StoreOptions::from(&args.store).nats;
            let keyring = snapshot_keys(&args.keys)?;
            let written = block_on(bridge::export(
                &args.stream,
                &options,
                keyring.as_ref(),
                args.out.as_deref(),
            ))?;
            if let Some(out) = &args.out {
                eprintln!("exported {written} lines to {}", out.display());
            }
            Ok(ExitCode::SUCCESS)
        }
        JournalCommand::Mirror(args) => {
            let options = StoreOptions::from(&args.store);
            let file = args.file.display().to_string();
            let keyring = snapshot_keys(&args.keys)?;
            block_on(bridge::mirror(
                &args.file,
                &args.to,
                &options.nats,
                keyring.as_ref(),
                options.max_line,
                shutdown_signal(),
                |event| match event {
                    MirrorEvent::CaughtUp {
                        published,
                        already,
                        skipped,
                    } => {
                        let skipped = match skipped {
                            0 => String::new(),
                            n => format!(", {n} that can never be published skipped"),
                        };
                        // Line-buffered: a supervisor (or a test) sees it at once.
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(
                            out,
                            "mirroring {file} to {}: caught up ({published} lines published, {already} already in the stream{skipped})",
                            args.to
                        )
                        .and_then(|()| out.flush());
                    }
                },
            ))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The keys a purged stream's snapshot may be vouched for by (`None`: none given).
fn snapshot_keys(args: &SnapshotKeyArgs) -> anyhow::Result<Option<Keyring>> {
    if args.key_files.is_empty() {
        return Ok(None);
    }
    Ok(Some(Keyring::load(&args.key_files, args.allow_test_key)?))
}

/// `journal compact`: one summary line on stdout, what was skipped on stderr.
fn compact(args: CompactArgs) -> CliResult {
    require_journal(&args.ledger.journal)?;
    let keyring = Keyring::load(&args.ledger.key_files, args.ledger.allow_test_key)?;
    let retention = args.retention;
    let options = StoreOptions::from(&args.ledger.store);
    let path = match &args.ledger.journal {
        JournalLocation::File(_) if args.purge => {
            anyhow::bail!("--purge is for a stream journal (a file's compaction keeps the old file beside it)")
        }
        JournalLocation::File(path) => path,
        JournalLocation::Nats(location) => {
            let done = block_on(compact::compact_stream(
                location,
                &options.nats,
                keyring,
                retention,
                Timestamp::now(),
                options.max_line,
                args.purge,
            ))?;
            let (s, marker) = (&done.selection, &done.marker);
            report_skipped(s);
            let journal = match done.purged {
                Some(purged) => format!(
                    "verified and purged behind: {} journal messages up to sequence {} and {} messages of older snapshots removed",
                    purged.journal, marker.covers, purged.snapshots
                ),
                None => "the journal is unchanged".to_owned(),
            };
            println!(
                "snapshot of {location} up to sequence {}: {} of {} lines kept; {} leases kept, {} dropped past the retention of {}; published to {} (new replicas start from it; {journal})",
                marker.covers,
                marker.lines,
                s.lines,
                s.leases_kept,
                s.leases_dropped,
                humantime::format_duration(retention),
                done.location,
            );
            return Ok(ExitCode::SUCCESS);
        }
    };
    let done = compact::compact_file(path, keyring, retention, Timestamp::now(), options.max_line)?;
    let (s, swapped) = (&done.selection, &done.swapped);
    report_skipped(s);
    if swapped.torn_bytes > 0 {
        eprintln!(
            "left out an unterminated last line ({} bytes)",
            swapped.torn_bytes
        );
    }
    println!(
        "compacted {}: {} of {} lines kept ({} bytes, was {}); {} leases kept, {} dropped past the retention of {}; {} duplicate grants and {} records that change no status dropped; {} lines appended meanwhile copied; the old journal is kept as {}",
        path.display(),
        s.kept.len() + swapped.appended_meanwhile,
        s.lines + swapped.appended_meanwhile,
        swapped.length,
        swapped.covered,
        s.leases_kept,
        s.leases_dropped,
        humantime::format_duration(retention),
        s.duplicate_grants,
        s.notes_dropped,
        swapped.appended_meanwhile,
        swapped.archive.display(),
    );
    Ok(ExitCode::SUCCESS)
}

/// Tells how many lines a compaction left out because the fold skips them.
fn report_skipped(s: &compact::Selection) {
    let invalid: Vec<String> = InvalidReason::ALL
        .iter()
        .zip(s.invalid)
        .filter(|(_, n)| *n > 0)
        .map(|(reason, n)| format!("{n} {}", reason.as_str()))
        .collect();
    if !invalid.is_empty() {
        eprintln!(
            "skipped lines the fold skips too: {} (see `leasegate verify`)",
            invalid.join(", ")
        );
    }
}
