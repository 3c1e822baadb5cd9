//! The journal fold: every event, chains, bad and torn lines, duplicate grants, appends.

use crate::support::{event_line, granted_line, id, key, lease, t};
use leasegate::contract::lease::sign;
use leasegate::contract::{Event, Key, Keyring};
use leasegate::registry::journal::{self, fold_bytes};
use leasegate::registry::store;
use leasegate::registry::{Applied, ChainError, InvalidReason, Ledger, LineError, Status};
use serde_json::json;

const WINDOW: (&str, &str) = ("2026-09-15T10:00:00.000Z", "2026-09-15T11:00:00.000Z");
const AT: &str = "2026-09-15T10:00:00.000Z";

fn ledger() -> Ledger {
    let mut ring = Keyring::new(false);
    ring.insert(key(1));
    Ledger::new(ring)
}

fn fold(lines: &[String]) -> (Ledger, usize) {
    let mut ledger = ledger();
    let text = lines.join("\n") + "\n";
    let problems = fold_bytes(&mut ledger, text.as_bytes());
    (ledger, problems.len())
}

fn root() -> serde_json::Value {
    lease(&key(1), &id(1), None, WINDOW, &["*.example.com"], &[])
}

/// A closing record closes when it is read, whatever its `at` says: a record dated after the
/// instant asked about (here, half an hour later) already applies. (Before issue 10 this
/// asserted `Open` before the record's `at`: a future-dated record kept the lease open.)
#[test]
fn each_closing_event_closes_when_read_whatever_its_at() {
    for (event, status) in [
        ("revoked", Status::Revoked),
        ("stopped", Status::Stopped),
        ("completed", Status::Completed),
        ("expired", Status::Expired),
    ] {
        let closing = event_line(
            event,
            &id(1),
            "2026-09-15T10:30:00.000Z",
            json!({"by": "issuer", "reason": "test"}),
        );
        let (ledger, problems) = fold(&[granted_line(&root(), AT), closing]);
        assert_eq!(problems, 0, "{event}");
        for now in [AT, "2026-09-15T10:29:59.999Z", "2026-09-15T10:30:00.000Z"] {
            assert_eq!(
                ledger.status(&id(1), t(now)),
                Some(status),
                "{event} at {now}"
            );
            assert!(
                ledger.check_chain(&id(1), t(now)).is_err(),
                "{event} at {now}"
            );
        }
        assert_eq!(
            ledger.stats().events[Event::parse(event).unwrap() as usize],
            1
        );
    }
}

/// A closing record of lease 1 (under `key(1)`), signed with `signer` (or `signature` forced).
fn signed_closing(event: &str, signer: &Key, forced: Option<&str>) -> String {
    let mut record: serde_json::Value = serde_json::from_str(&event_line(
        event,
        &id(1),
        AT,
        json!({"by": "issuer", "reason": "test"}),
    ))
    .unwrap();
    sign(&mut record, signer).unwrap();
    if let Some(forced) = forced {
        record["signature"] = forced.into();
    }
    record.to_string()
}

fn fold_with(ring: Keyring, lines: &[String]) -> Ledger {
    let mut ledger = Ledger::new(ring);
    fold_bytes(&mut ledger, (lines.join("\n") + "\n").as_bytes());
    ledger
}

fn signature_skips(ledger: &Ledger) -> u64 {
    let i = InvalidReason::ALL
        .iter()
        .position(|r| *r == InvalidReason::Signature)
        .unwrap();
    ledger.stats().invalid_by_reason[i]
}

#[test]
fn closing_records_with_a_bad_signature_are_skipped_and_counted() {
    for required in [false, true] {
        let ring = || {
            let mut ring = Keyring::new(false);
            ring.insert(key(1));
            ring.insert(key(2));
            ring.requiring_record_signatures(required)
        };
        for event in ["revoked", "stopped", "completed", "expired"] {
            let zeros = "0".repeat(64);
            let bad = [
                signed_closing(event, &key(1), Some(&zeros)),
                // Another trusted key, not the lease's own.
                signed_closing(event, &key(2), None),
                // A key not in the keyring at all.
                signed_closing(event, &key(3), None),
            ];
            for line in &bad {
                let ledger = fold_with(ring(), &[granted_line(&root(), AT), line.clone()]);
                assert_eq!(
                    ledger.status(&id(1), t(AT)),
                    Some(Status::Open),
                    "{required} {line}"
                );
                assert_eq!(signature_skips(&ledger), 1, "{line}");
                assert_eq!(ledger.stats().invalid_lines, 1);
                assert_eq!(
                    ledger.stats().events[Event::parse(event).unwrap() as usize],
                    0
                );
            }
            let good = signed_closing(event, &key(1), None);
            let ledger = fold_with(ring(), &[granted_line(&root(), AT), good]);
            assert_ne!(ledger.status(&id(1), t(AT)), Some(Status::Open), "{event}");
            assert_eq!(ledger.stats().invalid_lines, 0);
        }
    }
}

