//! `budget.wall_clock_ms`: a lease ends `wall_clock_ms` after `issued_at` when that comes before
//! its signed `expires_at`, and so do the leases under it, open tunnels included.

use crate::support::harness::{
    admin_get, http_origin, raw, streaming_tunnel, until_closed, Harness, AT_ONCE,
};
use leasegate::contract::Timestamp;
use std::time::{Duration, Instant};

/// A lease of `h` allowing `origin.test`, with the manifest budget `budget`.
async fn grant(
    h: &Harness,
    n: u32,
    parent: Option<&str>,
    issued: Timestamp,
    budget: serde_json::Value,
) -> String {
    h.grant_budgeted(n, parent, issued, &["origin.test"], budget)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_wall_clock_budget_closes_the_lease_its_child_and_their_tunnels() {
    let h = Harness::new();
    let origin = http_origin().await;
    let issued = Timestamp::now();
    let started = Instant::now();
    let parent = grant(
        &h,
        1,
        None,
        issued,
        serde_json::json!({"wall_clock_ms": 1500}),
    )
    .await;
    let child = grant(&h, 2, Some(&parent), issued, serde_json::json!({})).await;
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let target = format!("origin.test:{}", origin.addr.port());
    let (_, view) = admin_get(&server, &format!("/leases/{parent}")).await;
    assert_eq!(view["status"], "open");
    assert_eq!(
        view["expires_at"],
        issued.saturating_add_millis(1500).to_string()
    );
    assert_eq!(view["expires_by"], "budget.wall_clock_ms");
    let (_, view) = admin_get(&server, &format!("/leases/{child}")).await;
    assert_eq!(
        view["expires_at"],
        issued.saturating_add_millis(3_600_000).to_string()
    );
    assert!(view.get("expires_by").is_none(), "{view}");

    let mut tunnels = Vec::new();
    for lease in [&parent, &child] {
        tunnels.push(streaming_tunnel(server.addr, &target, Some(lease)).await);
    }
    for tunnel in &mut tunnels {
        until_closed(tunnel, Duration::from_millis(1500) + AT_ONCE * 2).await;
        let lived = started.elapsed();
        // `issued_at` is read in whole milliseconds, before `started`: the budget ends no
        // sooner than 1499 ms after it; the upper bound is loose for a busy machine.
        assert!(
            lived >= Duration::from_millis(1400) && lived < Duration::from_millis(1500) + AT_ONCE,
            "closed after {lived:?}"
        );
    }

    for (lease, code) in [(&parent, "lease-expired"), (&child, "ancestor-closed")] {
        let request = format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
        let answer = raw(server.addr, request.as_bytes()).await;
        for said in [
            format!("x-leasegate-refusal: {code}"),
            "budget.wall_clock_ms (1500 ms) spent".to_owned(),
        ] {
            assert!(answer.contains(&said), "{said}: {answer}");
        }
    }

    let (_, view) = admin_get(&server, &format!("/leases/{parent}")).await;
    assert_eq!(view["status"], "expired");
    assert_eq!(view["closed"]["event"], "expired");
    assert_eq!(
        view["closed"]["reason"],
        "budget.wall_clock_ms (1500 ms) spent"
    );
    let (_, view) = admin_get(&server, &format!("/leases/{child}")).await;
    assert_eq!(view["status"], "ancestor-closed");
    assert_eq!(view["closed"]["ancestor"], parent.as_str());
    assert_eq!(
        h.journal_records().await.len(),
        2,
        "closed by the clock alone: the journal holds only the grants"
    );
}
