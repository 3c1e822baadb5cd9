//! The contract's published vectors and fixtures, run against our code and schemas.

use crate::support::{data, read_json};
use leasegate::contract::canonical::{canonical_bytes, canonical_bytes_of, parse_text, Node};
use leasegate::contract::keys::sha256_hex;
use leasegate::contract::lease::verify_signature;
use leasegate::contract::schema::Schema;
use leasegate::contract::{Key, Keyring, Lease, LeaseError};
use serde_json::Value;

fn member<'a>(node: &'a Node, name: &str) -> &'a Node {
    let Node::Object(members) = node else {
        panic!("not an object")
    };
    let key: Vec<u16> = name.encode_utf16().collect();
    &members
        .iter()
        .find(|(k, _)| *k == key)
        .unwrap_or_else(|| panic!("no {name}"))
        .1
}

fn text(node: &Node) -> String {
    let Node::String(units) = node else {
        panic!("not a string")
    };
    String::from_utf16(units).unwrap()
}

#[test]
fn canonical_vectors_match_byte_for_byte() {
    // The file holds an unpaired surrogate, so serde_json cannot read it: our parser can.
    let file = std::fs::read_to_string(data("contract/vectors/canonical-vectors.json")).unwrap();
    let root = parse_text(&file).unwrap();
    let Node::Array(vectors) = member(&root, "vectors") else {
        panic!()
    };
    assert_eq!(vectors.len(), 9);
    for vector in vectors {
        let name = text(member(vector, "name"));
        let bytes = canonical_bytes_of(member(vector, "value")).unwrap();
        assert_eq!(
            String::from_utf8(bytes.clone()).unwrap(),
            text(member(vector, "canonical")),
            "{name}"
        );
        assert_eq!(sha256_hex(&bytes), text(member(vector, "sha256")), "{name}");
    }
    let Node::Array(must_fail) = member(&root, "must_fail") else {
        panic!()
    };
    assert_eq!(must_fail.len(), 2);
    for construct in [f64::INFINITY, f64::NAN, f64::NEG_INFINITY] {
        let value = Node::Object(vec![(
            "n".encode_utf16().collect(),
            Node::Number(construct),
        )]);
        assert!(
            canonical_bytes_of(&value).is_err(),
            "{construct} must not serialise"
        );
    }
}

fn test_key() -> Key {
    Key::load(&data("contract/vectors/test-key.txt")).unwrap()
}

#[test]
fn test_key_is_read_as_raw_bytes_and_refused_by_default() {
    let key = test_key();
    assert_eq!(key.fingerprint(), "sha256:9d12c441941d9b5e");
    assert!(key.is_test_key());
    let path = data("contract/vectors/test-key.txt");
    let refused = Keyring::load(&[&path], false).unwrap_err().to_string();
    assert!(refused.contains("published TEST key"), "{refused}");
    assert!(Keyring::load(&[&path], true).is_ok());
}

#[test]
fn signature_vectors_verify_and_fail_once_tampered() {
    let vectors = read_json("contract/vectors/signature-vectors.json");
    let key = test_key();
    let allowing = Keyring::load(&[data("contract/vectors/test-key.txt")], true).unwrap();
    let mut refusing = Keyring::new(false);
    refusing.insert(key.clone());
    let vectors = vectors["vectors"].as_array().unwrap();
    assert_eq!(vectors.len(), 3);
    for vector in vectors {
        let name = vector["name"].as_str().unwrap();
        let lease = read_json(&format!("contract/{}", vector["lease"].as_str().unwrap()));
        let declared_path = vector["declared"].as_str().unwrap();
        if declared_path.starts_with("fixtures/") {
            let declared = read_json(&format!("contract/{declared_path}"));
            assert_eq!(
                sha256_hex(&canonical_bytes(&declared).unwrap()),
                lease["declared_hash"].as_str().unwrap(),
                "{name}: declared_hash"
            );
        }
        assert!(verify_signature(&lease, &key).unwrap(), "{name}");
        assert!(Lease::load(lease.clone(), &allowing).is_ok(), "{name}");
        assert!(
            matches!(
                Lease::load(lease.clone(), &refusing),
                Err(LeaseError::TestKey)
            ),
            "{name}"
        );

        let signature = lease["signature"].as_str().unwrap();
        for position in [0, 31, 63] {
            let mut tampered = lease.clone();
            let mut chars: Vec<char> = signature.chars().collect();
            chars[position] = if chars[position] == '0' { '1' } else { '0' };
            tampered["signature"] = Value::String(chars.into_iter().collect());
            assert!(
                !verify_signature(&tampered, &key).unwrap(),
                "{name} @ {position}"
            );
            assert!(matches!(
                Lease::load(tampered, &allowing),
                Err(LeaseError::BadSignature(_))
            ));
        }
        // Unknown members are signed too: adding one breaks the signature.
        let mut extended = lease.clone();
        extended["x_extra"] = Value::Bool(true);
        assert!(
            !verify_signature(&extended, &key).unwrap(),
            "{name}: extra member"
        );
    }
}

