//! `leasegate health`: the container probe, so an image needs no shell and no HTTP client
//! (either would be one more way out that bypasses the policy).
//!
//! Invariant: exit 0 only on a `200` status line from the admin API's `/healthz` (or `/readyz`
//! with `--ready`) within the timeout; anything else is one line on stderr and exit 1.

use super::CliResult;
use crate::cli::HealthArgs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

/// How long the whole probe may take.
pub const TIMEOUT: Duration = Duration::from_secs(3);

/// Where to knock: the admin address `serve` binds (`LEASEGATE_ADMIN`), with an unspecified IP
/// (`0.0.0.0`, `::`) replaced by loopback.
pub fn target(admin: &str) -> Result<SocketAddr, String> {
    let addr = admin
        .to_socket_addrs()
        .map_err(|e| format!("{admin}: not an address: {e}"))?
        .next()
        .ok_or_else(|| format!("{admin}: resolves to no address"))?;
    Ok(reachable(addr))
}

/// A listening address as a client reaches it: an unspecified IP (a wildcard bind) replaced
/// by loopback.
pub fn reachable(mut addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    addr
}

/// GETs `path` from `addr` (with `token` as a bearer token); `Ok` with the status line when
/// it is a 200.
pub fn probe(addr: SocketAddr, path: &str, token: Option<&str>) -> Result<String, String> {
    let fail = |e: std::io::Error| format!("{addr}{path}: {e}");
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let mut stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(fail)?;
    stream.set_read_timeout(Some(TIMEOUT)).map_err(fail)?;
    stream.set_write_timeout(Some(TIMEOUT)).map_err(fail)?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n{authorization}\r\n").as_bytes(),
        )
        .map_err(fail)?;
    let mut answer = Vec::new();
    stream.take(4096).read_to_end(&mut answer).map_err(fail)?;
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or("").to_owned();
    match status.split_whitespace().nth(1) {
        Some("200") => Ok(status),
        _ => {
            let body = text.split("\r\n\r\n").nth(1).unwrap_or("").trim();
            Err(format!("{addr}{path}: {status} {body}").trim().to_owned())
        }
    }
}

/// `health`: 0 when the admin API answers 200, else one line and 1.
pub fn exec(args: HealthArgs) -> CliResult {
    let path = if args.ready { "/readyz" } else { "/healthz" };
    let token = match &args.admin_token_file {
        Some(file) => match std::fs::read_to_string(file) {
            Ok(token) => Some(token.trim().to_owned()),
            Err(e) => {
                eprintln!("leasegate health: {}: {e}", file.display());
                return Ok(ExitCode::FAILURE);
            }
        },
        None => None,
    };
    match target(&args.admin).and_then(|addr| probe(addr, path, token.as_deref())) {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("leasegate health: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}
