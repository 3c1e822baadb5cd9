//! The `leasegate` binary: CLI dispatch and exit codes (the only place anyhow is used).
#![forbid(unsafe_code)]

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use leasegate::commands::journal::bridge::{self, MirrorEvent};
use leasegate::cli::{self, Cli, Command};
use leasegate::config::{self, Credentials, OnRefusal, ProxyConfig, ServeConfig};
use leasegate::contract::lease::is_lease_id;
use leasegate::contract::{token, Key, Keyring, Timestamp};
use leasegate::descriptors;
use leasegate::commands::dev;
use leasegate::commands::inspect;
use leasegate::commands::issue::{self, IssueRequest};
use leasegate::registry::{compact, listing, open, InvalidReason};
use leasegate::registry::{JournalLocation, Ledger, StoreOptions};
use leasegate::commands::run;
use leasegate::server::Server;
use leasegate::commands::suggest;
use leasegate::telemetry::egress::Destination;
use leasegate::commands::usage;
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let serving = matches!(
        cli.command,
        Command::Serve(_)
            | Command::Journal(cli::JournalArgs {
                command: cli::JournalCommand::Mirror(_)
            })
    );
    init_logging(cli.log_format, serving);
    let outcome = match cli.command {
        Command::Keygen(args) => keygen(args),
        Command::Issue(args) => issue_lease(args),
        Command::Revoke(args) => revoke(args),
        Command::Verify(args) => return verify(args),
        Command::Leases(args) => leases(args),
        Command::Serve(args) => serve(args),
        Command::Check(args) => check(args),
        Command::Run(args) => return run_agent(args),
        Command::Token(args) => token(args),
        Command::Health(args) => return health(args),
        Command::Usage(args) => usage_report(args),
        Command::Suggest(args) => suggest(args),
        Command::Journal(args) => journal(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasegate: {}", error_text(&e));
            if e.downcast_ref::<MissingJournal>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// A report on a journal file that is not there: a mistyped path, not an empty journal.
#[derive(Debug, thiserror::Error)]
#[error("no journal at {0} (check --journal; `serve` creates it)")]
struct MissingJournal(String);

/// `leases` and `check` read a journal that must exist (the proxy's follower, by contrast,
/// waits for a missing file to appear).
fn require_journal(location: &JournalLocation) -> Result<()> {
    match location {
        JournalLocation::File(path) if !path.exists() => {
            Err(MissingJournal(path.display().to_string()).into())
        }
        _ => Ok(()),
    }
}

/// An error and its causes on one line, each cause once: many of our messages already embed
/// their cause, which `{:#}` would print a second time.
fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let cause = cause.to_string();
        if text.contains(&cause) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&cause);
    }
    text
}

/// Logs go to stderr; RUST_LOG filters (default: info for `serve`, warn otherwise).
fn init_logging(format: cli::LogFormat, serving: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if serving { "info" } else { "warn" })
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour codes only for a person at a terminal, never into a file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        cli::LogFormat::Text => builder.init(),
        cli::LogFormat::Json => builder.json().init(),
    }
}

fn keygen(args: cli::KeygenArgs) -> Result<()> {
    let key = Key::generate();
    match &args.out {
        Some(path) => {
            dev::write_key_file(path, &key)?;
            println!("{}", key.fingerprint());
        }
        None => {
            print!("{}", key.to_file_text());
            eprintln!("{}", key.fingerprint());
        }
    }
    Ok(())
}

fn issue_lease(args: cli::IssueArgs) -> Result<()> {
    let key = dev::signing_key(&args.key_file)?;
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
    // `leasegate issue ... | head -1` closes the pipe after the first line: not an error.
    let mut out = std::io::stdout().lock();
    let token = token::mint(&key, &issued.lease_id);
    let _ = match args.print {
        // Line 1 the lease id, line 2 its proxy token (`--credentials token`), line 3 expiry.
        cli::IssuePrint::All => writeln!(out, "{}", issued.lease_id)
            .and_then(|()| writeln!(out, "{token}"))
            .and_then(|()| writeln!(out, "expires_at {}", issued.expires_at)),
        cli::IssuePrint::Id => writeln!(out, "{}", issued.lease_id),
        cli::IssuePrint::Token => writeln!(out, "{token}"),
    };
    Ok(())
}

