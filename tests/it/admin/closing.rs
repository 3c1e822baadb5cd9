//! Why and when a lease closed, wherever an operator or a client looks: the refusal's body and
//! egress line, `GET /leases` and `/leases/{id}`, `leases` as a table and as JSON.

use crate::support::harness::{admin_get, all_leases, http_origin, raw, status_of, through};
use crate::support::harness::{CurlOutput, Harness};
use crate::support::{event_line, leasegate_command, succeeded};
use leasegate::commands::issue;
use leasegate::contract::Timestamp;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::time::Duration;

/// `POST /leases/{lease}/revoke` with `reason` (JSON-encoded here): the status.
async fn revoke_from_admin(server: &Server, lease: &str, reason: &str) -> u16 {
    let body = json!({ "reason": reason }).to_string();
    let answer = raw(
        server.admin_addr.unwrap(),
        format!(
            "POST /leases/{lease}/revoke HTTP/1.1\r\nHost: localhost\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await;
    status_of(&answer)
}

/// The `at` of `lease`'s `revoked` record in the journal.
async fn revoked_at(h: &Harness, lease: &str) -> String {
    let revocations = h.revocations().await;
    let record = revocations
        .iter()
        .find(|r| r["lease_id"] == lease)
        .unwrap_or_else(|| panic!("no revocation of {lease}: {revocations:?}"));
    record["at"].as_str().unwrap().to_owned()
}

/// Checks a refusal of a forwarded GET to `target` with `code` whose detail is `detail`: the
/// body, word for word, and the egress line's `error` (the `n`-th line).
async fn assert_refused_saying(
    h: &Harness,
    out: &CurlOutput,
    (lease, target): (&str, &str),
    code: &str,
    detail: &str,
    n: usize,
) {
    assert_eq!(out.status, 403, "{out:?}");
    assert_eq!(out.header("x-leasegate-refusal").as_deref(), Some(code));
    assert_eq!(
        out.body_text(),
        format!("leasegate refused GET {target} for lease {lease}: {code} ({detail})\n")
    );
    let line = h.egress_line(n).await;
    assert_eq!(
        (&line["code"], &line["error"]),
        (&code.into(), &detail.into())
    );
}

/// The `closed` object of `lease` in `GET /leases/{id}`, checked equal to its entry in
/// `GET /leases`.
async fn closed_in_admin(server: &Server, lease: &str) -> Value {
    let (status, view) = admin_get(server, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200, "{view}");
    assert!(view.get("closed").is_some(), "{view}");
    let listed = all_leases(server).await.unwrap();
    let entry = listed.iter().find(|l| l["lease_id"] == lease).unwrap();
    assert_eq!(entry["closed"], view["closed"], "{entry}");
    view["closed"].clone()
}

/// A GET of `origin.test` on `port` under `lease`, which the issuer revoked for `reason` (as
/// shown): the refusal (the `n`-th egress line) and the admin API say so, with the record's
/// time.
async fn assert_revoked_for(
    h: &Harness,
    server: &Server,
    lease: &str,
    port: u16,
    reason: &str,
    n: usize,
) {
    let at = revoked_at(h, lease).await;
    let out = through(server, lease, &format!("http://origin.test:{port}/")).await;
    assert_refused_saying(
        h,
        &out,
        (lease, &format!("origin.test:{port}")),
        "lease-revoked",
        &format!("lease {lease} was revoked at {at} by issuer: {reason}"),
        n,
    )
    .await;
    assert_eq!(out.body_text().lines().count(), 1);
    assert_eq!(
        closed_in_admin(server, lease).await,
        json!({"event": "revoked", "at": at, "by": "issuer", "reason": reason})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_revoked_from_the_admin_api_is_refused_naming_when_by_whom_and_why() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    assert_eq!(through(&server, &lease, &url).await.status, 200);
    assert_eq!(closed_in_admin(&server, &lease).await, Value::Null);

    let reason = "revoked from the dashboard: runaway loop";
    assert_eq!(revoke_from_admin(&server, &lease, reason).await, 200);
    assert_revoked_for(&h, &server, &lease, origin.addr.port(), reason, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refusal_after_a_revoking_one_names_the_request_that_revoked() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test", "*.evil.test"], &["*.evil.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("cdn.evil.test", "127.0.0.1")]))
        .await;
    let port = origin.addr.port();
    let denied = through(&server, &lease, &format!("http://cdn.evil.test:{port}/x")).await;
    assert_eq!(
        denied.header("x-leasegate-refusal").as_deref(),
        Some("host-denied")
    );
    let why = format!(
        "leasegate refused GET cdn.evil.test:{port}: host-denied (cdn.evil.test is denied by \
         *.evil.test in lease {lease})"
    );
    assert_revoked_for(&h, &server, &lease, port, &why, 2).await;
}

/// An expired lease, a stopped one and the child of a revoked parent: each refusal says what
/// closed it, and the admin API and `leases` (table and JSON) show the same closing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_a_stop_and_an_ancestors_revocation_are_shown_everywhere() {
    let h = Harness::new();
    let origin = http_origin().await;
    let now = Timestamp::now();
    let hour = Duration::from_secs(3600);
    let issued = now.saturating_add_millis(-7_200_000);
    let expired = h.lease_with(&["origin.test"], &[], None, issued, hour);
    let expires_at = issued.saturating_add_millis(3_600_000).to_string();
    let stopped = h.lease(&["origin.test"], &[]);
    h.append(&event_line(
        "stopped",
        &stopped,
        &now.to_string(),
        json!({"reason": "task finished"}),
    ))
    .await;
    let parent = h.lease(&["origin.test"], &[]);
    let child = h.lease_with(&["origin.test"], &[], Some(&parent), Timestamp::now(), hour);
    let at = Timestamp::now();
    assert!(issue::revoke(&h.journal, &h.key, &parent, "parent misbehaved", at).unwrap());
    let open = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let target = format!("origin.test:{}", origin.addr.port());

    let cases = [
        (
            &expired,
            "lease-expired",
            format!("lease {expired} expired at {expires_at}"),
            json!({"event": "expired", "at": expires_at, "by": null, "reason": null}),
        ),
        (
            &stopped,
            "lease-closed",
            format!("lease {stopped} was stopped at {now}: task finished"),
            json!({"event": "stopped", "at": now.to_string(), "by": null,
                "reason": "task finished"}),
        ),
        (
            &child,
            "ancestor-closed",
            format!(
                "lease {child} is closed: ancestor {parent} was revoked at {at} by issuer: \
                 parent misbehaved"
            ),
            json!({"event": "ancestor-closed", "at": at.to_string(), "by": "issuer",
                "reason": "parent misbehaved", "ancestor": parent}),
        ),
    ];
    for (n, (lease, code, detail, closed)) in cases.iter().enumerate() {
        let out = through(&server, lease, &url).await;
        assert_refused_saying(&h, &out, (lease, &target), code, detail, n + 1).await;
        assert_eq!(&closed_in_admin(&server, lease).await, closed, "{lease}");
    }
    assert_eq!(closed_in_admin(&server, &open).await, Value::Null);

    let (journal, key) = (h.journal.to_str().unwrap(), h.key_path.to_str().unwrap());
    let listed = |extra: &[&str]| {
        let mut args = vec!["leases", "--journal", journal, "--key-file", key];
        args.extend(extra);
        succeeded(&leasegate_command(&args).output().unwrap())
    };
    let rows: Vec<Value> = listed(&["--json"])
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = |id: &str| rows.iter().find(|r| r["lease_id"] == id).unwrap().clone();
    for (lease, _, _, closed) in &cases {
        assert_eq!(&row(lease)["closed"], closed, "{lease}");
    }
    assert_eq!(row(&open)["closed"], Value::Null);
    assert_eq!(
        row(&parent)["closed"],
        json!({"event": "revoked", "at": at.to_string(), "by": "issuer",
            "reason": "parent misbehaved"})
    );

    let table = listed(&[]);
    let header = table.lines().next().unwrap();
    assert!(header.ends_with("  CLOSED"), "{header}");
    let closed_at = header.find("CLOSED").unwrap();
    let cell = |id: &str| {
        let line = table.lines().find(|l| l.starts_with(id)).unwrap();
        line.get(closed_at..).unwrap_or_default().to_owned()
    };
    assert_eq!(cell(&expired), format!("expired at {expires_at}"));
    assert_eq!(
        cell(&stopped),
        format!("was stopped at {now}: task finished")
    );
    assert_eq!(
        cell(&child),
        format!("ancestor {parent} was revoked at {at} by issuer: parent misbehaved")
    );
    assert_eq!(cell(&open), "-");
}

