//! `leasegate verify`: check a lease, a journal file or a stream: schema, rules and (with a
//! key) signatures.
//!
//! Invariant: exit 0 all valid, 1 something invalid, 2 usage or I/O error; the result (each
//! problem, then the verdict) goes to stdout, diagnostics to stderr.

use super::{block_on, error_text, inspect, CliResult};
use crate::cli::VerifyArgs;
use crate::contract::{Keyring, Timestamp};
use crate::registry::{open, JournalLocation, StoreOptions};
use anyhow::anyhow;
use std::io::Read;
use std::process::ExitCode;

pub fn exec(args: VerifyArgs) -> CliResult {
    let usage_error = |e: anyhow::Error| {
        eprintln!("leasegate verify: {}", error_text(&e));
        ExitCode::from(2)
    };
    let now = match args
        .now
        .as_deref()
        .map(Timestamp::parse_lenient)
        .transpose()
    {
        Ok(now) => now.unwrap_or_else(Timestamp::now),
        Err(e) => return Ok(usage_error(e.into())),
    };
    let keyring = match args.key_files.is_empty() {
        true => None,
        false => match Keyring::load(&args.key_files, args.allow_test_key) {
            Ok(k) => Some(k.requiring_record_signatures(args.require_record_signatures)),
            Err(e) => return Ok(usage_error(e.into())),
        },
    };
    let name = args.file.to_string();
    let mut text = Vec::new();
    let read = match &args.file {
        JournalLocation::File(_) if name == "-" => std::io::stdin()
            .read_to_end(&mut text)
            .map(drop)
            .map_err(anyhow::Error::from),
        JournalLocation::File(path) => std::fs::read(path)
            .map(|t| text = t)
            .map_err(anyhow::Error::from),
        stream => block_on(open::read_lines(
            stream,
            &StoreOptions::from(&args.store),
            keyring.as_ref(),
        ))
        .map(|lines| {
            for line in lines {
                text.extend_from_slice(&line);
                text.push(b'\n');
            }
        }),
    };
    if let Err(e) = read {
        return Ok(usage_error(anyhow!("cannot read {name}: {e}")));
    }
    let max_line = StoreOptions::from(&args.store).max_line;
    let problems = inspect::verify(&text, keyring.as_ref(), now, max_line);
    for p in &problems {
        println!("{name}: {}: {}", p.place, p.reason);
    }
    let scope = if keyring.is_some() {
        "schema, rules and signatures"
    } else {
        "schema and rules only: no --key-file given, signatures not checked"
    };
    if problems.is_empty() {
        println!("{name}: valid ({scope})");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("{name}: {} problem(s) ({scope})", problems.len());
        Ok(ExitCode::FAILURE)
    }
}
