//! The misuse checks on arbitrary request parts, and what the outputs show of arbitrary paths,
//! queries and details: never panics; a request carrying a value or a canary is always refused
//! for it; a placeholder where its secret is not for is always `secret-misdirected`; secrets
//! are put in only inside a terminated tunnel, to their host, for an entitled lease, on a path
//! whose normal form is one of its routes; no refusal repeats a value, a canary or a
//! placeholder; the shown target keeps no query value but the literal `[redacted]`; and neither
//! the shown target nor a scrubbed detail holds a value, a canary or a placeholder's prefix in
//! any percent-encoding.
//!
//! Input: one flags byte (method, terminated, host, entitled agent), then newline-separated
//! parts: the request target (`path?query`), header values, and the body last. `{V}`, `{C}` and
//! `{P}` in a part stand for the secret's value, the canary and the lease's placeholder, so that
//! the fuzzer reaches them without guessing 30 bytes.

use leasegate::contract::{Key, Lease, Timestamp};
use leasegate::intercept::inspect::{inspect, Seen};
use leasegate::policy::codes::Code;
use leasegate::policy::path::normalise;
use leasegate::secrets::{placeholder, SecretSet, Secrets};
use std::sync::{Arc, OnceLock};

// A `/` in the value: a path can hold it across two segments.
const VALUE: &str = "ghp_fuzz/value0123456789abcdef";
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
        terms: None,
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
    let set = set();
    check_redacted(&set, path, query);
    check_scrubbed(&set, &target);

    let scanned: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let shown = set.shown_target(path, None);
    let normal = normalise(path);
    let seen = Seen {
        method,
        path: &shown,
        normal: normal.as_deref().map_err(|&why| why),
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
                let routed = matches!(
                    (method, normal.as_deref()),
                    ("GET", Ok("/request")) | ("POST", Ok("/upload"))
                );
                assert!(routed, "given off its routes: {method} {path:?}");
            }
        }
    }
    if !exposed && carried && !(terminated && host == Some(HOST) && entitled) {
        let code = outcome.as_ref().map_err(|r| r.code);
        assert_eq!(code.err(), Some(Code::SecretMisdirected), "{data:?}");
    }
}

/// Every item after the shown path's `?` is empty, `[redacted]`, or `name=[redacted]`, and
/// nothing shown holds what must never be shown.
fn check_redacted(set: &SecretSet, path: &str, query: Option<&str>) {
    let shown = set.shown_target(path, query);
    assert_clean(&shown);
    let Some(query) = query else {
        return;
    };
    let (_, items) = shown
        .split_once('?')
        .unwrap_or_else(|| panic!("{shown:?} lost its query"));
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

fn check_scrubbed(set: &SecretSet, text: &str) {
    assert_clean(&set.scrubbed(text));
}

/// `shown`, raw and percent-decoded up to four times, holds no value, canary or `lgp_` (in
/// any case).
fn assert_clean(shown: &str) {
    let mut current = shown.as_bytes().to_vec();
    for _ in 0..=4 {
        for needle in [VALUE, CANARY] {
            assert!(!holds(&current, needle), "{shown:?} shows {needle:?}");
        }
        let lower = current.to_ascii_lowercase();
        assert!(!holds(&lower, "lgp_"), "{shown:?} shows a placeholder");
        current = percent_encoding::percent_decode(&current).collect();
    }
}
