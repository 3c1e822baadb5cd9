//! Resolved, validated configuration: the raw flags of `cli.rs` become parsed addresses, loaded
//! keys and compiled options here (ripgrep's low-level args → high-level config).
//!
//! Invariant: a `ServeConfig` or `ProxyConfig` that exists is valid; nothing downstream parses
//! a flag again. `serve`'s flags become its configuration in one step ([`ServeConfig::resolve`]:
//! `--dev` defaults and `--listen` resolution included); the raw flags are never rewritten.

use crate::cli;
use crate::contract::keys::KeyError;
use crate::contract::Keyring;
use crate::descriptors;
use crate::intercept::{Broker, BrokerError};
use crate::mcp::McpServers;
use crate::nats::NatsOptions;
use crate::policy::{Guard, Ports};
use crate::registry::{JournalLocation, StoreOptions, WallClock};
use crate::resolve::Resolver;
use crate::secrets::{Secrets, SecretsError};
use crate::telemetry::egress::Destination;
use crate::telemetry::egress_stream::{EgressKey, EgressStreamConfig, KeyFileError, HOW_TO_MAKE};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Refuse what policy refuses.
    Enforce,
    /// Let policy refusals through, logged as `report` (for rolling out allow lists).
    Report,
}

/// `--on-refusal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRefusal {
    /// The first revoking refusal appends a signed `revoked` record.
    Revoke,
    /// Refusals are only logged.
    Log,
}

/// `--credentials`: what a credential on the shared listener must prove.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Credentials {
    /// The lease id alone is the credential (anyone who learns the id can spend the lease).
    #[default]
    Id,
    /// `<lease-id>.<tag>`: the tag is a MAC under the lease's key, so knowing the id (from
    /// the journal, the admin API, a log line) is not enough.
    Token,
}

/// `--lease-port-credentials`: what a connection on a lease's own port must carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LeasePortCredentials {
    /// Nothing: the port names the lease, and whatever reaches it spends the lease.
    #[default]
    None,
    /// The lease's token, as `--credentials token` requires on the shared listener.
    Token,
}

/// What the proxy needs to decide and connect, validated.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub mode: Mode,
    pub on_refusal: OnRefusal,
    pub guard: Guard,
    pub resolver: Resolver,
    /// Phase 5 resolves names. False only for `check` without `--resolve`: names are judged
    /// but not resolved (IP literals are still guarded).
    pub resolve_names: bool,
    /// What a credential must prove (`--credentials`).
    pub credentials: Credentials,
    /// What a connection on a lease port must carry (`--lease-port-credentials`).
    pub lease_port_credentials: LeasePortCredentials,
    /// Time to send a request head: the first one, and each next one on an idle keep-alive
    /// connection (hyper restarts the timer whenever it waits for a head).
    pub header_read_timeout: Duration,
    /// A tunnel (or upgraded connection) with no bytes either way for this long is closed.
    pub tunnel_idle_timeout: Duration,
    /// Threads client connections live on (0: one per core).
    pub workers: usize,
    /// Client connections at once, in total and per lease (`too-many-connections`).
    pub max_connections: usize,
    pub max_connections_per_lease: usize,
    /// Client connections at once from one source IP not yet tied to a lease: counted at
    /// accept, before any byte is parsed (so one client cannot hold every slot of
    /// `max_connections`), until the connection is identified; then its lease's budget
    /// (`max_connections_per_lease`) counts it instead.
    pub max_connections_per_client: usize,
    /// How long the metric series of a closed lease stay visible.
    pub series_grace: Duration,
    /// Leases shown by name on `/metrics` (the busiest by calls); the rest are summed.
    pub series_max_leases: usize,
    /// The largest request head (request line and headers) served; larger heads get 431.
    pub max_header_bytes: usize,
    /// A CONNECT tunnel whose first client bytes are not a ClientHello naming a host
    /// (`--require-sni`) is closed as `tls-unverifiable`.
    pub require_sni: bool,
    /// Ports a CONNECT tunnel may reach (`--connect-ports`, 443) and a forwarded request
    /// (`--forward-ports`, 80); others are `port-not-allowed`, in every mode.
    pub connect_ports: Ports,
    pub forward_ports: Ports,
    pub dns_timeout: Duration,
    pub connect_timeout: Duration,
    /// A forwarded request's upstream must send its response head within this
    /// (`upstream-timeout`, 504).
    pub upstream_response_timeout: Duration,
    /// The output tokens a model call whose request names no cap may spend, as its bound
    /// (`--model-output-bound`): reserved while it is in flight, charged if its usage cannot
    /// be read.
    pub model_output_bound: u64,
    /// The largest model-call request body read (`--max-model-request-bytes`); larger ones are
    /// `body-too-large`.
    pub max_model_request_bytes: usize,
    /// `--mcp-server`: the origins whose requests are read as MCP.
    pub mcp: Arc<McpServers>,
}

