//! Per-lease ports that never move between leases: across a restart, across replicas of one
//! journal, and after a lease closes; `--lease-port-credentials token`.

use crate::support::harness::{curl, eventually, http_origin, port_range, Harness};
use leasegate::commands::issue;
use leasegate::config::LeasePortCredentials;
use leasegate::contract::{token, Timestamp};
use leasegate::server::Server;
use std::ops::RangeInclusive;
use std::time::Duration;

/// The port serving each of `leases` on `server`, once every one has it.
async fn ports_of(server: &Server, leases: &[&str]) -> Vec<u16> {
    let ports = server.ports.clone().unwrap();
    eventually(Duration::from_secs(10), || async {
        leases.iter().map(|id| ports.port_of(id)).collect()
    })
    .await
    .unwrap_or_else(|| panic!("not every lease of {leases:?} got a port"))
}

/// Asserts that `lease` is told it has no port on `server` (and has none).
async fn assert_without_port(server: &Server, lease: &str) {
    let ports = server.ports.clone().unwrap();
    let warned = eventually(Duration::from_secs(5), || async {
        ports.is_warned(lease).then_some(())
    })
    .await;
    assert!(
        warned.is_some(),
        "lease {lease} was not told it has no port"
    );
    assert_eq!(ports.port_of(lease), None);
}

fn revoke(h: &Harness, lease: &str) {
    assert!(issue::revoke(&h.journal, &h.key, lease, "test", Timestamp::now()).unwrap());
}

