//! The proxy: listeners, the decision pipeline shared by CONNECT tunnels and forwarded
//! requests, and what moves the bytes.
//!
//! Invariant: every CONNECT and forwarded request (and `check`) is decided by
//! [`decision::decide`] then [`decision::resolve_and_guard`], in [`pipeline`]'s fixed phases,
//! then dialled, then relayed; every exchange writes exactly one egress line; every answer the
//! proxy itself writes is built in [`answer`]. No two modules here import each other.

pub mod answer;
pub mod approve;
pub mod body;
pub mod congestion;
pub mod connect;
pub mod connection;
pub mod decision;
pub mod dialer;
pub mod exchange;
pub mod explain;
pub mod forward;
pub mod hello;
pub mod identify;
pub mod lease_ports;
pub mod listener;
pub mod mcp;
pub mod metering;
pub mod pipeline;
pub mod plain_tunnel;
#[cfg(target_os = "linux")]
pub mod sniffed;
pub mod splice;
pub mod state;
pub mod terminate;
pub mod upstream;
pub mod workers;

pub use crate::config::{Mode, OnRefusal, ProxyConfig};
pub use body::{empty, full, Body, BoxError};
pub use connection::ClientConn;
pub use decision::Decision;
pub use listener::serve;
pub use pipeline::Cleared;
pub use state::Proxy;
pub use workers::Workers;

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::path::Path;

    /// The identifiers a path names right after `prefix`: `super::x` gives `x`,
    /// `super::{x, y::z, Z}` gives `x`, `y` and `Z`.
    fn named_after<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
        let ident = |s: &'a str| {
            let end = s
                .find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(s.len());
            &s[..end]
        };
        let mut names = Vec::new();
        for (at, _) in text.match_indices(prefix) {
            let rest = &text[at + prefix.len()..];
            match rest.strip_prefix('{') {
                Some(group) => {
                    let group = &group[..group.find('}').unwrap_or(group.len())];
                    names.extend(group.split(',').map(|item| ident(item.trim())));
                }
                None => names.push(ident(rest)),
            }
        }
        names
    }

    /// Which of this module's files each file imports (`use super::x`, `crate::proxy::x`, or a
    /// name this module re-exports from `x`), tests left out.
    fn imports() -> BTreeMap<String, BTreeSet<String>> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/proxy");
        let read = |path: &Path| std::fs::read_to_string(path).unwrap();
        let root = read(&dir.join("mod.rs"));
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
            let text = match path.is_dir() {
                true => read(&path.join("mod.rs")),
                false if name != "mod" => read(&path),
                false => continue,
            };
            files.insert(name, text);
        }
        // `pub use x::{A, B};` here: naming `A` through this module is importing `x`.
        let mut reexported = BTreeMap::new();
        for line in root.lines() {
            if let Some(rest) = line.strip_prefix("pub use ") {
                let module = &rest[..rest.find("::").unwrap_or(0)];
                if files.contains_key(module) {
                    for name in named_after(rest, &format!("{module}::")) {
                        reexported.insert(name.to_owned(), module.to_owned());
                    }
                }
            }
        }
        let mut graph = BTreeMap::new();
        for (name, text) in &files {
            let text = &text[..text.find("#[cfg(test)]\nmod tests").unwrap_or(text.len())];
            let mut names = named_after(text, "super::");
            names.extend(named_after(text, "crate::proxy::"));
            let deps: BTreeSet<String> = names
                .into_iter()
                .filter_map(|n| match files.contains_key(n) {
                    true => Some(n.to_owned()),
                    false => reexported.get(n).cloned(),
                })
                .filter(|dep| dep != name)
                .collect();
            graph.insert(name.clone(), deps);
        }
        graph
    }

    #[test]
    fn no_two_files_import_each_other() {
        let graph = imports();
        // The scan sees what it must: the pipeline uses the connection state and the decision.
        assert!(graph["pipeline"].contains("connection"), "{graph:?}");
        assert!(graph["pipeline"].contains("decision"), "{graph:?}");
        let mutual: Vec<(&String, &String)> = graph
            .iter()
            .flat_map(|(a, deps)| deps.iter().map(move |b| (a, b)))
            .filter(|(a, b)| a < b && graph.get(*b).is_some_and(|d| d.contains(*a)))
            .collect();
        assert!(
            mutual.is_empty(),
            "files under src/proxy importing each other: {mutual:?}"
        );
    }
}