impl Default for ProxyConfig {
    fn default() -> ProxyConfig {
        ProxyConfig {
            mode: Mode::Enforce,
            on_refusal: OnRefusal::Revoke,
            guard: Guard::default(),
            resolver: Resolver::system(),
            resolve_names: true,
            credentials: Credentials::Id,
            lease_port_credentials: LeasePortCredentials::None,
            header_read_timeout: Duration::from_secs(5),
            tunnel_idle_timeout: Duration::from_secs(3600),
            workers: 0,
            max_connections: 10_000,
            max_connections_per_lease: 1_000,
            max_connections_per_client: 256,
            series_grace: crate::telemetry::metrics::GRACE,
            series_max_leases: crate::telemetry::metrics::MAX_LEASES,
            max_header_bytes: 64 * 1024,
            require_sni: false,
            connect_ports: Ports::only(443),
            forward_ports: Ports::only(80),
            dns_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            upstream_response_timeout: Duration::from_secs(60),
            model_output_bound: 32_768,
            max_model_request_bytes: 16 << 20,
            mcp: Arc::default(),
        }
    }
}

/// Everything `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The shared proxy listener.
    pub listen: SocketAddr,
    pub journal: JournalLocation,
    /// How a stream journal is reached; where local state lives.
    pub store: StoreOptions,
    pub keyring: Keyring,
    /// `None`: no egress log.
    pub egress: Option<Destination>,
    /// `--egress-stream`: every egress line also published there; `None`: off.
    pub egress_stream: Option<EgressStreamConfig>,
    pub proxy: ProxyConfig,
    /// The admin API listener; `None`: no admin API.
    pub admin: Option<SocketAddr>,
    /// `--admin-host`: names the admin API answers to in `Host`, beyond `localhost` and its
    /// own address.
    pub admin_hosts: Vec<String>,
    /// Per-lease ports: the range and the address they bind.
    pub lease_ports: Option<(RangeInclusive<u16>, IpAddr)>,
    /// Certificate chain and key (PEM) for a TLS proxy listener.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Bearer token every admin route but `/healthz` requires.
    pub admin_token: Option<String>,
    /// `--admin-insecure`: the admin API binds beyond loopback without a token (warned at
    /// every start).
    pub admin_insecure: bool,
    /// How long a drain waits for requests and tunnels before closing them.
    pub drain_timeout: Duration,
    /// The wall clock lifetime checks start from (tests step an adjustable one).
    pub wall: WallClock,
    /// `--secrets` with `--ca-dir`: the secrets loaded at start and what terminates their
    /// hosts' tunnels; `None`: every tunnel is a blind relay.
    pub broker: Option<Arc<Broker>>,
    /// Calls waiting for a human: how long, and the webhook told of each.
    pub approvals: crate::approvals::Settings,
    /// `POST /leases`: the root policy and the per-caller rate.
    pub issuing: Issuing,
}

/// How the admin API issues leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Issuing {
    pub root: crate::contract::narrow::RootPolicy,
    /// `--max-issue-rate`: leases per second per caller.
    pub rate: std::num::NonZeroU32,
    /// `refused` records written a second, from every caller together.
    pub refusals_recorded: std::num::NonZeroU32,
}

impl Default for Issuing {
    fn default() -> Issuing {
        Issuing {
            root: Default::default(),
            rate: crate::admin::DEFAULT_ISSUE_RATE,
            refusals_recorded: crate::issuer::REFUSALS_RECORDED_PER_SECOND,
        }
    }
}

/// `serve`'s flags resolved: its configuration, and what only the start itself needs.
#[derive(Debug, Clone)]
pub struct ServeStart {
    pub config: ServeConfig,
    /// `--dev`: the demo lease to find or issue once the listeners are bound.
    pub demo: Option<Demo>,
    /// `--create-journal`: a missing journal file's directory is made too.
    pub create_journal: bool,
    /// `--max-connections` was given outside `--dev`: a number the descriptor limit cannot
    /// hold stops the start rather than being lowered ([`ServeStart::fit_connections`]).
    pub connections_fixed: bool,
}

/// The directory `serve --dev` keeps its files in, under the working directory.
pub const DEV_DIR: &str = ".leasegate";

/// `serve --dev --egress-stream`'s key, under [`DEV_DIR`].
pub const EGRESS_STREAM_DEV_KEY: &str = "egress-stream.key";

/// A file of `serve --dev` (`dev.key`, `journal.jsonl`, `egress.jsonl`) under [`DEV_DIR`].
/// The file of `--dev`'s admin token, in [`DEV_DIR`].
pub const DEV_ADMIN_TOKEN: &str = "admin-token";

pub fn dev_file(name: &str) -> PathBuf {
    Path::new(DEV_DIR).join(name)
}

/// What `serve --dev` needs to find or issue its demo lease.
#[derive(Debug, Clone)]
pub struct Demo {
    pub journal: PathBuf,
    pub key_path: PathBuf,
    /// The demo lease's allow list.
    pub hosts: Vec<String>,
    /// `--force`: a wildcard over a public suffix in `hosts` is accepted, with a warning.
    pub force: bool,
}

