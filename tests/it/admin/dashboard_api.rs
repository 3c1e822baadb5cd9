//! The admin endpoints the dashboard reads beyond `/leases` and `/refusals`: the health panel
//! (`/status`), the rates of the last minutes (`/rates`), a lease's last requests
//! (`/leases/{id}/requests`) and its children (`/leases?parent=`). Plain HTTP: every figure
//! the page shows comes from here.

use crate::support::harness::{
    admin_get, eventually, http_origin, port_range, raw, readyz_turns, status_of, Harness,
};
use leasegate::commands::issue::{self, IssueRequest};
use leasegate::contract::Timestamp;
use leasegate::server::Server;
use serde_json::Value;
use std::time::Duration;

/// Issues a lease for `agent` valid from now for an hour.
pub fn lease_for(
    h: &Harness,
    agent: &str,
    allow: &[&str],
    deny: &[&str],
    parent: Option<&str>,
) -> String {
    let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    issue::issue(
        &h.journal,
        &h.key,
        &IssueRequest {
            manifest: serde_json::json!({}),
            allow_hosts: strings(allow),
            deny_hosts: strings(deny),
            parent: parent.map(str::to_owned),
            ttl: Duration::from_secs(3600),
            name: agent.into(),
            purpose: "dashboard test".into(),
            now: Timestamp::now(),
        },
    )
    .unwrap()
    .lease_id
}

