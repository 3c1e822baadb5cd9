use super::*;
use crate::contract::lease::Lease;
use serde_json::json;

const PARENT: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

fn t(text: &str) -> Timestamp {
    Timestamp::parse(text).unwrap()
}

fn manifest(allow_hosts: Value, budget: Value) -> Value {
    completed(
        &json!({
            "agent": {"name": "worker"},
            "intent": {"purpose": "test the issuer"},
            "allow": {"hosts": allow_hosts, "tools": ["cdf_write", "gh/search"],
                      "read_paths": ["src/**"], "commands": ["git"]},
            "deny": {"hosts": ["*.internal.example"], "commands": ["sudo"]},
            "budget": budget,
            "approvals": ["external.write"],
        }),
        "1.0",
    )
}

/// A parent lease (unsigned: `Lease::check`) granted `manifest`, open 10:00–11:00.
fn parent(manifest: Value) -> Lease {
    Lease::check(json!({
        "schema_version": "1.0",
        "lease_id": PARENT,
        "manifest": manifest,
        "declared_hash": "0".repeat(64),
        "issued_at": "2026-01-01T10:00:00.000Z",
        "expires_at": "2026-01-01T11:00:00.000Z",
        "issuer_session_id": "test",
        "key_fingerprint": "sha256:0000000000000000",
        "signature": "0".repeat(64),
    }))
    .unwrap()
}

fn child_of<'a>(lease: &'a Lease, declared: &'a Value, remaining: Remaining) -> Ask<'a> {
    Ask {
        declared,
        parent: Some(Parent {
            lease,
            remaining,
            live_children: 0,
        }),
        root: RootPolicy::default(),
        ends: t("2026-01-01T12:00:00.000Z"),
        now: t("2026-01-01T10:30:00.000Z"),
        public_suffix_wildcards: false,
    }
}

fn root(declared: &Value) -> Ask<'_> {
    Ask {
        declared,
        parent: None,
        root: RootPolicy::default(),
        ends: t("2026-01-01T12:00:00.000Z"),
        now: t("2026-01-01T10:30:00.000Z"),
        public_suffix_wildcards: false,
    }
}

#[test]
fn allow_lists_are_intersected_with_the_parents() {
    let p = parent(manifest(
        json!(["*.example.com", "api.other.com"]),
        json!({}),
    ));
    let mut declared = manifest(
        json!([
            "api.example.com",
            "*.other.com",
            "evil.test",
            "api.example.com"
        ]),
        json!({}),
    );
    declared["allow"]["tools"] = json!(["gh/search", "shell/exec"]);
    declared["allow"]["read_paths"] = json!(["src/lib/**", "**", "etc/**"]);
    let grant = narrow(&child_of(&p, &declared, Remaining::default())).unwrap();
    let allow = &grant.manifest["allow"];
    // Within kept; wider gives way to the parent's entry; outside dropped; repeats once.
    assert_eq!(allow["hosts"], json!(["api.example.com", "api.other.com"]));
    assert_eq!(allow["tools"], json!(["gh/search"]));
    assert_eq!(allow["read_paths"], json!(["src/lib/**", "src/**"]));
    assert_eq!(grant.manifest["parent_lease_id"], PARENT);
    for clause in [
        "allow.hosts *.other.com → api.other.com",
        "allow.hosts -1",
        "allow.tools -1",
        "allow.read_paths ** → src/**",
        "allow.read_paths -1",
    ] {
        assert!(
            grant.narrowed.iter().any(|c| c == clause),
            "{clause}: {:?}",
            grant.narrowed
        );
    }
}

#[test]
fn deny_lists_and_approvals_are_united_with_the_parents() {
    let mut pm = manifest(json!(["*.example.com"]), json!({}));
    pm["deny"]["hosts"] = json!(["secret.example.com"]);
    pm["deny"]["paths"] = json!([".env"]);
    pm["approvals"] = json!(["phase.advance"]);
    let p = parent(pm);
    let declared = manifest(json!(["*.example.com"]), json!({}));
    let grant = narrow(&child_of(&p, &declared, Remaining::default())).unwrap();
    let m = &grant.manifest;
    assert_eq!(
        m["deny"]["hosts"],
        json!(["*.internal.example", "secret.example.com"])
    );
    assert_eq!(m["deny"]["paths"], json!([".env"]));
    assert_eq!(m["deny"]["commands"], json!(["sudo"]));
    assert_eq!(m["approvals"], json!(["external.write", "phase.advance"]));
    assert!(grant.narrowed.contains(&"deny.hosts +1".to_owned()));
    assert!(grant.narrowed.contains(&"approvals +1".to_owned()));
}

