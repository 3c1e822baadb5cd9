//! `leasegate run`: spawn an agent already pointed at its lease.
//!
//! Invariant: the child starts only if the admin API says the lease opens now (a lease it
//! does not know yet, or an admin API not up yet, is asked again until `--wait` has passed;
//! a closed one is never started under, and what closed it is said); it sees the
//! proxy in every variable clients read (upper and lower case) and no other proxy setting
//! (see `child_env`: the proxy's host is the operator's, never the admin API's); the child's
//! exit code (or 128+signal) becomes ours. As in shells, a command that is not found exits 127
//! and one that cannot be executed 126; every failure of our own exits 125, and says what the
//! admin API answered rather than that it cannot be reached. SIGINT and SIGTERM reach the
//! child. With `--complete-on-exit` the lease is completed (exit 0) or stopped (anything else)
//! with its own token when the child ends; that never changes the exit code.
//!
//! Nothing wider than the lease is ever in the child's reach: `run` holds no operator
//! credential (it takes the lease's own proxy token, `--lease-token-file`, and refuses the
//! signing key and the admin token), no `LEASEGATE_*` variable reaches the child, and before
//! it starts `run` is made undumpable, its inherited descriptors close-on-exec, and an operator
//! credential the environment names that this user can read stops the start (see `reach`).
//! The lease token asks the admin API for that lease's view and placeholders only (a token
//! opens nothing else there), goes only over TLS or to loopback (see `admin_api`), and is the
//! child's proxy credential; without one, the credential is the lease id, and a proxy in
//! token mode is an error before the child starts, not a 407 inside it. With the token, the
//! child also gets the lease's placeholders and trusts the interception CA (see `brokered`:
//! files in a private directory removed when `run` ends, and for Java a trust store named in
//! `JAVA_TOOL_OPTIONS`); an admin API that does not know placeholders is warned about, not
//! fatal.

mod admin_api;
mod brokered;
mod child_env;
mod jks;
mod node;
mod reach;
mod relay;

use super::CliResult;
use crate::cli::RunArgs;
pub use admin_api::AdminApi;
use brokered::{Brokered, TrustFiles, JAVA_VAR, SYSTEM_BUNDLES};
pub use child_env::{agent_env, is_proxy_setting, proxy_url};
use std::process::ExitCode;
use std::process::Stdio;

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("bad URL {0:?}: {1}")]
    Url(String, String),
    #[error("cannot reach the admin API at {url}: {reason} (is `leasegate serve` running?)")]
    Unreachable { url: String, reason: String },
    #[error("the admin API at {url} refused the lease id: {status}: {message}")]
    BadLeaseId {
        url: String,
        status: http::StatusCode,
        message: String,
    },
    #[error(
        "the admin API at {url} answered 401: give --lease-token-file (or \
         LEASEGATE_LEASE_TOKEN_FILE) with the lease's proxy token (`leasegate token --lease ID \
         --key-file K` mints it; the issuer's answer carries it)"
    )]
    NoLeaseToken { url: String },
    #[error("the admin API at {url} answered 401: it refused the token in --lease-token-file: {message}")]
    WrongLeaseToken { url: String, message: String },
    #[error("no such lease {lease}: the admin API at {url} answered 404 Not Found")]
    UnknownLease { url: String, lease: String },
    #[error("the admin API at {url} answered {status}: {message}")]
    Admin {
        url: String,
        status: http::StatusCode,
        message: String,
    },
    #[error(
        "lease {lease} does not open anything now (status {status}{why}); not starting {command}"
    )]
    NotOpen {
        lease: String,
        status: String,
        /// What closed it, as the admin API says (`: revoked by issuer at …: reason`).
        why: String,
        command: String,
    },
    #[error(
        "lease {lease} is not served by the proxy at {url} after {waited:?} ({last}): not \
         starting {command}. Issue it through the admin API (POST /leases answers once it is \
         served), or check that the proxy reads the journal it was written to"
    )]
    NotServed {
        lease: String,
        url: String,
        waited: std::time::Duration,
        last: String,
        command: String,
    },
    #[error("{0}: command not found")]
    CommandNotFound(String),
    #[error("{0}: cannot execute: {1}")]
    NotExecutable(String, std::io::Error),
    #[error("cannot start {0}: {1}")]
    Spawn(String, std::io::Error),
    #[error(
        "the proxy needs the token of lease {0} (--credentials token, or a lease port with \
         --lease-port-credentials token): give --lease-token-file (`leasegate token --lease \
         ID --key-file K` mints it; the issuer's answer carries it)"
    )]
    NoToken(String),
    #[error("{path} holds the token of lease {holds}, not of --lease {lease}")]
    TokenOfAnother {
        path: String,
        holds: String,
        lease: String,
    },
    #[error(
        "{flag} is not taken by `run`: the agent, the same user as `run`, could read it and \
         act as the operator (list, read and revoke every lease). Give the lease's own proxy \
         token instead: `leasegate token --lease ID --key-file K > F` (or the issuer's \
         answer), then `run --lease-token-file F`"
    )]
    OperatorCredential { flag: &'static str },
    #[error(
        "not starting {command}: {var} names {path}, an operator credential this user can \
         read, and so could the agent. Run the agent as a user that cannot read it (or unset \
         {var} for `run`)"
    )]
    CredentialInReach {
        command: String,
        var: &'static str,
        path: String,
    },
    #[error("not starting {command}: cannot close `run` off from it: {reason}")]
    NotSealed { command: String, reason: String },
    #[error("reading {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("writing the interception CA's files for the child ({path}): {reason}")]
    TrustFiles { path: String, reason: String },
    #[error(
        "not sending the lease token in plain HTTP to {url}: its host is {addr}, beyond \
         loopback. Use an https:// admin URL (with --admin-ca if its certificate is not from a \
         public CA), or reach the admin API on loopback (an SSH tunnel, `kubectl port-forward`)"
    )]
    PlainTextToken { url: String, addr: std::net::IpAddr },
}

