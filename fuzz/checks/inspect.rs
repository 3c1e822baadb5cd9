//! The misuse checks on arbitrary request parts, and the egress log's redacted target on
//! arbitrary paths and queries: never panics; a request carrying a value or a canary is always
//! refused for it; a placeholder where its secret is not for is always `secret-misdirected`;
//! secrets are put in only inside a terminated tunnel, to their host, for an entitled lease; no
//! refusal repeats a value, a canary or a placeholder; and the redacted target keeps no query
//! value but the literal `[redacted]`.
//!
//! Input: one flags byte (method, terminated, host, entitled agent), then newline-separated
//! parts: the request target (`path?query`), header values, and the body last. `{V}`, `{C}` and
//! `{P}` in a part stand for the secret's value, the canary and the lease's placeholder, so that
//! the fuzzer reaches them without guessing 30 bytes.

use leasegate::contract::{Key, Lease, Timestamp};
use leasegate::intercept::inspect::{inspect, redacted_target, Seen};
use leasegate::policy::codes::Code;
use leasegate::secrets::{placeholder, SecretSet, Secrets};
use std::sync::{Arc, OnceLock};

const VALUE: &str = "ghp_fuzzvalue0123456789abcdef";
const CANARY: &str = "AKIA-fuzz-canary-000042";
const HOST: &str = "api.origin.test";
const LEASE_ID: &str = "00000001-0000-4000-8000-000000000000";
const METHODS: [&str; 8] = [
    "GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS", "get",
];

/// The fixed set: one header secret for `HOST` with routes, for agent "tester"; one canary.
fn set() -> Arc<SecretSet> {
    static SET: OnceLock<Arc<SecretSet>> = OnceLock::new();
    SET.get_or_init(|| {
        let path = std::env::temp_dir().join(format!(
            "leasegate-fuzz-inspect-{}.toml",
            std::process::id()
        ));
        let text = format!(
            r#"canaries = ["{CANARY}"]

[[secret]]
id = "github"
hosts = ["{HOST}"]
header = "Authorization"
format = "Bearer {{value}}"
env = "LG_FUZZ_VALUE"
routes = [{{ method = "GET", path = "/request" }}, {{ method = "POST", path = "/upload" }}]
agents = ["tester"]
env_name = "GITHUB_TOKEN"
"#
        );
        std::fs::write(&path, text).unwrap();
        let secrets = Secrets::load_with(&path, &|name| {
            (name == "LG_FUZZ_VALUE").then(|| VALUE.to_owned())
        })
        .unwrap();
        let _ = std::fs::remove_file(&path);
        secrets.current()
    })
    .clone()
}

fn key() -> Key {
    Key::from_bytes([7; 32])
}

fn lease(agent: &str) -> Lease {
    Lease {
        id: LEASE_ID.into(),
        parent: None,
        issued_at: Timestamp::parse("2025-01-01T00:00:00.000Z").unwrap(),
        expires_at: Timestamp::parse("2025-01-01T01:00:00.000Z").unwrap(),
        agent_name: agent.into(),
        allow_hosts: vec![HOST.into()],
        deny_hosts: vec![],
        key_fingerprint: key().fingerprint().into(),
        budget: None,
    }
}

/// `part` with the stand-ins replaced.
fn expand(part: &[u8], stand_in: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(part.len());
    let mut rest = part;
    while let Some((&byte, after)) = rest.split_first() {
        let with = match rest.get(..3) {
            Some(b"{V}") => VALUE,
            Some(b"{C}") => CANARY,
            Some(b"{P}") => stand_in,
            _ => {
                out.push(byte);
                rest = after;
                continue;
            }
        };
        out.extend_from_slice(with.as_bytes());
        rest = &rest[3..];
    }
    out
}

fn holds(part: &[u8], needle: &str) -> bool {
    part.windows(needle.len()).any(|w| w == needle.as_bytes())
}

pub fn check(data: &[u8]) {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let method = METHODS[usize::from(flags & 7)];
    let terminated = flags & 8 != 0;
    let host = (flags & 16 != 0).then_some(HOST);
    let entitled = flags & 32 == 0;
    let lease = lease(if entitled { "tester" } else { "someone-else" });
    let key = key();
    let stand_in = placeholder::derive(&key, LEASE_ID, "github");
    let parts: Vec<Vec<u8>> = rest
        .split(|b| *b == b'\n')
        .map(|p| expand(p, &stand_in))
        .collect();
    let target = String::from_utf8_lossy(&parts[0]).into_owned();
    let (path, query) = match target.split_once('?') {
        Some((path, query)) => (path, Some(query)),
        None => (target.as_str(), None),
    };
    check_redacted(path, query);

    let set = set();
    let scanned: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let seen = Seen {
        method,
        path,
        host,
        parts: &scanned,
        terminated,
    };
    // One memo for every input: a remembered placeholder must hold as well as a fresh one.
    static MEMO: OnceLock<placeholder::Memo> = OnceLock::new();
    let memo = MEMO.get_or_init(placeholder::Memo::default);
    let outcome = inspect(&set, &lease, Some(&key), memo, &seen);
    let exposed = parts.iter().any(|p| holds(p, VALUE) || holds(p, CANARY));
    let carried = parts.iter().any(|p| holds(p, &stand_in));
    match &outcome {
        Err(refusal) => {
            for shown in [VALUE, CANARY, stand_in.as_str()] {
                assert!(!refusal.detail.contains(shown), "{refusal:?}");
            }
            if exposed {
                assert!(
                    matches!(refusal.code, Code::SecretExposed | Code::CanaryTripped),
                    "{refusal:?}"
                );
            }
        }
        Ok(given) => {
            assert!(!exposed, "a value or canary passed: {data:?}");
            if !given.is_empty() {
                assert!(terminated && host == Some(HOST) && entitled, "{data:?}");
            }
        }
    }
    if !exposed && carried && !(terminated && host == Some(HOST) && entitled) {
        let code = outcome.as_ref().map_err(|r| r.code);
        assert_eq!(code.err(), Some(Code::SecretMisdirected), "{data:?}");
    }
}

/// Every item after the path's `?` is empty, `[redacted]`, or `name=[redacted]`.
fn check_redacted(path: &str, query: Option<&str>) {
    let shown = redacted_target(path, query);
    let Some(query) = query else {
        assert_eq!(shown, path);
        return;
    };
    let items = shown
        .strip_prefix(path)
        .and_then(|rest| rest.strip_prefix('?'))
        .unwrap_or_else(|| panic!("{shown:?} does not start with {path:?}?"));
    for item in items.split('&') {
        match item.split_once('=') {
            Some((_, value)) => assert_eq!(value, "[redacted]", "{path:?} {query:?}"),
            None => assert!(
                item.is_empty() || item == "[redacted]",
                "{path:?} {query:?}"
            ),
        }
    }
}