/// A server on the harness's journal whose lease ports bind `ip` and whose local state is in
/// `data` (a replica of the harness's own server).
async fn replica(h: &Harness, range: RangeInclusive<u16>, ip: &str, data: &str) -> Server {
    let mut config = h.serve_config(h.config(&[]), Some(range.clone()));
    config.lease_ports = Some((range, ip.parse().unwrap()));
    config.store.data_dir = h.dir.path().join(data);
    Server::start(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_every_open_lease_on_its_port() {
    let h = Harness::new();
    let leases: Vec<String> = (0..3).map(|_| h.lease(&["origin.test"], &[])).collect();
    let range = port_range(8);
    let first = h.start_with_ports(h.config(&[]), Some(range.clone())).await;
    let ports = ports_of(&first, &[&leases[0], &leases[1], &leases[2]]).await;
    // The first lease closes: its port is held, the others stay where they are.
    revoke(&h, &leases[0]);
    let first_ports = first.ports.clone().unwrap();
    let closed = eventually(Duration::from_secs(5), || async {
        first_ports.port_of(&leases[0]).is_none().then_some(())
    })
    .await;
    assert!(closed.is_some(), "the revoked lease kept its open port");
    first.shutdown().await;

    let second = h.start_with_ports(h.config(&[]), Some(range)).await;
    assert_eq!(
        ports_of(&second, &[&leases[1], &leases[2]]).await,
        ports[1..],
        "a restart moved open leases to other ports"
    );
    let held = second.ports.clone().unwrap();
    assert_eq!(held.held_port(&leases[0]), Some(ports[0]));
    assert_eq!(
        held.port_of(&leases[0]),
        None,
        "a closed lease's port opens at start"
    );
}

/// Leases whose home ports collide in `range`, granted in the harness's journal in that order:
/// two with home `range.start()`, one with the next home. Issued into a scratch journal under
/// the harness's key, and only these grants copied.
async fn colliding_leases(h: &Harness, range: &RangeInclusive<u16>) -> [String; 3] {
    let scratch = Harness::new();
    let scratch_journal = scratch.dir.path().join("scratch.jsonl");
    let mut at_start = Vec::new();
    let mut next = None;
    while at_start.len() < 2 || next.is_none() {
        let id = issue::issue(
            &scratch_journal,
            &h.key,
            &leasegate::commands::issue::IssueRequest {
                manifest: serde_json::json!({}),
                allow_hosts: vec!["origin.test".into()],
                deny_hosts: vec![],
                parent: None,
                ttl: Duration::from_secs(3600),
                name: "tester".into(),
                purpose: "colliding lease ports".into(),
                now: Timestamp::now(),
            },
        )
        .unwrap()
        .lease_id;
        let home = leasegate::proxy::lease_ports::home_port(range, &id);
        if home == *range.start() && at_start.len() < 2 {
            at_start.push(id);
        } else if home == range.start() + 1 && next.is_none() {
            next = Some(id);
        }
    }
    let grants = std::fs::read_to_string(&scratch_journal).unwrap();
    let ordered = [at_start[0].clone(), at_start[1].clone(), next.unwrap()];
    for id in &ordered {
        let line = grants.lines().find(|l| l.contains(id.as_str())).unwrap();
        h.append(line).await;
    }
    ordered
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_ports_whose_probe_passed_a_lease_retired_since() {
    let h = Harness::new();
    let range = port_range(4);
    let [a, b, c] = colliding_leases(&h, &range).await;
    let first = h.start_with_ports(h.config(&[]), Some(range.clone())).await;
    let start = *range.start();
    assert_eq!(
        ports_of(&first, &[&a, &b, &c]).await,
        [start, start + 1, start + 2],
        "home, then probed past the held ports"
    );
    revoke(&h, &a);
    first.shutdown().await;

    // Restarted with a retention that retires the closed lease at once: derived afresh, `b`
    // would take `a`'s port and `c` `b`'s. The written assignments win.
    let mut config = h.serve_config(h.config(&[]), Some(range));
    config.store.closed_lease_retention = Some(Duration::from_millis(1));
    let second = Server::start(config).await.unwrap();
    assert_eq!(ports_of(&second, &[&b, &c]).await, [start + 1, start + 2]);
    let held = second.ports.clone().unwrap();
    assert_eq!(
        held.held_port(&a),
        None,
        "a retired lease's port is free again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_of_one_journal_give_every_lease_the_same_port() {
    let h = Harness::new();
    let earlier = h.lease(&["origin.test"], &[]);
    let kept = h.lease(&["origin.test"], &[]);
    let range = port_range(8);
    let one = replica(&h, range.clone(), "127.0.0.1", "data-one").await;
    ports_of(&one, &[&earlier, &kept]).await;
    // The second replica starts after the earlier lease closed.
    revoke(&h, &earlier);
    let one_ports = one.ports.clone().unwrap();
    let closed = eventually(Duration::from_secs(5), || async {
        one_ports.port_of(&earlier).is_none().then_some(())
    })
    .await;
    assert!(closed.is_some());
    let two = replica(&h, range, "127.0.0.2", "data-two").await;
    // And a lease granted while both run.
    let later = h.lease(&["origin.test"], &[]);
    let leases = [kept.as_str(), later.as_str()];
    assert_eq!(ports_of(&one, &leases).await, ports_of(&two, &leases).await);
    assert_eq!(
        one_ports.held_port(&earlier),
        two.ports.clone().unwrap().held_port(&earlier)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_lease_port_answers_as_that_lease_and_goes_to_no_other() {
    let h = Harness::new();
    let origin = http_origin().await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let first = h.lease(&["origin.test"], &[]);
    // One port: the first lease's, and nobody else's while it is held.
    let range = port_range(1);
    let config = || h.config(&[("origin.test", "127.0.0.1")]);
    let server = h.start_with_ports(config(), Some(range.clone())).await;
    let [port] = <[u16; 1]>::try_from(ports_of(&server, &[&first]).await).unwrap();
    let plain = format!("http://127.0.0.1:{port}");
    assert_eq!(curl(&["-x", &plain, &url], &[]).await.status, 200);
    assert_eq!(h.egress_line(1).await["lease_id"], first.as_str());

    revoke(&h, &first);
    let ports = server.ports.clone().unwrap();
    // Once a pass has seen the lease closed (it no longer counts as its port's lease).
    let seen = eventually(Duration::from_secs(5), || async {
        ports.port_of(&first).is_none().then_some(())
    })
    .await;
    assert!(seen.is_some(), "the revoked lease still has its port");
    let refused = curl(&["-x", &plain, &url], &[]).await;
    assert_eq!(refused.status, 403, "{refused:?}");
    assert_eq!(
        refused.header("x-leasegate-refusal").as_deref(),
        Some("lease-revoked")
    );
    let line = h.egress_line(2).await;
    assert_eq!(line["lease_id"], first.as_str());
    assert_eq!(line["code"], "lease-revoked");

    let second = h.lease(&["origin.test"], &[]);
    assert_without_port(&server, &second).await;
    server.shutdown().await;

    // Nor after a restart, when nothing in memory remembers the closed lease's port.
    let server = h.start_with_ports(config(), Some(range)).await;
    assert_without_port(&server, &second).await;
    let out = curl(&["-x", &plain, &url], &[]).await;
    assert_ne!(out.status, 200, "the closed lease's port served: {out:?}");
    let lines = h.egress_lines(2).await;
    assert!(
        lines.iter().all(|l| l["lease_id"] != second.as_str()),
        "{lines:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_port_with_token_credentials_wants_the_lease_token() {
    let h = Harness::new();
    let origin = http_origin().await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.lease_port_credentials = LeasePortCredentials::Token;
    let server = h.start_with_ports(config, Some(port_range(4))).await;
    let [port] = <[u16; 1]>::try_from(ports_of(&server, &[&lease]).await).unwrap();
    let at_port = |credential: Option<&str>| match credential {
        Some(credential) => format!("http://agent:{credential}@127.0.0.1:{port}"),
        None => format!("http://127.0.0.1:{port}"),
    };
    let refusal = |out: &crate::support::harness::CurlOutput| out.header("x-leasegate-refusal");

    let none = curl(&["-x", &at_port(None), &url], &[]).await;
    assert_eq!(none.status, 407, "{none:?}");
    assert_eq!(refusal(&none).as_deref(), Some("lease-missing"));
    let bare = curl(&["-x", &at_port(Some(&lease)), &url], &[]).await;
    assert_eq!(
        (bare.status, refusal(&bare).as_deref()),
        (407, Some("lease-missing"))
    );
    let theirs = token::mint(&h.key, &other);
    let conflict = curl(&["-x", &at_port(Some(&theirs)), &url], &[]).await;
    assert_eq!(refusal(&conflict).as_deref(), Some("lease-conflict"));
    let own = token::mint(&h.key, &lease);
    let served = curl(&["-x", &at_port(Some(&own)), &url], &[]).await;
    assert_eq!(served.status, 200, "{served:?}");
    let lines = h.egress_lines(4).await;
    assert_eq!(lines[3]["lease_id"], lease.as_str());
    assert_eq!(lines[3]["verdict"], "allow");
}
