//! The journal fold: every event, chains, bad and torn lines, duplicate grants, appends.

use crate::support::{event_line, granted_line, id, key, lease, t};
use leasegate::contract::lease::sign;
use leasegate::contract::{Event, Key, Keyring};
use leasegate::registry::closed::Ending;
use leasegate::registry::journal::{self, fold_bytes};
use leasegate::registry::store;
use leasegate::registry::{Applied, ChainError, Closure, InvalidReason, Ledger, LineError, Status};
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
/// instant asked about (here, half an hour later) already applies: a future-dated record does
/// not keep the lease open.
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
    let error = ledger.check_chain(&id(3), t(AT)).unwrap_err();
    assert_eq!(
        error,
        ChainError::AncestorClosed {
            lease: id(3),
            ancestor: id(1),
            ending: Ending::Closed(Closure {
                event: Event::Stopped,
                at: t(AT),
                by: None,
                reason: Some("done".into()),
            }),
        }
    );
    assert_eq!(
        error.to_string(),
        format!(
            "lease {} is closed: ancestor {} was stopped at {AT}: done",
            id(3),
            id(1)
        )
    );
    assert!(matches!(
        ledger.check_chain(&id(2), t(AT)),
        Err(ChainError::AncestorClosed { .. })
    ));
    assert!(matches!(
        ledger.check_chain(&id(1), t(AT)),
        Err(ChainError::Closed { closure, .. }) if closure.event == Event::Stopped
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
    assert_eq!(
        ledger.check_chain(&id(2), t(AT)).unwrap_err().to_string(),
        format!("lease {} is closed: ancestor {} is not known", id(2), id(8))
    );
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

/// The fold of `leases`, `check`, `verify` and `journal compact` skips a line over
/// `--max-journal-line` as the proxy does, so they agree on every lease.
#[test]
fn a_line_over_the_cap_is_skipped_and_counted_as_too_long() {
    let grant = granted_line(&root(), AT);
    let text = format!("{grant}\n");
    let mut capped = ledger().limiting_lines(grant.len() - 1);
    let problems = fold_bytes(&mut capped, text.as_bytes());
    assert_eq!(problems.len(), 1);
    assert!(
        matches!(problems[0].error, LineError::TooLong { len, max } if len == grant.len() as u64 && max == grant.len() - 1),
        "{}",
        problems[0].error
    );
    assert_eq!(capped.status(&id(1), t(AT)), None);
    let too_long = InvalidReason::ALL
        .iter()
        .position(|r| r.as_str() == "too-long")
        .unwrap();
    assert_eq!(capped.stats().invalid_by_reason[too_long], 1);
    assert!(capped.apply_line_bytes(grant.as_bytes()).is_err());
    // A store's skipped lines count the same way.
    capped.count_too_long(2);
    assert_eq!(capped.stats().invalid_by_reason[too_long], 4);
    assert_eq!(capped.stats().invalid_lines, 4);

    let mut exact = ledger().limiting_lines(grant.len());
    assert!(fold_bytes(&mut exact, text.as_bytes()).is_empty());
    assert_eq!(exact.status(&id(1), t(AT)), Some(Status::Open));
    assert_eq!(ledger().max_line(), journal::MAX_LINE);
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

/// A closing record of lease `n`, signed with `signer`.
fn signed_event(event: &str, n: u32, at: &str, signer: &Key, extra: serde_json::Value) -> String {
    let mut record: serde_json::Value =
        serde_json::from_str(&event_line(event, &id(n), at, extra)).unwrap();
    sign(&mut record, signer).unwrap();
    record.to_string()
}

/// What a ledger says about lease `n` at `now`: status, chain (or why not), retirement.
fn facts(ledger: &Ledger, n: u32, now: leasegate::contract::Timestamp) -> String {
    let id = id(n);
    let chain = ledger
        .check_chain(&id, now)
        .map(|chain| chain.iter().map(|l| l.id.clone()).collect::<Vec<_>>());
    format!(
        "{:?} {chain:?} {:?} {:?}",
        ledger.status(&id, now),
        ledger.lease(&id),
        ledger.retired(&id)
    )
}

/// The fold prepares lines on every core and applies them in order: over a journal long enough
/// to be split into rounds, with duplicate grants, closings before their grants (signed: held),
/// bad signatures, L3 violations, children and bad lines, it gives exactly what applying each
/// line in turn gives.
#[test]
fn the_parallel_fold_is_the_line_by_line_fold() {
    let (k1, k2) = (key(1), key(2));
    let window = ("2026-09-15T10:00:00.000Z", "2026-09-15T12:00:00.000Z");
    let mut lines = Vec::new();
    for n in 1..=300u32 {
        let parent = (n % 3 == 0).then(|| id(n - 1));
        match n % 10 {
            // A signed closing before its grant: held, applied at the grant.
            1 => lines.push(signed_event("stopped", n, AT, &k1, json!({"reason": "r"}))),
            // A closing signed with a key the ring does not hold: held, then skipped.
            2 => lines.push(signed_event(
                "revoked",
                n,
                AT,
                &k2,
                json!({"by": "issuer", "reason": "r"}),
            )),
            _ => {}
        }
        let lease = lease(
            &k1,
            &id(n),
            parent.as_deref(),
            window,
            &["*.example.com"],
            &[],
        );
        lines.push(granted_line(&lease, AT));
        for _ in 0..14 {
            lines.push(event_line("heartbeat", &id(n), AT, json!({})));
        }
        match n % 10 {
            4 => lines.push(granted_line(&root(), AT)),
            5 => lines.push("{not json".into()),
            6 => lines.push(r#"{"schema_version":"1.2","event":"granted"}"#.into()),
            7 => lines.push(granted_line(&lease_signed_by(&k2, n + 1000), AT)),
            8 => lines.push(event_line(
                "revoked",
                &id(n),
                AT,
                json!({"by": id(n - 1), "reason": "r"}),
            )),
            9 => lines.push(String::new()),
            _ => {}
        }
    }
    let text = lines.join("\n") + "\n";
    assert!(lines.len() > 4096 + 256, "more than one round");
    let mut parallel = ledger();
    let problems = fold_bytes(&mut parallel, text.as_bytes());
    let mut serial = ledger();
    let mut serial_problems = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if let Err(error) = serial.apply_line_bytes(line.as_bytes()) {
            serial_problems.push((i + 1, error.to_string()));
        }
    }
    let problems: Vec<(usize, String)> = problems
        .into_iter()
        .map(|p| (p.line, p.error.to_string()))
        .collect();
    assert_eq!(problems, serial_problems);
    assert!(problems.len() > 100, "{problems:?}");
    assert_eq!(parallel.stats(), serial.stats());
    assert!(parallel.stats().duplicate_grants > 0);
    assert!(signature_skips(&parallel) > 0);
    let now = t("2026-09-15T11:00:00.000Z");
    for n in 1..=1400 {
        assert_eq!(
            facts(&parallel, n, now),
            facts(&serial, n, now),
            "lease {n}"
        );
    }
    let order = |l: &Ledger| l.leases().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(order(&parallel), order(&serial));
}

fn lease_signed_by(signer: &Key, n: u32) -> serde_json::Value {
    lease(signer, &id(n), None, WINDOW, &["*.example.com"], &[])
}

/// With a retention, a lease closed or expired longer ago than that keeps only its id, parent,
/// key and closing: it is still known and closed for the reason it closed, never reopened by a
/// repeated grant; its children are refused as `ancestor-closed`; a revocation by it (L3) still
/// applies to a descendant; and a lease closed more recently is retired once its time comes.
#[test]
fn leases_past_their_retention_are_retired_but_still_refused() {
    use leasegate::contract::Timestamp;
    let k = key(1);
    let now = Timestamp::now();
    let ago = |hours: i64| now.saturating_add_millis(-hours * 3_600_000).to_string();
    let window = (ago(72), now.saturating_add_millis(86_400_000).to_string());
    let window = (window.0.as_str(), window.1.as_str());
    let expired_window = (ago(72), ago(71));
    let grant = |n: u32, parent: Option<u32>, window: (&str, &str)| {
        let parent = parent.map(id);
        granted_line(
            &lease(&k, &id(n), parent.as_deref(), window, &["*"], &[]),
            AT,
        )
    };
    let lines = [
        grant(1, None, window),
        grant(2, Some(1), window),
        grant(3, Some(2), window),
        event_line("stopped", &id(1), &ago(48), json!({"reason": "done"})),
        grant(
            4,
            None,
            (expired_window.0.as_str(), expired_window.1.as_str()),
        ),
        grant(5, None, window),
        event_line("completed", &id(5), &ago(1), json!({})),
        // Retired already: a repeated grant changes nothing.
        grant(1, None, window),
        // By lease 1, retired: L3 still finds it among 3's ancestors.
        event_line(
            "revoked",
            &id(3),
            &ago(1),
            json!({"by": id(1), "reason": "r"}),
        ),
    ];
    let mut ring = Keyring::new(false);
    ring.insert(k.clone());
    let mut ledger = Ledger::new(ring).retaining_closed(std::time::Duration::from_secs(86_400));
    let problems = fold_bytes(&mut ledger, (lines.join("\n") + "\n").as_bytes());
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(ledger.stats().duplicate_grants, 1);
    assert_eq!(
        ledger.retired_count(),
        2,
        "1 (stopped 48 h ago) and 4 (expired 71 h ago)"
    );
    for (n, status) in [(1, Status::Stopped), (4, Status::Expired)] {
        assert!(ledger.lease(&id(n)).is_none());
        assert_eq!(ledger.retired(&id(n)).unwrap().status(), status);
        assert_eq!(ledger.status(&id(n), now), Some(status));
    }
    assert_eq!(ledger.retired(&id(1)).unwrap().parent(), None);
    assert_eq!(
        ledger.key_fingerprint(&id(1)),
        Some(k.fingerprint()),
        "a token for it is still checked"
    );
    // Retired: the closing's event and time are kept, its `by` and `reason` are not.
    let stopped = Closure {
        event: Event::Stopped,
        at: Timestamp::parse(&ago(48)).unwrap(),
        by: None,
        reason: None,
    };
    assert_eq!(
        ledger.check_chain(&id(1), now).unwrap_err(),
        ChainError::Closed {
            lease: id(1),
            closure: stopped.clone()
        }
    );
    assert_eq!(
        ledger.check_chain(&id(4), now).unwrap_err(),
        ChainError::Closed {
            lease: id(4),
            closure: Closure {
                event: Event::Expired,
                at: Timestamp::parse(&ago(71)).unwrap(),
                by: None,
                reason: None,
            }
        }
    );
    assert_eq!(
        ledger.check_chain(&id(2), now).unwrap_err(),
        ChainError::AncestorClosed {
            lease: id(2),
            ancestor: id(1),
            ending: Ending::Closed(stopped),
        }
    );
    assert_eq!(ledger.status(&id(2), now), Some(Status::AncestorClosed));
    assert_eq!(
        ledger.status(&id(3), now),
        Some(Status::Revoked),
        "L3 via 1"
    );
    assert_eq!(ledger.status(&id(5), now), Some(Status::Completed));
    assert!(
        ledger.lease(&id(5)).is_some(),
        "closed an hour ago: kept whole"
    );
    assert_eq!(ledger.status(&id(9), now), None, "never granted: unknown");
    let later = now.saturating_add_millis(24 * 3_600_000);
    assert_eq!(
        ledger.retire_closed(later),
        2,
        "5 and 3 (closed an hour ago)"
    );
    assert_eq!(ledger.status(&id(5), later), Some(Status::Completed));
    assert_eq!(ledger.status(&id(3), later), Some(Status::Revoked));
    assert_eq!(
        ledger.leases().map(|l| l.id.clone()).collect::<Vec<_>>(),
        vec![id(2)],
        "grant order keeps the loaded leases"
    );
    // Without a retention nothing is retired.
    let mut whole = ledger_of(&k);
    fold_bytes(&mut whole, (lines.join("\n") + "\n").as_bytes());
    assert_eq!(whole.retire_closed(later), 0);
    assert_eq!(whole.leases().count(), 5);
}

fn ledger_of(k: &Key) -> Ledger {
    let mut ring = Keyring::new(false);
    ring.insert(k.clone());
    Ledger::new(ring)
}

/// Leases with the same host lists share one compiled policy; other lists get their own, and
/// each still decides by its own lists.
#[test]
fn leases_with_the_same_lists_share_their_compiled_policy() {
    let k = key(1);
    let grant =
        |n: u32, allow: &[&str]| granted_line(&lease(&k, &id(n), None, WINDOW, allow, &[]), AT);
    let (ledger, skipped) = fold(&[
        grant(1, &["*.example.com"]),
        grant(2, &["*.example.com"]),
        grant(3, &["pypi.org"]),
    ]);
    assert_eq!(skipped, 0);
    let policy = |n: u32| ledger.policy(&id(n)).unwrap().clone();
    assert!(std::sync::Arc::ptr_eq(&policy(1), &policy(2)));
    assert!(!std::sync::Arc::ptr_eq(&policy(1), &policy(3)));
    let host = leasegate::policy::target::parse_host("pypi.org").unwrap();
    assert!(policy(3).allow.find(&host).is_some());
    assert!(policy(2).allow.find(&host).is_none());
}

/// `--max-lease-lifetime`: a lease that says it lives longer expires at `issued_at` plus the
/// ceiling (its own expiry, when sooner, stands); the fold counts the capped grants.
#[test]
fn a_lifetime_ceiling_brings_a_far_expiry_forward() {
    let far = lease(
        &key(1),
        &id(1),
        None,
        ("2026-09-15T10:00:00.000Z", "9999-12-31T23:59:59.999Z"),
        &["*.example.com"],
        &[],
    );
    let near = lease(&key(1), &id(2), None, WINDOW, &["*.example.com"], &[]);
    let lines = [granted_line(&far, AT), granted_line(&near, AT)];
    let text = lines.join("\n") + "\n";
    let day = std::time::Duration::from_secs(86_400);
    let mut capped = ledger().capping_lifetime(30 * day);
    assert!(fold_bytes(&mut capped, text.as_bytes()).is_empty());
    let mut uncapped = ledger();
    assert!(fold_bytes(&mut uncapped, text.as_bytes()).is_empty());

    let last = t("2026-10-15T09:59:59.999Z");
    let past = t("2026-10-15T10:00:00.000Z");
    assert_eq!(capped.status(&id(1), last), Some(Status::Open));
    assert_eq!(capped.status(&id(1), past), Some(Status::Expired));
    assert!(matches!(
        capped.check_chain(&id(1), past),
        Err(ChainError::Closed { closure, .. })
            if closure.event == Event::Expired && closure.at == past
    ));
    assert_eq!(
        capped.lease(&id(1)).unwrap().expires_at,
        t("2026-10-15T10:00:00.000Z")
    );
    assert_eq!(uncapped.status(&id(1), past), Some(Status::Open));
    // Within the ceiling: as signed.
    assert_eq!(capped.lease(&id(2)).unwrap().expires_at, t(WINDOW.1));
    assert_eq!(capped.stats().capped_grants, 1);
    assert_eq!(uncapped.stats().capped_grants, 0);
}

/// A replaced journal is folded on `Ledger::refolded`: closures stay, grants go until the new
/// journal grants them again, and the grant numbering goes on.
#[test]
fn a_refolded_ledger_keeps_closures_and_drops_grants() {
    let other = lease(&key(1), &id(2), None, WINDOW, &["*.example.com"], &[]);
    let closing = event_line(
        "revoked",
        &id(1),
        AT,
        json!({"by": "issuer", "reason": "test"}),
    );
    let (ledger, problems) = fold(&[granted_line(&root(), AT), granted_line(&other, AT), closing]);
    assert_eq!(problems, 0);
    let (mut next, dropped) = ledger.refolded();
    assert_eq!(dropped, 2);
    assert!(next.lease(&id(1)).is_none() && next.lease(&id(2)).is_none());
    assert!(matches!(
        next.check_chain(&id(2), t(AT)),
        Err(ChainError::Unknown(_))
    ));
    // The new journal grants both again, without the closing: lease 1 stays revoked.
    for grant in [granted_line(&root(), AT), granted_line(&other, AT)] {
        next.apply_line_bytes(grant.as_bytes()).unwrap();
    }
    assert_eq!(next.status(&id(1), t(AT)), Some(Status::Revoked));
    assert_eq!(next.status(&id(2), t(AT)), Some(Status::Open));
    assert_eq!(next.granted(), 4);
}

/// A lease of `key(1)` under `parent` with the manifest budget `budget`, granted at `AT`.
fn budgeted(n: u32, parent: Option<&str>, budget: serde_json::Value) -> String {
    let mut signed = lease(&key(1), &id(n), parent, WINDOW, &["*.example.com"], &[]);
    signed["manifest"]["budget"] = budget;
    sign(&mut signed, &key(1)).unwrap();
    granted_line(&signed, AT)
}

/// Leases written by another issuer that break an ancestor's `budget.depth` or a parent's
/// `budget.fan_out` are not loaded: they open nothing, on every replica alike (journal order).
#[test]
fn grants_that_break_depth_or_fan_out_are_not_loaded() {
    let (ledger, problems) = fold(&[
        budgeted(1, None, json!({"depth": 1, "fan_out": 2})),
        budgeted(2, Some(&id(1)), json!({})),
        // Two generations beneath a depth of 1.
        budgeted(3, Some(&id(2)), json!({})),
        budgeted(4, Some(&id(1)), json!({})),
        // A third live child of a fan_out of 2.
        budgeted(5, Some(&id(1)), json!({})),
    ]);
    assert_eq!(problems, 2);
    for (n, loaded) in [(2, true), (3, false), (4, true), (5, false)] {
        assert_eq!(ledger.lease(&id(n)).is_some(), loaded, "lease {n}");
    }
    assert!(matches!(
        ledger.check_chain(&id(3), t(AT)),
        Err(ChainError::Unknown(_))
    ));
    let rule = InvalidReason::ALL
        .iter()
        .position(|r| *r == InvalidReason::Rule)
        .unwrap();
    assert_eq!(ledger.stats().invalid_by_reason[rule], 2);
    assert_eq!(ledger.stats().rejected_grants, 2);
    assert_eq!(ledger.live_children(&id(1), t(AT)).count(), 2);
    // A closed child frees its place: the next one is loaded.
    let (ledger, problems) = fold(&[
        budgeted(1, None, json!({"fan_out": 1})),
        budgeted(2, Some(&id(1)), json!({})),
        event_line("completed", &id(2), AT, json!({})),
        budgeted(3, Some(&id(1)), json!({})),
    ]);
    assert_eq!(problems, 0);
    assert!(ledger.lease(&id(3)).is_some());
    assert_eq!(ledger.live_children(&id(1), t(AT)).count(), 1);
    assert!(matches!(
        ledger.lineage(&id(1), t(AT)),
        Err(leasegate::registry::ledger::Lineage::FanOut {
            fan_out: 1,
            live: 1,
            ..
        })
    ));
}