/// A flag that does not make a valid configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("no --key-file given: leases cannot be verified without a key")]
    NoKey,
    #[error("--journal is required")]
    NoJournal,
    #[error(transparent)]
    Keys(#[from] KeyError),
    #[error("--admin {0:?}: expected ADDR:PORT or `off`")]
    Admin(String),
    #[error("--admin-host {0:?}: expected a host name or an IP address, without a port")]
    AdminHost(String),
    #[error(
        "--admin {0} is reachable beyond loopback but has no --admin-token-file: anyone who \
         reaches it could list leases and revoke them. Give it a token, bind 127.0.0.1, or \
         pass --admin-insecure to accept the risk"
    )]
    AdminExposed(SocketAddr),
    #[error("the egress log {0} is the journal: give --egress-log another file")]
    EgressIsJournal(String),
    #[error("--listen {0}: the name does not resolve to an address")]
    ListenResolve(String),
    #[error("--max-connections-per-client must be at least 1")]
    PerClientLimit,
    #[error("--resolve {0:?}: expected NAME=ADDR with an IP address")]
    Resolve(String),
    #[error("reading {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error(
        "--dev issues its demo lease into a file journal; give --journal a file, or leave it out"
    )]
    DevStreamJournal,
    #[error(transparent)]
    Descriptors(#[from] descriptors::Shortfall),
    #[error(transparent)]
    Secrets(#[from] SecretsError),
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error(transparent)]
    Prices(#[from] crate::meter::prices::PricesError),
    #[error(transparent)]
    McpServer(#[from] crate::mcp::servers::BadServer),
    #[error("--approval-timeout {0}: between 1s and 1h")]
    ApprovalTimeout(String),
    #[error("--approval-webhook {0}")]
    ApprovalWebhook(String),
    #[error(
        "--mcp-server {0}: an https server's requests are read inside a terminated tunnel, so it \
         needs --secrets and --ca-dir (a secrets file may list no secret: `canaries = []`)"
    )]
    McpNeedsBroker(String),
    #[error(
        "--mcp-server {0}: a name spelled METHOD: is a route in a lease's approvals \
         (POST:host/path), so a server may not be named so"
    )]
    McpNamedAsRoute(String),
    #[error(
        "--mcp-server {server}: the interception CA's name constraints ({subtrees}) do not cover \
         its host: make a CA for it with `leasegate ca init --host {host}`"
    )]
    McpNotCovered {
        server: String,
        host: String,
        subtrees: String,
    },
    #[error(
        "--egress-stream needs --egress-stream-key FILE: without the replicas' shared key \
         anyone who can publish to the stream could forge or erase usage; {HOW_TO_MAKE}"
    )]
    NoEgressStreamKey,
    #[error(transparent)]
    EgressStreamKey(#[from] KeyFileError),
}

impl TryFrom<&cli::PolicyArgs> for ProxyConfig {
    type Error = ConfigError;

    /// The decision-relevant flags `serve` and `check` share, over the defaults.
    fn try_from(args: &cli::PolicyArgs) -> Result<ProxyConfig, ConfigError> {
        Ok(ProxyConfig {
            mode: match args.mode {
                cli::ModeArg::Enforce => Mode::Enforce,
                cli::ModeArg::Report => Mode::Report,
            },
            guard: Guard {
                allow_private: args.allow_private.clone(),
                ..Guard::default()
            },
            resolver: Resolver {
                overrides: parse_resolve(&args.resolve)?,
                ..Resolver::system()
            },
            dns_timeout: args.dns_timeout,
            connect_ports: args.connect_ports.clone(),
            forward_ports: args.forward_ports.clone(),
            ..ProxyConfig::default()
        })
    }
}

impl From<&cli::StoreArgs> for StoreOptions {
    fn from(args: &cli::StoreArgs) -> StoreOptions {
        StoreOptions {
            nats: NatsOptions {
                creds: args.nats_creds.clone(),
                tls_ca: args.nats_tls_ca.clone(),
                replicas: usize::from(args.nats_replicas),
                stale_after: args.store_stale_after,
                start_timeout: args.store_start_timeout,
            },
            data_dir: args.data_dir.clone(),
            closed_lease_retention: None,
            max_line: usize::try_from(args.max_journal_line).unwrap_or(usize::MAX),
            max_lease_lifetime: args.max_lease_lifetime.0,
        }
    }
}

