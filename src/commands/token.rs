//! `leasegate token`: the proxy token of a lease, minted from the key it is signed with.

use super::CliResult;
use crate::cli::TokenArgs;
use crate::contract::lease::is_lease_id;
use crate::contract::{token, Key};
use anyhow::anyhow;
use std::process::ExitCode;

/// `token`: the proxy token of a lease, from the key it is signed with.
pub fn exec(args: TokenArgs) -> CliResult {
    if !is_lease_id(&args.lease) {
        return Err(anyhow!(
            "{:?} is not a lease id (a lower-case UUID)",
            args.lease
        ));
    }
    let key = Key::load(&args.key_file)?;
    println!("{}", token::mint(&key, &args.lease));
    Ok(ExitCode::SUCCESS)
}