/// `token`: the proxy token of a lease, from the key it is signed with.
fn token(args: cli::TokenArgs) -> Result<()> {
    if !is_lease_id(&args.lease) {
        return Err(anyhow!(
            "{:?} is not a lease id (a lower-case UUID)",
            args.lease
        ));
    }
    let key = Key::load(&args.key_file)?;
    println!("{}", token::mint(&key, &args.lease));
    Ok(())
}

fn revoke(args: cli::RevokeArgs) -> Result<()> {
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
    Ok(())
}

/// Exit 0 all valid, 1 something invalid, 2 usage or I/O error.
fn verify(args: cli::VerifyArgs) -> ExitCode {
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
        Err(e) => return usage_error(e.into()),
    };
    let keyring = match args.key_files.is_empty() {
        true => None,
        false => match Keyring::load(&args.key_files, args.allow_test_key) {
            Ok(k) => Some(k.requiring_record_signatures(args.require_record_signatures)),
            Err(e) => return usage_error(e.into()),
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
        return usage_error(anyhow!("cannot read {name}: {e}"));
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
        eprintln!("{name}: valid ({scope})");
        ExitCode::SUCCESS
    } else {
        eprintln!("{name}: {} problem(s) ({scope})", problems.len());
        ExitCode::FAILURE
    }
}

/// Folds a journal under its keys.
fn load_ledger(args: &cli::LedgerArgs) -> Result<Ledger> {
    let keyring = Keyring::load(&args.key_files, args.allow_test_key)?
        .requiring_record_signatures(args.require_record_signatures);
    let options = StoreOptions::from(&args.store);
    let (ledger, _) = block_on(open::fold(&args.journal, options.ledger(keyring), &options))?;
    Ok(ledger)
}

