//! Command-line flags, as clap reads them. Every flag also reads a `LEASEGATE_*` variable.
//!
//! Invariant: raw arguments only; validation and loading happen in `config`.

use crate::registry::store::NatsLocation;
use crate::registry::JournalLocation;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "leasegate",
    version,
    about = "An egress HTTP proxy for AI agents, governed by signed leases"
)]
pub struct Cli {
    /// Log lines as text or JSON (filter with RUST_LOG, e.g. RUST_LOG=leasegate=debug).
    #[arg(
        long,
        global = true,
        env = "LEASEGATE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Write a new random key (mode 0600) and print its fingerprint.
    Keygen(KeygenArgs),
    /// Sign a lease for the given hosts and append its `granted` record (development issuer).
    Issue(IssueArgs),
    /// Append a signed `revoked` record for a lease.
    Revoke(RevokeArgs),
    /// Check a lease or a journal: schema, rules and (with a key) signatures.
    Verify(VerifyArgs),
    /// Print the folded status of every lease in a journal.
    Leases(LeasesArgs),
    /// Run the proxy.
    Serve(Box<ServeArgs>),
    /// Explain the verdict for a lease and a target, without network I/O (unless --resolve).
    Check(CheckArgs),
    /// Run an agent command pointed at its lease (proxy variables set, exit code passed through).
    Run(RunArgs),
    /// Print the proxy token of a lease (`<lease-id>.<tag>`, for `--credentials token`).
    Token(TokenArgs),
    /// Probe a running proxy's admin API (`/healthz`, or `/readyz`): exit 0 if it answers 200
    /// (a container HEALTHCHECK that needs no shell).
    Health(HealthArgs),
    /// Calls, refusals, bytes and top hosts per lease, from an egress stream (every replica)
    /// or an egress log file.
    Usage(UsageArgs),
    /// The smallest allow list covering the hosts each lease reached, from an egress log
    /// (e.g. one recorded with `serve --mode report`), as `--allow-host` flags or JSON.
    Suggest(SuggestArgs),
    /// Move a journal between a file and a NATS JetStream stream (import, export, mirror).
    Journal(JournalArgs),
    /// List the tool calls waiting for a human's approval on a running proxy (GET /approvals).
    Approvals(ApprovalsArgs),
    /// Approve a waiting call (POST /approvals/{id}): it goes on, on whichever replica holds it.
    Approve(DecideArgs),
    /// Deny a waiting call (POST /approvals/{id}): the agent is refused, with the reason.
    Deny(DecideArgs),
    /// The interception CA for hosts whose TLS the proxy ends (`ca init`).
    Ca(CaArgs),
    /// Print a shell completion script, e.g. `leasegate completions bash >
    /// ~/.local/share/bash-completion/completions/leasegate`.
    Completions(CompletionsArgs),
    /// Print this command line's reference, made from its own definitions (the generator of
    /// docs/reference/cli.md and docs/reference/man/).
    #[command(hide = true)]
    Reference(ReferenceArgs),
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell the script is for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ReferenceArgs {
    #[arg(value_enum)]
    pub format: ReferenceFormat,
    /// With `man`: write every page (`leasegate.1` and one per subcommand) into this
    /// directory instead of printing the top-level one.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReferenceFormat {
    /// Markdown (docs/reference/cli.md).
    Markdown,
    /// The man pages, roff (docs/reference/man/).
    Man,
}

#[derive(Debug, Args)]
pub struct UsageArgs {
    /// Where the egress lines are: `nats://HOST:PORT[,HOST:PORT...]/STREAM` (the
    /// `serve --egress-stream` of every replica) or an egress log file (JSON Lines).
    #[arg(long, env = "LEASEGATE_USAGE_FROM")]
    pub from: JournalLocation,
    /// Only this lease (`_` for lines without a lease).
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = parse_lease_filter)]
    pub lease: Option<String>,
    /// Only lines logged within this long before now, e.g. `1h`, `30m`, `7d`.
    #[arg(long, env = "LEASEGATE_SINCE", value_parser = parse_duration)]
    pub since: Option<std::time::Duration>,
    /// JSON Lines (one object per lease) instead of a table.
    #[arg(long, env = "LEASEGATE_JSON")]
    pub json: bool,
    /// The replicas' --egress-stream-key: only lines sealed with it count. Required with a
    /// `nats://` --from.
    #[arg(long, env = "LEASEGATE_EGRESS_STREAM_KEY")]
    pub egress_stream_key: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// `table` (the default), `json` (as --json), or `record`: the lease record's `usage`
    /// object for --lease (with --subtree, summed over it and its descendants).
    #[arg(
        long,
        env = "LEASEGATE_USAGE_FORMAT",
        value_enum,
        conflicts_with = "json",
        requires_if("record", "lease")
    )]
    pub format: Option<UsageFormat>,
    /// The lease given by --lease and every lease below it in the journal (needs --journal).
    #[arg(long, env = "LEASEGATE_SUBTREE", requires_all = ["lease", "journal"])]
    pub subtree: bool,
    /// The journal --subtree reads the parent links from.
    #[command(flatten)]
    pub lease_journal: LeaseJournalArgs,
}

/// A lease journal a command that reads egress lines may consult (`suggest --agent`, `usage
/// --subtree`), with the keys its leases are signed with: signatures are checked.
#[derive(Debug, Args)]
pub struct LeaseJournalArgs {
    /// The lease journal: a file or `nats://HOST:PORT[,...]/STREAM`.
    #[arg(long, env = "LEASEGATE_JOURNAL", requires = "key_files")]
    pub journal: Option<JournalLocation>,
    /// Keys the journal's leases are signed with (repeatable).
    #[arg(
        long = "key-file",
        env = "LEASEGATE_KEY_FILE",
        value_delimiter = ',',
        requires = "journal"
    )]
    pub key_files: Vec<PathBuf>,
    /// Accept leases signed with the published test key.
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
}