#[test]
fn the_end_and_every_budget_field_are_clamped_to_the_parents_remaining() {
    let p = parent(manifest(
        json!(["*.example.com"]),
        json!({"tokens": 1000, "cost_usd": 3, "depth": 2, "fan_out": 4}),
    ));
    let declared = manifest(
        json!(["api.example.com"]),
        json!({"tokens": 400000, "cost_usd": 4.5, "steps": 10, "depth": 3, "fan_out": 1}),
    );
    let remaining = Remaining {
        tokens: Some(250),
        cost_usd: Some(1.25),
        steps: None,
    };
    let grant = narrow(&child_of(&p, &declared, remaining)).unwrap();
    assert_eq!(
        grant.manifest["budget"],
        json!({"tokens": 250, "cost_usd": 1.25, "steps": 10, "depth": 1, "fan_out": 1})
    );
    assert_eq!(grant.expires_at, p.expires_at, "never after the parent");
    assert!(
        grant.summary().contains("budget.tokens 400000→250"),
        "{}",
        grant.summary()
    );
    assert!(grant.summary().contains("budget.depth 3→1"));
    // An absent field takes the parent's remaining.
    let declared = manifest(json!(["api.example.com"]), json!({}));
    let grant = narrow(&child_of(&p, &declared, remaining)).unwrap();
    assert_eq!(
        grant.manifest["budget"],
        json!({"tokens": 250, "cost_usd": 1.25, "depth": 1, "fan_out": 4})
    );
}

#[test]
fn a_parent_at_depth_zero_or_with_a_full_fan_out_issues_nothing() {
    let p = parent(manifest(json!(["*"]), json!({"depth": 0})));
    let declared = manifest(json!(["api.example.com"]), json!({}));
    let refused = narrow(&child_of(&p, &declared, Remaining::default())).unwrap_err();
    assert_eq!(refused.reasons, ["vendor:leasegate:depth-exhausted"]);
    assert_eq!(refused.kind, Refusal::Parent);

    let p = parent(manifest(json!(["*"]), json!({"fan_out": 2})));
    let mut ask = child_of(&p, &declared, Remaining::default());
    if let Some(parent) = &mut ask.parent {
        parent.live_children = 2;
    }
    let refused = narrow(&ask).unwrap_err();
    assert_eq!(refused.reasons, ["vendor:leasegate:fan-out-full"]);
    if let Some(parent) = &mut ask.parent {
        parent.live_children = 1;
    }
    assert!(narrow(&ask).is_ok());
}

#[test]
fn the_reserved_reasons_are_given_together() {
    let mut declared = manifest(json!(["api.example.com"]), json!({}));
    declared["intent"]["purpose"] = json!("  ");
    declared["agent"]["kind"] = json!("native");
    let refused = narrow(&root(&declared)).unwrap_err();
    assert_eq!(refused.reasons, ["R1", "R4"]);
    assert_eq!(
        refused.reason,
        "purpose is empty; runtime_agent unknown is refused for a native agent"
    );
    declared["intent"]["purpose"] = json!("");
    declared["allow"]["tools"] = json!(["*"]);
    let refused = narrow(&root(&declared)).unwrap_err();
    assert_eq!(
        refused.reasons,
        ["R1", "R4", "runtime_error:schema_invalid"]
    );
    assert!(
        refused.reason.contains("/allow/tools/0"),
        "{}",
        refused.reason
    );
}

#[test]
fn malformed_and_public_suffix_host_patterns_are_refused_not_ignored() {
    for (list, host) in [
        ("deny", "*.*.example.com"),
        ("allow", "*.com"),
        ("allow", "a b"),
    ] {
        let mut declared = manifest(json!(["api.example.com"]), json!({}));
        declared[list]["hosts"] = json!([host]);
        let refused = narrow(&root(&declared)).unwrap_err();
        assert_eq!(refused.reasons, ["runtime_error:schema_invalid"], "{host}");
    }
}

#[test]
fn a_grant_that_opens_nothing_is_r2() {
    let p = parent(manifest(json!(["*.example.com"]), json!({})));
    let mut declared = manifest(json!(["evil.test"]), json!({}));
    declared["allow"]["tools"] = json!(["shell/exec"]);
    let refused = narrow(&child_of(&p, &declared, Remaining::default())).unwrap_err();
    assert_eq!(refused.reasons, ["R2"]);
    assert_eq!(refused.kind, Refusal::Declaration);
    let empty = completed(
        &json!({"agent": {"name": "a"}, "intent": {"purpose": "p"}}),
        "1.0",
    );
    assert_eq!(narrow(&root(&empty)).unwrap_err().reasons, ["R2"]);
}