impl ServeConfig {
    /// `serve`'s flags → its configuration, in one step: where `--dev` is given, the journal,
    /// key and egress log under [`DEV_DIR`] (its key must exist: `serve` writes it first) and
    /// logging rather than revoking refusals, unless the flags say otherwise; `--listen
    /// NAME:PORT` resolved; the keys loaded. Only the connection limit is left to the start
    /// ([`ServeStart::fit_connections`]).
    pub async fn resolve(args: cli::ServeArgs) -> Result<ServeStart, ConfigError> {
        let dev = args.dev;
        let journal = match (args.journal, dev) {
            (Some(journal), _) => journal,
            (None, true) => JournalLocation::File(dev_file("journal.jsonl")),
            (None, false) => return Err(ConfigError::NoJournal),
        };
        let demo = match (&journal, dev) {
            (_, false) => None,
            (JournalLocation::File(path), true) => Some(Demo {
                journal: path.clone(),
                key_path: dev_file("dev.key"),
                hosts: match args.allow_hosts.is_empty() {
                    true => vec!["*".to_owned()],
                    false => args.allow_hosts.clone(),
                },
                force: args.force,
            }),
            (JournalLocation::Nats(_), true) => return Err(ConfigError::DevStreamJournal),
        };
        let key_files = match &demo {
            Some(demo) if args.key_files.is_empty() => vec![demo.key_path.clone()],
            _ => args.key_files,
        };
        let egress_log = match dev {
            true => args
                .egress_log
                .or_else(|| Some(dev_file("egress.jsonl").display().to_string())),
            false => args.egress_log,
        };
        // One refusal must not end the demo: a user trying things out hits refusals on purpose.
        let on_refusal = match dev {
            true => args.on_refusal.or(Some(cli::OnRefusalArg::Log)),
            false => args.on_refusal,
        };
        let listen = resolve_listen(&args.listen).await?;
        if key_files.is_empty() {
            return Err(ConfigError::NoKey);
        }
        let proxy = ProxyConfig {
            on_refusal: match on_refusal {
                None | Some(cli::OnRefusalArg::Revoke) => OnRefusal::Revoke,
                Some(cli::OnRefusalArg::Log) => OnRefusal::Log,
            },
            credentials: match args.credentials {
                cli::CredentialsArg::Id => Credentials::Id,
                cli::CredentialsArg::Token => Credentials::Token,
            },
            lease_port_credentials: match args.lease_port_credentials {
                cli::LeasePortCredentialsArg::None => LeasePortCredentials::None,
                cli::LeasePortCredentialsArg::Token => LeasePortCredentials::Token,
            },
            header_read_timeout: args.header_read_timeout,
            tunnel_idle_timeout: args.tunnel_idle_timeout,
            workers: args.worker_threads,
            max_connections: args
                .max_connections
                .unwrap_or(ProxyConfig::default().max_connections),
            max_connections_per_lease: args.max_connections_per_lease,
            max_connections_per_client: match args.max_connections_per_client {
                0 => return Err(ConfigError::PerClientLimit),
                n => n,
            },
            series_grace: args.metrics_grace,
            series_max_leases: args.metrics_max_leases,
            max_header_bytes: args.max_header_bytes,
            require_sni: args.require_sni,
            connect_timeout: args.connect_timeout,
            upstream_response_timeout: args.upstream_response_timeout,
            model_output_bound: args.model_output_bound,
            max_model_request_bytes: args.max_model_request_bytes,
            ..ProxyConfig::try_from(&args.policy)?
        };
        // `--dev` keeps its admin token in its directory: issuing leases needs one.
        let admin_token_file = match (&args.admin_token_file, dev) {
            (Some(path), _) => Some(path.clone()),
            (None, true) => Some(dev_file(DEV_ADMIN_TOKEN)),
            (None, false) => None,
        };
        let admin_token = match &admin_token_file {
            // `serve --dev` writes it before this runs; nothing else reads it.
            Some(path) if args.admin_token_file.is_none() && !path.exists() => String::new(),
            Some(path) => std::fs::read_to_string(path)
                .map_err(|error| ConfigError::Read {
                    path: path.display().to_string(),
                    error,
                })?
                .trim()
                .to_owned(),
            None => String::new(),
        };
        let admin = match args.admin.as_str() {
            "off" => None,
            addr => Some(
                addr.parse::<SocketAddr>()
                    .map_err(|_| ConfigError::Admin(addr.to_owned()))?,
            ),
        };
        let admin_token = Some(admin_token).filter(|t| !t.is_empty());
        let admin_hosts = args
            .admin_hosts
            .iter()
            .map(|name| parse_admin_host(name))
            .collect::<Result<Vec<_>, _>>()?;
        // Fail closed: an admin API others can reach lists every lease and revokes any of
        // them, so beyond loopback it needs a token unless the operator says otherwise.
        if let Some(addr) = admin {
            if !addr.ip().is_loopback() && admin_token.is_none() && !args.admin_insecure {
                return Err(ConfigError::AdminExposed(addr));
            }
        }
        let store = StoreOptions {
            closed_lease_retention: Some(args.closed_lease_retention),
            ..StoreOptions::from(&args.store)
        };
        let egress_stream = match args.egress_stream {
            None => None,
            Some(location) => {
                // Fail closed: unsealed lines would let anyone who can publish rewrite usage.
                let key_path = match (args.egress_stream_key, dev) {
                    (Some(path), _) => path,
                    (None, true) => dev_file(EGRESS_STREAM_DEV_KEY),
                    (None, false) => return Err(ConfigError::NoEgressStreamKey),
                };
                Some(EgressStreamConfig {
                    location,
                    nats: store.nats.clone(),
                    max_age: args.egress_max_age,
                    backlog: args.egress_stream_backlog as usize,
                    key: EgressKey::load(&key_path)?,
                })
            }
        };
        let egress = match egress_log.as_deref() {
            Some("off") => None,
            Some("-") => Some(Destination::Stdout),
            Some(path) => Some(Destination::File(path.into())),
            None => Some(Destination::File(default_egress_log(&journal, &store))),
        };
        if let (Some(Destination::File(egress)), JournalLocation::File(journal)) =
            (&egress, &journal)
        {
            if egress == journal {
                return Err(ConfigError::EgressIsJournal(egress.display().to_string()));
            }
        }
        let mcp = crate::mcp::McpServers::parse(&args.mcp_servers)?;
        let approvals = approval_settings(args.approval_timeout, args.approval_webhook.as_deref())?;
        let mut config = ServeConfig {
            approvals,
            listen,
            journal,
            store,
            keyring: Keyring::load(&key_files, args.allow_test_key)?
                .requiring_record_signatures(args.require_record_signatures),
            egress,
            egress_stream,
            proxy,
            admin,
            admin_hosts,
            lease_ports: args.lease_ports.map(|range| (range, args.lease_port_bind)),
            tls: args.tls_cert.zip(args.tls_key),
            admin_token,
            admin_insecure: args.admin_insecure,
            drain_timeout: args.drain_timeout,
            wall: WallClock::system(),
            issuing: Issuing {
                root: crate::contract::narrow::RootPolicy {
                    max_depth: Some(args.issue_max_depth),
                    max_fan_out: Some(args.issue_max_fan_out),
                },
                rate: args.max_issue_rate,
                refusals_recorded: crate::issuer::REFUSALS_RECORDED_PER_SECOND,
            },
            broker: match (&args.secrets, &args.ca_dir) {
                (Some(path), Some(ca_dir)) => {
                    let broker = Broker::new(
                        Arc::new(Secrets::load(path)?),
                        ca_dir,
                        args.upstream_ca.as_deref(),
                    )?;
                    Some(Arc::new(match &args.prices {
                        Some(prices) => broker.with_prices_file(prices)?,
                        None => broker,
                    }))
                }
                _ => None,
            },
        };
        check_mcp(&mcp, config.broker.as_deref())?;
        config.proxy.mcp = Arc::new(mcp);
        Ok(ServeStart {
            config,
            demo,
            create_journal: args.create_journal,
            // Dev mode lowers even an operator's number to what fits: a demo should start.
            connections_fixed: args.max_connections.is_some() && !dev,
        })
    }
}