#[test]
fn unsigned_closing_records_apply_unless_signatures_are_required() {
    let unsigned = event_line("stopped", &id(1), AT, json!({"reason": "done"}));
    let ring = |required: bool| {
        let mut ring = Keyring::new(false);
        ring.insert(key(1));
        ring.requiring_record_signatures(required)
    };
    let ledger = fold_with(ring(false), &[granted_line(&root(), AT), unsigned.clone()]);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Stopped));
    let ledger = fold_with(ring(true), &[granted_line(&root(), AT), unsigned]);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Open));
    assert_eq!(signature_skips(&ledger), 1);
}

/// A closing record read before its lease's grant cannot be checked then: it is held and
/// checked under the lease's key when the grant arrives.
#[test]
fn a_closing_record_before_its_grant_is_checked_at_the_grant() {
    let zeros = "0".repeat(64);
    let forged = signed_closing("revoked", &key(1), Some(&zeros));
    let ring = ledger().keyring().unwrap().clone();
    let folded = fold_with(ring.clone(), &[forged, granted_line(&root(), AT)]);
    assert_eq!(folded.status(&id(1), t(AT)), Some(Status::Open));
    assert_eq!(signature_skips(&folded), 1);
    assert_eq!(folded.stats().events[Event::Revoked as usize], 0);

    let genuine = signed_closing("revoked", &key(1), None);
    let ledger = fold_with(ring, &[genuine, granted_line(&root(), AT)]);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Revoked));
    assert_eq!(ledger.stats().events[Event::Revoked as usize], 1);
    assert_eq!(ledger.stats().invalid_lines, 0);
}

#[test]
fn non_closing_events_change_nothing_and_heartbeat_never_extends() {
    let lines = [
        granted_line(&root(), AT),
        event_line(
            "heartbeat",
            &id(1),
            "2026-09-15T10:59:00.000Z",
            json!({"expires_at": "2027-01-01T00:00:00.000Z"}),
        ),
        event_line(
            "attached",
            &id(1),
            AT,
            json!({"containment": "enforced", "platform": "linux"}),
        ),
        event_line("narrowed", &id(1), AT, json!({"reason": "hosts narrowed"})),
        event_line(
            "refused",
            &id(9),
            AT,
            json!({"reasons": ["R1"], "declared_hash": "0".repeat(64)}),
        ),
    ];
    let (ledger, problems) = fold(&lines);
    assert_eq!(problems, 0);
    assert_eq!(
        ledger.status(&id(1), t("2026-09-15T10:59:59.999Z")),
        Some(Status::Open)
    );
    assert_eq!(
        ledger.status(&id(1), t("2026-09-15T11:00:00.000Z")),
        Some(Status::Expired)
    );
    assert_eq!(
        ledger.status(&id(1), t("2026-09-15T09:59:59.999Z")),
        Some(Status::NotYetValid)
    );
    assert_eq!(
        ledger.status(&id(9), t(AT)),
        None,
        "a refusal names no lease"
    );
    let events = &ledger.stats().events;
    for e in [
        Event::Granted,
        Event::Heartbeat,
        Event::Attached,
        Event::Narrowed,
        Event::Refused,
    ] {
        assert_eq!(events[e as usize], 1, "{e:?}");
    }
}

#[test]
fn closing_an_ancestor_closes_the_whole_subtree() {
    let child = lease(
        &key(1),
        &id(2),
        Some(&id(1)),
        WINDOW,
        &["a.example.com"],
        &[],
    );
    let grandchild = lease(
        &key(1),
        &id(3),
        Some(&id(2)),
        WINDOW,
        &["a.example.com"],
        &[],
    );
    let mut lines = vec![
        granted_line(&root(), AT),
        granted_line(&child, AT),
        granted_line(&grandchild, AT),
    ];
    let (ledger, _) = fold(&lines);
    let chain = ledger.check_chain(&id(3), t(AT)).unwrap();
    assert_eq!(
        chain.iter().map(|l| l.id.clone()).collect::<Vec<_>>(),
        [id(3), id(2), id(1)]
    );

    lines.push(event_line("stopped", &id(1), AT, json!({"reason": "done"})));
    let (ledger, _) = fold(&lines);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Stopped));
    assert_eq!(ledger.status(&id(3), t(AT)), Some(Status::AncestorClosed));
    assert_eq!(
        ledger.check_chain(&id(3), t(AT)).unwrap_err(),
        ChainError::AncestorClosed {
            lease: id(3),
            ancestor: id(1)
        }
    );
    assert!(matches!(
        ledger.check_chain(&id(2), t(AT)),
        Err(ChainError::AncestorClosed { .. })
    ));
    assert!(matches!(
        ledger.check_chain(&id(1), t(AT)),
        Err(ChainError::Closed(_))
    ));
    assert!(matches!(
        ledger.check_chain(&id(7), t(AT)),
        Err(ChainError::Unknown(_))
    ));
}