impl RunError {
    /// The exit code for this failure, as shells use them: 127 when the command is not found,
    /// 126 when it cannot be executed, 2 for a flag `run` does not take, 125 for leasegate's own
    /// failures (so that the child's
    /// own codes stay distinguishable).
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::CommandNotFound(_) => 127,
            RunError::NotExecutable(..) => 126,
            RunError::OperatorCredential { .. } => 2,
            _ => 125,
        }
    }

    /// The error for a child that could not be spawned.
    fn spawning(command: &str, e: std::io::Error) -> RunError {
        match e.kind() {
            std::io::ErrorKind::NotFound => RunError::CommandNotFound(command.to_owned()),
            std::io::ErrorKind::PermissionDenied => RunError::NotExecutable(command.to_owned(), e),
            _ if e.raw_os_error() == Some(nix::libc::ENOEXEC) => {
                RunError::NotExecutable(command.to_owned(), e)
            }
            _ => RunError::Spawn(command.to_owned(), e),
        }
    }
}

/// The credential `run` may use — the lease's own proxy token, which the admin API takes for
/// that lease's view and placeholders and the proxy for its traffic — and what it trusts to
/// hear it: `--admin-ca` for an `https://` admin API.
#[derive(Debug, Default)]
pub struct RunAuth {
    pub lease_token: Option<String>,
    pub admin_ca: Option<Vec<rustls::pki_types::CertificateDer<'static>>>,
}

/// How `run` waits for its lease and what it does when the child exits.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// How long the lease may take to be served (`--wait`).
    pub wait: std::time::Duration,
    /// `--complete-on-exit`: exit 0 completes the lease, any other ending stops it.
    pub complete_on_exit: bool,
}

