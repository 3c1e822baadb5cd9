//! `leasegate serve`: run the proxy until SIGINT or SIGTERM, then drain; SIGHUP reads the
//! secrets file again.
//!
//! Invariant: the flags become the configuration in one step ([`ServeConfig::resolve`]); the
//! listeners are bound, and the journal file made, before the descriptor limit is touched and
//! before a `--dev` demo lease is issued (a lease only for a proxy that can start); the
//! listening address is the last word on stdout unless stdout carries the egress log.

use super::{dev, health, issue, shutdown_signal, CliResult};
use crate::cli::ServeArgs;
use crate::config::{Credentials, OnRefusal, ProxyConfig, ServeConfig, ServeStart};
use crate::contract::token;
use crate::intercept::Broker;
use crate::registry::{open, JournalLocation};
use crate::secrets::{SecretSet, Secrets};
use crate::server::Server;
use crate::telemetry::egress::Destination;
use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;
use std::sync::Arc;
use tokio::signal::unix::{signal, Signal, SignalKind};

/// Threads of `serve`'s main runtime (the control plane; connections have their own).
const CONTROL_THREADS: usize = 2;

pub fn exec(args: Box<ServeArgs>) -> CliResult {
    crate::memory::configure();
    // Connections live on their own workers (`--worker-threads`, proxy::workers); this
    // runtime keeps the journal, the admin API and lease ports' bookkeeping.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CONTROL_THREADS)
        .enable_all()
        .build()?;
    runtime.block_on(serve(*args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    if args.dev {
        dev::prepare(args.egress_stream.is_some() && args.egress_stream_key.is_none())?;
    }
    let args_token_is_dev = args.dev && args.admin_token_file.is_none();
    let start = ServeConfig::resolve(args).await?;
    if let Some(demo) = &start.demo {
        // Before anything is bound: a refused allow list starts nothing.
        for warning in issue::public_suffix_wildcards(&demo.hosts, demo.force)? {
            eprintln!("leasegate serve: {warning}");
        }
    }
    let config = &start.config;
    let revoking = config.proxy.on_refusal == OnRefusal::Revoke;
    let egress = match &config.egress {
        None => "egress log off".to_owned(),
        Some(Destination::Stdout) => "egress log on stdout".to_owned(),
        Some(Destination::File(path)) => format!("egress log {}", path.display()),
    };
    let egress_on_stdout = config.egress == Some(Destination::Stdout);
    let tls = config.tls.is_some();
    let credentials = config.proxy.credentials;
    let local_test = local_test_hint(&config.proxy);
    // Bind first: a demo lease is issued only for a proxy that can start.
    let bound = Server::bind(config).await?;
    if let JournalLocation::File(path) = &config.journal {
        open::create_journal_file(path, start.create_journal).await?;
    }
    let max_connections = start.fit_connections()?;
    let ServeStart { config, demo, .. } = start;
    let config = ServeConfig {
        proxy: ProxyConfig {
            max_connections,
            ..config.proxy
        },
        ..config
    };
    let demo_lease = match &demo {
        Some(demo) => Some(dev::demo_lease(demo)?),
        None => None,
    };
    if let Some(broker) = &config.broker {
        log_loaded(&broker.secrets, "secrets loaded");
        // Listening before the proxy is reachable: a SIGHUP from then on reloads, never kills.
        match signal(SignalKind::hangup()) {
            Ok(hangup) => {
                tokio::spawn(reload_on_hangup(broker.clone(), hangup));
            }
            Err(error) => tracing::warn!(
                %error,
                "cannot listen for SIGHUP: the secrets file is read at start only"
            ),
        }
    }
    let server = Server::start_bound(config, bound).await?;
    if let (Some(demo), Some(lease)) = (&demo, demo_lease) {
        // In token mode the demo lease's credential is its token, minted with the dev key.
        let credential = match credentials {
            Credentials::Token => token::mint(&dev::signing_key(&demo.key_path)?, &lease.id),
            Credentials::Id => lease.id.clone(),
        };
        let scheme = if tls { "https" } else { "http" };
        let url = format!("{scheme}://agent:{credential}@{}", server.addr);
        let how = match (lease.reused, lease.closed.as_slice()) {
            (true, []) => "reused".to_owned(),
            (false, []) => "issued".to_owned(),
            (reused, closed) => format!(
                "{}; closed the demo lease{} {} for other hosts",
                if reused { "reused" } else { "issued" },
                if closed.len() > 1 { "s" } else { "" },
                closed.join(", ")
            ),
        };
        let refusals = if revoking {
            "a refusal revokes the lease"
        } else {
            "refusals are logged, not revoking (--on-refusal revoke to revoke)"
        };
        println!(
            "leasegate (dev) on {} with demo lease {} ({how}); {refusals}; {egress}",
            server.addr, lease.id
        );
        // NO_PROXY: the admin API (the dashboard, `leasegate leases`) is reached directly, not
        // through the proxy, which would refuse it and could revoke the demo lease.
        println!(
            "export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} \
             ALL_PROXY={url} all_proxy={url} NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost"
        );
        if let Some(admin) = server.admin_addr {
            println!("dashboard http://{}/", health::reachable(admin));
        }
        if let Some(hint) = local_test {
            println!("{hint}");
        }
        if args_token_is_dev && server.admin_addr.is_some() {
            let path = crate::config::dev_file(crate::config::DEV_ADMIN_TOKEN);
            println!(
                "admin token in {} (the dashboard and POST /leases ask for it): \
                 export LEASEGATE_ADMIN_TOKEN_FILE=$PWD/{}",
                path.display(),
                path.display()
            );
        }
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

/// Counts and the path of the secrets in use: never a value.
fn log_loaded(secrets: &Secrets, what: &str) {
    let set = secrets.current();
    tracing::info!(
        path = %secrets.path().display(),
        secrets = set.secrets().len(),
        canaries = set.canary_count(),
        "{what}"
    );
}

/// Reads the secrets file (and the price table) again on every SIGHUP: each new one in whole,
/// or, on any problem, the one in use kept and the problem logged (never a value: errors name
/// fields, not values).
async fn reload_on_hangup(broker: Arc<Broker>, mut hangup: Signal) {
    let secrets = &broker.secrets;
    let env = |name: &str| std::env::var(name).ok();
    let covered = |set: &SecretSet| broker.covers(set).map_err(|e| e.to_string());
    while hangup.recv().await.is_some() {
        match secrets.reload_checked(&env, &covered) {
            Ok(()) => log_loaded(secrets, "secrets reloaded"),
            Err(error) => tracing::error!(
                path = %secrets.path().display(),
                "secrets file not reloaded, the secrets in use stay: {error}"
            ),
        }
        match broker.reload_prices() {
            None => {}
            Some(Ok(())) => tracing::info!("price table reloaded"),
            Some(Err(error)) => {
                tracing::error!("price table not reloaded, the prices in use stay: {error}")
            }
        }
    }
}

/// `--dev`'s line for a first test against a server on this host, while loopback is still
/// guarded: the flags it needs (the guard refuses loopback, a test name needs an address, the
/// port lists keep their defaults).
fn local_test_hint(proxy: &ProxyConfig) -> Option<String> {
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if proxy
        .guard
        .allow_private
        .iter()
        .any(|net| net.contains(&loopback))
    {
        return None;
    }
    Some(format!(
        "a server on this host needs --allow-private 127.0.0.0/8 (loopback is guarded), \
         --resolve NAME=127.0.0.1 to be reached by a test name, and its port in \
         --forward-ports (now {}) or --connect-ports (now {})",
        proxy.forward_ports, proxy.connect_ports
    ))
}