/// `health`: 0 when the admin API answers 200, else one line and 1.
fn health(args: cli::HealthArgs) -> ExitCode {
    let path = if args.ready { "/readyz" } else { "/healthz" };
    let token = match &args.admin_token_file {
        Some(file) => match std::fs::read_to_string(file) {
            Ok(token) => Some(token.trim().to_owned()),
            Err(e) => {
                eprintln!("leasegate health: {}: {e}", file.display());
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    match leasegate::commands::health::target(&args.admin)
        .and_then(|addr| leasegate::commands::health::probe(addr, path, token.as_deref()))
    {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasegate health: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `future` on a current-thread runtime (the read-only commands).
fn block_on<T, E, F>(future: F) -> Result<T>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: Into<anyhow::Error>,
{
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(future)
        .map_err(Into::into)
}

fn leases(args: cli::LeasesArgs) -> Result<()> {
    require_journal(&args.ledger.journal)?;
    let ledger = load_ledger(&args.ledger)?;
    let filter = listing::Filter {
        // clap has checked the name.
        status: args.status.as_deref().and_then(listing::parse_status),
        agent: args.agent,
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
            .map(|(lease, status)| inspect::lease_row(lease, status))
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
    Ok(())
}

/// `usage`: one report from an egress stream or an egress log file.
fn usage_report(args: cli::UsageArgs) -> Result<()> {
    let since = args.since.map(|ago| {
        let ms = i64::try_from(ago.as_millis()).unwrap_or(i64::MAX);
        Timestamp::now().saturating_add_millis(-ms)
    });
    let mut tally = usage::Tally::new(usage::Filter {
        lease: args.lease,
        since,
    });
    match &args.from {
        JournalLocation::File(path) if path.as_os_str() == "-" => {
            usage::read_lines(std::io::stdin().lock(), &mut tally).context("reading stdin")?
        }
        JournalLocation::File(path) => std::fs::File::open(path)
            .and_then(|file| usage::read_lines(std::io::BufReader::new(file), &mut tally))
            .with_context(|| format!("reading {}", path.display()))?,
        JournalLocation::Nats(nats) => block_on(usage::read_stream(
            nats,
            &StoreOptions::from(&args.store).nats,
            &mut tally,
        ))?,
    }
    let report = tally.finish();
    if report.unreadable > 0 {
        eprintln!(
            "leasegate usage: {} line(s) of {} are not egress lines; skipped",
            report.unreadable, args.from
        );
    }
    let mut out = std::io::stdout().lock();
    if args.json {
        for lease in &report.leases {
            serde_json::to_writer(&mut out, lease)?;
            writeln!(out)?;
        }
    } else {
        out.write_all(usage::render_table(&report.leases).as_bytes())?;
    }
    Ok(())
}

/// `suggest`: the allow list each lease's recorded traffic needs.
fn suggest(args: cli::SuggestArgs) -> Result<()> {
    let since = args.since.map(|ago| {
        let ms = i64::try_from(ago.as_millis()).unwrap_or(i64::MAX);
        Timestamp::now().saturating_add_millis(-ms)
    });
    // The manifest agent of every lease the journal holds, signatures verified.
    let agents = match args.journal {
        Some(journal) => {
            let ledger = cli::LedgerArgs {
                journal,
                store: args.store,
                key_files: args.key_files,
                allow_test_key: args.allow_test_key,
                require_record_signatures: false,
            };
            require_journal(&ledger.journal)?;
            let ledger = load_ledger(&ledger)?;
            let agents = ledger
                .leases()
                .map(|l| (l.id.clone(), l.agent_name.clone()));
            Some(agents.collect())
        }
        None => None,
    };
    let grouping = match (args.agent, args.label) {
        (Some(agent), _) => suggest::Grouping::Agent(agent),
        (None, Some(label)) => suggest::Grouping::Label(label),
        (None, None) => suggest::Grouping::ByLease,
    };
    let mut tally = suggest::Tally::new(
        usage::Filter {
            lease: args.lease,
            since,
        },
        grouping,
        agents,
    );
    let name = args.from.display().to_string();
    match name.as_str() {
        "-" => usage::for_each_line(std::io::stdin().lock(), |line| tally.add(line))
            .context("reading stdin")?,
        _ => std::fs::File::open(&args.from)
            .and_then(|file| {
                usage::for_each_line(std::io::BufReader::new(file), |line| tally.add(line))
            })
            .with_context(|| format!("reading {name}"))?,
    }
    if tally.unreadable > 0 {
        eprintln!(
            "leasegate suggest: {} line(s) of {name} are not egress lines; skipped",
            tally.unreadable
        );
    }
    let suggestions = tally.finish(args.collapse.map(|n| n as usize));
    for warning in suggestions.iter().filter_map(|s| s.warning.as_deref()) {
        eprintln!("leasegate suggest: warning: {warning}");
    }
    if suggestions.is_empty() {
        eprintln!("leasegate suggest: no line of {name} reached a host; nothing to suggest");
    }
    let text = match args.format {
        cli::SuggestFormat::Flags => suggest::render_flags(&suggestions),
        cli::SuggestFormat::Json => suggest::render_json(&suggestions),
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(())
}

/// `journal import | export | mirror | compact`.
fn journal(args: cli::JournalArgs) -> Result<()> {
    match args.command {
        cli::JournalCommand::Compact(args) => compact(args),
        cli::JournalCommand::Import(args) => {
            let options = StoreOptions::from(&args.store).nats;
            let keyring = snapshot_keys(&args.keys)?;
            let imported = block_on(bridge::import(
                &args.file,
                &args.to,
                &options,
                keyring.as_ref(),
            ))?;
            let unterminated = match imported.unterminated {
                true => "; the last line has no newline and was left out",
                false => "",
            };
            println!(
                "imported {} lines, {} already in the stream{unterminated}",
                imported.published, imported.already
            );
            if imported.skipped.is_empty() {
                return Ok(());
            }
            let lines: Vec<String> = imported
                .skipped
                .iter()
                .map(|s| format!("line {} of {}: {}", s.line, args.file.display(), s.why))
                .collect();
            anyhow::bail!(
                "{} line(s) can never be published and were skipped (every other line is in the stream):\n  {}",
                lines.len(),
                lines.join("\n  ")
            )
        }
        cli::JournalCommand::Export(args) => {
            let options = StoreOptions::from(&args.store).nats;
            let keyring = snapshot_keys(&args.keys)?;
            let written = block_on(bridge::export(
                &args.stream,
                &options,
                keyring.as_ref(),
                args.out.as_deref(),
            ))?;
            if let Some(out) = &args.out {
                eprintln!("exported {written} lines to {}", out.display());
            }
            Ok(())
        }
        cli::JournalCommand::Mirror(args) => {
            let options = StoreOptions::from(&args.store);
            let file = args.file.display().to_string();
            let keyring = snapshot_keys(&args.keys)?;
            block_on(bridge::mirror(
                &args.file,
                &args.to,
                &options.nats,
                keyring.as_ref(),
                options.max_line,
                shutdown_signal(),
                |event| match event {
                    MirrorEvent::CaughtUp {
                        published,
                        already,
                        skipped,
                    } => {
                        let skipped = match skipped {
                            0 => String::new(),
                            n => format!(", {n} that can never be published skipped"),
                        };
                        // Line-buffered: a supervisor (or a test) sees it at once.
                        let mut out = std::io::stdout().lock();
                        let _ = writeln!(
                            out,
                            "mirroring {file} to {}: caught up ({published} lines published, {already} already in the stream{skipped})",
                            args.to
                        )
                        .and_then(|()| out.flush());
                    }
                },
            ))
        }
    }
}

/// The keys a purged stream's snapshot may be vouched for by (`None`: none given).
fn snapshot_keys(args: &cli::SnapshotKeyArgs) -> Result<Option<Keyring>> {
    if args.key_files.is_empty() {
        return Ok(None);
    }
    Ok(Some(Keyring::load(&args.key_files, args.allow_test_key)?))
}

/// `journal compact`: one summary line on stdout, what was skipped on stderr.
fn compact(args: cli::CompactArgs) -> Result<()> {
    require_journal(&args.ledger.journal)?;
    let keyring = Keyring::load(&args.ledger.key_files, args.ledger.allow_test_key)?;
    let retention = args.retention;
    let options = StoreOptions::from(&args.ledger.store);
    let path = match &args.ledger.journal {
        JournalLocation::File(_) if args.purge => {
            anyhow::bail!("--purge is for a stream journal (a file's compaction keeps the old file beside it)")
        }
        JournalLocation::File(path) => path,
        JournalLocation::Nats(location) => {
            let done = block_on(compact::compact_stream(
                location,
                &options.nats,
                keyring,
                retention,
                Timestamp::now(),
                options.max_line,
                args.purge,
            ))?;
            let (s, marker) = (&done.selection, &done.marker);
            report_skipped(s);
            let journal = match done.purged {
                Some(purged) => format!(
                    "verified and purged behind: {} journal messages up to sequence {} and {} messages of older snapshots removed",
                    purged.journal, marker.covers, purged.snapshots
                ),
                None => "the journal is unchanged".to_owned(),
            };
            println!(
                "snapshot of {location} up to sequence {}: {} of {} lines kept; {} leases kept, {} dropped past the retention of {}; published to {} (new replicas start from it; {journal})",
                marker.covers,
                marker.lines,
                s.lines,
                s.leases_kept,
                s.leases_dropped,
                humantime::format_duration(retention),
                done.location,
            );
            return Ok(());
        }
    };
    let done = compact::compact_file(path, keyring, retention, Timestamp::now(), options.max_line)?;
    let (s, swapped) = (&done.selection, &done.swapped);
    report_skipped(s);
    if swapped.torn_bytes > 0 {
        eprintln!(
            "left out an unterminated last line ({} bytes)",
            swapped.torn_bytes
        );
    }
    println!(
        "compacted {}: {} of {} lines kept ({} bytes, was {}); {} leases kept, {} dropped past the retention of {}; {} duplicate grants and {} records that change no status dropped; {} lines appended meanwhile copied; the old journal is kept as {}",
        path.display(),
        s.kept.len() + swapped.appended_meanwhile,
        s.lines + swapped.appended_meanwhile,
        swapped.length,
        swapped.covered,
        s.leases_kept,
        s.leases_dropped,
        humantime::format_duration(retention),
        s.duplicate_grants,
        s.notes_dropped,
        swapped.appended_meanwhile,
        swapped.archive.display(),
    );
    Ok(())
}

/// Tells how many lines a compaction left out because the fold skips them.
fn report_skipped(s: &compact::Selection) {
    let invalid: Vec<String> = InvalidReason::ALL
        .iter()
        .zip(s.invalid)
        .filter(|(_, n)| *n > 0)
        .map(|(reason, n)| format!("{n} {}", reason.as_str()))
        .collect();
    if !invalid.is_empty() {
        eprintln!(
            "skipped lines the fold skips too: {} (see `leasegate verify`)",
            invalid.join(", ")
        );
    }
}

/// Threads of `serve`'s main runtime (the control plane; connections have their own).
const CONTROL_THREADS: usize = 2;

fn serve(args: Box<cli::ServeArgs>) -> Result<()> {
    leasegate::memory::configure();
    // Connections live on their own workers (`--worker-threads`, proxy::workers); this
    // runtime keeps the journal, the admin API and lease ports' bookkeeping.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CONTROL_THREADS)
        .enable_all()
        .build()?;
    runtime.block_on(serve_async(*args))
}

async fn serve_async(mut args: cli::ServeArgs) -> Result<()> {
    let demo = if args.dev {
        Some(dev::prepare(&mut args)?)
    } else {
        None
    };
    let egress_on_stdout = args.egress_log.as_deref() == Some("-");
    let tls = args.tls_cert.is_some();
    let create_journal = args.create_journal;
    args.listen = cli::ListenAddr::Addr(config::resolve_listen(&args.listen).await?);
    let dev = args.dev;
    let mut config = ServeConfig::try_from(args)?;
    let revoking = config.proxy.on_refusal == OnRefusal::Revoke;
    let egress = match &config.egress {
        None => "egress log off".to_owned(),
        Some(Destination::Stdout) => "egress log on stdout".to_owned(),
        Some(Destination::File(path)) => format!("egress log {}", path.display()),
    };
    let credentials = config.proxy.credentials;
    // Bind first: a demo lease is issued only for a proxy that can start.
    let bound = Server::bind(&config).await?;
    if let JournalLocation::File(path) = &config.journal {
        open::create_journal_file(path, create_journal).await?;
    }
    fit_descriptors(&mut config, dev)?;
    let demo_lease = match &demo {
        Some(demo) => Some(dev::demo_lease(demo)?),
        None => None,
    };
    let server = Server::start_bound(config, bound).await?;
    if let (Some(demo), Some(lease)) = (&demo, demo_lease) {
        // In token mode the demo lease's credential is its token, minted with the dev key.
        let credential = match credentials {
            Credentials::Token => token::mint(&dev::signing_key(&demo.key_path)?, &lease.id),
            Credentials::Id => lease.id.clone(),
        };
        let scheme = if tls { "https" } else { "http" };
        let url = format!("{scheme}://agent:{credential}@{}", server.addr);
        let how = if lease.reused { "reused" } else { "issued" };
        let refusals = if revoking {
            "a refusal revokes the lease"
        } else {
            "refusals are logged, not revoking (--on-refusal revoke to revoke)"
        };
        println!(
            "leasegate (dev) on {} with demo lease {} ({how}); {refusals}; {egress}",
            server.addr, lease.id
        );
        println!(
            "export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} \
             ALL_PROXY={url} all_proxy={url}"
        );
    } else if egress_on_stdout {
        // stdout carries the egress log's JSON lines: keep it pure.
        eprintln!("leasegate ({egress}) listening on {}", server.addr);
    } else {
        // The address stays the last word: scripts take it from there.
        println!("leasegate ({egress}) listening on {}", server.addr);
    }
    shutdown_signal().await;
    server.shutdown().await;
    Ok(())
}

/// Raises the descriptor limit to the hard one and fits the connection limit under it: the
/// default is lowered to what fits, an operator's own number (outside `--dev`) that does not
/// fit stops the start.
fn fit_descriptors(config: &mut ServeConfig, dev: bool) -> Result<()> {
    let Some(limit) = descriptors::raise_limit() else {
        return Ok(());
    };
    let needs = descriptors::Needs {
        workers: leasegate::proxy::Workers::resolve(config.proxy.workers) as u64,
        lease_ports: config.lease_ports.as_ref().map_or(0, |(range, _)| {
            u64::from(*range.end()) - u64::from(*range.start()) + 1
        }),
    };
    let given = config.max_connections_given && !dev;
    config.proxy.max_connections =
        descriptors::fit(config.proxy.max_connections, given, needs, limit)?;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

fn check(args: cli::CheckArgs) -> Result<()> {
    require_journal(&args.ledger.journal)?;
    let keyring = Keyring::load(&args.ledger.key_files, args.ledger.allow_test_key)?
        .requiring_record_signatures(args.ledger.require_record_signatures);
    let config = ProxyConfig {
        resolve_names: args.resolve_names,
        ..ProxyConfig::try_from(&args.policy)?
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let explanation = runtime
        .block_on(inspect::check(
            &args.ledger.journal,
            &StoreOptions::from(&args.ledger.store),
            keyring,
            config,
            &args.lease,
            &args.target,
        ))
        .with_context(|| format!("reading {}", args.ledger.journal))?;
    match &explanation.refusal {
        None => println!("allow"),
        Some(r) => println!("refuse {} {}", r.code, r.code.status().as_u16()),
    }
    for note in std::iter::once(&explanation.reason).chain(&explanation.notes) {
        println!("  {note}");
    }
    if explanation.refusal.is_some() {
        std::process::exit(1);
    }
    Ok(())
}

/// `run`: exit with the child's code (128+signal if killed); 125 if it could not start.
fn run_agent(args: cli::RunArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("leasegate run: {e}");
            return ExitCode::from(125);
        }
    };
    let auth = match run_auth(&args) {
        Ok(auth) => auth,
        Err(e) => {
            eprintln!("leasegate run: {e}");
            return ExitCode::from(125);
        }
    };
    match runtime.block_on(run::run(
        &args.lease,
        args.proxy.as_deref(),
        &args.admin,
        &auth,
        &args.command,
    )) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("leasegate run: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// The key, admin token and admin CA `run` was given, loaded.
fn run_auth(args: &cli::RunArgs) -> Result<run::RunAuth, run::RunError> {
    let read_error = |path: &std::path::Path, reason: String| run::RunError::Read {
        path: path.display().to_string(),
        reason,
    };
    let key = match &args.key_file {
        Some(path) => Some(Key::load(path).map_err(|e| read_error(path, e.to_string()))?),
        None => None,
    };
    let admin_token = match &args.admin_token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| read_error(path, e.to_string()))?
                .trim()
                .to_owned(),
        ),
        None => None,
    };
    let admin_ca = match &args.admin_ca {
        Some(path) => Some(
            <rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| read_error(path, e.to_string()))?,
        ),
        None => None,
    };
    Ok(run::RunAuth {
        key,
        admin_token,
        admin_ca,
    })
}