impl LeaseJournalArgs {
    /// What [`crate::commands::load_ledger`] takes, when a journal was given.
    pub fn ledger(&self, store: &StoreArgs) -> Option<LedgerArgs> {
        Some(LedgerArgs {
            journal: self.journal.clone()?,
            store: store.clone(),
            key_files: self.key_files.clone(),
            allow_test_key: self.allow_test_key,
            require_record_signatures: false,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageFormat {
    Table,
    Json,
    Record,
}

#[derive(Debug, Args)]
pub struct SuggestArgs {
    /// The egress log (JSON Lines), or `-` for stdin.
    #[arg(long, env = "LEASEGATE_SUGGEST_FROM")]
    pub from: PathBuf,
    /// Only this lease.
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = crate::contract::lease::lease_id_any_case)]
    pub lease: Option<String>,
    /// One list for every lease whose manifest names this agent (`agent.name`, signed), read
    /// from the journal: needs --journal and --key-file.
    #[arg(
        long,
        env = "LEASEGATE_AGENT",
        requires = "journal",
        conflicts_with = "label"
    )]
    pub agent: Option<String>,
    /// One list for every line whose client sent this label (the user part of the proxy
    /// credentials, e.g. `agent` in `http://agent:<lease>@proxy`): any lease may send any
    /// label, so the leases that contributed are named, and with --journal a label spanning
    /// leases of different manifest agents is warned about.
    #[arg(long, env = "LEASEGATE_LABEL")]
    pub label: Option<String>,
    /// The journal the manifest agent of each lease is read from (--agent; --label warns
    /// from it).
    #[command(flatten)]
    pub lease_journal: LeaseJournalArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Only lines logged within this long before now, e.g. `1h`, `30m`, `7d`.
    #[arg(long, env = "LEASEGATE_SINCE", value_parser = parse_duration)]
    pub since: Option<std::time::Duration>,
    /// Write `*.domain` once this many sibling names under `domain` were reached (never for
    /// a public suffix such as `co.uk`); without it every host stays exact.
    #[arg(long, env = "LEASEGATE_COLLAPSE", value_parser = clap::value_parser!(u32).range(2..))]
    pub collapse: Option<u32>,
    /// `flags`: `--allow-host` flags after commented call counts; `json`: one line per
    /// lease with a manifest `allow` fragment.
    #[arg(long, env = "LEASEGATE_FORMAT", value_enum, default_value = "flags")]
    pub format: SuggestFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SuggestFormat {
    Flags,
    Json,
}

#[derive(Debug, Args)]
pub struct CaArgs {
    #[command(subcommand)]
    pub command: CaCommand,
}

#[derive(Debug, Subcommand)]
pub enum CaCommand {
    /// Write a new CA (`ca.pem`, and `ca-key.pem` mode 0600) name-constrained to the given
    /// host patterns and to no IP address, and print its SHA-256 fingerprint.
    Init(CaInitArgs),
}

#[derive(Debug, Args)]
pub struct CaInitArgs {
    /// The directory to write `ca.pem` and `ca-key.pem` into (made mode 0700 if missing).
    #[arg(long, env = "LEASEGATE_CA_DIR")]
    pub dir: PathBuf,
    /// A host pattern the CA may vouch for: `*.example.com` or an exact name (a name also
    /// covers its subdomains); never `*` or an IP address.
    #[arg(
        long = "host",
        env = "LEASEGATE_CA_HOST",
        value_delimiter = ',',
        required = true
    )]
    pub hosts: Vec<String>,
    /// How long the CA certificate is valid, e.g. `365d`, `90d`.
    #[arg(long, env = "LEASEGATE_CA_VALIDITY", default_value = "365d", value_parser = parse_duration)]
    pub validity: std::time::Duration,
    /// Replace an existing `ca.pem` / `ca-key.pem` (no variable: an inherited environment
    /// never replaces a CA key unasked).
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct JournalArgs {
    #[command(subcommand)]
    pub command: JournalCommand,
}

#[derive(Debug, Subcommand)]
pub enum JournalCommand {
    /// Publish each line of a journal file the stream lacks, in file order (running it again
    /// adds nothing).
    Import(ImportArgs),
    /// Write every message of a stream as JSON Lines, in stream order.
    Export(ExportArgs),
    /// Follow a journal file an issuer appends to and publish each new line once, until
    /// SIGINT or SIGTERM (a restart publishes nothing twice).
    Mirror(MirrorArgs),
    /// Write a smaller journal that folds the same for every lease open or closed within the
    /// retention; the old file is kept as `<journal>.<timestamp>`, and a running `serve`
    /// follows the swap without folding anything again.
    Compact(CompactArgs),
}

#[derive(Debug, Args)]
pub struct CompactArgs {
    /// The journal, and the keys its leases are signed with (unsigned closing records are
    /// kept whatever --require-record-signatures says: a fold that requires signatures skips
    /// them as it did before).
    #[command(flatten)]
    pub ledger: LedgerArgs,
    /// Keep a lease until this long after both its expiry and its last closing record, e.g.
    /// `24h`, `7d`.
    #[arg(long, env = "LEASEGATE_COMPACT_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub retention: std::time::Duration,
    /// A stream journal only: once the snapshot is published and reads back verified, remove
    /// the journal's messages it covers and the older snapshots (the role needs the purge
    /// permission on the journal stream).
    #[arg(long, env = "LEASEGATE_COMPACT_PURGE")]
    pub purge: bool,
}

/// The keys a purged stream's snapshot may be vouched for by: a bridge or export reads a
/// stream that `journal compact --purge` trimmed from its snapshot, and uses that only if its
/// marker verifies under one of them.
#[derive(Debug, Args)]
pub struct SnapshotKeyArgs {
    /// Keys a snapshot's marker may be made under (repeatable); needed only once the stream is
    /// purged.
    #[arg(long = "key-file", env = "LEASEGATE_KEY_FILE", value_delimiter = ',')]
    pub key_files: Vec<PathBuf>,
    /// Accept a snapshot made under the published test key.
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
}

#[derive(Debug, Args)]
pub struct ImportArgs {
    /// The journal file (JSON Lines).
    pub file: PathBuf,
    /// The stream: `nats://HOST:PORT[,HOST:PORT...]/STREAM` (created if missing).
    #[arg(long, env = "LEASEGATE_JOURNAL_STREAM")]
    pub to: NatsLocation,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub keys: SnapshotKeyArgs,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The stream: `nats://HOST:PORT[,HOST:PORT...]/STREAM`.
    pub stream: NatsLocation,
    /// Write here (atomically: a temp file renamed into place) instead of stdout.
    #[arg(long, env = "LEASEGATE_OUT")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub keys: SnapshotKeyArgs,
}

#[derive(Debug, Args)]
pub struct MirrorArgs {
    /// The journal file to follow (it may not exist yet).
    pub file: PathBuf,
    /// The stream: `nats://HOST:PORT[,HOST:PORT...]/STREAM` (created if missing).
    #[arg(long, env = "LEASEGATE_JOURNAL_STREAM")]
    pub to: NatsLocation,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub keys: SnapshotKeyArgs,
}

