//! The fuzz targets' checks (`fuzz/checks/`) replayed over their committed seed corpora: a
//! smoke run of `fuzz/` inside `cargo test`; `fuzz/run.sh SECONDS` explores beyond the seeds.

#[path = "../../../fuzz/checks/admin_origin.rs"]
mod admin_origin;
#[path = "../../../fuzz/checks/admin_query.rs"]
mod admin_query;
#[path = "../../../fuzz/checks/approval_decision.rs"]
mod approval_decision;
#[path = "../../../fuzz/checks/approval_line.rs"]
mod approval_line;
#[path = "../../../fuzz/checks/approval_route.rs"]
mod approval_route;
#[path = "../../../fuzz/checks/broadcast.rs"]
mod broadcast;
#[path = "../../../fuzz/checks/canonical.rs"]
mod canonical;
#[path = "../../../fuzz/checks/hello.rs"]
mod hello;
#[path = "../../../fuzz/checks/identify.rs"]
mod identify;
#[path = "../../../fuzz/checks/inspect.rs"]
mod inspect;
#[path = "../../../fuzz/checks/issue_request.rs"]
mod issue_request;
#[path = "../../../fuzz/checks/journal_fold.rs"]
mod journal_fold;
#[path = "../../../fuzz/checks/mcp_filter.rs"]
mod mcp_filter;
#[path = "../../../fuzz/checks/mcp_message.rs"]
mod mcp_message;
#[path = "../../../fuzz/checks/meter.rs"]
mod meter;
#[path = "../../../fuzz/checks/meter_request.rs"]
mod meter_request;
#[path = "../../../fuzz/checks/path_normalise.rs"]
mod path_normalise;
#[path = "../../../fuzz/checks/plain_tunnel_rewrite.rs"]
mod plain_tunnel_rewrite;
#[path = "../../../fuzz/checks/run_answer.rs"]
mod run_answer;
#[path = "../../../fuzz/checks/secrets_file.rs"]
mod secrets_file;
#[path = "../../../fuzz/checks/snapshot.rs"]
mod snapshot;
#[path = "../../../fuzz/checks/stream_record.rs"]
mod stream_record;
#[path = "../../../fuzz/checks/target_parser.rs"]
mod target_parser;
#[path = "../../../fuzz/checks/tunnel_first_bytes.rs"]
mod tunnel_first_bytes;

/// Runs `check` on every seed of `target`; returns how many there were.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut seeds = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(|| check(&bytes));
        assert!(
            outcome.is_ok(),
            "{target}: seed {} fails its check",
            path.display()
        );
        seeds += 1;
    }
    seeds
}

#[test]
fn every_fuzz_check_holds_on_its_seed_corpus() {
    for (target, check, at_least) in [
        ("admin_origin", admin_origin::check as fn(&[u8]), 8),
        ("admin_query", admin_query::check, 8),
        ("approval_decision", approval_decision::check, 12),
        ("approval_line", approval_line::check, 12),
        ("approval_route", approval_route::check, 12),
        ("canonical", canonical::check, 20),
        ("hello", hello::check, 15),
        ("identify", identify::check, 5),
        ("inspect", inspect::check, 15),
        ("broadcast", broadcast::check, 9),
        ("journal_fold", journal_fold::check, 10),
        ("mcp_filter", mcp_filter::check, 10),
        ("mcp_message", mcp_message::check, 12),
        ("meter", meter::check, 10),
        ("issue_request", issue_request::check, 12),
        ("meter_request", meter_request::check, 12),
        ("path_normalise", path_normalise::check, 12),
        ("plain_tunnel_rewrite", plain_tunnel_rewrite::check, 12),
        ("run_answer", run_answer::check, 10),
        ("secrets_file", secrets_file::check, 15),
        ("snapshot", snapshot::check, 5),
        ("stream_record", stream_record::check, 8),
        ("target_parser", target_parser::check, 20),
        ("tunnel_first_bytes", tunnel_first_bytes::check, 10),
    ] {
        let seeds = replay(target, check);
        assert!(seeds >= at_least, "{target}: only {seeds} seeds");
    }
}
