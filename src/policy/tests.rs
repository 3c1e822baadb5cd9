//! Table tests (one named row per behaviour, in smokescreen's style) and property tests for
//! target normalisation, pattern containment and chain verdicts.
//!
//! Invariant: every row and property asserts a value; a row's name says the behaviour it pins.

use super::pattern::HostPattern;
use super::target::{parse_authority, parse_host, Target, TargetHost};
use super::verdict::{decide, HostPolicy, HostSet, HostVerdict};
use proptest::prelude::*;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The kind of verdict a row expects (which lease decided is pinned in verdict.rs's tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Allowed,
    Denied,
    NotAllowed,
}

fn kind(verdict: &HostVerdict<'_>) -> Want {
    match verdict {
        HostVerdict::Allowed(_) => Want::Allowed,
        HostVerdict::Denied(_) => Want::Denied,
        HostVerdict::NotAllowed(_) => Want::NotAllowed,
    }
}

struct Case {
    name: &'static str,
    allow: &'static [&'static str],
    deny: &'static [&'static str],
    /// The parent's lists; `None`: the lease has no parent.
    parent_allow: Option<&'static [&'static str]>,
    parent_deny: &'static [&'static str],
    /// As a client would spell it (normalised like a target before matching).
    host: &'static str,
    want: Want,
}

const fn case(
    name: &'static str,
    allow: &'static [&'static str],
    deny: &'static [&'static str],
    host: &'static str,
    want: Want,
) -> Case {
    Case {
        name,
        allow,
        deny,
        parent_allow: None,
        parent_deny: &[],
        host,
        want,
    }
}

const VERDICTS: &[Case] = &[
    case(
        "a wildcard does not match its apex",
        &["*.example.com"],
        &[],
        "example.com",
        Want::NotAllowed,
    ),
    case(
        "a wildcard matches a direct subdomain",
        &["*.example.com"],
        &[],
        "api.example.com",
        Want::Allowed,
    ),
    case(
        "a wildcard matches deep subdomains",
        &["*.example.com"],
        &[],
        "a.b.c.d.example.com",
        Want::Allowed,
    ),
    case(
        "a wildcard does not match a look-alike suffix",
        &["*.example.com"],
        &[],
        "badexample.com",
        Want::NotAllowed,
    ),
    case(
        "an exact name does not cover its subdomains",
        &["api.example.com"],
        &[],
        "x.api.example.com",
        Want::NotAllowed,
    ),
    case(
        "an exact name matches whatever the target's case and trailing dot",
        &["api.example.com"],
        &[],
        "API.Example.COM.",
        Want::Allowed,
    ),
    case(
        "a wildcard never matches an IP literal",
        &["*.0.0.1", "*.1"],
        &[],
        "127.0.0.1",
        Want::NotAllowed,
    ),
    case(
        "* matches an IP literal",
        &["*"],
        &[],
        "10.0.0.1",
        Want::Allowed,
    ),
    case(
        "* matches an IPv6 literal",
        &["*"],
        &[],
        "[2001:db8::1]",
        Want::Allowed,
    ),
    case(
        "an IP pattern matches another spelling of the target",
        &["10.1.2.3"],
        &[],
        "0x0a.1.2.3",
        Want::Allowed,
    ),
    case(
        "an octal IPv4 pattern names the dotted quad",
        &["0177.0.0.1"],
        &[],
        "127.0.0.1",
        Want::Allowed,
    ),
    case(
        "an IDN target matches its A-label pattern",
        &["xn--bcher-kva.example"],
        &[],
        "bücher.example",
        Want::Allowed,
    ),
    case(
        "an IDN subdomain matches an A-label wildcard",
        &["*.xn--bcher-kva.example"],
        &[],
        "shop.BÜCHER.example",
        Want::Allowed,
    ),
    case(
        "a U-label pattern matches nothing: patterns are A-labels",
        &["*.bücher.example"],
        &[],
        "shop.bücher.example",
        Want::NotAllowed,
    ),
    case(
        "deny beats allow in the same lease",
        &["*.example.com"],
        &["secret.example.com"],
        "secret.example.com",
        Want::Denied,
    ),
    case(
        "a deny wildcard beats an exact allow",
        &["a.evil.example"],
        &["*.evil.example"],
        "a.evil.example",
        Want::Denied,
    ),
    case(
        "a denied IP matches every spelling of it",
        &["*"],
        &["127.0.0.1"],
        "2130706433",
        Want::Denied,
    ),
    case(
        "deny * refuses everything",
        &["*"],
        &["*"],
        "example.com",
        Want::Denied,
    ),
    case(
        "an empty allow list allows nothing",
        &[],
        &[],
        "example.com",
        Want::NotAllowed,
    ),
    case(
        "a malformed `*.` never widens to *",
        &["*."],
        &[],
        "anything.example",
        Want::NotAllowed,
    ),
    case(
        "a malformed `*..` never widens to *",
        &["*.."],
        &[],
        "anything.example",
        Want::NotAllowed,
    ),
    case(
        "a malformed `*x.com` matches neither x.com nor ax.com",
        &["*x.com"],
        &[],
        "ax.com",
        Want::NotAllowed,
    ),
    case(
        "a pattern with a port matches nothing",
        &["example.com:443"],
        &[],
        "example.com",
        Want::NotAllowed,
    ),
    case(
        "a pattern with a scheme matches nothing",
        &["https://example.com"],
        &[],
        "example.com",
        Want::NotAllowed,
    ),
    case(
        "a double wildcard matches nothing",
        &["*.*.com"],
        &[],
        "a.b.com",
        Want::NotAllowed,
    ),
    Case {
        name: "a parent narrower than its child wins",
        allow: &["*"],
        deny: &[],
        parent_allow: Some(&["*.example.com"]),
        parent_deny: &[],
        host: "other.org",
        want: Want::NotAllowed,
    },
    Case {
        name: "what child and parent both allow is allowed",
        allow: &["*"],
        deny: &[],
        parent_allow: Some(&["*.example.com"]),
        parent_deny: &[],
        host: "a.example.com",
        want: Want::Allowed,
    },
    Case {
        name: "a child narrower than its parent is honoured",
        allow: &["a.example.com"],
        deny: &[],
        parent_allow: Some(&["*.example.com"]),
        parent_deny: &[],
        host: "b.example.com",
        want: Want::NotAllowed,
    },
    Case {
        name: "a deny in an ancestor beats the child's allow",
        allow: &["*"],
        deny: &[],
        parent_allow: Some(&["*"]),
        parent_deny: &["*.evil.example"],
        host: "x.evil.example",
        want: Want::Denied,
    },
    Case {
        name: "a child's deny applies even where the parent allows",
        allow: &["*"],
        deny: &["api.example.com"],
        parent_allow: Some(&["*"]),
        parent_deny: &[],
        host: "api.example.com",
        want: Want::Denied,
    },
];

