//! The `leasegate` binary: CLI dispatch and exit codes (the only place anyhow is used).
#![forbid(unsafe_code)]

mod cli;

use anyhow::{anyhow, Context, Result};
use clap::Parser;
use cli::{Cli, Command};
use leasegate::config;
use leasegate::contract::{Key, Keyring, Timestamp};
use leasegate::inspect;
use leasegate::issue::{self, IssueRequest};
use leasegate::policy::Guard;
use leasegate::proxy::upstream::Resolver;
use leasegate::proxy::{Mode, OnRefusal, ProxyConfig};
use leasegate::registry::{journal, Ledger};
use leasegate::run;
use leasegate::server::Server;
use leasegate::telemetry::egress::Destination;
use std::io::{Read, Write};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.log_format, matches!(cli.command, Command::Serve(_)));
    let outcome = match cli.command {
        Command::Keygen(args) => keygen(args),
        Command::Issue(args) => issue_lease(args),
        Command::Revoke(args) => revoke(args),
        Command::Verify(args) => return verify(args),
        Command::Leases(args) => leases(args),
        Command::Serve(args) => serve(args),
        Command::Check(args) => check(args),
        Command::Run(args) => return run_agent(args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("leasegate: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr; RUST_LOG filters (default: info for `serve`, warn otherwise).
fn init_logging(format: cli::LogFormat, serving: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if serving { "info" } else { "warn" })
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
            write_secret(path, key.to_file_text().as_bytes())
                .with_context(|| format!("writing {}", path.display()))?;
            println!("{}", key.fingerprint());
        }
        None => {
            print!("{}", key.to_file_text());
            eprintln!("{}", key.fingerprint());
        }
    }
    Ok(())
}

/// Creates a file readable by its owner only; refuses to overwrite one.
fn write_secret(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

fn load_key(path: &std::path::Path) -> Result<Key> {
    let key = Key::load(path)?;
    if key.is_test_key() {
        return Err(anyhow!(
            "{} holds the published TEST key; issue and revoke refuse it",
            path.display()
        ));
    }
    Ok(key)
}

fn issue_lease(args: cli::IssueArgs) -> Result<()> {
    let key = load_key(&args.key_file)?;
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
    let _ = writeln!(out, "{}", issued.lease_id)
        .and_then(|()| writeln!(out, "expires_at {}", issued.expires_at));
    Ok(())
}

fn revoke(args: cli::RevokeArgs) -> Result<()> {
    let key = load_key(&args.key_file)?;
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
        eprintln!("leasegate verify: {e:#}");
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
            Ok(k) => Some(k),
            Err(e) => return usage_error(e.into()),
        },
    };
    let name = args.file.display().to_string();
    let mut text = Vec::new();
    let read = if name == "-" {
        std::io::stdin().read_to_end(&mut text).map(drop)
    } else {
        std::fs::read(&args.file).map(|t| text = t)
    };
    if let Err(e) = read {
        return usage_error(anyhow!("cannot read {name}: {e}"));
    }
    let problems = inspect::verify(&text, keyring.as_ref(), now);
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
    let keyring = Keyring::load(&args.key_files, args.allow_test_key)?;
    let (ledger, _) = journal::load(&args.journal, Ledger::new(keyring))
        .with_context(|| format!("reading {}", args.journal.display()))?;
    Ok(ledger)
}

fn leases(args: cli::LeasesArgs) -> Result<()> {
    let ledger = load_ledger(&args.ledger)?;
    let rows = inspect::lease_rows(&ledger, Timestamp::now());
    let mut out = std::io::stdout().lock();
    if args.json {
        for row in rows {
            serde_json::to_writer(&mut out, &row)?;
            writeln!(out)?;
        }
    } else {
        out.write_all(inspect::render_table(&rows).as_bytes())?;
    }
    Ok(())
}

/// The ./.leasegate/ files of `serve --dev`.
const DEV_DIR: &str = ".leasegate";

fn serve(args: Box<cli::ServeArgs>) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve_async(*args))
}