/// `--approval-timeout` and `--approval-webhook`, checked.
fn approval_settings(
    timeout: Duration,
    webhook: Option<&str>,
) -> Result<crate::approvals::Settings, ConfigError> {
    if !(Duration::from_secs(1)..=crate::approvals::MAX_TIMEOUT).contains(&timeout) {
        return Err(ConfigError::ApprovalTimeout(
            humantime::format_duration(timeout).to_string(),
        ));
    }
    let webhook = webhook
        .map(crate::approvals::Webhook::parse)
        .transpose()
        .map_err(ConfigError::ApprovalWebhook)?;
    Ok(crate::approvals::Settings { timeout, webhook })
}

impl ServeStart {
    /// The connection limit to serve with, fitted under the descriptor limit, which is raised
    /// to the hard one first ([`descriptors::fit`]); without a readable limit, the one asked
    /// for. A step of the start rather than of [`ServeConfig::resolve`]: it raises the
    /// process's limit, which `serve` does only once its listeners are bound and its journal
    /// is there, so a start that fails before says nothing about descriptors.
    pub fn fit_connections(&self) -> Result<usize, ConfigError> {
        let (proxy, lease_ports) = (&self.config.proxy, &self.config.lease_ports);
        let Some(limit) = descriptors::raise_limit() else {
            return Ok(proxy.max_connections);
        };
        let needs = descriptors::Needs {
            workers: worker_threads(proxy.workers) as u64,
            lease_ports: lease_ports.as_ref().map_or(0, |(range, _)| {
                u64::from(*range.end()) - u64::from(*range.start()) + 1
            }),
        };
        let fixed = self.connections_fixed;
        Ok(descriptors::fit(
            proxy.max_connections,
            fixed,
            needs,
            limit,
        )?)
    }
}

/// Threads client connections live on for `--worker-threads count` (0: one per core).
pub fn worker_threads(count: usize) -> usize {
    match count {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    }
}

/// Where the egress log goes without `--egress-log`: `egress.jsonl` beside a file journal,
/// or under `--data-dir` for a stream journal.
pub fn default_egress_log(journal: &JournalLocation, store: &StoreOptions) -> PathBuf {
    match journal {
        JournalLocation::File(path) => path
            .parent()
            .map(|dir| dir.join("egress.jsonl"))
            .unwrap_or_else(|| PathBuf::from("egress.jsonl")),
        JournalLocation::Nats(_) => store.data_dir.join("egress.jsonl"),
    }
}