#[test]
fn a_child_of_an_unknown_parent_opens_nothing() {
    let orphan = lease(&key(1), &id(2), Some(&id(8)), WINDOW, &["*"], &[]);
    let (ledger, _) = fold(&[granted_line(&orphan, AT)]);
    assert_eq!(ledger.status(&id(2), t(AT)), Some(Status::AncestorClosed));
}

#[test]
fn l3_revocations_by_a_non_ancestor_are_skipped() {
    let child = lease(
        &key(1),
        &id(2),
        Some(&id(1)),
        WINDOW,
        &["a.example.com"],
        &[],
    );
    let base = vec![granted_line(&root(), AT), granted_line(&child, AT)];
    let by_stranger = event_line("revoked", &id(2), AT, json!({"by": id(5), "reason": "x"}));
    let mut lines = base.clone();
    lines.push(by_stranger);
    let (ledger, problems) = fold(&lines);
    assert_eq!(problems, 1);
    assert_eq!(ledger.status(&id(2), t(AT)), Some(Status::Open));

    let by_parent = event_line("revoked", &id(2), AT, json!({"by": id(1), "reason": "x"}));
    let mut lines = base;
    lines.push(by_parent);
    let (ledger, problems) = fold(&lines);
    assert_eq!(problems, 0);
    assert_eq!(ledger.status(&id(2), t(AT)), Some(Status::Revoked));
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Open));
}

#[test]
fn bad_lines_are_skipped_and_counted() {
    let mut ledger = ledger();
    let text = format!(
        "{}\nnot json\n{{\"event\":\"granted\"}}\n\n{}\n",
        granted_line(&root(), AT),
        event_line("paused", &id(1), AT, json!({}))
    );
    let problems = fold_bytes(&mut ledger, text.as_bytes());
    assert_eq!(
        problems.iter().map(|p| p.line).collect::<Vec<_>>(),
        [2, 3, 5]
    );
    assert_eq!(ledger.stats().invalid_lines, 3);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Open));
    let mut ledger = self::ledger();
    assert!(matches!(
        ledger.apply_line_bytes(b"\xff\xfe"),
        Err(LineError::NotUtf8)
    ));
}

#[test]
fn a_final_line_without_newline_is_read_and_a_torn_line_is_skipped() {
    let mut ledger = ledger();
    let grant = granted_line(&root(), AT);
    let text = format!("{}\n{}", &grant[..40], grant);
    let problems = fold_bytes(&mut ledger, text.as_bytes());
    assert_eq!(problems.len(), 1, "the torn fragment");
    assert_eq!(problems[0].line, 1);
    assert_eq!(
        ledger.status(&id(1), t(AT)),
        Some(Status::Open),
        "the unterminated final line"
    );
}

#[test]
fn grants_that_fail_checks_are_not_loaded() {
    let mut tampered = root();
    tampered["manifest"]["allow"]["hosts"] = json!(["*"]);
    let foreign = lease(&key(2), &id(2), None, WINDOW, &["*"], &[]);
    let backwards = lease(&key(1), &id(3), None, (WINDOW.1, WINDOW.0), &["*"], &[]);
    let own_parent = lease(&key(1), &id(4), Some(&id(4)), WINDOW, &["*"], &[]);
    let bad_host = lease(&key(1), &id(5), None, WINDOW, &["https://x.example"], &[]);
    let mut ledger = ledger();
    for (value, what) in [
        (tampered, "signature does not verify"),
        (foreign, "not in the keyring"),
        (backwards, "L1"),
        (own_parent, "L2"),
        (bad_host, "schema"),
    ] {
        let err = ledger
            .apply_line_bytes(granted_line(&value, AT).as_bytes())
            .unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    assert_eq!(ledger.leases().count(), 0);
    assert_eq!(ledger.stats().rejected_grants, 5);
}

#[test]
fn a_repeated_grant_keeps_the_first() {
    let second = lease(&key(1), &id(1), None, WINDOW, &["*"], &[]);
    let mut ledger = ledger();
    assert_eq!(
        ledger
            .apply_line_bytes(granted_line(&root(), AT).as_bytes())
            .unwrap(),
        Applied::Granted(id(1))
    );
    assert_eq!(
        ledger
            .apply_line_bytes(granted_line(&second, AT).as_bytes())
            .unwrap(),
        Applied::DuplicateGrant(id(1))
    );
    assert_eq!(ledger.lease(&id(1)).unwrap().allow_hosts, ["*.example.com"]);
    assert_eq!(ledger.stats().duplicate_grants, 1);
}

#[test]
fn appends_are_whole_lines_even_after_a_torn_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.jsonl");
    std::fs::write(&path, "{\"torn").unwrap();
    let record = serde_json::from_str(&granted_line(&root(), AT)).unwrap();
    store::file::append(&path, &record, true).unwrap();
    store::file::append(&path, &record, false).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0], "{\"torn");
    assert!(text.ends_with('\n'));
    let (ledger, problems) = journal::load(&path, ledger()).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(ledger.stats().duplicate_grants, 1);
    assert_eq!(ledger.status(&id(1), t(AT)), Some(Status::Open));
}