#[test]
fn verdict_table() {
    let mut failures = Vec::new();
    for case in VERDICTS {
        let own = HostPolicy::compile(case.allow, case.deny);
        let parent = case
            .parent_allow
            .map(|allow| HostPolicy::compile(allow, case.parent_deny));
        let mut chain = vec![("child", &own)];
        chain.extend(parent.as_ref().map(|p| ("parent", p)));
        let host = parse_authority(case.host, Some(443))
            .unwrap_or_else(|e| panic!("{}: bad host {:?}: {e}", case.name, case.host))
            .host;
        let got = kind(&decide(chain.iter().copied(), &host));
        if got != case.want {
            failures.push(format!("{}: want {:?}, got {got:?}", case.name, case.want));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `parse_authority(input, Some(443))`: the canonical `Display`, or the refusal's reason.
const TARGETS: &[(&str, &str, Result<&str, &str>)] = &[
    (
        "a name is lower-cased",
        "Example.COM",
        Ok("example.com:443"),
    ),
    (
        "one trailing dot is dropped",
        "example.com.",
        Ok("example.com:443"),
    ),
    (
        "two trailing dots are refused",
        "example.com..",
        Err("more than one trailing dot"),
    ),
    (
        "an explicit port is kept",
        "example.com:8080",
        Ok("example.com:8080"),
    ),
    (
        "a U-label becomes its A-label",
        "Bücher.example",
        Ok("xn--bcher-kva.example:443"),
    ),
    (
        "an A-label stays as it is",
        "xn--bcher-kva.example",
        Ok("xn--bcher-kva.example:443"),
    ),
    (
        "a full-width dot separates labels",
        "example\u{ff0e}com",
        Ok("example.com:443"),
    ),
    (
        "a short IPv4 is a dotted quad",
        "127.1",
        Ok("127.0.0.1:443"),
    ),
    (
        "a decimal IPv4 is a dotted quad",
        "2130706433",
        Ok("127.0.0.1:443"),
    ),
    (
        "a hex IPv4 is a dotted quad",
        "0x7f.0.0.1",
        Ok("127.0.0.1:443"),
    ),
    (
        "an octal IPv4 is a dotted quad",
        "0177.0.0.1:80",
        Ok("127.0.0.1:80"),
    ),
    (
        "IPv6 is canonical and bracketed",
        "[2001:DB8:0:0:0:0:0:1]:8443",
        Ok("[2001:db8::1]:8443"),
    ),
    (
        "IPv4-mapped IPv6 is IPv4",
        "[::ffff:10.0.0.1]",
        Ok("10.0.0.1:443"),
    ),
    (
        "IPv6 without brackets is refused",
        "2001:db8::1",
        Err("IPv6 address without brackets"),
    ),
    (
        "a zone id is refused",
        "[fe80::1%25eth0]",
        Err("percent-escape or zone id in target"),
    ),
    (
        "userinfo is refused",
        "user@example.com",
        Err("userinfo in target"),
    ),
    (
        "a percent-escape is refused",
        "ex%61mple.com",
        Err("percent-escape or zone id in target"),
    ),
    (
        "whitespace is refused",
        "exa mple.com",
        Err("whitespace or control character in target"),
    ),
    ("an empty host is refused", ":443", Err("empty host")),
    (
        "port 0 is refused",
        "example.com:0",
        Err("port out of range"),
    ),
    (
        "a port past 65535 is refused",
        "example.com:65536",
        Err("port out of range"),
    ),
    (
        "a signed port is refused",
        "example.com:-1",
        Err("port out of range"),
    ),
    (
        "a wildcard is not a target",
        "*.example.com",
        Err("host is not a DNS name"),
    ),
    (
        "an IPv4 out of range is refused",
        "256.0.0.1",
        Err("unparseable host"),
    ),
    ("junk after ']' is refused", "[::1]x", Err("junk after ']'")),
];

#[test]
fn target_table() {
    let mut failures = Vec::new();
    for (name, input, want) in TARGETS {
        let got = parse_authority(input, Some(443));
        let got = got
            .as_ref()
            .map(Target::to_string)
            .map_err(|e| e.to_string());
        if got.as_deref().map_err(String::as_str) != *want {
            failures.push(format!("{name}: {input:?}: want {want:?}, got {got:?}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// --- Properties -------------------------------------------------------------------------

/// A DNS-ish label: ASCII in mixed case, or one of a few IDN labels.
fn label() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9]([a-zA-Z0-9-]{0,8}[a-zA-Z0-9])?",
        prop::sample::select(vec![
            "bücher",
            "MÜNCHEN",
            "日本",
            "ﬁx",
            "straße",
            "пример",
            "xn--bcher-kva",
            "Ωmega",
        ])
        .prop_map(str::to_owned),
    ]
}

/// An IPv4 address in one of the spellings the WHATWG host parser reads.
fn ipv4_spelling() -> impl Strategy<Value = (Ipv4Addr, String)> {
    (any::<u32>(), 0..4u8).prop_map(|(n, style)| {
        let ip = Ipv4Addr::from(n);
        let [a, b, c, d] = ip.octets();
        let text = match style {
            0 => ip.to_string(),
            1 => n.to_string(),
            2 => format!("0x{a:x}.0x{b:x}.0x{c:x}.0x{d:x}"),
            _ => format!("0{a:o}.0{b:o}.0{c:o}.0{d:o}"),
        };
        (ip, text)
    })
}

/// All eight groups, upper-case hex: the opposite of the canonical form.
fn spelled_out(ip: Ipv6Addr) -> String {
    let groups: Vec<String> = ip.segments().iter().map(|g| format!("{g:X}")).collect();
    groups.join(":")
}

/// A host as a client might write it (upper case, IDN, trailing dot, IP literals).
fn host_spelling() -> impl Strategy<Value = String> {
    prop_oneof![
        (prop::collection::vec(label(), 1..5), any::<bool>()).prop_map(|(labels, dot)| {
            format!("{}{}", labels.join("."), if dot { "." } else { "" })
        }),
        ipv4_spelling().prop_map(|(_, text)| text),
        any::<u128>().prop_map(|n| format!("[{}]", Ipv6Addr::from(n))),
        any::<u128>().prop_map(|n| format!("[{}]", spelled_out(Ipv6Addr::from(n)))),
    ]
}

proptest! {
    #[test]
    fn parse_authority_is_idempotent_on_its_output(
        host in host_spelling(),
        port in prop::option::of(1..=u16::MAX),
    ) {
        let authority = match port {
            Some(port) => format!("{host}:{port}"),
            None => host.clone(),
        };
        if let Ok(target) = parse_authority(&authority, Some(443)) {
            let again = parse_authority(&target.to_string(), None);
            prop_assert_eq!(again, Ok(target.clone()), "{} -> {}", authority, target);
            if let TargetHost::Name(name) = &target.host {
                prop_assert!(name.is_ascii() && !name.ends_with('.'));
                prop_assert_eq!(name, &name.to_ascii_lowercase());
            }
        }
    }

    #[test]
    fn every_ipv4_spelling_is_its_address(
        (ip, text) in ipv4_spelling(),
        dot in any::<bool>(),
    ) {
        let text = if dot { format!("{text}.") } else { text };
        prop_assert_eq!(parse_host(&text), Ok(TargetHost::Ip(IpAddr::V4(ip))));
    }

    #[test]
    fn every_ipv6_literal_is_canonical(n in any::<u128>()) {
        let ip = Ipv6Addr::from(n);
        let want = match ip.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(ip),
        };
        let target = parse_authority(&format!("[{}]:8080", spelled_out(ip)), None);
        prop_assert_eq!(target, Ok(Target { host: TargetHost::Ip(want), port: 8080 }));
    }
}

/// Names over a small alphabet, so that generated patterns and hosts often overlap.
fn small_name() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(vec!["a", "b", "c", "xn--bcher-kva"]),
        1..5,
    )
    .prop_map(|labels| labels.join("."))
}

/// IP literals as patterns spell them (`::1` has no brackets: it matches nothing, as the
/// schema admits no colon in a pattern).
fn small_ip() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "10.0.0.1",
        "127.0.0.1",
        "2130706433",
        "::1",
        "0x0a.0.0.1",
    ])
    .prop_map(str::to_owned)
}