/// `--admin-host`: a host name (letters, digits, `-`, `.`) or an IP address (IPv6 with or
/// without brackets); no port, no wildcard.
fn parse_admin_host(text: &str) -> Result<String, ConfigError> {
    let bare = text.trim_start_matches('[').trim_end_matches(']');
    let is_name = !bare.is_empty()
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    match is_name || bare.parse::<IpAddr>().is_ok() {
        true => Ok(bare.to_owned()),
        false => Err(ConfigError::AdminHost(text.to_owned())),
    }
}

/// Resolves `--listen NAME:PORT` to its first address (a literal address is kept as is).
async fn resolve_listen(listen: &cli::ListenAddr) -> Result<SocketAddr, ConfigError> {
    match listen {
        cli::ListenAddr::Addr(addr) => Ok(*addr),
        cli::ListenAddr::Name(name) => tokio::net::lookup_host(name.as_str())
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| ConfigError::ListenResolve(name.clone())),
    }
}

/// `NAME=ADDR` pairs of `--resolve` (IPv6 with or without brackets).
pub fn parse_resolve(pairs: &[String]) -> Result<HashMap<String, Vec<IpAddr>>, ConfigError> {
    let mut map: HashMap<String, Vec<IpAddr>> = HashMap::new();
    for pair in pairs {
        let bad = || ConfigError::Resolve(pair.clone());
        let (name, addr) = pair.split_once('=').ok_or_else(bad)?;
        let addr = addr
            .trim_matches(|c| c == '[' || c == ']')
            .parse()
            .map_err(|_| bad())?;
        map.entry(name.to_ascii_lowercase()).or_default().push(addr);
    }
    Ok(map)
}

