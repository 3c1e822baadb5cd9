//! The `leasegate` binary: CLI dispatch and exit codes (the only place anyhow is used).
#![forbid(unsafe_code)]

mod cli;

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use cli::{Cli, Command};
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::inspect;
use leasegate::issue::{self, IssueRequest};
use leasegate::registry::{journal, Ledger};
use std::io::{Read, Write};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let outcome = match cli.command {
        Command::Keygen(args) => keygen(args),
        Command::Issue(args) => issue_lease(args),
        Command::Revoke(args) => revoke(args),
        Command::Verify(args) => return verify(args),
        Command::Leases(args) => leases(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasegate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn keygen(args: cli::KeygenArgs) -> Result<()> {
    let key = Key::generate();
    match &args.out {
        Some(path) => {
            write_secret(path, key.to_file_text().as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            println!("{}", key.fingerprint());
        }
        None => {
            print!("{}", key.to_file_text());
            eprintln!("{}", key.fingerprint());
        }
    }
    Ok(())
}

/// Creates a file readable by its owner only; refuses to overwrite one.
fn write_secret(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn load_key(path: &std::path::Path) -> Result<Key> {
    let key = Key::load(path)?;
    if key.is_test_key() {
        return Err(anyhow!(
            "{} holds the published TEST key; issue and revoke refuse it",
            path.display()
        ));
    }
    Ok(key)
}

fn issue_lease(args: cli::IssueArgs) -> Result<()> {
    let key = load_key(&args.key_file)?;
    let issued = issue::issue(
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
    println!("{}", issued.lease_id);
    println!("expires_at {}", issued.expires_at);
    Ok(())
}

fn revoke(args: cli::RevokeArgs) -> Result<()> {
    let key = load_key(&args.key_file)?;
    if issue::revoke(
        &args.journal,
        &key,
        &args.lease,
        &args.reason,
        Timestamp::now(),
    )? {
        println!("revoked {}", args.lease);
    } else {
        println!("{} was already revoked; nothing written", args.lease);
    }
    Ok(())
}

/// Exit 0 all valid, 1 something invalid, 2 usage or I/O error.
fn verify(args: cli::VerifyArgs) -> ExitCode {
    let usage_error = |e: anyhow::Error| {
        eprintln!("leasegate verify: {e:#}");
        ExitCode::from(2)
    };
    let now = match args
        .now
        .as_deref()
        .map(Timestamp::parse_lenient)
        .transpose()
    {
        Ok(now) => now.unwrap_or_else(Timestamp::now),
        Err(e) => return usage_error(e.into()),
    };
    let keyring = match args.key_files.is_empty() {
        true => None,
        false => match Keyring::load(&args.key_files, args.allow_test_key) {
            Ok(k) => Some(k),
            Err(e) => return usage_error(e.into()),
        },
    };
    let name = args.file.display().to_string();
    let mut text = Vec::new();
    let read = if name == "-" {
        std::io::stdin().read_to_end(&mut text).map(drop)
    } else {
        std::fs::read(&args.file).map(|t| text = t)
    };
    if let Err(e) = read {
        return usage_error(anyhow!("cannot read {name}: {e}"));
    }
    let problems = inspect::verify(&text, keyring.as_ref(), now);
    for p in &problems {
        println!("{name}: {}: {}", p.place, p.reason);
    }
    let scope = if keyring.is_some() {
        "schema, rules and signatures"
    } else {
        "schema and rules only: no --key-file given, signatures not checked"
    };
    if problems.is_empty() {
        eprintln!("{name}: valid ({scope})");
        ExitCode::SUCCESS
    } else {
        eprintln!("{name}: {} problem(s) ({scope})", problems.len());
        ExitCode::FAILURE
    }
}

fn leases(args: cli::LeasesArgs) -> Result<()> {
    let keyring = Keyring::load(&args.key_files, args.allow_test_key)?;
    let (ledger, _) = journal::load(&args.journal, Ledger::new(keyring))
        .with_context(|| format!("reading {}", args.journal.display()))?;
    let rows = inspect::lease_rows(&ledger, Timestamp::now());
    let mut out = std::io::stdout().lock();
    if args.json {
        for row in rows {
            serde_json::to_writer(&mut out, &row)?;
            writeln!(out)?;
        }
    } else {
        out.write_all(inspect::render_table(&rows).as_bytes())?;
    }
    Ok(())
}
