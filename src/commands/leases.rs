//! `leasegate leases`: the folded status of every lease in a journal, as a table or JSON Lines.

use super::{inspect, load_ledger, require_journal, CliResult};
use crate::cli::LeasesArgs;
use crate::contract::Timestamp;
use crate::registry::listing;
use std::io::Write;
use std::process::ExitCode;

pub fn exec(args: LeasesArgs) -> CliResult {
    require_journal(&args.ledger.journal)?;
    let ledger = load_ledger(&args.ledger)?;
    let filter = listing::Filter {
        // clap has checked the name.
        status: args.status.as_deref().and_then(listing::parse_status),
        agent: args.agent,
        ..listing::Filter::default()
    };
    let order = match args.newest_first {
        true => listing::Order::NewestFirst,
        false => listing::Order::OldestFirst,
    };
    let now = Timestamp::now();
    let limit = args.limit.map_or(usize::MAX, |n| n as usize);
    let rows = || {
        listing::matching(&ledger, now, &filter, order)
            .take(limit)
            .map(|(lease, status)| inspect::lease_row(&ledger, lease, status, now))
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if args.json {
        for row in rows() {
            serde_json::to_writer(&mut out, &row)?;
            writeln!(out)?;
        }
    } else {
        inspect::write_table(&mut out, rows)?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