async fn serve_async(mut args: cli::ServeArgs) -> Result<()> {
    let mut dev_lease = None;
    if args.dev {
        let dir = std::path::Path::new(DEV_DIR);
        std::fs::create_dir_all(dir).with_context(|| format!("creating {DEV_DIR}/"))?;
        let key_path = dir.join("dev.key");
        if !key_path.exists() {
            write_secret(&key_path, Key::generate().to_file_text().as_bytes())?;
        }
        let journal = args
            .journal
            .get_or_insert_with(|| dir.join("journal.jsonl"))
            .clone();
        if args.key_files.is_empty() {
            args.key_files.push(key_path.clone());
        }
        if args.egress_log.is_none() {
            args.egress_log = Some(dir.join("egress.jsonl").display().to_string());
        }
        let hosts = if args.allow_hosts.is_empty() {
            vec!["*".to_owned()]
        } else {
            args.allow_hosts.clone()
        };
        let issued = issue::issue(
            &journal,
            &load_key(&key_path)?,
            &IssueRequest {
                allow_hosts: hosts,
                deny_hosts: vec![],
                parent: None,
                ttl: std::time::Duration::from_secs(24 * 3600),
                name: "dev-agent".into(),
                purpose: "demo lease issued by leasegate serve --dev".into(),
                now: Timestamp::now(),
            },
        )?;
        dev_lease = Some(issued.lease_id);
    }
    if args.key_files.is_empty() {
        return Err(anyhow!(
            "no --key-file given: leases cannot be verified without a key"
        ));
    }
    let config = config::ServeConfig {
        listen: args.listen,
        journal: args
            .journal
            .clone()
            .ok_or_else(|| anyhow!("--journal is required"))?,
        keyring: Keyring::load(&args.key_files, args.allow_test_key)?,
        egress: args.egress_log.as_deref().map(|d| match d {
            "-" => Destination::Stdout,
            path => Destination::File(path.into()),
        }),
        proxy: ProxyConfig {
            mode: match args.mode {
                cli::ModeArg::Enforce => Mode::Enforce,
                cli::ModeArg::Report => Mode::Report,
            },
            on_refusal: match args.on_refusal {
                cli::OnRefusalArg::Revoke => OnRefusal::Revoke,
                cli::OnRefusalArg::Log => OnRefusal::Log,
            },
            guard: Guard {
                allow_private: args.allow_private.clone(),
                ..Guard::default()
            },
            resolver: Resolver {
                overrides: parse_resolve(&args.resolve)?,
                system: true,
                ..Resolver::default()
            },
            header_read_timeout: args.header_read_timeout,
            tunnel_idle_timeout: args.tunnel_idle_timeout,
            max_connections: args.max_connections,
            max_connections_per_lease: args.max_connections_per_lease,
            series_grace: args.metrics_grace,
            max_header_bytes: args.max_header_bytes,
            dns_timeout: args.dns_timeout,
            connect_timeout: args.connect_timeout,
        },
        admin: match args.admin.as_str() {
            "off" => None,
            addr => Some(addr.parse().with_context(|| format!("--admin {addr:?}"))?),
        },
        lease_ports: args
            .lease_ports
            .clone()
            .map(|range| (range, args.lease_port_bind)),
        tls: args.tls_cert.clone().zip(args.tls_key.clone()),
        admin_token: match &args.admin_token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?
                    .trim()
                    .to_owned(),
            )
            .filter(|t| !t.is_empty()),
            None => None,
        },
        drain_timeout: args.drain_timeout,
    };
    let server = Server::start(config).await?;
    if let Some(lease) = dev_lease {
        let url = format!("http://agent:{lease}@{}", server.addr);
        println!("leasegate (dev) on {} with demo lease {lease}", server.addr);
        println!("export HTTPS_PROXY={url} HTTP_PROXY={url}");
    } else if args.egress_log.as_deref() == Some("-") {
        // stdout carries the egress log's JSON lines: keep it pure.
        eprintln!("leasegate listening on {}", server.addr);
    } else {
        println!("leasegate listening on {}", server.addr);
    }
    shutdown_signal().await;
    server.shutdown().await;
    Ok(())
}

/// `NAME=ADDR` pairs of `--resolve`.
fn parse_resolve(
    pairs: &[String],
) -> Result<std::collections::HashMap<String, Vec<std::net::IpAddr>>> {
    let mut map: std::collections::HashMap<String, Vec<std::net::IpAddr>> =
        std::collections::HashMap::new();
    for pair in pairs {
        let (name, addr) = pair
            .split_once('=')
            .ok_or_else(|| anyhow!("--resolve {pair:?}: expected NAME=ADDR"))?;
        let addr = addr
            .trim_matches(|c| c == '[' || c == ']')
            .parse()
            .with_context(|| format!("--resolve {pair:?}: not an IP address"))?;
        map.entry(name.to_ascii_lowercase()).or_default().push(addr);
    }
    Ok(map)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
    }
}

fn check(args: cli::CheckArgs) -> Result<()> {
    let ledger = load_ledger(&args.ledger)?;
    let now = Timestamp::now();
    let explanation = inspect::explain(&ledger, &args.lease, &args.target, now);
    let mut refusal = explanation.refusal.clone();
    let mut notes = vec![explanation.reason];
    if args.resolve && refusal.is_none() {
        let target = leasegate::policy::target::parse_authority(&args.target, Some(443))?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let host = target.host.as_text();
        let resolved: Vec<std::net::SocketAddr> = match &target.host {
            leasegate::policy::TargetHost::Ip(ip) => {
                vec![std::net::SocketAddr::new(*ip, target.port)]
            }
            leasegate::policy::TargetHost::Name(name) => runtime
                .block_on(Resolver::system().resolve(
                    name,
                    target.port,
                    std::time::Duration::from_secs(5),
                ))
                .unwrap_or_default(),
        };
        let checked =
            Guard::default().check(&resolved, leasegate::policy::guard::Exception::None, true);
        for blocked in &checked.blocked {
            notes.push(format!(
                "address {} is guarded: {}",
                blocked.addr, blocked.why
            ));
        }
        notes.push(format!("{host} resolves to {:?}", resolved));
        if checked.dialable.is_empty() {
            refusal = Some(leasegate::proxy::refusal::Refusal::new(
                leasegate::proxy::refusal::Code::AddressNotAllowed,
                "no resolved address survives the guard",
            ));
        }
    }
    match &refusal {
        None => println!("allow"),
        Some(r) => println!("refuse {} {}", r.code, r.code.status().as_u16()),
    }
    for note in notes {
        println!("  {note}");
    }
    if refusal.is_some() {
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
    match runtime.block_on(run::run(
        &args.lease,
        args.proxy.as_deref(),
        &args.admin,
        &args.command,
    )) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("leasegate run: {e}");
            ExitCode::from(125)
        }
    }
}