#[derive(Debug, Args)]
pub struct HealthArgs {
    /// The admin API `serve` listens on, as `http://HOST:PORT` or `HOST:PORT` (0.0.0.0 is
    /// probed on loopback).
    #[arg(long, env = "LEASEGATE_ADMIN", default_value = "127.0.0.1:3129", value_parser = admin_address)]
    pub admin: String,
    /// Ask `/readyz` (journal followed, listeners bound) instead of `/healthz` (alive).
    #[arg(long)]
    pub ready: bool,
    /// The admin token (`/readyz` needs it when `serve` has one): the same file and variable
    /// `serve` reads.
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct TokenArgs {
    /// The lease.
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = crate::contract::lease::lease_id_any_case)]
    pub lease: String,
    /// The key the lease is signed with.
    #[arg(long, env = "LEASEGATE_KEY_FILE")]
    pub key_file: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CredentialsArg {
    /// The lease id alone is the credential.
    Id,
    /// `<lease-id>.<tag>` (see `leasegate token`); a bare lease id is refused.
    Token,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeasePortCredentialsArg {
    /// The port is the credential: whatever reaches it spends its lease.
    None,
    /// The lease's token (`<lease-id>.<tag>`) is required on its port too.
    Token,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lease the agent runs under.
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = crate::contract::lease::lease_id_any_case)]
    pub lease: String,
    /// The proxy (scheme, host, port) to use with the lease's credential; a lease with a port
    /// of its own is reached on this host. Default: the admin URL's host, with the port the
    /// admin API names.
    #[arg(long, env = "LEASEGATE_PROXY")]
    pub proxy: Option<String>,
    /// The lease's own proxy token (`<lease-id>.<tag>`: `leasegate token` mints it, the
    /// issuer's answer carries it): the child's proxy credential, and what asks the admin API
    /// for this lease's view and placeholders (it opens nothing else there). Sent only over
    /// https:// or to a loopback address.
    #[arg(long, env = "LEASEGATE_LEASE_TOKEN_FILE")]
    pub lease_token_file: Option<PathBuf>,
    /// Refused: the agent could read the signing key (use --lease-token-file).
    #[arg(long, hide = true)]
    pub key_file: Option<PathBuf>,
    /// Refused: the agent could read the admin token (use --lease-token-file).
    #[arg(long, hide = true)]
    pub admin_token_file: Option<PathBuf>,
    /// The admin API of the running proxy: http://HOST:PORT, https://…, or HOST:PORT (as
    /// `serve --admin` takes it, meaning http://). Without --proxy, the proxy is reached on
    /// this URL's host.
    #[arg(
        long,
        env = "LEASEGATE_ADMIN_URL",
        default_value = "http://127.0.0.1:3129",
        value_parser = admin_url
    )]
    pub admin: String,
    /// CA certificates (PEM) an https:// admin API's certificate must chain to (default: the
    /// public roots).
    #[arg(long, env = "LEASEGATE_ADMIN_CA")]
    pub admin_ca: Option<PathBuf>,
    /// How long to wait for the lease to be served (a grant the proxy has not read yet, a
    /// proxy still starting) before giving up without starting the command.
    #[arg(long, env = "LEASEGATE_RUN_WAIT", default_value = "10s", value_parser = parse_duration)]
    pub wait: std::time::Duration,
    /// When the command exits, end the lease: exit code 0 completes it (a `completed` record
    /// with the usage the proxy measured), any other code or a signal stops it.
    #[arg(long, env = "LEASEGATE_COMPLETE_ON_EXIT")]
    pub complete_on_exit: bool,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnRefusalArg {
    Revoke,
    Log,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    Enforce,
    Report,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Where the proxy listens: ADDR:PORT or NAME:PORT (a name is resolved at start).
    #[arg(long, env = "LEASEGATE_LISTEN", default_value = "127.0.0.1:3128", value_parser = parse_listen)]
    pub listen: ListenAddr,
    /// The lease journal: a file, or a NATS JetStream stream
    /// (`nats://HOST:PORT[,HOST:PORT...]/STREAM`). Required unless --dev.
    #[arg(long, env = "LEASEGATE_JOURNAL", required_unless_present = "dev")]
    pub journal: Option<JournalLocation>,
    /// Create a missing journal file's directory too (the file itself is always created).
    #[arg(long, env = "LEASEGATE_CREATE_JOURNAL")]
    pub create_journal: bool,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Keys leases are signed with (repeatable, for rotation).
    #[arg(long = "key-file", env = "LEASEGATE_KEY_FILE", value_delimiter = ',')]
    pub key_files: Vec<PathBuf>,
    /// Egress log destination: a file, `-` for stdout, or `off` [default: egress.jsonl beside
    /// a file journal, or under --data-dir for a stream journal].
    #[arg(long, env = "LEASEGATE_EGRESS_LOG")]
    pub egress_log: Option<String>,
    /// Also publish every egress line to this NATS JetStream stream
    /// (`nats://HOST:PORT[,HOST:PORT...]/STREAM`, created if missing; subjects
    /// `leasegate.egress.<lease_id>`), for `leasegate usage` across replicas.
    #[arg(long, env = "LEASEGATE_EGRESS_STREAM")]
    pub egress_stream: Option<NatsLocation>,
    /// How long a stream created by --egress-stream keeps a line.
    #[arg(long, env = "LEASEGATE_EGRESS_MAX_AGE", default_value = "7d", value_parser = parse_duration)]
    pub egress_max_age: std::time::Duration,
    /// Egress lines kept while NATS is unreachable; beyond, lines are dropped and counted
    /// (leasegate_egress_stream_dropped_total). Requests never wait on the stream.
    #[arg(long, env = "LEASEGATE_EGRESS_STREAM_BACKLOG", default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub egress_stream_backlog: u32,
    /// The key every --egress-stream message is sealed with, the same file on every replica
    /// and for `usage`: mode 0600, one line of at least 32 random bytes as hex or base64
    /// (`leasegate keygen --egress-stream --out FILE`). Required with --egress-stream
    /// [default under --dev: .leasegate/egress-stream.key, made when missing].
    #[arg(long, env = "LEASEGATE_EGRESS_STREAM_KEY")]
    pub egress_stream_key: Option<PathBuf>,
    /// What a revoking refusal does: revoke the lease, or only log [default: revoke; log
    /// under --dev].
    #[arg(long, env = "LEASEGATE_ON_REFUSAL", value_enum)]
    pub on_refusal: Option<OnRefusalArg>,
    /// Accept leases signed with the published test key (conformance runs only).
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
    /// Skip closing records (revoked, stopped, completed, expired) that carry no signature
    /// (a present signature is always checked under the lease's key).
    #[arg(long, env = "LEASEGATE_REQUIRE_RECORD_SIGNATURES")]
    pub require_record_signatures: bool,
    /// Development mode: key, journal and egress log under ./.leasegate/, a demo lease (the open
    /// one reused), the export line; refusals are logged, not revoking, unless --on-refusal.
    #[arg(long, env = "LEASEGATE_DEV")]
    pub dev: bool,
    /// Hosts of the --dev demo lease (default `*`).
    #[arg(
        long = "allow-host",
        env = "LEASEGATE_ALLOW_HOST",
        value_delimiter = ','
    )]
    pub allow_hosts: Vec<String>,
    /// Let the --dev demo lease have an --allow-host wildcard over a public suffix (`*.com`),
    /// with a warning; refused without it. On the command line only.
    #[arg(long)]
    pub force: bool,
    /// Time a client has to send a request head: the first, and the next on an idle
    /// keep-alive connection.
    #[arg(long, env = "LEASEGATE_HEADER_READ_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub header_read_timeout: std::time::Duration,
    /// Largest request head accepted, in bytes.
    #[arg(long, env = "LEASEGATE_MAX_HEADER_BYTES", default_value_t = 65536)]
    pub max_header_bytes: usize,
    /// Close a CONNECT tunnel (`tls-unverifiable`) unless its first bytes are a TLS
    /// ClientHello whose SNI the lease may reach (no plain-text or SNI-less tunnels).
    #[arg(long, env = "LEASEGATE_REQUIRE_SNI")]
    pub require_sni: bool,
    /// Admin API address, `HOST:PORT` or `http://HOST:PORT` (`off` to disable).
    #[arg(long, env = "LEASEGATE_ADMIN", default_value = "127.0.0.1:3129", value_parser = admin_address)]
    pub admin: String,
    /// A name the admin API also answers to in `Host` (repeatable), beyond `localhost` and
    /// its own address (any IP address for a wildcard bind), e.g. the name a reverse proxy or
    /// a Service gives it.
    #[arg(
        long = "admin-host",
        env = "LEASEGATE_ADMIN_HOST",
        value_delimiter = ','
    )]
    pub admin_hosts: Vec<String>,
    /// Give every lease its own port from this range for its whole life, e.g. 40000-40999
    /// (the assignments are kept in `<data-dir>/lease-ports`).
    #[arg(long, env = "LEASEGATE_LEASE_PORTS", value_parser = parse_port_range)]
    pub lease_ports: Option<std::ops::RangeInclusive<u16>>,
    /// Address the per-lease ports bind: only where the agents are (anything that reaches a
    /// lease port spends its lease).
    #[arg(long, env = "LEASEGATE_LEASE_PORT_BIND", default_value = "127.0.0.1")]
    pub lease_port_bind: std::net::IpAddr,
    /// What a connection on a lease's own port must carry: nothing, or the lease's token (for
    /// hosts where other processes can reach the ports).
    #[arg(
        long,
        env = "LEASEGATE_LEASE_PORT_CREDENTIALS",
        value_enum,
        default_value = "none"
    )]
    pub lease_port_credentials: LeasePortCredentialsArg,
    /// Close a tunnel after this long without a byte either way.
    #[arg(long, env = "LEASEGATE_TUNNEL_IDLE_TIMEOUT", default_value = "1h", value_parser = parse_duration)]
    pub tunnel_idle_timeout: std::time::Duration,
    /// Connection workers: threads with an event loop each, on which a client connection
    /// lives from accept to close (0: one per core). The journal, the admin API and lease
    /// ports' bookkeeping run on two threads of their own. Benchmarks pin the proxy to N
    /// cores and give it N workers.
    #[arg(long, env = "LEASEGATE_WORKER_THREADS", default_value_t = 0)]
    pub worker_threads: usize,
    /// Client connections open at once, in total (beyond: 429 too-many-connections). Each
    /// needs 7 file descriptors: a number the descriptor limit cannot hold stops the start
    /// [default: 10000, or as many as the limit holds].
    #[arg(long, env = "LEASEGATE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Client connections open at once from one source IP address that are not yet tied to
    /// a lease (beyond: 429); an identified connection counts against its lease's limit only.
    #[arg(
        long,
        env = "LEASEGATE_MAX_CONNECTIONS_PER_CLIENT",
        default_value_t = 256
    )]
    pub max_connections_per_client: usize,
    /// What a credential on the shared listener must be: the lease id, or its token.
    #[arg(long, env = "LEASEGATE_CREDENTIALS", value_enum, default_value = "id")]
    pub credentials: CredentialsArg,
    /// Client connections open at once per lease.
    #[arg(
        long,
        env = "LEASEGATE_MAX_CONNECTIONS_PER_LEASE",
        default_value_t = 1_000
    )]
    pub max_connections_per_lease: usize,
    /// How long the metric series of a closed lease stay on /metrics.
    #[arg(long, env = "LEASEGATE_METRICS_GRACE", default_value = "5m", value_parser = parse_duration)]
    pub metrics_grace: std::time::Duration,
    /// How long a closed or expired lease is kept whole after it closed; then only its id,
    /// parent and closing are kept (a request naming it, or a descendant, is still refused with
    /// the right code; the admin API no longer lists it).
    #[arg(long, env = "LEASEGATE_CLOSED_LEASE_RETENTION", default_value = "24h", value_parser = parse_duration)]
    pub closed_lease_retention: std::time::Duration,
    /// Leases /metrics shows by name, the busiest by calls; the others are summed under
    /// `lease_id="other"` (every total is kept).
    #[arg(long, env = "LEASEGATE_METRICS_MAX_LEASES", default_value_t = crate::telemetry::metrics::MAX_LEASES)]
    pub metrics_max_leases: usize,
    /// On SIGTERM/SIGINT, how long requests and tunnels may finish before they are closed.
    #[arg(long, env = "LEASEGATE_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: std::time::Duration,
    /// Serve the proxy over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "LEASEGATE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The TLS listener's private key (PEM).
    #[arg(long, env = "LEASEGATE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The secrets file (TOML; docs/reference/secrets.md): read at start and on SIGHUP, with
    /// every value it names; a bad file stops the start. Tunnels to its hosts are terminated
    /// under the CA in --ca-dir and the secrets put in for entitled leases.
    #[arg(long, env = "LEASEGATE_SECRETS", requires = "ca_dir")]
    pub secrets: Option<PathBuf>,
    /// The interception CA's directory (`ca.pem`, `ca-key.pem`, made by `leasegate ca init`):
    /// its name constraints must cover every host of every secret.
    #[arg(long, env = "LEASEGATE_CA_DIR", requires = "secrets")]
    pub ca_dir: Option<PathBuf>,
    /// Trust anchors (PEM) for the TLS to terminated hosts' origins, in place of the system's
    /// roots: for private origins and tests.
    #[arg(long, env = "LEASEGATE_UPSTREAM_CA", requires = "secrets")]
    pub upstream_ca: Option<PathBuf>,
    /// The price table (TOML) that turns metered model calls' tokens into `cost_usd`: model
    /// names or `prefix*` patterns, prices per million input, output and cached tokens. A
    /// model it does not name is reported unpriced, never priced at zero.
    #[arg(long, env = "LEASEGATE_PRICES", requires = "secrets")]
    pub prices: Option<PathBuf>,
    /// The output tokens a metered model call whose request names no cap (`max_tokens`,
    /// `max_completion_tokens`, `max_output_tokens`) may spend: with its request's size as
    /// its input, the bound it reserves against budgets while in flight and is charged when
    /// its usage cannot be read.
    #[arg(long, env = "LEASEGATE_MODEL_OUTPUT_BOUND", default_value_t = 32_768)]
    pub model_output_bound: u64,
    /// Largest metered model call's request body read, in bytes (the proxy reads it whole to
    /// bound the call); a larger one is refused `body-too-large`.
    #[arg(long, env = "LEASEGATE_MAX_MODEL_REQUEST_BYTES", default_value_t = 16 << 20)]
    pub max_model_request_bytes: usize,
    /// An MCP server whose requests are read at the edge, as NAME=URL (repeat, or separate
    /// with commas): every request to the URL's origin is read, its `tools/call`s judged
    /// against the lease's `allow.tools` and `approvals` (`NAME/<tool>`) and its tool lists
    /// cut to what the lease may call. An https server is terminated, so it needs --secrets
    /// and --ca-dir whose CA covers its host.
    #[arg(
        long = "mcp-server",
        env = "LEASEGATE_MCP_SERVERS",
        value_delimiter = ',',
        value_name = "NAME=URL"
    )]
    pub mcp_servers: Vec<String>,
    /// How long a tool call that a lease's `approvals` names waits for a human (GET
    /// /approvals, `leasegate approve|deny`) before it is refused `approval-timed-out`; at
    /// most 1h. Keep it under the client's read timeout (the MCP SDK waits 5 minutes).
    #[arg(long, env = "LEASEGATE_APPROVAL_TIMEOUT", default_value = "2m", value_parser = parse_duration)]
    pub approval_timeout: std::time::Duration,
    /// An http:// or https:// URL each call waiting for approval is POSTed to as JSON
    /// (`{"event": "approval.requested", "approval": {...}}`), best effort.
    #[arg(long, env = "LEASEGATE_APPROVAL_WEBHOOK", value_name = "URL")]
    pub approval_webhook: Option<String>,
    /// A file holding the bearer token every admin route but /healthz requires.
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// Let --admin bind beyond loopback without --admin-token-file (warned at every start).
    #[arg(long, env = "LEASEGATE_ADMIN_INSECURE")]
    pub admin_insecure: bool,
    /// Leases one caller (the operator, or one lease issuing its children) may issue a
    /// second through `POST /leases`; more are answered 429.
    #[arg(long, env = "LEASEGATE_MAX_ISSUE_RATE", default_value_t = crate::admin::DEFAULT_ISSUE_RATE)]
    pub max_issue_rate: std::num::NonZeroU32,
    /// The most `budget.depth` a root lease issued through `POST /leases` gets (generations of
    /// children beneath it); a root that asks for none gets this.
    #[arg(long, env = "LEASEGATE_ISSUE_MAX_DEPTH", default_value_t = 4, value_parser = clap::value_parser!(u64).range(0..=16))]
    pub issue_max_depth: u64,
    /// The most `budget.fan_out` a root lease issued through `POST /leases` gets (children
    /// live at once); a root that asks for none gets this.
    #[arg(long, env = "LEASEGATE_ISSUE_MAX_FAN_OUT", default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=256))]
    pub issue_max_fan_out: u64,
    /// Time allowed for one upstream connect.
    #[arg(long, env = "LEASEGATE_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: std::time::Duration,
    /// Time a forwarded request's upstream has to send its response head (then 504).
    #[arg(long, env = "LEASEGATE_UPSTREAM_RESPONSE_TIMEOUT", default_value = "60s", value_parser = parse_duration)]
    pub upstream_response_timeout: std::time::Duration,
}