#[test]
fn a_root_is_held_to_the_root_policy_and_tool_args_are_not_granted() {
    let mut declared = manifest(json!(["api.example.com"]), json!({"depth": 9}));
    declared["allow"]["tool_args"] = json!({"gh/search": {"type": "object"}});
    declared["parent_lease_id"] = json!(PARENT);
    let grant = narrow(&root(&declared)).unwrap();
    assert_eq!(grant.manifest["budget"], json!({"depth": 4, "fan_out": 8}));
    assert!(grant.manifest["allow"].get("tool_args").is_none());
    assert!(grant.manifest.get("parent_lease_id").is_none());
    assert_eq!(grant.expires_at, t("2026-01-01T12:00:00.000Z"));
    assert_eq!(
        grant.narrowed,
        [
            "allow.tool_args dropped (a declaration, not a grant)",
            "budget.depth 9→4",
            "budget.fan_out set to 8"
        ]
    );
}

#[test]
fn a_completed_manifest_is_schema_valid_and_keeps_what_was_given() {
    let given = json!({"agent": {"name": "a", "kind": "plugin"}, "intent": {"purpose": "p"},
                       "allow": {"hosts": ["x.test"]}, "budget": {"tokens": 5}});
    let whole = completed(&given, "1.0");
    Schema::Manifest.validate(&whole).unwrap();
    assert_eq!(whole["agent"]["kind"], "plugin");
    assert_eq!(whole["agent"]["runtime_agent"], "unknown");
    assert_eq!(whole["allow"]["hosts"], json!(["x.test"]));
    assert_eq!(whole["allow"]["tools"], json!([]));
    assert_eq!(whole["budget"], json!({"tokens": 5}));
    assert_eq!(completed(&json!([1]), "1.0"), json!([1]));
}

#[test]
fn the_summary_is_bounded() {
    let grant = Grant {
        manifest: json!({}),
        expires_at: t("2026-01-01T12:00:00.000Z"),
        narrowed: vec!["x".repeat(300), "y".repeat(300)],
    };
    assert_eq!(grant.summary().chars().count(), SUMMARY_MAX_CHARS);
}

#[test]
fn members_the_contract_does_not_name_are_refused_not_carried() {
    for (part, key) in [
        ("budget", "token"),
        ("allow", "hostz"),
        ("deny", "host"),
        ("", "budgett"),
    ] {
        let mut declared = manifest(json!(["api.example.com"]), json!({}));
        match part {
            "" => declared[key] = json!(5),
            part => declared[part][key] = json!(5),
        }
        let refused = narrow(&root(&declared)).unwrap_err();
        assert_eq!(
            refused.reasons,
            ["runtime_error:schema_invalid"],
            "{part}.{key}"
        );
        assert!(refused.reason.contains(key), "{}", refused.reason);
    }
}

mod index {
    use super::super::{Hosts, Paths, Within};
    use crate::policy::HostPattern;
    use proptest::prelude::*;

    fn host() -> impl Strategy<Value = String> {
        let label = prop::sample::select(vec!["a", "b", "c", "example", "com"]);
        (prop::collection::vec(label, 1..4), 0..3u8).prop_map(|(labels, kind)| {
            let name = labels.join(".");
            match kind {
                0 => format!("*.{name}"),
                1 if labels.len() == 1 => "*".to_owned(),
                _ => name,
            }
        })
    }

    fn path() -> impl Strategy<Value = String> {
        let part = prop::sample::select(vec!["src", "lib", "a", "**", "x.rs"]);
        prop::collection::vec(part, 1..4).prop_map(|parts| parts.join("/"))
    }

    fn glob_contains(parent: &str, child: &str) -> bool {
        parent == child
            || parent == "**"
            || parent
                .strip_suffix("**")
                .is_some_and(|dir| dir.ends_with('/') && child.starts_with(dir))
    }

    proptest! {
        /// The index answers what comparing every pair answers.
        #[test]
        fn hosts_index_agrees_with_pairwise_containment(
            parent in prop::collection::vec(host(), 0..6),
            child in host(),
        ) {
            let index = Hosts::new(&parent);
            let pat = |t: &str| HostPattern::parse(t).unwrap();
            let c = pat(&child);
            prop_assert_eq!(index.covers(&child), parent.iter().any(|p| pat(p).contains(&c)));
            let mut under = index.under(&child);
            under.sort();
            under.dedup();
            let mut expected: Vec<String> = parent
                .iter()
                .filter(|p| c.contains(&pat(p)) && **p != child)
                .map(|p| pat(p).to_string())
                .collect();
            expected.sort();
            expected.dedup();
            if !index.covers(&child) {
                prop_assert_eq!(under, expected);
            }
        }

        #[test]
        fn paths_index_agrees_with_pairwise_containment(
            parent in prop::collection::vec(path(), 0..6),
            child in path(),
        ) {
            let index = Paths::new(&parent);
            prop_assert_eq!(index.covers(&child), parent.iter().any(|p| glob_contains(p, &child)));
            if !index.covers(&child) {
                let mut under = index.under(&child);
                under.sort();
                under.dedup();
                let mut expected: Vec<String> =
                    parent.iter().filter(|p| glob_contains(&child, p)).cloned().collect();
                expected.sort();
                expected.dedup();
                prop_assert_eq!(under, expected);
            }
        }
    }
}
