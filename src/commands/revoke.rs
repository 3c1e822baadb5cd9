//! `leasegate revoke`: append a signed `revoked` record for a lease (development issuer), or
//! revoke it through a running proxy's admin API (`--admin`).

use super::{dev, issue, CliResult};
use crate::cli::RevokeArgs;
use crate::contract::Timestamp;
use serde_json::json;
use std::process::ExitCode;

pub fn exec(args: RevokeArgs) -> CliResult {
    let revoked = match (&args.admin, &args.journal, &args.key_file) {
        (Some(admin), _, _) => through_admin(&args, admin)?,
        (None, Some(journal), Some(key_file)) => {
            let key = dev::signing_key(key_file)?;
            issue::revoke(journal, &key, &args.lease, &args.reason, Timestamp::now())?
        }
        // clap requires --journal and --key-file without --admin.
        _ => return Ok(ExitCode::from(2)),
    };
    if revoked {
        println!("revoked {}", args.lease);
    } else {
        println!("{} was already revoked; nothing written", args.lease);
    }
    Ok(ExitCode::SUCCESS)
}

/// `POST /leases/{id}/revoke` to the admin API at `admin`: whether it revoked.
fn through_admin(args: &RevokeArgs, admin: &str) -> anyhow::Result<bool> {
    let token = match &args.admin_token_file {
        Some(path) => Some(std::fs::read_to_string(path)?.trim().to_owned()),
        None => None,
    };
    let api = super::run::AdminApi::new(admin, None)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (status, answer) = runtime.block_on(api.post(
        &["leases", &args.lease, "revoke"],
        token.as_deref(),
        &[],
        &json!({"reason": args.reason}),
    ))?;
    match status.as_u16() {
        200 => Ok(answer["revoked"].as_bool().unwrap_or(true)),
        202 => {
            eprintln!(
                "leasegate revoke: revoked in memory; the record waits for the journal: {}",
                answer["error"].as_str().unwrap_or_default()
            );
            Ok(true)
        }
        _ => anyhow::bail!(
            "the admin API at {admin} answered {status}: {}",
            answer["error"].as_str().unwrap_or_default()
        ),
    }
}