/// The flags that shape a decision, shared by `serve` and `check` so both decide alike.
#[derive(Debug, Args)]
pub struct PolicyArgs {
    /// An address range exempt from the address guard (repeatable), e.g. 10.20.0.0/16.
    #[arg(
        long = "allow-private",
        env = "LEASEGATE_ALLOW_PRIVATE",
        value_delimiter = ','
    )]
    pub allow_private: Vec<ipnet::IpNet>,
    /// `report` lets policy refusals through and logs them (for rolling out allow lists).
    #[arg(long, env = "LEASEGATE_MODE", value_enum, default_value = "enforce")]
    pub mode: ModeArg,
    /// Fixed name resolution, NAME=ADDR (repeatable; other names use the system resolver).
    #[arg(long = "resolve", env = "LEASEGATE_RESOLVE", value_delimiter = ',')]
    pub resolve: Vec<String>,
    /// Time allowed for one name resolution.
    #[arg(long, env = "LEASEGATE_DNS_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub dns_timeout: std::time::Duration,
    /// Ports a CONNECT tunnel may reach, e.g. `443,8443,9000-9100` (others:
    /// port-not-allowed, in every mode).
    #[arg(long, env = "LEASEGATE_CONNECT_PORTS", default_value = "443")]
    pub connect_ports: crate::policy::Ports,
    /// Ports a forwarded request (or WebSocket upgrade) may reach, e.g. `80,8080`.
    #[arg(long, env = "LEASEGATE_FORWARD_PORTS", default_value = "80")]
    pub forward_ports: crate::policy::Ports,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The lease journal: a file (JSON Lines) or `nats://HOST:PORT[,...]/STREAM` (not with
    /// --admin).
    #[arg(long, env = "LEASEGATE_JOURNAL", required_unless_present = "admin")]
    pub journal: Option<JournalLocation>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Keys the leases are signed with (repeatable; not with --admin).
    #[arg(
        long = "key-file",
        env = "LEASEGATE_KEY_FILE",
        value_delimiter = ',',
        required_unless_present = "admin"
    )]
    pub key_files: Vec<PathBuf>,
    /// Accept leases signed with the published test key.
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
    /// Skip closing records (revoked, stopped, completed, expired) that carry no signature
    /// (a present signature is always checked under the lease's key).
    #[arg(long, env = "LEASEGATE_REQUIRE_RECORD_SIGNATURES")]
    pub require_record_signatures: bool,
    /// Ask the running proxy instead (`GET /check`): its own ports, policy flags, resolver and
    /// state decide, so the answer is the proxy's (the policy flags here are not used).
    /// http://HOST:PORT, https://…, or HOST:PORT.
    #[arg(long, env = "LEASEGATE_CHECK_ADMIN", value_parser = admin_url, conflicts_with_all = ["journal", "key_files", "resolve_names"])]
    pub admin: Option<String>,
    /// With --admin: a file holding the admin token.
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE", requires = "admin")]
    pub admin_token_file: Option<PathBuf>,
    /// The lease to check.
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = crate::contract::lease::lease_id_any_case)]
    pub lease: String,
    /// Also resolve a host name (IP literals are always guarded).
    #[arg(long = "resolve-names")]
    pub resolve_names: bool,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// HOST, HOST:PORT (port 443 if absent) or a URL (`https://api.github.com/x`: its host,
    /// and its port or its scheme's: 80 for http, 443 for https).
    pub target: String,
}

