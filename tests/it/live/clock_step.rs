//! The proxy's clock stepped back: an expiry it has seen stays seen, in memory and across a
//! restart; the step shows on `/readyz` and `/metrics`.

use crate::support::harness::answer_through;
use crate::support::harness::{admin_get, admin_text, http_origin, Harness};
use leasegate::contract::Timestamp;
use leasegate::registry::WallClock;
use leasegate::server::Server;
use std::time::Duration;

const HOUR: i64 = 3_600_000;

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// A lease the proxy refused as `lease-expired` stays refused when the proxy's wall clock
/// steps back an hour (an NTP step, a VM resumed, an operator's mistake) to within the lease's
/// window, and after a restart with the clock still behind; `/readyz` (still 200) and
/// `/metrics` show the step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_seen_expired_stays_expired_when_the_clock_steps_back() {
    let h = Harness::new();
    let origin = http_origin().await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let now = Timestamp::now();
    // Issued two hours ago, for two hours less a minute: an hour back, it was open.
    let expired = h.lease_with(
        &["origin.test"],
        &[],
        None,
        now.saturating_add_millis(-2 * HOUR),
        Duration::from_millis((2 * HOUR - 60_000) as u64),
    );
    // Open from two hours ago for three: open now and an hour back.
    let open = h.lease_with(
        &["origin.test"],
        &[],
        None,
        now.saturating_add_millis(-2 * HOUR),
        Duration::from_millis((3 * HOUR) as u64),
    );
    let start = |wall: WallClock| {
        let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
        config.wall = wall;
        Server::start(config)
    };

    let wall = WallClock::adjustable();
    let server = start(wall.clone()).await.unwrap();
    assert_eq!(
        answer_through(&server, &expired, &url).await,
        (403, Some("lease-expired".into()))
    );
    assert_eq!(answer_through(&server, &open, &url).await, (200, None));
    let (status, ready) = admin_get(&server, "/readyz").await;
    assert_eq!((status, ready.get("clock")), (200, None), "{ready}");

    wall.step(-HOUR);
    assert_eq!(
        answer_through(&server, &expired, &url).await,
        (403, Some("lease-expired".into())),
        "the expiry the proxy saw stands"
    );
    assert_eq!(answer_through(&server, &open, &url).await, (200, None));
    let (status, ready) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["clock"]["steps_back"], 1, "{ready}");
    let behind = ready["clock"]["behind_seconds"].as_f64().unwrap();
    assert!((3590.0..3700.0).contains(&behind), "{ready}");
    let (_, metrics) = admin_text(&server, "/metrics").await;
    assert!(metric(&metrics, "leasegate_clock_behind_seconds") > 3590.0);
    assert_eq!(metric(&metrics, "leasegate_clock_steps_back_total"), 1.0);
    let (_, view) = admin_get(&server, &format!("/leases/{expired}")).await;
    assert_eq!(view["status"], "expired");
    server.shutdown().await;

    // A restart on the same journal, its clock still an hour behind.
    let wall = WallClock::adjustable();
    wall.step(-HOUR);
    let server = start(wall).await.unwrap();
    assert_eq!(
        answer_through(&server, &expired, &url).await,
        (403, Some("lease-expired".into())),
        "the floor written down before the restart stands"
    );
    assert_eq!(answer_through(&server, &open, &url).await, (200, None));
    let (status, ready) = admin_get(&server, "/readyz").await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["clock"]["steps_back"], 1, "{ready}");
    server.shutdown().await;
}

/// A clock file that does not hold a time stops the start (the floor cannot be known); the
/// error names the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_clock_stops_the_start() {
    let h = Harness::new();
    let mut path = h.journal.as_os_str().to_owned();
    path.push(".clock");
    std::fs::write(&path, "not a time\n").unwrap();
    let error = match Server::start(h.serve_config(h.config(&[]), None)).await {
        Ok(_) => panic!("started over an unreadable clock"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains(".clock") && error.contains("remove it only if"),
        "{error}"
    );
}
