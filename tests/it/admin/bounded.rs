//! What stays bounded as leases grow: `GET /leases` and `leases` a page at a time, and one
//! log episode (not one line per lease) for an exhausted lease-port range.

use crate::support::harness::{admin_get, port_range, Harness};
use crate::support::succeeded;
use crate::support::{leasegate_command, serve_lease_ports};
use leasegate::commands::issue::{self, IssueRequest};
use leasegate::contract::Timestamp;
use serde_json::Value;
use std::collections::HashSet;
use std::time::Duration;

/// Issues a lease for `agent` into the harness's journal.
fn lease_for(h: &Harness, agent: &str) -> String {
    let request = IssueRequest {
        manifest: serde_json::json!({}),
        allow_hosts: vec!["origin.test".into()],
        deny_hosts: vec![],
        parent: None,
        ttl: Duration::from_secs(3600),
        name: agent.into(),
        purpose: "paging test".into(),
        now: Timestamp::now(),
    };
    issue::issue(&h.journal, &h.key, &request).unwrap().lease_id
}

fn ids(page: &Value) -> Vec<String> {
    page["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["lease_id"].as_str().unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_page_by_cursor_in_grant_order_while_leases_are_added() {
    let h = Harness::new();
    let mut granted: Vec<String> = (0..23)
        .map(|i| lease_for(&h, if i % 3 == 0 { "gamma" } else { "delta" }))
        .collect();
    let server = h.start(h.config(&[])).await;

    // Default: one page of up to 100, all of them, no cursor.
    let (status, all) = admin_get(&server, "/leases").await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(ids(&all), granted);
    assert_eq!(all["next_cursor"], Value::Null);
    assert_eq!(all["total"], 23);
    assert_eq!(all["limit"], 100);
    assert!(all.get("counts").is_none());

    // Pages of 10; leases granted while paging come at the end, none twice, none skipped.
    let mut seen = Vec::new();
    let mut path = "/leases?limit=10".to_owned();
    for page in 0.. {
        let (status, answer) = admin_get(&server, &path).await;
        assert_eq!(status, 200, "{answer}");
        assert!(answer["leases"].as_array().unwrap().len() <= 10);
        seen.extend(ids(&answer));
        if page == 0 {
            granted.push(lease_for(&h, "delta"));
            granted.push(lease_for(&h, "delta"));
            let shown = crate::support::harness::eventually(Duration::from_secs(5), || async {
                let (_, view) = admin_get(&server, &format!("/leases/{}", granted[24])).await;
                (view["status"] == "open").then_some(())
            })
            .await;
            assert!(shown.is_some(), "the new leases are folded");
        }
        match answer["next_cursor"].as_str() {
            Some(cursor) => path = format!("/leases?limit=10&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(seen, granted);
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 25);

    // Filters, newest first, and the counts by status.
    let gammas: Vec<String> = granted.iter().step_by(3).take(8).cloned().collect();
    let (_, answer) = admin_get(
        &server,
        "/leases?status=open&agent=gamma&order=newest&counts=true",
    )
    .await;
    assert_eq!(
        ids(&answer),
        gammas.iter().rev().cloned().collect::<Vec<_>>()
    );
    assert_eq!(answer["counts"]["open"], 25);
    assert_eq!(answer["counts"]["revoked"], 0);
    let (_, answer) = admin_get(&server, "/leases?status=revoked").await;
    assert_eq!(ids(&answer), Vec::<String>::new());
    assert_eq!(answer["next_cursor"], Value::Null);

    // Everything out of range is a 400 that says what is accepted.
    for (query, says) in [
        ("limit=1001", "limit must be a number from 1 to 1000"),
        ("limit=0", "limit must be a number from 1 to 1000"),
        ("limit=many", "limit must be a number from 1 to 1000"),
        (
            "status=closed",
            "status \"closed\" is not one of open, not-yet-valid",
        ),
        ("order=random", "order \"random\" is not oldest or newest"),
        ("cursor=bm90LWEtY3Vyc29y", "is not one this API gave out"),
        ("cursor=%%%", "is not one this API gave out"),
        ("colour=blue", "unknown parameter \"colour\""),
        ("limit=1&limit=2", "parameter \"limit\" is given twice"),
    ] {
        let (status, answer) = admin_get(&server, &format!("/leases?{query}")).await;
        assert_eq!(status, 400, "{query}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(says), "{query}: {error}");
    }
    // A cursor of one order is not followed in the other.
    let (_, first) = admin_get(&server, "/leases?limit=1&order=newest").await;
    let cursor = first["next_cursor"].as_str().unwrap();
    let (status, answer) = admin_get(&server, &format!("/leases?cursor={cursor}")).await;
    assert_eq!(status, 400);
    assert!(answer["error"].as_str().unwrap().contains("order=newest"));
    // /refusals is bounded by its ring, and says so.
    let (status, answer) = admin_get(&server, "/refusals?limit=1001").await;
    assert_eq!(status, 400);
    assert!(answer["error"].as_str().unwrap().contains("1 to 1000"));
    server.shutdown().await;
}

#[test]
fn the_leases_command_filters_limits_and_orders() {
    let h = Harness::new();
    let leases: Vec<String> = (0..6)
        .map(|i| lease_for(&h, if i % 2 == 0 { "even" } else { "odd" }))
        .collect();
    assert!(issue::revoke(&h.journal, &h.key, &leases[2], "test", Timestamp::now()).unwrap());
    let (journal, key) = (h.journal.to_str().unwrap(), h.key_path.to_str().unwrap());
    let run = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["leases", "--journal", journal, "--key-file", key];
        args.extend(extra);
        succeeded(&leasegate_command(&args).output().unwrap())
            .lines()
            .map(str::to_owned)
            .collect()
    };
    let first_column = |lines: Vec<String>| -> Vec<String> {
        lines
            .iter()
            .skip(1)
            .map(|l| l.split_whitespace().next().unwrap().to_owned())
            .collect()
    };
    let table = run(&[]);
    assert!(table[0].starts_with("LEASE "), "{table:?}");
    assert_eq!(first_column(table.clone()), leases);
    // Columns line up on the widest cell, row by row.
    let status_at = table[0].find("STATUS").unwrap();
    assert!(table[1..]
        .iter()
        .all(|l| l[status_at..].starts_with("open") || l[status_at..].starts_with("revoked")));

    assert_eq!(
        first_column(run(&["--agent", "even", "--status", "open"])),
        vec![leases[0].clone(), leases[4].clone()]
    );
    assert_eq!(
        first_column(run(&["--newest-first", "--limit", "2"])),
        vec![leases[5].clone(), leases[4].clone()]
    );
    let json = run(&["--json", "--status", "revoked"]);
    assert_eq!(json.len(), 1);
    let row: Value = serde_json::from_str(&json[0]).unwrap();
    assert_eq!(row["lease_id"], leases[2].as_str());
    assert_eq!(row["status"], "revoked");
    let out = leasegate_command(&[
        "leases",
        "--journal",
        journal,
        "--key-file",
        key,
        "--status",
        "closed",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses an unknown status");
}

#[test]
fn an_exhausted_lease_port_range_is_one_episode_in_the_log_not_a_line_per_lease() {
    use std::io::BufRead;
    const CHILDREN: usize = 40;
    let h = Harness::new();
    // The parent is granted first and takes the only port; its children find none.
    let parent = h.lease(&["origin.test"], &[]);
    for _ in 0..CHILDREN {
        h.lease_with(
            &["origin.test"],
            &[],
            Some(&parent),
            Timestamp::now(),
            Duration::from_secs(3600),
        );
    }
    let range = port_range(1);
    let range = format!("{}-{}", range.start(), range.end());
    let mut child = serve_lease_ports(
        h.journal.to_str().unwrap(),
        h.key_path.to_str().unwrap(),
        &range,
    );
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (lines, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let mut wait_for = |what: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match received.recv_timeout(left) {
                Ok(line) => {
                    let done = line.contains(what);
                    seen.push(line);
                    if done {
                        return;
                    }
                }
                Err(_) => panic!("no line with {what:?} within 20 s:\n{}", seen.join("\n")),
            }
        }
    };
    wait_for("reachable by credentials only");
    // Closing the parent closes every child: the episode ends, and says how many it counted.
    assert!(issue::revoke(&h.journal, &h.key, &parent, "test", Timestamp::now()).unwrap());
    wait_for("every open lease has its lease port again");
    let _ = child.kill();
    let _ = child.wait();
    let warnings: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains(" WARN ") && l.contains("lease_ports"))
        .collect();
    assert_eq!(warnings.len(), 1, "{}", seen.join("\n"));
    // The port may be held by another process (another test run): then the parent is
    // without one too, and that is the episode's single line.
    assert!(
        warnings[0].contains(&format!("no free lease port in {range}: "))
            || warnings[0].contains("is held by another process"),
        "{}",
        warnings[0]
    );
    let end = seen.last().unwrap();
    let counted: usize = end
        .split("leases=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {end}"));
    assert!(end.contains(" INFO "), "{end}");
    assert!(
        counted == CHILDREN || counted == CHILDREN + 1,
        "{counted} leases counted: {end}"
    );
}