fn schema_for(file_name: &str) -> Schema {
    if file_name.starts_with("agent-lease-manifest.") {
        Schema::Manifest
    } else if file_name.starts_with("agent-lease.") {
        Schema::Lease
    } else if file_name.starts_with("lease-record.") {
        Schema::Record
    } else {
        panic!("no schema for {file_name}")
    }
}

fn fixtures(kind: &str) -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> =
        std::fs::read_dir(data(&format!("contract/fixtures/{kind}")))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".json") && !n.ends_with(".expect.json"))
            .map(|n| {
                let value = read_json(&format!("contract/fixtures/{kind}/{n}"));
                (n, value)
            })
            .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn valid_fixtures_validate() {
    let all = fixtures("valid");
    assert_eq!(all.len(), 20);
    for (name, value) in all {
        let schema = schema_for(&name);
        assert_eq!(schema.validate(&value), Ok(()), "{name}");
        if schema == Schema::Lease {
            let lease = Lease::check(value).unwrap();
            assert_eq!(&*lease.key_fingerprint, "sha256:9d12c441941d9b5e", "{name}");
        }
    }
}

#[test]
fn invalid_fixtures_are_rejected_where_expected() {
    let all = fixtures("invalid");
    assert_eq!(all.len(), 24);
    let mut with_expectation = 0;
    for (name, value) in all {
        let issues = schema_for(&name).validate(&value).expect_err(&name);
        let expect = data(&format!(
            "contract/fixtures/invalid/{}",
            name.replace(".json", ".expect.json")
        ));
        if expect.exists() {
            with_expectation += 1;
            let expect: Value = serde_json::from_slice(&std::fs::read(expect).unwrap()).unwrap();
            let path = expect["path"].as_str().unwrap();
            assert!(
                issues.iter().any(|i| i.path == path),
                "{name}: expected a failure at {path}, got {issues:?}"
            );
        }
    }
    assert_eq!(with_expectation, 18);
}

#[test]
fn only_major_version_one_is_read() {
    let mut lease = read_json("contract/fixtures/valid/agent-lease.minimal.json");
    lease["schema_version"] = "1.9".into();
    assert!(Lease::check(lease.clone()).is_ok());
    lease["schema_version"] = "2.0".into();
    assert!(matches!(
        Lease::check(lease),
        Err(LeaseError::UnknownMajor(2))
    ));
}

/// The issuer's rules over the contract's manifest fixtures: a valid declaration is granted,
/// or refused only for what the contract refuses a grant for (R2: it opens nothing; R4: a
/// native agent that is `unknown`), and every grant is schema-valid; every invalid one is
/// refused, as schema-invalid or, without a purpose, R1.
#[test]
fn the_issuer_grants_or_refuses_every_manifest_fixture_as_the_contract_says() {
    use leasegate::contract::narrow::{narrow, Ask, RootPolicy};
    use leasegate::contract::Timestamp;
    let now = Timestamp::parse("2026-09-15T10:00:00.000Z").unwrap();
    let ask = |declared: &Value| {
        narrow(&Ask {
            declared,
            parent: None,
            root: RootPolicy::default(),
            ends: now.saturating_add_millis(60_000),
            now,
            public_suffix_wildcards: false,
        })
    };
    let mut seen = (0, 0);
    for (dir, valid) in [("valid", true), ("invalid", false)] {
        for entry in std::fs::read_dir(data(&format!("contract/fixtures/{dir}"))).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !name.starts_with("agent-lease-manifest.")
                || !name.ends_with(".json")
                || name.ends_with(".expect.json")
            {
                continue;
            }
            let declared = read_json(&format!("contract/fixtures/{dir}/{name}"));
            match (ask(&declared), valid) {
                (Ok(grant), true) => {
                    Schema::Manifest.validate(&grant.manifest).unwrap();
                    seen.0 += 1;
                }
                (Err(refused), true) => {
                    for code in &refused.reasons {
                        assert!(["R2", "R4"].contains(&code.as_str()), "{name}: {refused:?}");
                    }
                    seen.0 += 1;
                }
                (Err(refused), false) => {
                    assert!(
                        refused
                            .reasons
                            .iter()
                            .any(|r| r == "runtime_error:schema_invalid" || r == "R1"),
                        "{name}: {refused:?}"
                    );
                    seen.1 += 1;
                }
                (Ok(_), false) => panic!("{name}: an invalid manifest was granted"),
            }
        }
    }
    assert!(seen.0 >= 6 && seen.1 >= 15, "{seen:?}");
}
