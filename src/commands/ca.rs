//! `leasegate ca init`: the interception CA, written once into a directory.
//!
//! Invariant: the key file is created mode 0600 and never printed; an existing CA is replaced
//! only with `--force`.

use super::CliResult;
use crate::cli::{CaArgs, CaCommand, CaInitArgs};
use crate::intercept::ca;
use std::process::ExitCode;

pub fn exec(args: CaArgs) -> CliResult {
    match args.command {
        CaCommand::Init(args) => init(args),
    }
}

fn init(args: CaInitArgs) -> CliResult {
    let made = ca::make(&args.hosts, args.validity)?;
    let (cert, key) = ca::write(&made, &args.dir, args.force)?;
    println!("certificate: {}", cert.display());
    println!(
        "key:         {} (mode 0600: the proxy's only, never the agent's)",
        key.display()
    );
    println!("permits:     {}", made.subtrees.join(", "));
    println!("sha256:      {}", made.fingerprint);
    Ok(ExitCode::SUCCESS)
}