/// The lease's view once the admin API serves it: an unknown lease (not folded yet) or an
/// admin API not up yet is asked again until `wait` has passed.
async fn served(
    admin: &AdminApi,
    lease: &str,
    token: Option<&str>,
    wait: std::time::Duration,
    command: &str,
) -> Result<serde_json::Value, RunError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let last = match admin.lookup(lease, token).await {
            Ok(view) => return Ok(view),
            Err(e @ (RunError::UnknownLease { .. } | RunError::Unreachable { .. })) => e,
            Err(e) => return Err(e),
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(match last {
                // Not asked to wait, or no admin API answering at all: said as it is.
                last if wait.is_zero() => last,
                last @ RunError::Unreachable { .. } => last,
                last => RunError::NotServed {
                    lease: lease.to_owned(),
                    url: admin.shown().to_owned(),
                    waited: wait,
                    last: last.to_string(),
                    command: command.to_owned(),
                },
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// What closed a lease, from the view's `closed`: `, revoked by issuer at T: reason`.
fn closed_by(closed: &serde_json::Value) -> String {
    let Some(event) = closed["event"].as_str() else {
        return String::new();
    };
    let mut why = format!(", {event}");
    if let Some(ancestor) = closed["ancestor"].as_str() {
        why.push_str(&format!(" (ancestor {ancestor})"));
    }
    if let Some(by) = closed["by"].as_str() {
        why.push_str(&format!(" by {by}"));
    }
    if let Some(at) = closed["at"].as_str() {
        why.push_str(&format!(" at {at}"));
    }
    if let Some(reason) = closed["reason"].as_str() {
        why.push_str(&format!(": {reason}"));
    }
    why
}

/// With `--complete-on-exit`: the lease completed (exit 0) or stopped (anything else) as the
/// child ended; a failure is said on stderr and does not change the exit code.
async fn end_lease(
    admin: &AdminApi,
    lease: &str,
    token: Option<&str>,
    code: u8,
    signal: Option<i32>,
) {
    let (how, reason) = match (code, signal) {
        (_, Some(signal)) => ("stop", format!("the agent was killed by signal {signal}")),
        (0, None) => ("complete", "the agent exited with code 0".to_owned()),
        (code, None) => ("stop", format!("the agent exited with code {code}")),
    };
    match admin.end(lease, token, how, &reason).await {
        Ok(answer) => {
            let usage = match answer.get("usage") {
                Some(usage) => format!(" (usage {usage})"),
                None => String::new(),
            };
            eprintln!("leasegate run: lease {lease} {how}d: {reason}{usage}");
        }
        Err(e) => eprintln!("leasegate run: warning: lease {lease} was not {how}d: {e}"),
    }
}

/// Runs `command` under `lease`; returns the exit code to exit with.
pub async fn run(
    lease: &str,
    proxy: Option<&str>,
    admin: &str,
    auth: &RunAuth,
    options: RunOptions,
    command: &[String],
) -> Result<u8, RunError> {
    let shown = command.join(" ");
    let admin = AdminApi::new(admin, auth.admin_ca.clone())?;
    let token = auth.lease_token.as_deref();
    let view = served(&admin, lease, token, options.wait, &shown).await?;
    let status = view["status"].as_str().unwrap_or("unknown");
    if status != "open" {
        return Err(RunError::NotOpen {
            lease: lease.to_owned(),
            status: status.to_owned(),
            why: closed_by(&view["closed"]),
            command: shown,
        });
    }
    let url = proxy_url(&view, lease, proxy, admin.url(), token)?;
    let brokered = brokered(&admin, lease, token).await?;
    // Held until the child is gone: dropping it removes the CA's directory.
    let trust = match &brokered.ca {
        Some(ca) => {
            let (files, warning) = TrustFiles::write(ca, &SYSTEM_BUNDLES)?;
            if let Some(warning) = warning {
                eprintln!("leasegate run: warning: {warning}");
            }
            Some(files)
        }
        None => None,
    };
    let inherited = std::env::vars_os().map(|(name, _)| name);
    let (set, unset) = agent_env(&url, lease, admin.url().host_str(), inherited);
    let mut child = tokio::process::Command::new(&command[0]);
    child
        .args(&command[1..])
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    for name in unset {
        child.env_remove(name);
    }
    for (name, _) in std::env::vars_os().filter(|(name, _)| reach::is_leasegate_setting(name)) {
        child.env_remove(name);
    }
    for (name, value) in set {
        child.env(name, value);
    }
    for (name, value) in &brokered.placeholders {
        child.env(name, value);
    }
    for (name, value) in trust.iter().flat_map(TrustFiles::env) {
        child.env(name, value);
    }
    // Held until the child is gone: Node's way to the proxy.
    let node = match node::NodePreload::write() {
        Ok(preload) => {
            let inherited = std::env::var_os(node::NODE_OPTIONS);
            child.env(
                node::NODE_OPTIONS,
                preload.node_options(inherited.as_deref()),
            );
            Some(preload)
        }
        Err(error) => {
            eprintln!(
                "leasegate run: warning: Node's own fetch and http(s) will not use the proxy: \
                 its preload cannot be written: {error} (give Node programs undici's \
                 EnvHttpProxyAgent)"
            );
            None
        }
    };
    // Held until the child is gone: the JVM's way to the proxy with the lease's credential.
    let (java_proxy, _relay) = java_proxy(&url, admin.url().host_str()).await;
    let inherited = std::env::var_os(JAVA_VAR).filter(|held| !held.is_empty());
    let java = match (inherited, java_proxy) {
        (Some(mut held), Some(ours)) => {
            held.push(" ");
            held.push(ours);
            Some(held)
        }
        (held, ours) => held.or(ours.map(Into::into)),
    };
    match &trust {
        Some(files) => match files.java_tool_options(java) {
            Ok(options) => {
                child.env(JAVA_VAR, options);
            }
            Err(warning) => eprintln!("leasegate run: warning: {warning}"),
        },
        None => {
            if let Some(options) = java {
                child.env(JAVA_VAR, options);
            }
        }
    }
    let mut child = child
        .spawn()
        .map_err(|e| RunError::spawning(&command[0], e))?;
    let pid = child.id().map(|id| nix::unistd::Pid::from_raw(id as i32));
    let mut interrupt =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let status = loop {
        let forward = tokio::select! {
            status = child.wait() => break status,
            _ = recv(&mut interrupt) => nix::sys::signal::Signal::SIGINT,
            _ = recv(&mut terminate) => nix::sys::signal::Signal::SIGTERM,
        };
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(pid, forward);
        }
    };
    drop((trust, node));
    let status = status.map_err(|e| RunError::Spawn(shown, e))?;
    use std::os::unix::process::ExitStatusExt;
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => (128 + signal) as u8,
        _ => 1,
    };
    if options.complete_on_exit {
        end_lease(&admin, lease, token, code, status.signal()).await;
    }
    Ok(code)
}

/// What the JVM is told of the proxy (`-Dhttp(s).proxyHost/Port`, and `http.nonProxyHosts`
/// naming the admin API's host), and the relay that puts the lease's credential on its
/// requests where the proxy URL carries one (the JVM sends none of its own). `None` with a
/// warning where the JVM cannot be pointed at the proxy.
async fn java_proxy(url: &str, admin_host: Option<&str>) -> (Option<String>, Option<relay::Relay>) {
    let Ok(parsed) = url::Url::parse(url) else {
        return (None, None);
    };
    if parsed.scheme() != "http" {
        eprintln!(
            "leasegate run: warning: Java programs will not use the proxy: the JVM speaks \
             plain HTTP to a proxy, and this one is {}:// (give run --proxy http://… of a plain \
             listener)",
            parsed.scheme()
        );
        return (None, None);
    }
    let (host, port, relay) = match relay::Relay::start(&parsed).await {
        Ok(Some(relay)) => ("127.0.0.1".to_owned(), relay.addr.port(), Some(relay)),
        Ok(None) => (
            parsed.host_str().unwrap_or_default().to_owned(),
            parsed.port_or_known_default().unwrap_or(80),
            None,
        ),
        Err(error) => {
            eprintln!(
                "leasegate run: warning: Java programs will not use the proxy: its relay \
                 cannot listen: {error}"
            );
            return (None, None);
        }
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let mut options = format!(
        "-Dhttp.proxyHost={host} -Dhttp.proxyPort={port} -Dhttps.proxyHost={host} \
         -Dhttps.proxyPort={port}"
    );
    if let Some(admin) = admin_host.filter(|a| a.chars().all(|c| c.is_ascii_graphic())) {
        options.push_str(&format!(" -Dhttp.nonProxyHosts={admin}"));
    }
    (Some(options), relay)
}

/// The lease's placeholders and the interception CA, asked of the admin API with the lease's
/// token (without one it would refuse: none is asked for). An admin API that does not know the
/// route, or that authenticates nobody (no token of its own), gives none, with a warning.
async fn brokered(
    admin: &AdminApi,
    lease: &str,
    token: Option<&str>,
) -> Result<Brokered, RunError> {
    let Some(token) = token else {
        return Ok(Brokered::default());
    };
    match admin.placeholders(lease, Some(token)).await {
        Ok(Some(answer)) => {
            let brokered = Brokered::parse(&answer, admin.shown())?;
            for name in &brokered.refused {
                eprintln!(
                    "leasegate run: warning: not setting {name} to a placeholder: `run` sets it \
                     itself, or it changes what the child runs or loads; give the secret another \
                     env_name"
                );
            }
            Ok(brokered)
        }
        Ok(None) => {
            eprintln!(
                "leasegate run: warning: the admin API at {} does not hand out placeholders (a \
                 leasegate older than brokered credentials): the child gets no placeholders and \
                 does not trust the interception CA",
                admin.shown()
            );
            Ok(Brokered::default())
        }
        Err(RunError::Admin {
            status: http::StatusCode::FORBIDDEN,
            message,
            ..
        }) => {
            eprintln!(
                "leasegate run: warning: the admin API at {} answered 403 for the placeholders \
                 ({message}): the child gets none and does not trust the interception CA",
                admin.shown()
            );
            Ok(Brokered::default())
        }
        Err(e) => Err(e),
    }
}

async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// `run`: exit with the child's code (128+signal if killed); 125 if it could not start.
pub fn exec(args: RunArgs) -> CliResult {
    let fail = |e: RunError| {
        eprintln!("leasegate run: {e}");
        Ok(ExitCode::from(e.exit_code()))
    };
    // Before any thread or connection: nothing opened from here on is inherited either.
    if let Err(e) = reach::seal_off() {
        return fail(RunError::NotSealed {
            command: args.command.join(" "),
            reason: e.to_string(),
        });
    }
    if let Some(found) = reach::readable_credentials(std::env::vars_os()).first() {
        return fail(RunError::CredentialInReach {
            command: args.command.join(" "),
            var: found.var,
            path: found.path.display().to_string(),
        });
    }
    let auth = match run_auth(&args) {
        Ok(auth) => auth,
        Err(e) => return fail(e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("leasegate run: {e}");
            return Ok(ExitCode::from(125));
        }
    };
    let options = RunOptions {
        wait: args.wait,
        complete_on_exit: args.complete_on_exit,
    };
    match runtime.block_on(run(
        &args.lease,
        args.proxy.as_deref(),
        &args.admin,
        &auth,
        options,
        &args.command,
    )) {
        Ok(code) => Ok(ExitCode::from(code)),
        Err(e) => fail(e),
    }
}

/// The lease token and admin CA `run` was given, loaded; the operator's credentials refused.
fn run_auth(args: &RunArgs) -> Result<RunAuth, RunError> {
    if args.key_file.is_some() {
        return Err(RunError::OperatorCredential { flag: "--key-file" });
    }
    if args.admin_token_file.is_some() {
        return Err(RunError::OperatorCredential {
            flag: "--admin-token-file",
        });
    }
    let read_error = |path: &std::path::Path, reason: String| RunError::Read {
        path: path.display().to_string(),
        reason,
    };
    let lease_token = match &args.lease_token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .map_err(|e| read_error(path, e.to_string()))?
                .trim()
                .to_owned();
            match crate::contract::token::split(&token) {
                (id, Some(_)) if id == args.lease => Some(token),
                (id, Some(_)) => {
                    return Err(RunError::TokenOfAnother {
                        path: path.display().to_string(),
                        holds: id.to_owned(),
                        lease: args.lease.clone(),
                    })
                }
                (_, None) => {
                    return Err(read_error(
                        path,
                        "not a lease's proxy token (<lease-id>.<tag>, as `leasegate token` \
                         prints it)"
                            .to_owned(),
                    ))
                }
            }
        }
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
    Ok(RunAuth {
        lease_token,
        admin_ca,
    })
}