#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// Where to write the key (default: print the key file to stdout).
    #[arg(long, env = "LEASEGATE_OUT")]
    pub out: Option<PathBuf>,
    /// A key for --egress-stream-key (32 random bytes, hex) instead of a lease signing key.
    #[arg(long)]
    pub egress_stream: bool,
}

#[derive(Debug, Args)]
pub struct IssueArgs {
    /// The lease journal (JSON Lines) to append to (not with --admin).
    #[arg(
        long,
        env = "LEASEGATE_JOURNAL",
        required_unless_present = "admin",
        conflicts_with = "admin"
    )]
    pub journal: Option<PathBuf>,
    /// The signing key (not with --admin: the proxy signs with its own).
    #[arg(
        long,
        env = "LEASEGATE_KEY_FILE",
        required_unless_present = "admin",
        conflicts_with = "admin"
    )]
    pub key_file: Option<PathBuf>,
    /// Issue through a running proxy's admin API (`POST /leases`, e.g. http://127.0.0.1:3129)
    /// instead of appending to a journal file: the lease is served once this prints, and a
    /// child is clamped to what its parent has left as the proxy measured it.
    #[arg(long, env = "LEASEGATE_ISSUE_ADMIN", value_parser = admin_url)]
    pub admin: Option<String>,
    /// With --admin: a file holding the admin token (`serve --dev` writes
    /// `.leasegate/admin-token`).
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE", requires = "admin")]
    pub admin_token_file: Option<PathBuf>,
    /// With --admin: the `Idempotency-Key` of the request, so that running the same command
    /// again returns the same lease instead of a second one.
    #[arg(long, requires = "admin")]
    pub idempotency_key: Option<String>,
    /// A declared manifest (JSON) to start from: members left out take the contract's empty
    /// values, and the flags below add to its lists and set its budget.
    #[arg(long, env = "LEASEGATE_MANIFEST")]
    pub manifest: Option<PathBuf>,
    /// A host the lease may reach: `*`, `*.example.com` or an exact name or IPv4 address.
    #[arg(
        long = "allow-host",
        env = "LEASEGATE_ALLOW_HOST",
        value_delimiter = ',',
        required_unless_present = "manifest"
    )]
    pub allow_hosts: Vec<String>,
    /// A host the lease must not reach (beats any allow).
    #[arg(long = "deny-host", env = "LEASEGATE_DENY_HOST", value_delimiter = ',')]
    pub deny_hosts: Vec<String>,
    /// A governed tool the lease may call (`allow.tools`; `<server>/<tool>` for an MCP tool).
    #[arg(long = "tool", value_delimiter = ',')]
    pub tools: Vec<String>,
    /// An action that needs a human first (`approvals`).
    #[arg(long = "approval", value_delimiter = ',')]
    pub approvals: Vec<String>,
    /// `budget.tokens`: model tokens, input plus output, for the lease and its children.
    #[arg(long)]
    pub tokens: Option<u64>,
    /// `budget.cost_usd`: model spend in US dollars (needs `serve --prices` to be counted).
    #[arg(long)]
    pub cost_usd: Option<f64>,
    /// `budget.steps`: tool calls or turns.
    #[arg(long)]
    pub steps: Option<u64>,
    /// `budget.depth`: generations of children that may be issued beneath the lease.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=16))]
    pub depth: Option<u64>,
    /// `budget.fan_out`: children that may be live under the lease at once.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=256))]
    pub fan_out: Option<u64>,
    /// Sign an --allow-host wildcard over a public suffix (`*.com`, `*.co.uk`, `*.github.io`:
    /// every name anyone may register there), with a warning; refused without it. On the
    /// command line only: no variable turns it on. Not with --admin (the API refuses them).
    #[arg(long, conflicts_with = "admin")]
    pub force: bool,
    /// Parent lease id: the new lease is narrowed to the parent's (hosts and tools within
    /// its, its denials and approvals kept, its budget and end at most the parent's).
    #[arg(long, env = "LEASEGATE_PARENT", value_parser = crate::contract::lease::lease_id_any_case)]
    pub parent: Option<String>,
    /// Lifetime, e.g. `15m`, `1h`, `2s`.
    #[arg(long, env = "LEASEGATE_TTL", default_value = "1h", value_parser = parse_duration)]
    pub ttl: std::time::Duration,
    /// Agent name shown in tables and logs (the manifest's agent.name; default `agent`).
    #[arg(long, env = "LEASEGATE_NAME")]
    pub name: Option<String>,
    /// Why the agent runs (the manifest's intent.purpose; default `development lease issued
    /// by leasegate`).
    #[arg(long, env = "LEASEGATE_PURPOSE")]
    pub purpose: Option<String>,
    /// What to print on stdout: `all` (the lease id, its proxy token, its expiry: one per
    /// line), or one value alone for `$(...)` in scripts: `id` or `token`.
    #[arg(long, env = "LEASEGATE_PRINT", value_enum, default_value_t = IssuePrint::All)]
    pub print: IssuePrint,
}

