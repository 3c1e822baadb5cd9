//! Development conveniences: the key files `keygen` writes, the key `issue` and `revoke` sign
//! with, and the set-up of `serve --dev` (a key, a journal, an egress log and a demo lease
//! under `./.leasegate/`).
//!
//! Invariant: a key file is created readable by its owner only and never overwritten; the
//! published test key never signs anything here.

use crate::commands::issue::{self, IssueError, IssueRequest};
use crate::config::{dev_file, Demo, DEV_ADMIN_TOKEN, DEV_DIR, EGRESS_STREAM_DEV_KEY};
use crate::contract::keys::KeyError;
use crate::contract::{Key, Keyring, Timestamp};
use crate::registry::ledger::{Ledger, Status};
use crate::telemetry::egress_stream::EgressKey;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum DevError {
    #[error("{path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("{0} holds the published TEST key; issue and revoke refuse it")]
    TestKey(String),
    #[error(transparent)]
    Issue(#[from] IssueError),
}

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> DevError + '_ {
    move |error| DevError::Io {
        path: path.display().to_string(),
        error,
    }
}

/// Writes `key` to a new file readable by its owner only; refuses to overwrite one.
pub fn write_key_file(path: &Path, key: &Key) -> Result<(), DevError> {
    crate::durable::create_new(path, 0o600, key.to_file_text().as_bytes()).map_err(io_error(path))
}

/// The key `issue` and `revoke` sign with: never the published test key.
pub fn signing_key(path: &Path) -> Result<Key, DevError> {
    let key = Key::load(path)?;
    if key.is_test_key() {
        return Err(DevError::TestKey(path.display().to_string()));
    }
    Ok(key)
}

/// The demo lease `serve --dev` hands out, whether an open one was reused, and the open demo
/// leases for other hosts it closed (a demo lease for `*` left open would outlive the
/// narrower one that replaced it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemoLease {
    pub id: String,
    pub reused: bool,
    pub closed: Vec<String>,
}

const DEMO_AGENT: &str = "dev-agent";

/// `serve --dev`'s directory [`DEV_DIR`] and its key (and, for `egress_stream`, the egress
/// stream's key), made where missing; the configuration
/// ([`crate::config::ServeConfig::resolve`]) then points at them where the flags say nothing.
pub fn prepare(egress_stream: bool) -> Result<(), DevError> {
    let dir = Path::new(DEV_DIR);
    std::fs::create_dir_all(dir).map_err(io_error(dir))?;
    let key_path = dev_file("dev.key");
    if !key_path.exists() {
        write_key_file(&key_path, &Key::generate())?;
    }
    let token_path = dev_file(DEV_ADMIN_TOKEN);
    if !token_path.exists() {
        let mut raw = [0u8; 32];
        rand::fill(&mut raw);
        let token = format!("{}\n", hex::encode(raw));
        crate::durable::create_new(&token_path, 0o600, token.as_bytes())
            .map_err(io_error(&token_path))?;
    }
    let stream_key = dev_file(EGRESS_STREAM_DEV_KEY);
    if egress_stream && !stream_key.exists() {
        EgressKey::write_new(&stream_key).map_err(io_error(&stream_key))?;
    }
    Ok(())
}

/// The open demo lease in the journal for the same hosts, signed with the dev key, if there
/// is one; otherwise a new one, issued now.
pub fn demo_lease(demo: &Demo) -> Result<DemoLease, DevError> {
    let key = signing_key(&demo.key_path)?;
    let mut keyring = Keyring::new(false);
    keyring.insert(key.clone());
    let (ledger, _) = crate::registry::journal::load(&demo.journal, Ledger::new(keyring))
        .map_err(io_error(&demo.journal))?;
    let now = Timestamp::now();
    let demos = || {
        ledger.leases().filter(|lease| {
            lease.agent_name == DEMO_AGENT
                && lease.parent.is_none()
                && *lease.key_fingerprint == *key.fingerprint()
                && ledger.status(&lease.id, now) == Some(Status::Open)
        })
    };
    let open = demos().filter(|lease| {
        lease.allow_hosts == demo.hosts
            && lease.deny_hosts.is_empty()
            // An hour left at least: a reused lease should outlive the session.
            && lease.expires_at.as_millis() > now.saturating_add_millis(3_600_000).as_millis()
    });
    // The newest one: it lives longest.
    let open = open.last().map(|lease| lease.id.clone());
    let others: Vec<String> = demos()
        .filter(|lease| Some(&lease.id) != open.as_ref())
        .map(|lease| lease.id.clone())
        .collect();
    let mut closed = Vec::new();
    for id in others {
        let reason = format!(
            "superseded: serve --dev now hands out a demo lease for {}",
            demo.hosts.join(" ")
        );
        if issue::revoke(&demo.journal, &key, &id, &reason, now)? {
            closed.push(id);
        }
    }
    if let Some(id) = open {
        return Ok(DemoLease {
            id,
            reused: true,
            closed,
        });
    }
    let issued = issue::issue(
        &demo.journal,
        &key,
        &IssueRequest {
            manifest: serde_json::json!({}),
            allow_hosts: demo.hosts.clone(),
            deny_hosts: vec![],
            parent: None,
            ttl: std::time::Duration::from_secs(24 * 3600),
            name: DEMO_AGENT.into(),
            purpose: "demo lease issued by leasegate serve --dev".into(),
            now,
        },
    )?;
    Ok(DemoLease {
        id: issued.lease_id,
        reused: false,
        closed,
    })
}