/// One forwarded GET of `url` through `server` under `lease` (`X-Lease-Id`): its status.
pub async fn call(server: &Server, lease: &str, url: &str) -> u16 {
    let host = url.trim_start_matches("http://").split('/').next().unwrap();
    let answer = raw(
        server.addr,
        format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nX-Lease-Id: {lease}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    status_of(&answer)
}

fn sum(counts: &Value) -> u64 {
    counts
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_what_listens_where_the_build_the_readiness_and_the_limits_in_force() {
    let h = Harness::new();
    h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[]);
    config.max_connections = 321;
    config.max_connections_per_lease = 17;
    config.max_connections_per_client = 9;
    config.header_read_timeout = Duration::from_secs(7);
    config.tunnel_idle_timeout = Duration::from_secs(600);
    config.connect_timeout = Duration::from_millis(2500);
    config.upstream_response_timeout = Duration::from_secs(45);
    let range = port_range(4);
    let server = h.start_with_ports(config, Some(range.clone())).await;
    let (status, s) = admin_get(&server, "/status").await;
    assert_eq!(status, 200, "{s}");
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    assert_eq!(s["build"]["profile"], profile);
    assert_eq!(
        s["build"]["target"],
        format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS)
    );
    assert_eq!(s["ready"], true, "{s}");
    assert_eq!(s["reason"], Value::Null);
    assert_eq!(s["listeners"]["proxy"], server.addr.to_string());
    assert_eq!(
        s["listeners"]["admin"],
        server.admin_addr.unwrap().to_string()
    );
    assert_eq!(s["listeners"]["lease_ports"]["bind"], "127.0.0.1");
    assert_eq!(s["listeners"]["lease_ports"]["first"], *range.start());
    assert_eq!(s["listeners"]["lease_ports"]["last"], *range.end());
    assert_eq!(s["listeners"]["tls"], false);
    assert_eq!(
        (s["mode"].as_str(), s["on_refusal"].as_str()),
        (Some("enforce"), Some("revoke"))
    );
    assert_eq!(s["journal"]["pending_appends"], 0);
    assert_eq!(s["journal"]["append_failures"], 0);
    assert!(s["journal"]["store_lag_seconds"].is_number(), "{s}");
    let limits = &s["limits"];
    assert_eq!(limits["max_connections"], 321);
    assert_eq!(limits["max_connections_per_lease"], 17);
    assert_eq!(limits["max_connections_per_client"], 9);
    assert_eq!(limits["header_read_timeout_seconds"], 7.0);
    assert_eq!(limits["tunnel_idle_timeout_seconds"], 600.0);
    assert_eq!(limits["connect_timeout_seconds"], 2.5);
    assert_eq!(limits["upstream_response_timeout_seconds"], 45.0);
    assert_eq!(limits["connect_ports"], "1-65535");
    // Readiness is /readyz's decision, and says why the same way: an unreadable journal.
    std::fs::remove_file(&h.journal).unwrap();
    std::fs::create_dir(&h.journal).unwrap();
    let unready = readyz_turns(&server, 503, Duration::from_secs(10))
        .await
        .expect("/readyz turns 503");
    let (_, s) = admin_get(&server, "/status").await;
    assert_eq!(s["ready"], false, "{s}");
    assert!(s["reason"].as_str().is_some_and(|r| !r.is_empty()), "{s}");
    let (_, readyz) = admin_get(&server, "/readyz").await;
    assert_eq!(readyz["reason"], s["reason"], "{unready}");
    // Read-only.
    let post = raw(
        server.admin_addr.unwrap(),
        b"POST /status HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&post), 405, "{post}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_new_route_needs_the_admin_token() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let mut serve = h.serve_config(h.config(&[]), None);
    serve.admin_token = Some("the-token".into());
    let server = Server::start(serve).await.unwrap();
    for path in [
        "/status".to_owned(),
        format!("/rates?leases={lease}"),
        format!("/leases/{lease}/requests"),
        format!("/leases?parent={lease}"),
    ] {
        let (status, body) = admin_get(&server, &path).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(!body.to_string().contains("origin.test"), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rates_hold_each_second_of_the_last_two_minutes_in_total_and_per_lease() {
    let h = Harness::new();
    let origin = http_origin().await;
    let busy = h.lease(&["origin.test"], &[]);
    let idle = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    for _ in 0..7 {
        assert_eq!(call(&server, &busy, &url).await, 200);
    }
    // An unknown lease id is counted in the total only.
    let unknown = "00000000-0000-4000-8000-000000000000";
    assert_eq!(call(&server, unknown, &url).await, 407);
    // The second under way is not shown: the calls appear once it is over.
    let path = format!("/rates?leases={busy},{idle},{unknown}");
    let rates = eventually(Duration::from_secs(10), || async {
        let (status, rates) = admin_get(&server, &path).await;
        assert_eq!(status, 200, "{rates}");
        (sum(&rates["leases"][&busy]) == 7 && sum(&rates["total"]) == 8).then_some(rates)
    })
    .await
    .expect("the calls show in the rates");
    assert_eq!(rates["interval_seconds"], 1);
    assert_eq!(rates["window_seconds"], 120);
    assert_eq!(rates["total"].as_array().unwrap().len(), 120);
    assert_eq!(rates["leases"][&busy].as_array().unwrap().len(), 120);
    assert_eq!(sum(&rates["leases"][&idle]), 0);
    assert_eq!(sum(&rates["leases"][unknown]), 0);
    // Without leases, the total alone.
    let (_, total) = admin_get(&server, "/rates").await;
    assert_eq!(total["leases"], serde_json::json!({}));
    assert_eq!(sum(&total["total"]), 8);

    let many: Vec<String> = (0..101).map(|_| unknown.to_owned()).collect();
    for (query, message) in [
        ("leases=nope".to_owned(), "\"nope\" is not a lease id"),
        (
            format!("leases={}", many.join(",")),
            "leases names 101 leases; at most 100 at once",
        ),
        ("window=5".to_owned(), "unknown parameter \"window\""),
        (format!("leases={busy}&leases={busy}"), "given twice"),
    ] {
        let (status, body) = admin_get(&server, &format!("/rates?{query}")).await;
        assert_eq!(status, 400, "{query}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(message),
            "{query}: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_s_last_requests_come_newest_first_and_bounded() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]);
    config.on_refusal = leasegate::config::OnRefusal::Log;
    let server = h.start(config).await;
    let port = origin.addr.port();
    let allowed = format!("http://origin.test:{port}/");
    for _ in 0..3 {
        assert_eq!(call(&server, &lease, &allowed).await, 200);
    }
    assert_eq!(
        call(&server, &lease, &format!("http://other.test:{port}/")).await,
        403
    );
    assert_eq!(call(&server, &other, &allowed).await, 200);
    h.egress_lines(5).await;
    let (status, answer) = admin_get(&server, &format!("/leases/{lease}/requests")).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["limit"], 50);
    let requests = answer["requests"].as_array().unwrap();
    let seen: Vec<(&str, &str, Option<&str>)> = requests
        .iter()
        .map(|r| {
            (
                r["host"].as_str().unwrap(),
                r["verdict"].as_str().unwrap(),
                r["code"].as_str(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("other.test", "refuse", Some("host-not-allowed")),
            ("origin.test", "allow", None),
            ("origin.test", "allow", None),
            ("origin.test", "allow", None),
        ]
    );
    assert!(requests.iter().all(|r| r["lease_id"] == lease.as_str()));
    let (_, one) = admin_get(&server, &format!("/leases/{lease}/requests?limit=1")).await;
    assert_eq!(one["requests"].as_array().unwrap().len(), 1);
    assert_eq!(one["requests"][0]["host"], "other.test");

    for (query, status, message) in [
        ("?limit=0", 400, "limit must be a number from 1 to 50"),
        ("?limit=51", 400, "limit must be a number from 1 to 50"),
        ("?since=1", 400, "unknown parameter"),
    ] {
        let (got, body) = admin_get(&server, &format!("/leases/{lease}/requests{query}")).await;
        assert_eq!(got, status, "{query}: {body}");
        assert!(body["error"].as_str().unwrap().contains(message), "{body}");
    }
    let unknown = "00000000-0000-4000-8000-000000000000";
    let (status, body) = admin_get(&server, &format!("/leases/{unknown}/requests")).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (404, Some(&*format!("no lease {unknown}")))
    );
    let (status, _) = admin_get(&server, "/leases/NOPE/requests").await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_s_children_are_the_leases_whose_parent_it_is() {
    let h = Harness::new();
    let parent = h.lease(&["origin.test"], &[]);
    let first = lease_for(&h, "worker-1", &["origin.test"], &[], Some(&parent));
    let grandchild = lease_for(&h, "worker-1a", &["origin.test"], &[], Some(&first));
    let second = lease_for(&h, "worker-2", &["origin.test"], &[], Some(&parent));
    let _unrelated = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[])).await;
    let (status, page) = admin_get(&server, &format!("/leases?parent={parent}")).await;
    assert_eq!(status, 200, "{page}");
    let children: Vec<(&str, &str)> = page["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["lease_id"].as_str().unwrap(),
                l["agent"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        children,
        [(first.as_str(), "worker-1"), (second.as_str(), "worker-2")]
    );
    let (_, page) = admin_get(&server, &format!("/leases?parent={first}")).await;
    assert_eq!(page["leases"][0]["lease_id"], grandchild.as_str());
    assert_eq!(page["leases"].as_array().unwrap().len(), 1);
    let (status, body) = admin_get(&server, "/leases?parent=nope").await;
    assert_eq!(status, 400);
    assert_eq!(
        body["error"],
        "parent \"nope\" is not a lease id (a lower-case UUID)"
    );
}