/// What `issue` prints on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IssuePrint {
    /// The lease id, its proxy token and `expires_at <time>`, one per line.
    All,
    /// The lease id alone.
    Id,
    /// The proxy token (`<lease-id>.<tag>`, for `--credentials token`) alone.
    Token,
}

/// Where the admin API is and the token that decides.
#[derive(Debug, Args)]
pub struct AdminApiArgs {
    /// The admin API of the running proxy: http://HOST:PORT, https://…, or HOST:PORT
    /// (meaning http://).
    #[arg(
        long,
        env = "LEASEGATE_ADMIN_URL",
        default_value = "http://127.0.0.1:3129",
        value_parser = admin_url
    )]
    pub admin: String,
    /// A file holding the admin token (deciding needs it).
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ApprovalsArgs {
    #[command(flatten)]
    pub api: AdminApiArgs,
    /// Decided ones too (the newest first), not only those waiting.
    #[arg(long)]
    pub all: bool,
    /// Print the admin API's JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DecideArgs {
    #[command(flatten)]
    pub api: AdminApiArgs,
    /// The approval (`apr-…`, from `leasegate approvals`).
    pub id: String,
    /// Why; the agent is told it (a denial needs one).
    #[arg(long)]
    pub reason: Option<String>,
    /// Approve this tool for the rest of the lease: its later calls go on without asking.
    #[arg(long)]
    pub for_lease: bool,
}

