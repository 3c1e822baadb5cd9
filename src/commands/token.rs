//! `leasegate token`: the proxy token of a lease, minted from the key it is signed with.

use super::CliResult;
use crate::cli::TokenArgs;
use crate::contract::{token, Key};
use std::process::ExitCode;

/// `token`: the proxy token of a lease, from the key it is signed with.
pub fn exec(args: TokenArgs) -> CliResult {
    let key = Key::load(&args.key_file)?;
    println!("{}", token::mint(&key, &args.lease));
    Ok(ExitCode::SUCCESS)
}
