//! `leasegate approvals`, `approve ID` and `deny ID`: the calls waiting for a human on a
//! running proxy, through its admin API.
//!
//! Invariant: results go to stdout, diagnostics to stderr; the exit code is 0 only when the
//! admin API answered 200 (a decision taken, or the list), 1 otherwise, with what it said.

use super::run::AdminApi;
use super::CliResult;
use crate::cli::{AdminApiArgs, ApprovalsArgs, DecideArgs};
use serde_json::{json, Value};
use std::process::ExitCode;

fn token(api: &AdminApiArgs) -> anyhow::Result<Option<String>> {
    admin_token(api.admin_token_file.as_deref())
}

/// The admin token in `--admin-token-file`'s file, if one is named.
pub fn admin_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    file.map(|path| {
        std::fs::read_to_string(path)
            .map(|token| token.trim().to_owned())
            .map_err(|e| anyhow::anyhow!("--admin-token-file {}: {e}", path.display()))
    })
    .transpose()
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// `leasegate approvals`: a table (or the JSON) of the calls waiting, or of all kept.
pub fn list(args: ApprovalsArgs) -> CliResult {
    let token = token(&args.api)?;
    let api = AdminApi::new(&args.api.admin, None)?;
    let query = match args.all {
        true => "status=all&limit=500",
        false => "status=pending&limit=500",
    };
    let (status, body) =
        runtime()?.block_on(api.get_query(&["approvals"], query, token.as_deref()))?;
    let answer: Value = serde_json::from_slice(&body).unwrap_or_else(|_| json!({}));
    if status != http::StatusCode::OK {
        anyhow::bail!(
            "the admin API at {} answered {status}: {}",
            args.api.admin,
            answer["error"].as_str().unwrap_or_default()
        );
    }
    if args.json {
        println!("{answer}");
        return Ok(ExitCode::SUCCESS);
    }
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let rows: Vec<[String; 6]> = answer["approvals"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|a| {
            [
                text(&a["id"]),
                text(&a["status"]),
                text(&a["lease_id"]),
                text(&a["tool"]),
                text(&a["deadline"]),
                text(&a["arguments"]).chars().take(60).collect(),
            ]
        })
        .collect();
    print!(
        "{}",
        crate::table::render(
            ["ID", "STATUS", "LEASE", "TOOL", "DEADLINE", "ARGUMENTS"],
            &rows
        )
    );
    Ok(ExitCode::SUCCESS)
}

/// `leasegate approve|deny ID`: `decision` is `approve` or `deny`.
pub fn decide(args: DecideArgs, decision: &str) -> CliResult {
    let token = token(&args.api)?;
    let api = AdminApi::new(&args.api.admin, None)?;
    let mut body = json!({"decision": decision});
    if let Some(reason) = &args.reason {
        body["reason"] = reason.as_str().into();
    }
    if args.for_lease {
        body["for"] = "lease".into();
    }
    let id = args.id.to_ascii_lowercase();
    let (status, answer) =
        runtime()?.block_on(api.post(&["approvals", &id], token.as_deref(), &[], &body))?;
    if status != http::StatusCode::OK {
        anyhow::bail!(
            "the admin API at {} answered {status}: {}",
            args.api.admin,
            answer["error"].as_str().unwrap_or_default()
        );
    }
    println!(
        "{} {} ({} for lease {})",
        answer["id"].as_str().unwrap_or(&id),
        answer["status"].as_str().unwrap_or_default(),
        answer["tool"].as_str().unwrap_or_default(),
        answer["lease_id"].as_str().unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}