fn pattern_text() -> impl Strategy<Value = String> {
    prop_oneof![
        1 => Just("*".to_owned()),
        4 => small_name().prop_map(|n| format!("*.{n}")),
        4 => small_name(),
        1 => small_ip(),
    ]
}

fn target_host() -> impl Strategy<Value = TargetHost> {
    let ip = prop::sample::select(vec!["10.0.0.1", "127.0.0.1", "2130706433", "[::1]"])
        .prop_map(str::to_owned);
    prop_oneof![4 => small_name(), 1 => ip]
        .prop_map(|h| parse_host(&h).expect("generated hosts parse"))
}

proptest! {
    #[test]
    fn a_containing_pattern_matches_all_the_contained_one_does(
        a in pattern_text(),
        b in pattern_text(),
        hosts in prop::collection::vec(target_host(), 1..16),
    ) {
        // A malformed spelling (`::1`) is no pattern: it contains and matches nothing.
        let (Ok(pa), Ok(pb)) = (HostPattern::parse(&a), HostPattern::parse(&b)) else {
            return Ok(());
        };
        prop_assert!(pa.contains(&pa), "{} contains itself", a);
        if pa.contains(&pb) {
            let (sa, sb) = (HostSet::compile(&[&a]), HostSet::compile(&[&b]));
            for host in &hosts {
                if sb.find(host).is_some() {
                    prop_assert!(sa.find(host).is_some(), "{} contains {} but misses {}", a, b, host);
                }
                if let TargetHost::Name(name) = host {
                    if pb.matches(name) {
                        prop_assert!(pa.matches(name), "{} contains {} but misses {}", a, b, name);
                    }
                }
            }
        }
    }

    #[test]
    fn deny_always_wins_and_allow_needs_every_lease(
        leases in prop::collection::vec(
            (
                prop::collection::vec(pattern_text(), 0..4),
                prop::collection::vec(pattern_text(), 0..3),
            ),
            1..4,
        ),
        host in target_host(),
    ) {
        let policies: Vec<HostPolicy> = leases
            .iter()
            .map(|(allow, deny)| HostPolicy::compile(allow, deny))
            .collect();
        let ids = ["child", "parent", "grandparent"];
        let chain: Vec<(&str, &HostPolicy)> = ids.iter().copied().zip(policies.iter()).collect();
        let verdict = decide(chain.iter().copied(), &host);
        let denied = policies.iter().any(|p| p.deny.find(&host).is_some());
        let allowed = policies.iter().all(|p| p.allow.find(&host).is_some());
        let want = if denied {
            Want::Denied
        } else if allowed {
            Want::Allowed
        } else {
            Want::NotAllowed
        };
        prop_assert_eq!(kind(&verdict), want, "{:?} for {}", leases, host);
    }
}

