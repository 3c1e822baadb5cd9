//! `leasegate revoke`: append a signed `revoked` record for a lease (development issuer).

use super::{dev, issue, CliResult};
use crate::cli::RevokeArgs;
use crate::contract::Timestamp;
use std::process::ExitCode;

pub fn exec(args: RevokeArgs) -> CliResult {
    let key = dev::signing_key(&args.key_file)?;
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
    Ok(ExitCode::SUCCESS)
}