/// A reason is signed, but says anything: control characters and 10 KB of it reach neither
/// the client's one line nor the admin API whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_reason_with_control_characters_is_shown_on_one_bounded_line() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let reason = format!(
        "line one\r\nline two\u{1b}[2J\u{202E}txet\u{2028}{}",
        "x".repeat(10_000)
    );
    assert_eq!(revoke_from_admin(&server, &lease, &reason).await, 200);
    let kept: String = reason.chars().take(500).collect();
    assert_eq!(
        h.revocations().await[0]["reason"],
        kept.as_str(),
        "the journal keeps what the schema allows"
    );
    // 240 characters: the 28 before the x's, 211 x's and an ellipsis.
    let shown = format!("line one  line two [2J txet {}…", "x".repeat(240 - 1 - 28));
    assert_revoked_for(&h, &server, &lease, origin.addr.port(), &shown, 1).await;
}

/// A retired lease keeps only its closing's event and time (or its expiry): the refusal still
/// says what closed it and when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_lease_is_refused_naming_its_closing_and_time() {
    let h = Harness::new();
    let origin = http_origin().await;
    let now = Timestamp::now();
    let days = |n: i64| now.saturating_add_millis(n * 86_400_000);
    let revoked = h.lease_with(
        &["origin.test"],
        &[],
        None,
        days(-3),
        Duration::from_secs(7 * 86_400),
    );
    assert!(issue::revoke(&h.journal, &h.key, &revoked, "old news", days(-2)).unwrap());
    let expired = h.lease_with(
        &["origin.test"],
        &[],
        None,
        days(-3),
        Duration::from_secs(3600),
    );
    let expires_at = days(-3).saturating_add_millis(3_600_000);
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.store.closed_lease_retention = Some(Duration::from_secs(86_400));
    let server = Server::start(config).await.unwrap();
    let (status, _) = admin_get(&server, &format!("/leases/{revoked}")).await;
    assert_eq!(status, 404, "retired");
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let target = format!("origin.test:{}", origin.addr.port());
    let out = through(&server, &revoked, &url).await;
    let detail = format!("lease {revoked} was revoked at {}", days(-2));
    assert_refused_saying(&h, &out, (&revoked, &target), "lease-revoked", &detail, 1).await;
    let out = through(&server, &expired, &url).await;
    let detail = format!("lease {expired} expired at {expires_at}");
    assert_refused_saying(&h, &out, (&expired, &target), "lease-expired", &detail, 2).await;
}