#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// The journal to append the record to (not with --admin).
    #[arg(
        long,
        env = "LEASEGATE_JOURNAL",
        required_unless_present = "admin",
        conflicts_with = "admin"
    )]
    pub journal: Option<PathBuf>,
    /// The key the revocation is signed with (the lease's own key; not with --admin).
    #[arg(
        long,
        env = "LEASEGATE_KEY_FILE",
        required_unless_present = "admin",
        conflicts_with = "admin"
    )]
    pub key_file: Option<PathBuf>,
    /// Revoke through a running proxy's admin API (`POST /leases/{id}/revoke`): the lease is
    /// closed on every replica and its tunnels torn down before this prints, so a `run` right
    /// after it refuses.
    #[arg(long, env = "LEASEGATE_REVOKE_ADMIN", value_parser = admin_url)]
    pub admin: Option<String>,
    /// With --admin: a file holding the admin token.
    #[arg(long, env = "LEASEGATE_ADMIN_TOKEN_FILE", requires = "admin")]
    pub admin_token_file: Option<PathBuf>,
    /// The lease to revoke.
    #[arg(long, env = "LEASEGATE_LEASE", value_parser = crate::contract::lease::lease_id_any_case)]
    pub lease: String,
    /// Why (at most 500 characters are kept).
    #[arg(long, env = "LEASEGATE_REASON")]
    pub reason: String,
}

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Keys to check signatures with (repeatable, for rotation).
    #[arg(long = "key-file", env = "LEASEGATE_KEY_FILE", value_delimiter = ',')]
    pub key_files: Vec<PathBuf>,
    /// Accept leases signed with the published test key (conformance runs only).
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
    /// Skip closing records (revoked, stopped, completed, expired) that carry no signature
    /// (a present signature is always checked under the lease's key).
    #[arg(long, env = "LEASEGATE_REQUIRE_RECORD_SIGNATURES")]
    pub require_record_signatures: bool,
    /// The instant to check a lease's lifetime at (default: now).
    #[arg(long, env = "LEASEGATE_NOW")]
    pub now: Option<String>,
    /// A lease (JSON), a journal (JSON Lines) or a stream (`nats://...`); `-` for stdin.
    pub file: JournalLocation,
    #[command(flatten)]
    pub store: StoreArgs,
}

#[derive(Debug, Args)]
pub struct LeasesArgs {
    #[command(flatten)]
    pub ledger: LedgerArgs,
    /// JSON Lines instead of a table.
    #[arg(long, env = "LEASEGATE_JSON")]
    pub json: bool,
    /// Only leases with this status now.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(crate::registry::Status::ALL.map(|s| s.as_str())))]
    pub status: Option<String>,
    /// Only leases whose manifest names this agent.
    #[arg(long)]
    pub agent: Option<String>,
    /// At most this many leases (the first ones in the order shown).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,
    /// Newest grant first (default: grant order, oldest first).
    #[arg(long)]
    pub newest_first: bool,
}

/// How a stream journal is reached (`--journal nats://...`), and where local state lives.
#[derive(Debug, Clone, Args)]
pub struct StoreArgs {
    /// A NATS credentials file (JWT and NKey seed).
    #[arg(long, env = "LEASEGATE_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// CA certificates (PEM) for the NATS servers; TLS is then required.
    #[arg(long, env = "LEASEGATE_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,
    /// Replicas of a stream leasegate creates (an existing stream keeps its own).
    #[arg(long, env = "LEASEGATE_NATS_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub nats_replicas: u8,
    /// Without contact with the stream this long, `/readyz` turns 503 (the last known lease
    /// state stays enforced).
    #[arg(long, env = "LEASEGATE_STORE_STALE_AFTER", default_value = "5s", value_parser = parse_duration)]
    pub store_stale_after: std::time::Duration,
    /// At start, how long a stream journal is retried, whatever the error (a cluster that is
    /// starting or has lost its quorum), before `serve` exits naming the last error.
    #[arg(long, env = "LEASEGATE_STORE_START_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub store_start_timeout: std::time::Duration,
    /// Local state: a stream journal's queue of pending revocations, the per-lease port
    /// assignments (`lease-ports`).
    #[arg(long, env = "LEASEGATE_DATA_DIR", default_value = ".leasegate")]
    pub data_dir: PathBuf,
    /// The longest journal line (or stream message) read, in bytes: a longer one is skipped
    /// unread and counted (`too-long`). The default is above the largest real grant (a lease
    /// of 500,000 hosts is 21 MB).
    #[arg(long, env = "LEASEGATE_MAX_JOURNAL_LINE", default_value_t = crate::registry::journal::MAX_LINE as u64, value_parser = clap::value_parser!(u64).range(1024..))]
    pub max_journal_line: u64,
    /// The longest a lease lives: one whose expires_at is later than issued_at plus this
    /// expires then (e.g. 30d); `off`: as long as it says.
    #[arg(long, env = "LEASEGATE_MAX_LEASE_LIFETIME", default_value = "off", value_parser = parse_lifetime_ceiling)]
    pub max_lease_lifetime: LifetimeCeiling,
}

/// `--max-lease-lifetime`: a duration, or `off` (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LifetimeCeiling(pub Option<std::time::Duration>);

