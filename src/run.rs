//! `leasegate run`: spawn an agent already pointed at its lease.
//!
//! Invariant: the child starts only if the admin API says the lease opens now; it sees the
//! proxy in every variable clients read (upper and lower case), no `NO_PROXY`, and its exit
//! code (or 128+signal) becomes ours. As in shells, a command that is not found exits 127 and
//! one that cannot be executed 126; every failure of our own exits 125, and says what the
//! admin API answered rather than that it cannot be reached. SIGINT and SIGTERM reach the
//! child. Its credential is the lease's token when one is at hand (minted from `--key-file`,
//! or handed out by an admin API we authenticated to), else the lease id; a proxy in token
//! mode with no token at hand is an error before the child starts, not a 407 inside it.

use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use serde_json::Value;
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
        "the admin API at {url} answered 401: give --admin-token-file (or \
         LEASEGATE_ADMIN_TOKEN_FILE) with the token `serve --admin-token-file` reads"
    )]
    NoAdminToken { url: String },
    #[error("the admin API at {url} answered 401: it refused the token in --admin-token-file")]
    WrongAdminToken { url: String },
    #[error("no such lease {lease}: the admin API at {url} answered 404 Not Found")]
    UnknownLease { url: String, lease: String },
    #[error("the admin API at {url} answered {status}: {message}")]
    Admin {
        url: String,
        status: http::StatusCode,
        message: String,
    },
    #[error("lease {lease} does not open anything now (status {status}); not starting {command}")]
    NotOpen {
        lease: String,
        status: String,
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
         --lease-port-credentials token): give --key-file, or \
         --admin-token-file so that the admin API hands it out"
    )]
    NoToken(String),
    #[error("reading {path}: {reason}")]
    Read { path: String, reason: String },
}

