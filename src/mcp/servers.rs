//! The MCP servers the operator names (`serve --mcp-server NAME=URL`): which origins' requests
//! are read as MCP, and the name a lease's `allow.tools` and `approvals` give their tools
//! (`<server>/<tool>`).
//!
//! Invariant: pure; a server is its whole origin (scheme, host, port), never a path, so no
//! spelling of a path (`/mcp/`, `/%6Dcp`, `//mcp`) reaches the server unread; names are unique
//! and in the contract's tool-name alphabet, so `<server>/<tool>` is a name a lease can hold.

use crate::policy::target::{parse_host, Target};
use crate::policy::TargetHost;
use std::fmt;

/// One MCP server as the operator named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpServer {
    /// What its tools are prefixed with in a lease (`notes` in `notes/read_note`).
    pub name: String,
    /// `https`: reached through a CONNECT tunnel, terminated to be read; `http`: forwarded.
    pub tls: bool,
    pub host: TargetHost,
    pub port: u16,
}

impl McpServer {
    /// Whether a request to `target` (inside a terminated tunnel when `tls`) is to this server.
    pub fn is(&self, target: &Target, tls: bool) -> bool {
        self.tls == tls && self.port == target.port && self.host == target.host
    }

    /// `<server>/<tool>`: the tool as a lease names it.
    pub fn tool(&self, tool: &str) -> String {
        format!("{}/{tool}", self.name)
    }
}

impl fmt::Display for McpServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        match &self.host {
            TargetHost::Ip(std::net::IpAddr::V6(ip)) => {
                write!(f, "{}={scheme}://[{ip}]:{}", self.name, self.port)
            }
            host => write!(f, "{}={scheme}://{host}:{}", self.name, self.port),
        }
    }
}

/// What is wrong with one `--mcp-server` value, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--mcp-server {spec:?}: {why}")]
pub struct BadServer {
    spec: String,
    why: String,
}

/// The servers, in the order given.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpServers {
    servers: Vec<McpServer>,
}

impl McpServers {
    /// Reads `NAME=URL` values: `URL` is `http://` or `https://`, a host and an optional port
    /// (80 or 443 by default); a path is allowed and ignored (the whole origin is the server).
    pub fn parse<S: AsRef<str>>(specs: &[S]) -> Result<McpServers, BadServer> {
        let mut servers: Vec<McpServer> = Vec::new();
        for spec in specs {
            let spec = spec.as_ref();
            let server = parse_one(spec).map_err(|why| BadServer {
                spec: spec.chars().take(200).collect(),
                why,
            })?;
            let clash = servers.iter().find(|s| {
                s.name == server.name || (s.host == server.host && s.port == server.port)
            });
            if let Some(clash) = clash {
                return Err(BadServer {
                    spec: spec.chars().take(200).collect(),
                    why: format!("{clash} is given already (one name and one origin per server)"),
                });
            }
            servers.push(server);
        }
        Ok(McpServers { servers })
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &McpServer> {
        self.servers.iter()
    }

    /// The server a request to `target` is for (`tls`: inside a terminated tunnel).
    pub fn find(&self, target: &Target, tls: bool) -> Option<&McpServer> {
        self.servers.iter().find(|s| s.is(target, tls))
    }

    /// Whether tunnels to `host` are terminated for an `https` server: the tunnel's port is
    /// judged by the request inside.
    pub fn terminates(&self, target: &Target) -> bool {
        self.find(target, true).is_some()
    }
}

/// The contract's tool-name alphabet, less `/` (the server's name is the part before it).
fn is_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
        && name.len() <= 64
}

fn parse_one(spec: &str) -> Result<McpServer, String> {
    let (name, url) = spec
        .split_once('=')
        .ok_or("expected NAME=URL, e.g. notes=http://127.0.0.1:8931/mcp")?;
    if !is_name(name) {
        return Err(format!(
            "the name {name:?} must be 1 to 64 letters, digits, _ . : or - (starting with a \
             letter, digit or _): it is the `<server>` of `<server>/<tool>` in a lease"
        ));
    }
    let url = url::Url::parse(url).map_err(|e| format!("the URL does not parse: {e}"))?;
    let tls = match url.scheme() {
        "https" => true,
        "http" => false,
        other => return Err(format!("the scheme {other:?} is neither http nor https")),
    };
    if !url.username().is_empty() || url.password().is_some() {
        return Err("the URL holds credentials: give a server's key as a secret instead".into());
    }
    let host = url.host_str().ok_or("the URL has no host")?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let host = parse_host(host).map_err(|e| format!("the host: {e}"))?;
    let port = url.port_or_known_default().ok_or("the URL has no port")?;
    Ok(McpServer {
        name: name.to_owned(),
        tls,
        host,
        port,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(host: &str, port: u16) -> Target {
        Target {
            host: parse_host(host).unwrap(),
            port,
        }
    }

    #[test]
    fn a_server_is_its_origin_whatever_the_path() {
        let servers = McpServers::parse(&[
            "notes=http://127.0.0.1:8931/mcp",
            "search=https://MCP.Example.com/v1/mcp/",
        ])
        .unwrap();
        let notes = servers.find(&target("127.0.0.1", 8931), false).unwrap();
        assert_eq!(notes.tool("read"), "notes/read");
        assert!(servers.find(&target("127.0.0.1", 8931), true).is_none());
        assert!(servers.find(&target("127.0.0.1", 8932), false).is_none());
        assert_eq!(
            servers
                .find(&target("mcp.example.com", 443), true)
                .unwrap()
                .name,
            "search"
        );
        assert!(servers.terminates(&target("mcp.example.com", 443)));
        assert!(!servers.terminates(&target("127.0.0.1", 8931)));
    }

    #[test]
    fn bad_values_say_what_is_wrong() {
        let why = |spec: &str| McpServers::parse(&[spec]).unwrap_err().to_string();
        assert!(why("notes").contains("expected NAME=URL"));
        assert!(why("no/slash=http://a.test").contains("the name"));
        assert!(why("a=ftp://a.test").contains("neither http nor https"));
        assert!(why("a=http://u:p@a.test").contains("credentials"));
        assert!(why("a=not a url").contains("does not parse"));
        let twice = McpServers::parse(&["a=http://a.test", "a=http://b.test"]).unwrap_err();
        assert!(twice.to_string().contains("given already"), "{twice}");
        let same = McpServers::parse(&["a=http://a.test", "b=http://a.test:80/x"]).unwrap_err();
        assert!(same.to_string().contains("given already"), "{same}");
    }
}
