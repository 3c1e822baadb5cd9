//! A `POST /leases` body on arbitrary bytes, decided against a fixed parent: never panic; a
//! body it accepts is decided (granted or refused, never both); a grant is schema-valid, names
//! only hosts the parent's patterns contain, keeps every parent denial and approval, holds each
//! ceiling at most the parent's remaining, is one generation shallower, and ends no later than
//! the parent; a refusal gives reserved codes only.

use leasegate::admin::issue::parse;
use leasegate::contract::narrow::{self, Ask, Parent, Remaining, RootPolicy};
use leasegate::contract::schema::Schema;
use leasegate::contract::{Lease, Timestamp};
use leasegate::issuer::Issuer;
use leasegate::policy::HostPattern;
use serde_json::{json, Value};
use std::sync::OnceLock;

fn parent() -> &'static Lease {
    static PARENT: OnceLock<Lease> = OnceLock::new();
    PARENT.get_or_init(|| {
        Lease::check(json!({
            "schema_version": "1.0",
            "lease_id": "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c",
            "manifest": narrow::completed(&json!({
                "agent": {"name": "parent"},
                "intent": {"purpose": "fuzz"},
                "allow": {"hosts": ["*.example.com", "api.other.org"], "tools": ["gh/search", "fs.read"],
                          "read_paths": ["src/**"]},
                "deny": {"hosts": ["secret.example.com"], "commands": ["sudo"]},
                "budget": {"tokens": 1000, "cost_usd": 2.5, "steps": 50, "depth": 2, "fan_out": 3},
                "approvals": ["external.write"],
            }), "1.0"),
            "declared_hash": "0".repeat(64),
            "issued_at": "2026-01-01T10:00:00.000Z",
            "expires_at": "2026-01-01T11:00:00.000Z",
            "issuer_session_id": "fuzz",
            "key_fingerprint": "sha256:0000000000000000",
            "signature": "0".repeat(64),
        }))
        .expect("the fuzz parent loads")
    })
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

pub fn check(data: &[u8]) {
    let Ok(request) = parse(data, None, Issuer::Operator) else {
        return;
    };
    let parent = parent();
    let now = Timestamp::parse("2026-01-01T10:30:00.000Z").unwrap();
    let declared = narrow::completed(&request.manifest, "1.0");
    let remaining = Remaining {
        tokens: Some(400),
        cost_usd: Some(1.0),
        steps: Some(50),
    };
    for with_parent in [false, true] {
        let ask = Ask {
            declared: &declared,
            parent: with_parent.then_some(Parent {
                lease: parent,
                remaining,
                live_children: 1,
            }),
            root: RootPolicy::default(),
            ends: Timestamp::parse("2026-01-01T12:00:00.000Z").unwrap(),
            now,
            public_suffix_wildcards: false,
        };
        let grant = match narrow::narrow(&ask) {
            Ok(grant) => grant,
            Err(refused) => {
                assert!(!refused.reasons.is_empty());
                for code in &refused.reasons {
                    let reserved = ["R1", "R2", "R4"].contains(&code.as_str())
                        || code.starts_with("runtime_error:")
                        || code.starts_with("vendor:leasegate:");
                    assert!(reserved, "{code}");
                }
                assert!(refused.reason.chars().count() <= 500);
                continue;
            }
        };
        let m = &grant.manifest;
        Schema::Manifest
            .validate(m)
            .expect("a grant is schema-valid");
        assert!(grant.summary().chars().count() <= 500);
        if !with_parent {
            let budget = &m["budget"];
            assert!(budget["depth"].as_u64().is_some_and(|d| d <= 4), "{budget}");
            assert!(
                budget["fan_out"].as_u64().is_some_and(|f| f <= 8),
                "{budget}"
            );
            continue;
        }
        let patterns: Vec<HostPattern> = parent
            .allow_hosts
            .iter()
            .map(|h| HostPattern::parse(h).unwrap())
            .collect();
        for host in strings(&m["allow"]["hosts"]) {
            let host = HostPattern::parse(host).expect("a granted host is a pattern");
            assert!(
                patterns.iter().any(|p| p.contains(&host)),
                "{host} is wider than the parent"
            );
        }
        for tool in strings(&m["allow"]["tools"]) {
            assert!(["gh/search", "fs.read"].contains(&tool), "{tool}");
        }
        for path in strings(&m["allow"]["read_paths"]) {
            assert!(path.starts_with("src/"), "{path}");
        }
        assert!(strings(&m["allow"]["write_paths"]).is_empty());
        assert!(strings(&m["allow"]["commands"]).is_empty());
        assert!(strings(&m["deny"]["hosts"]).contains(&"secret.example.com"));
        assert!(strings(&m["deny"]["commands"]).contains(&"sudo"));
        assert!(strings(&m["approvals"]).contains(&"external.write"));
        let budget = &m["budget"];
        assert!(
            budget["tokens"].as_u64().is_some_and(|t| t <= 400),
            "{budget}"
        );
        assert!(
            budget["cost_usd"].as_f64().is_some_and(|c| c <= 1.0),
            "{budget}"
        );
        assert!(
            budget["steps"].as_u64().is_some_and(|s| s <= 50),
            "{budget}"
        );
        assert!(budget["depth"].as_u64().is_some_and(|d| d <= 1), "{budget}");
        assert!(
            budget["fan_out"].as_u64().is_some_and(|f| f <= 3),
            "{budget}"
        );
        assert!(grant.expires_at <= parent.expires_at);
        assert_eq!(m["parent_lease_id"], parent.id.as_str());
    }
}