// --- Boundary properties: spelling, chains, lists -------------------------------------------

/// One host written several ways a client might: letters in any case, a trailing dot, the
/// U-label or the A-label of an IDN, an IPv4 address in any spelling.
fn spellings_of_one_host() -> impl Strategy<Value = Vec<String>> {
    let name = prop::collection::vec(
        prop::sample::select(vec![
            ("a", "A"),
            ("b", "B"),
            ("example", "ExAmPlE"),
            ("xn--bcher-kva", "BÜCHER"),
            ("xn--bcher-kva", "bücher"),
        ]),
        1..5,
    )
    .prop_flat_map(|labels| {
        let n = labels.len();
        (
            Just(labels),
            prop::collection::vec(any::<bool>(), n),
            any::<bool>(),
        )
    })
    .prop_map(|(labels, upper, dot)| {
        let plain: Vec<&str> = labels.iter().map(|(a, _)| *a).collect();
        let other: Vec<&str> = labels
            .iter()
            .zip(&upper)
            .map(|((a, u), up)| if *up { *u } else { *a })
            .collect();
        vec![
            plain.join("."),
            format!("{}{}", other.join("."), if dot { "." } else { "" }),
        ]
    });
    let ip = ipv4_spelling().prop_map(|(ip, a)| {
        let [o1, o2, o3, o4] = ip.octets();
        vec![
            a,
            ip.to_string(),
            format!("0x{o1:x}.{o2}.{o3}.{o4}"),
            u32::from(ip).to_string(),
        ]
    });
    prop_oneof![3 => name, 1 => ip]
}