/// Every https MCP server is one the broker can terminate: a name its CA covers.
fn check_mcp(servers: &McpServers, broker: Option<&Broker>) -> Result<(), ConfigError> {
    if let Some(server) = servers
        .iter()
        .find(|s| crate::approvals::route::is_route_shaped(&s.name))
    {
        return Err(ConfigError::McpNamedAsRoute(server.to_string()));
    }
    for server in servers.iter().filter(|s| s.tls) {
        let Some(broker) = broker else {
            return Err(ConfigError::McpNeedsBroker(server.to_string()));
        };
        if let Err(subtrees) = broker.covers_name(&server.host) {
            return Err(ConfigError::McpNotCovered {
                server: server.to_string(),
                host: server.host.as_text(),
                subtrees,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `serve` flags as the binary would parse them, with a key file that exists.
    fn serve_config(extra: &[&str]) -> Result<ServeConfig, ConfigError> {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path();
        let key = dir.join("k.key");
        std::fs::write(&key, crate::contract::Key::generate().to_file_text()).unwrap();
        let token = dir.join("admin-token");
        std::fs::write(&token, "s3cret\n").unwrap();
        let stream_key = dir.join("egress-stream.key");
        crate::telemetry::egress_stream::EgressKey::write_new(&stream_key).unwrap();
        let mut argv = vec![
            "--journal".to_owned(),
            dir.join("j.jsonl").display().to_string(),
            "--key-file".into(),
            key.display().to_string(),
        ];
        for arg in extra {
            argv.push(
                arg.replace("TOKEN_FILE", &token.display().to_string())
                    .replace("STREAM_KEY", &stream_key.display().to_string()),
            );
        }
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        Ok(serve_start(&argv)?.config)
    }

    /// `serve` flags resolved as the binary resolves them.
    fn serve_start(argv: &[&str]) -> Result<ServeStart, ConfigError> {
        let cli = cli::Cli::try_parse_from(["leasegate", "serve"].iter().chain(argv)).unwrap();
        let cli::Command::Serve(args) = cli.command else {
            unreachable!()
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(ServeConfig::resolve(*args))
    }

    #[test]
    fn dev_fills_in_only_what_the_flags_leave_out() {
        let temp = tempfile::tempdir().unwrap();
        let key = temp.path().join("k.key");
        std::fs::write(&key, crate::contract::Key::generate().to_file_text()).unwrap();
        let key = key.display().to_string();
        let start = serve_start(&["--dev", "--key-file", &key]).unwrap();
        let demo = start.demo.unwrap();
        assert_eq!(demo.journal, Path::new(".leasegate/journal.jsonl"));
        assert_eq!(demo.key_path, Path::new(".leasegate/dev.key"));
        assert_eq!(demo.hosts, ["*"]);
        assert_eq!(
            start.config.journal,
            JournalLocation::File(".leasegate/journal.jsonl".into())
        );
        assert_eq!(
            start.config.egress,
            Some(Destination::File(".leasegate/egress.jsonl".into()))
        );
        assert_eq!(start.config.proxy.on_refusal, OnRefusal::Log);
        assert!(!start.connections_fixed, "--dev lowers what does not fit");

        let journal = temp.path().join("j.jsonl").display().to_string();
        let given = serve_start(&[
            "--dev",
            "--key-file",
            &key,
            "--journal",
            &journal,
            "--egress-log",
            "off",
            "--on-refusal",
            "revoke",
            "--allow-host",
            "example.com",
            "--max-connections",
            "10",
        ])
        .unwrap();
        assert_eq!(given.config.journal, JournalLocation::File(journal.into()));
        assert_eq!(given.config.egress, None);
        assert_eq!(given.config.proxy.on_refusal, OnRefusal::Revoke);
        assert_eq!(given.demo.unwrap().hosts, ["example.com"]);
        assert!(!given.connections_fixed);

        let plain = serve_start(&[
            "--key-file",
            &key,
            "--journal",
            "j",
            "--max-connections",
            "10",
        ]);
        let plain = plain.unwrap();
        assert!(plain.demo.is_none() && plain.connections_fixed);
        assert_eq!(plain.config.proxy.on_refusal, OnRefusal::Revoke);
        assert!(matches!(
            serve_start(&["--dev", "--journal", "nats://127.0.0.1:4222/J"]),
            Err(ConfigError::DevStreamJournal)
        ));
    }

    #[test]
    fn an_exposed_admin_api_needs_a_token_or_an_explicit_override() {
        for addr in ["0.0.0.0:3129", "[::]:3129", "10.1.2.3:3129"] {
            assert!(
                matches!(
                    serve_config(&["--admin", addr]),
                    Err(ConfigError::AdminExposed(_))
                ),
                "{addr}"
            );
            let with_token =
                serve_config(&["--admin", addr, "--admin-token-file", "TOKEN_FILE"]).unwrap();
            assert_eq!(with_token.admin_token.as_deref(), Some("s3cret"));
            let insecure = serve_config(&["--admin", addr, "--admin-insecure"]).unwrap();
            assert!(insecure.admin_insecure && insecure.admin_token.is_none());
        }
        for addr in ["127.0.0.1:3129", "[::1]:3129", "off"] {
            assert!(serve_config(&["--admin", addr]).is_ok(), "{addr}");
        }
    }

    #[test]
    fn an_mcp_server_may_not_be_named_as_a_route() {
        let named =
            |name: &str| serve_config(&["--mcp-server", &format!("{name}=http://127.0.0.1:9/mcp")]);
        assert!(matches!(
            named("POST:pay"),
            Err(ConfigError::McpNamedAsRoute(_))
        ));
        assert!(named("notes").is_ok());
        assert!(named("my:notes").is_ok());
    }

    #[test]
    fn the_lease_lifetime_ceiling_is_off_unless_given() {
        let ceiling = |extra: &[&str]| serve_config(extra).unwrap().store.max_lease_lifetime;
        assert_eq!(ceiling(&[]), None);
        assert_eq!(ceiling(&["--max-lease-lifetime", "off"]), None);
        assert_eq!(
            ceiling(&["--max-lease-lifetime", "30d"]),
            Some(Duration::from_secs(30 * 86_400))
        );
        for bad in ["0s", "forever", "-1d"] {
            let parsed = cli::Cli::try_parse_from([
                "leasegate",
                "serve",
                "--journal",
                "j.jsonl",
                "--max-lease-lifetime",
                bad,
            ]);
            assert!(parsed.is_err(), "{bad}");
        }
    }

    #[test]
    fn the_journal_line_cap_defaults_above_the_largest_grant() {
        let config = serve_config(&[]).unwrap();
        assert_eq!(config.store.max_line, 32 << 20);
        let lowered = serve_config(&["--max-journal-line", "65536"]).unwrap();
        assert_eq!(lowered.store.max_line, 65536);
        assert_eq!(
            lowered.store.ledger(Keyring::new(false)).max_line(),
            65536,
            "the fold skips what the store skips"
        );
        let cli = cli::Cli::try_parse_from(["leasegate", "serve", "--max-journal-line", "100"]);
        assert!(cli.is_err(), "below 1024 bytes nothing real fits");
    }

    #[test]
    fn admin_hosts_are_names_or_addresses_without_a_port() {
        assert!(serve_config(&[]).unwrap().admin_hosts.is_empty());
        let config = serve_config(&[
            "--admin-host",
            "admin.corp",
            "--admin-host",
            "[fd00::1],10.0.0.1",
        ])
        .unwrap();
        assert_eq!(config.admin_hosts, ["admin.corp", "fd00::1", "10.0.0.1"]);
        for bad in ["admin.corp:3129", "*.corp", "", "a b", "user@host"] {
            assert!(
                matches!(
                    serve_config(&["--admin-host", bad]),
                    Err(ConfigError::AdminHost(_))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn connection_defaults_bound_a_slow_or_greedy_client() {
        let config = serve_config(&[]).unwrap();
        assert_eq!(config.proxy.header_read_timeout, Duration::from_secs(5));
        assert_eq!(config.proxy.max_connections_per_client, 256);
        assert_eq!(config.proxy.credentials, Credentials::Id);
        assert_eq!(
            ProxyConfig::default().header_read_timeout,
            Duration::from_secs(5)
        );
        assert_eq!(ProxyConfig::default().max_connections_per_client, 256);
        assert!(matches!(
            serve_config(&["--max-connections-per-client", "0"]),
            Err(ConfigError::PerClientLimit)
        ));
        let token = serve_config(&["--credentials", "token"]).unwrap();
        assert_eq!(token.proxy.credentials, Credentials::Token);
        assert_eq!(
            config.proxy.lease_port_credentials,
            LeasePortCredentials::None
        );
        let on_ports = serve_config(&["--lease-port-credentials", "token"]).unwrap();
        assert_eq!(
            on_ports.proxy.lease_port_credentials,
            LeasePortCredentials::Token
        );
    }

    #[test]
    fn port_lists_default_to_443_and_80_and_a_bad_one_says_why() {
        let config = serve_config(&[]).unwrap();
        assert_eq!(config.proxy.connect_ports, Ports::only(443));
        assert_eq!(config.proxy.forward_ports, Ports::only(80));
        assert_eq!(ProxyConfig::default().connect_ports, Ports::only(443));
        assert_eq!(ProxyConfig::default().forward_ports, Ports::only(80));
        let wide = serve_config(&[
            "--connect-ports",
            "443,8443,9000-9100",
            "--forward-ports",
            "80,8080",
        ])
        .unwrap();
        assert_eq!(wide.proxy.connect_ports.to_string(), "443,8443,9000-9100");
        assert_eq!(wide.proxy.forward_ports.to_string(), "80,8080");
        for (flag, bad, why) in [
            ("--connect-ports", "0", "not a port (1-65535)"),
            ("--connect-ports", "443,", "not a port (1-65535)"),
            ("--forward-ports", "http", "not a port (1-65535)"),
            (
                "--forward-ports",
                "9100-9000",
                "from its lower port to its higher one",
            ),
            ("--connect-ports", "", "no ports"),
        ] {
            let error = cli::Cli::try_parse_from([
                "leasegate",
                "serve",
                "--journal",
                "j.jsonl",
                "--key-file",
                "k.key",
                flag,
                bad,
            ])
            .unwrap_err()
            .to_string();
            assert!(
                error.contains(flag) && error.contains(why),
                "{bad:?}: {error}"
            );
        }
    }

    #[test]
    fn the_egress_log_defaults_beside_the_journal_or_under_the_data_dir() {
        let config = serve_config(&[]).unwrap();
        let JournalLocation::File(journal) = &config.journal else {
            unreachable!()
        };
        assert_eq!(
            config.egress,
            Some(Destination::File(journal.with_file_name("egress.jsonl")))
        );
        assert_eq!(serve_config(&["--egress-log", "off"]).unwrap().egress, None);
        assert_eq!(
            serve_config(&["--egress-log", "-"]).unwrap().egress,
            Some(Destination::Stdout)
        );
        let stream: JournalLocation = "nats://127.0.0.1:4222/J".parse().unwrap();
        let store = StoreOptions {
            data_dir: PathBuf::from("/var/lib/leasegate"),
            ..StoreOptions::default()
        };
        assert_eq!(
            default_egress_log(&stream, &store),
            PathBuf::from("/var/lib/leasegate/egress.jsonl")
        );
        let bare = JournalLocation::File(PathBuf::from("journal.jsonl"));
        assert_eq!(
            default_egress_log(&bare, &store),
            PathBuf::from("egress.jsonl")
        );
    }

    #[test]
    fn the_egress_stream_is_off_by_default_and_keeps_a_week() {
        assert!(serve_config(&[]).unwrap().egress_stream.is_none());
        let keyless = serve_config(&["--egress-stream", "nats://127.0.0.1:4222/EGRESS"]);
        let error = keyless.unwrap_err().to_string();
        assert!(
            error.starts_with("--egress-stream needs --egress-stream-key FILE")
                && error.contains("leasegate keygen --egress-stream"),
            "{error}"
        );
        let on = serve_config(&[
            "--egress-stream",
            "nats://127.0.0.1:4222,n2/EGRESS",
            "--egress-stream-key",
            "STREAM_KEY",
        ])
        .unwrap()
        .egress_stream
        .unwrap();
        assert_eq!(on.location.servers, ["127.0.0.1:4222", "n2:4222"]);
        assert_eq!(on.location.stream, "EGRESS");
        assert_eq!(on.max_age, Duration::from_secs(7 * 24 * 3600));
        assert_eq!(on.backlog, 10_000);
        assert_eq!(on.nats.replicas, 1);
        let tuned = serve_config(&[
            "--egress-stream",
            "nats://h:1/E",
            "--egress-max-age",
            "1h",
            "--egress-stream-backlog",
            "5",
            "--nats-replicas",
            "3",
            "--egress-stream-key",
            "STREAM_KEY",
        ])
        .unwrap()
        .egress_stream
        .unwrap();
        assert_eq!(
            (tuned.max_age, tuned.backlog, tuned.nats.replicas),
            (Duration::from_secs(3600), 5, 3)
        );
    }
}