fn parse_lifetime_ceiling(text: &str) -> Result<LifetimeCeiling, String> {
    if text == "off" {
        return Ok(LifetimeCeiling(None));
    }
    match parse_duration(text) {
        Ok(max) if !max.is_zero() => Ok(LifetimeCeiling(Some(max))),
        Ok(_) => Err("a lifetime of zero opens nothing: give a duration, or `off`".into()),
        Err(e) => Err(format!("{e}, or `off`")),
    }
}

/// Every duration flag's parser: humantime's spellings (`90s`, `15m`, `2h`, `7d`, `1h 30m`),
/// and an error that names them instead of a byte offset.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    use humantime::DurationError;
    humantime::parse_duration(text).map_err(|e| {
        let what = match e {
            DurationError::Empty => "no duration".to_owned(),
            DurationError::UnknownUnit { unit, .. } => format!("unknown unit {unit:?}"),
            DurationError::NumberOverflow => "too long".to_owned(),
            DurationError::InvalidCharacter(_) | DurationError::NumberExpected(_) => {
                "not a duration".to_owned()
            }
        };
        format!("{what}: write a number and a unit, e.g. 90s, 15m, 2h or 7d")
    })
}

/// `usage --lease`: a lease id, or `_` for lines without a lease.
/// `--admin` of a command that calls the admin API: its URL (`http://HOST:PORT`,
/// `https://…`); a bare `HOST:PORT`, the address `serve --admin` takes, means `http://` it.
/// What follows the scheme is checked where the URL is used.
pub fn admin_url(text: &str) -> Result<String, String> {
    let text = text.trim();
    match text {
        "" => Err("no admin API: give http://HOST:PORT".into()),
        _ if text.contains("://") => Ok(text.to_owned()),
        _ => Ok(format!("http://{text}")),
    }
}

/// `--admin` of `serve` and `health`: the admin API's address, `HOST:PORT`; `http://HOST:PORT`
/// (the URL the other commands take) means the same. The admin API itself speaks plain HTTP.
pub fn admin_address(text: &str) -> Result<String, String> {
    let text = text.trim();
    match text.split_once("://") {
        None => Ok(text.to_owned()),
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("http") => {
            let rest = rest.strip_suffix('/').unwrap_or(rest);
            match rest.contains(['/', '@', '?', '#']) || rest.is_empty() {
                true => Err(format!(
                    "{text:?}: the admin address is http://HOST:PORT (or HOST:PORT), with no \
                     user, path or query"
                )),
                false => Ok(rest.to_owned()),
            }
        }
        Some(_) => Err(format!(
            "{text:?}: the admin API speaks plain HTTP (put TLS in front of it for others): give \
             http://HOST:PORT or HOST:PORT"
        )),
    }
}

fn parse_lease_filter(text: &str) -> Result<String, crate::contract::lease::NotALeaseId> {
    match text {
        "_" => Ok(text.to_owned()),
        _ => crate::contract::lease::lease_id_any_case(text),
    }
}

/// A journal and the keys its leases are signed with (`leases`, `check`).
#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// The lease journal: a file (JSON Lines) or `nats://HOST:PORT[,...]/STREAM`.
    #[arg(long, env = "LEASEGATE_JOURNAL")]
    pub journal: JournalLocation,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Keys the leases are signed with (repeatable).
    #[arg(
        long = "key-file",
        env = "LEASEGATE_KEY_FILE",
        value_delimiter = ',',
        required = true
    )]
    pub key_files: Vec<PathBuf>,
    /// Accept leases signed with the published test key.
    #[arg(long, env = "LEASEGATE_ALLOW_TEST_KEY")]
    pub allow_test_key: bool,
    /// Skip closing records (revoked, stopped, completed, expired) that carry no signature
    /// (a present signature is always checked under the lease's key).
    #[arg(long, env = "LEASEGATE_REQUIRE_RECORD_SIGNATURES")]
    pub require_record_signatures: bool,
}

/// `--listen`: an address, or a name resolved when `serve` starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Addr(std::net::SocketAddr),
    /// `NAME:PORT`, kept as given until it is resolved.
    Name(String),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Addr(addr) => addr.fmt(f),
            ListenAddr::Name(name) => f.write_str(name),
        }
    }
}

/// `ADDR:PORT`, `[V6]:PORT` or `NAME:PORT`.
fn parse_listen(text: &str) -> Result<ListenAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(ListenAddr::Addr(addr));
    }
    let expected = || format!("{text:?}: expected ADDR:PORT or NAME:PORT, e.g. 127.0.0.1:3128");
    let (name, port) = text.rsplit_once(':').ok_or_else(expected)?;
    let valid_name = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.');
    if !valid_name || port.parse::<u16>().is_err() {
        return Err(expected());
    }
    Ok(ListenAddr::Name(text.to_owned()))
}

/// `A-B` with A <= B.
fn parse_port_range(text: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let (a, b) = text
        .split_once('-')
        .ok_or("expected A-B, e.g. 40000-40999")?;
    let a: u16 = a.trim().parse().map_err(|e| format!("{a}: {e}"))?;
    let b: u16 = b.trim().parse().map_err(|e| format!("{b}: {e}"))?;
    if a == 0 || a > b {
        return Err(format!("{text}: expected 1 <= A <= B"));
    }
    Ok(a..=b)
}

#[cfg(test)]
mod tests {
    use super::{admin_address, admin_url};

    /// Every `--admin` takes both spellings: the URL and the bare address.
    #[test]
    fn every_admin_flag_takes_the_url_and_the_address() {
        assert_eq!(
            admin_url("127.0.0.1:3129").unwrap(),
            "http://127.0.0.1:3129"
        );
        assert_eq!(admin_url("[::1]:3129").unwrap(), "http://[::1]:3129");
        for url in ["http://127.0.0.1:3129", "https://admin.example:8443"] {
            assert_eq!(admin_url(url).unwrap(), url);
        }
        assert!(admin_url(" ").is_err());
        assert_eq!(admin_address("127.0.0.1:3129").unwrap(), "127.0.0.1:3129");
        assert_eq!(admin_address("off").unwrap(), "off");
        for url in ["http://127.0.0.1:3129", "HTTP://127.0.0.1:3129/"] {
            assert_eq!(admin_address(url).unwrap(), "127.0.0.1:3129");
        }
        assert_eq!(admin_address("http://[::1]:3129").unwrap(), "[::1]:3129");
        for bad in [
            "https://127.0.0.1:3129",
            "http://127.0.0.1:3129/admin",
            "http://a@b:1",
        ] {
            assert!(admin_address(bad).is_err(), "{bad}");
        }
    }
}