/// Any pattern text, well-formed or not: a malformed one must never widen a list.
fn any_pattern_text() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => pattern_text(),
        1 => prop::sample::select(vec![
            "*.", "*..", "*x.com", "**", "*.*", "https://a", "a:443", "a/b", "", " ", "*.a.",
            "a..b", "[::1]", "*.10.0.0.1", "a b", "-a", ".a",
        ])
        .prop_map(str::to_owned),
    ]
}

/// The reference reading of one list entry: does it match `host` (docs/guide/leases-and-journal.md)?
fn entry_matches(entry: &str, host: &TargetHost) -> bool {
    if entry == "*" {
        return true;
    }
    if let Some(suffix) = entry.strip_prefix("*.") {
        let Ok(TargetHost::Name(suffix)) = parse_host(suffix) else {
            return false;
        };
        return matches!(host, TargetHost::Name(name)
            if name.len() > suffix.len() + 1 && name.ends_with(&format!(".{suffix}")));
    }
    parse_host(entry).as_ref() == Ok(host)
}

proptest! {
    #[test]
    fn the_verdict_is_the_same_for_every_spelling_of_a_host(
        spellings in spellings_of_one_host(),
        allow in prop::collection::vec(any_pattern_text(), 0..5),
        deny in prop::collection::vec(any_pattern_text(), 0..3),
    ) {
        let policy = HostPolicy::compile(&allow, &deny);
        let hosts: Vec<TargetHost> = spellings
            .iter()
            .map(|s| parse_host(s).expect("generated spellings parse"))
            .collect();
        for (spelling, host) in spellings.iter().zip(&hosts) {
            prop_assert_eq!(host, &hosts[0], "{} normalises apart from {}", spelling, spellings[0]);
            prop_assert_eq!(
                kind(&decide([("l", &policy)], host)),
                kind(&decide([("l", &policy)], &hosts[0])),
                "{}", spelling
            );
        }
    }

    #[test]
    fn a_childs_verdict_is_never_wider_than_its_parents(
        child_allow in prop::collection::vec(any_pattern_text(), 0..5),
        child_deny in prop::collection::vec(any_pattern_text(), 0..3),
        parent_allow in prop::collection::vec(any_pattern_text(), 0..5),
        parent_deny in prop::collection::vec(any_pattern_text(), 0..3),
        hosts in prop::collection::vec(target_host(), 1..16),
    ) {
        let child = HostPolicy::compile(&child_allow, &child_deny);
        let parent = HostPolicy::compile(&parent_allow, &parent_deny);
        for host in &hosts {
            let chain = kind(&decide([("child", &child), ("parent", &parent)], host));
            let alone = kind(&decide([("parent", &parent)], host));
            if chain == Want::Allowed {
                prop_assert_eq!(alone, Want::Allowed, "{} allowed to the child, not the parent", host);
            }
            if alone == Want::Denied {
                prop_assert_eq!(chain, Want::Denied, "{} denied by the parent, not the chain", host);
            }
        }
    }

    #[test]
    fn a_list_never_allows_a_host_no_entry_matches(
        allow in prop::collection::vec(any_pattern_text(), 0..6),
        hosts in prop::collection::vec(target_host(), 1..16),
    ) {
        let set = HostSet::compile(&allow);
        for host in &hosts {
            if set.find(host).is_some() {
                prop_assert!(
                    allow.iter().any(|entry| entry_matches(entry, host)),
                    "{:?} allows {} though no entry matches it", allow, host
                );
            }
        }
    }
}