impl RunError {
    /// The exit code for this failure, as shells use them: 127 when the command is not found,
    /// 126 when it cannot be executed, 125 for leasegate's own failures (so that the child's
    /// own codes stay distinguishable).
    pub fn exit_code(&self) -> u8 {
        match self {
            RunError::CommandNotFound(_) => 127,
            RunError::NotExecutable(..) => 126,
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

/// The credentials `run` may use: the lease's key (mints its token) and the admin API token.
#[derive(Debug, Default)]
pub struct RunAuth {
    pub key: Option<crate::contract::Key>,
    pub admin_token: Option<String>,
}

/// Asks the admin API for `GET /leases/{id}` (with `admin_token` as bearer token). Every
/// answer but 200 is an error that says what the API said.
pub async fn lookup(
    admin: &str,
    lease: &str,
    admin_token: Option<&str>,
) -> Result<Value, RunError> {
    let base =
        url::Url::parse(admin).map_err(|e| RunError::Url(admin.to_owned(), e.to_string()))?;
    let unreachable = |reason: String| RunError::Unreachable {
        url: admin.to_owned(),
        reason,
    };
    let host = base
        .host_str()
        .ok_or_else(|| RunError::Url(admin.to_owned(), "no host".into()))?
        .to_owned();
    let port = base.port_or_known_default().unwrap_or(80);
    let stream =
        tokio::net::TcpStream::connect((host.trim_matches(|c| c == '[' || c == ']'), port))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    tokio::spawn(connection);
    // The id goes into the path as given (escaped), so that the API judges it, not us.
    let mut path = base.clone();
    path.path_segments_mut()
        .map_err(|()| RunError::Url(admin.to_owned(), "cannot be a base".into()))?
        .clear()
        .extend(["leases", lease]);
    let path = path.path().to_owned();
    let mut request = http::Request::get(path).header(http::header::HOST, format!("{host}:{port}"));
    if let Some(token) = admin_token {
        request = request.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .body(Empty::<bytes::Bytes>::new())
        .map_err(|e| RunError::Url(admin.to_owned(), e.to_string()))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| unreachable(e.to_string()))?
        .to_bytes();
    let url = admin.to_owned();
    if status == http::StatusCode::OK {
        return serde_json::from_slice(&body).map_err(|e| RunError::Admin {
            url,
            status,
            message: format!("unreadable answer: {e}"),
        });
    }
    // The API's `{"error": ...}`, else the body as text.
    let message = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_owned());
    Err(match status {
        http::StatusCode::BAD_REQUEST => RunError::BadLeaseId {
            url,
            status,
            message,
        },
        http::StatusCode::UNAUTHORIZED if admin_token.is_some() => {
            RunError::WrongAdminToken { url }
        }
        http::StatusCode::UNAUTHORIZED => RunError::NoAdminToken { url },
        http::StatusCode::NOT_FOUND => RunError::UnknownLease {
            url,
            lease: lease.to_owned(),
        },
        _ => RunError::Admin {
            url,
            status,
            message,
        },
    })
}

/// The proxy URL for a lease: its own port if it has one, else `proxy` (or the admin's
/// proxy URL) carrying the lease's credential as the password: `token` if given, else the
/// one the admin API put in its URL (only for an authenticated caller), else the lease id —
/// unless the admin API says the proxy wants tokens. A lease port that wants the token
/// (`--lease-port-credentials token`) gets it the same way.
pub fn proxy_url(
    view: &Value,
    lease: &str,
    proxy: Option<&str>,
    token: Option<&str>,
) -> Result<String, RunError> {
    let admin_url = view["proxy_url"].as_str().unwrap_or_default().to_owned();
    let on_port = !view["port"].is_null();
    if on_port && view["lease_port_credentials"] != "token" {
        return Ok(admin_url);
    }
    // A lease port that wants the token is the base whatever `proxy` says.
    let base = if on_port {
        &admin_url
    } else {
        proxy.unwrap_or(&admin_url)
    };
    let mut url =
        url::Url::parse(base).map_err(|e| RunError::Url(base.to_owned(), e.to_string()))?;
    let handed_out = url::Url::parse(&admin_url)
        .ok()
        .and_then(|u| u.password().map(str::to_owned));
    let credential = match (token, handed_out) {
        (Some(token), _) => token.to_owned(),
        (None, Some(credential)) => credential,
        (None, None) if on_port || view["credentials"] == "token" => {
            return Err(RunError::NoToken(lease.to_owned()))
        }
        (None, None) => lease.to_owned(),
    };
    url.set_username("agent")
        .and_then(|()| url.set_password(Some(&credential)))
        .map_err(|()| RunError::Url(base.to_owned(), "cannot carry credentials".into()))?;
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

/// The environment changes that point a process at `proxy_url`.
pub fn agent_env(proxy_url: &str, lease: &str) -> (Vec<(&'static str, String)>, [&'static str; 2]) {
    let mut set = Vec::new();
    for name in [
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
    ] {
        set.push((name, proxy_url.to_owned()));
    }
    set.push(("NODE_USE_ENV_PROXY", "1".to_owned()));
    set.push(("LEASEGATE_LEASE_ID", lease.to_owned()));
    (set, ["NO_PROXY", "no_proxy"])
}

/// Runs `command` under `lease`; returns the exit code to exit with.
pub async fn run(
    lease: &str,
    proxy: Option<&str>,
    admin: &str,
    auth: &RunAuth,
    command: &[String],
) -> Result<u8, RunError> {
    let shown = command.join(" ");
    let view = lookup(admin, lease, auth.admin_token.as_deref()).await?;
    let status = view["status"].as_str().unwrap_or("unknown");
    if status != "open" {
        return Err(RunError::NotOpen {
            lease: lease.to_owned(),
            status: status.to_owned(),
            command: shown,
        });
    }
    let token = auth
        .key
        .as_ref()
        .map(|key| crate::contract::token::mint(key, lease));
    let url = proxy_url(&view, lease, proxy, token.as_deref())?;
    let (set, unset) = agent_env(&url, lease);
    let mut child = tokio::process::Command::new(&command[0]);
    child
        .args(&command[1..])
        .stdin(Stdio::inherit())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit());
    for (name, value) in set {
        child.env(name, value);
    }
    for name in unset {
        child.env_remove(name);
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
    let status = status.map_err(|e| RunError::Spawn(shown, e))?;
    use std::os::unix::process::ExitStatusExt;
    Ok(match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(signal)) => (128 + signal) as u8,
        _ => 1,
    })
}

async fn recv(signal: &mut Option<tokio::signal::unix::Signal>) {
    match signal {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";

    #[test]
    fn a_lease_port_carries_the_token_only_when_it_wants_one() {
        let open = json!({"port": 40001, "proxy_url": "http://127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "none"});
        assert_eq!(
            proxy_url(&open, LEASE, Some("http://proxy:3128"), Some("t")).unwrap(),
            "http://127.0.0.1:40001"
        );
        let wants = json!({"port": 40001, "proxy_url": "http://127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "token"});
        assert_eq!(
            proxy_url(&wants, LEASE, Some("http://proxy:3128"), Some("tok")).unwrap(),
            "http://agent:tok@127.0.0.1:40001",
            "the port, not --proxy, with the token"
        );
        assert!(matches!(
            proxy_url(&wants, LEASE, None, None),
            Err(RunError::NoToken(_))
        ));
        let handed_out = json!({"port": 40001,
            "proxy_url": "http://agent:handed@127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "token"});
        assert_eq!(
            proxy_url(&handed_out, LEASE, None, None).unwrap(),
            "http://agent:handed@127.0.0.1:40001"
        );
    }
}
