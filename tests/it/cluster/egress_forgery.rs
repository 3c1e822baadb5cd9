//! The egress stream under attack: a writer without the replicas' key cannot plant ids that
//! erase a replica's lines, nor add lines that count; a line filed under another lease's
//! subject, unsigned, blank or with a bad MAC is set aside by reason. And the follower a
//! replica folds the others' usage with yields only verified lines, through a NATS outage.

use super::usage::{
    fetch, first_line_stored, holds, metric, publish_sealed, replica, row, rows, scene, stream_key,
    usage, Scene, EGRESS,
};
use crate::support::nats::Role;
use crate::support::{leasegate_sync, nats_missing};
use async_nats::jetstream::message::PublishMessage;
use futures_util::StreamExt;
use leasegate::contract::Timestamp;
use leasegate::nats::{NatsOptions, NatsStream};
use leasegate::telemetry::egress_stream::{self, EgressKey, Followed, MAC_HEADER, NONCE_HEADER};
use serde_json::Value;
use std::time::Duration;

/// Publishes `payload` on `subject` with exactly `headers` (none: a bare message).
async fn publish_raw(
    stream: &NatsStream,
    subject: String,
    headers: &[(&str, String)],
    payload: &[u8],
) -> async_nats::jetstream::publish::PublishAck {
    let mut message = PublishMessage::build().payload(bytes::Bytes::copy_from_slice(payload));
    for (name, value) in headers {
        message = message.header(*name, value.as_str());
    }
    stream
        .jetstream
        .send_publish(subject, message)
        .await
        .unwrap()
        .await
        .unwrap()
}

fn random_hex(bytes: usize) -> String {
    (0..bytes)
        .map(|_| format!("{:02x}", rand::random::<u8>()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_forged_misfiled_and_blank_messages_do_not_count() {
    if nats_missing() {
        return;
    }
    let Scene {
        cluster,
        h,
        origin,
        leases,
    } = scene(2).await;
    let [x, y] = [&leases[0], &leases[1]].map(String::clone);
    let (server, egress) = replica(&h, &cluster, "one").await;
    let url = format!("http://origin.test:{}/", origin.addr.port());

    // The replica's first line: its nonce tells anyone who reads the stream its publisher id.
    fetch(&server, &x, &url).await;
    let stream = first_line_stored(&cluster).await;
    let first = stream.stream.get_raw_message(1).await.unwrap();
    let nonce = first.headers.get(NONCE_HEADER).unwrap().as_str().to_owned();
    let publisher = server.proxy.telemetry.stream.publisher_id().unwrap();
    assert_eq!(nonce, format!("{publisher}-1"));

    // (a) A writer without the key plants the ids the replica used to take next
    // (`<publisher>-2..101`) with forged lines, and 20 random ids with bare ones.
    let forged = {
        let mut line: Value = serde_json::from_slice(&first.payload).unwrap();
        line["bytes_down"] = 999_999.into();
        line.to_string()
    };
    let x_subject = stream.subject(Some(&x));
    for n in 2..=101 {
        let ack = publish_raw(
            &stream,
            x_subject.clone(),
            &[
                ("Nats-Msg-Id", format!("{publisher}-{n}")),
                (NONCE_HEADER, format!("{publisher}-{n}")),
                (MAC_HEADER, random_hex(32)),
            ],
            forged.as_bytes(),
        )
        .await;
        assert!(!ack.duplicate);
    }
    for _ in 0..20 {
        let id = random_hex(16);
        publish_raw(
            &stream,
            x_subject.clone(),
            &[("Nats-Msg-Id", id)],
            forged.as_bytes(),
        )
        .await;
    }
    for _ in 0..5 {
        fetch(&server, &x, &url).await;
    }
    fetch(&server, &y, &url).await;
    // Every real line is stored: none of them was taken for a duplicate of a planted one.
    assert!(
        holds(&stream, 1 + 120 + 6).await,
        "the replica's lines were not all stored"
    );
    assert_eq!(
        metric(&server, "leasegate_egress_stream_duplicates_total").await,
        Some(0.0)
    );
    server.shutdown().await;
    let logged: Vec<String> = std::fs::read_to_string(&egress)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(logged.len(), 7);
    let published: Vec<String> = stream
        .read_all()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, m)| String::from_utf8(m.to_vec()).unwrap())
        .collect();
    for line in &logged {
        assert!(published.contains(line), "not stored: {line}");
    }

    // (b) A key holder's line of x filed under y's subject; x's line sealed with another key;
    // one with no headers at all; (c) a blank message.
    let key = stream_key(&h).1;
    let y_subject = stream.subject(Some(&y));
    publish_sealed(&stream, &key, y_subject, "intruder-1", logged[0].as_bytes()).await;
    let other_key = EgressKey::from_bytes(&[9; 32]).unwrap();
    publish_sealed(
        &stream,
        &other_key,
        x_subject.clone(),
        "intruder-2",
        logged[0].as_bytes(),
    )
    .await;
    publish_raw(&stream, x_subject.clone(), &[], logged[0].as_bytes()).await;
    publish_raw(&stream, x_subject.clone(), &[], b"").await;

    let url = cluster.url_as(Role::Reader, EGRESS);
    let summed = |field: &str| -> u64 {
        logged
            .iter()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter(|l| l["lease_id"] == x.as_str())
            .map(|l| l[field].as_u64().unwrap())
            .sum()
    };
    let set_aside = |blank: u64, unsigned: u64, bad_mac: u64, lease_mismatch: u64| {
        serde_json::json!({"set_aside": {
            "blank": blank, "unreadable": 0, "unsigned": unsigned, "bad_mac": bad_mac,
            "lease_mismatch": lease_mismatch,
        }})
    };
    let all = rows(&usage(&h, &["--from", &url, "--json"]).await);
    assert_eq!(all.len(), 3, "{all:?}");
    assert_eq!(row(&all, &x)["calls"], 6);
    assert_eq!(row(&all, &x)["bytes_down"], summed("bytes_down"));
    assert_eq!(row(&all, &y)["calls"], 1);
    assert_eq!(all[2], set_aside(1, 21, 101, 1));

    let only_x = rows(&usage(&h, &["--from", &url, "--lease", &x, "--json"]).await);
    assert_eq!(only_x.len(), 2, "{only_x:?}");
    assert_eq!(
        (&only_x[0]["lease_id"], &only_x[0]["calls"]),
        (&Value::from(x.as_str()), &Value::from(6))
    );
    assert_eq!(only_x[1], set_aside(1, 21, 101, 0));
    let only_y = rows(&usage(&h, &["--from", &url, "--lease", &y, "--json"]).await);
    assert_eq!(only_y.len(), 2, "{only_y:?}");
    assert_eq!(only_y[0]["calls"], 1);
    assert_eq!(only_y[1], set_aside(0, 0, 0, 1));

    let table = usage(&h, &["--from", &url]).await;
    assert_eq!(
        table.lines().last(),
        Some("set aside: 124 line(s) not counted (blank 1, unsigned 21, bad-mac 101, lease-mismatch 1)"),
        "{table}"
    );
    let table = usage(&h, &["--from", &url, "--lease", &y]).await;
    assert_eq!(
        table.lines().last(),
        Some("set aside: 1 line(s) not counted (lease-mismatch 1)"),
        "{table}"
    );
}

/// The next `n` lines of `follower`, within 30 seconds.
async fn next_lines(follower: &mut egress_stream::Follower, n: usize) -> Vec<Followed> {
    let mut lines = Vec::new();
    while lines.len() < n {
        let next = tokio::time::timeout(Duration::from_secs(30), follower.next()).await;
        match next {
            Ok(Some(line)) => lines.push(line),
            Ok(None) => panic!("the follower ended"),
            Err(_) => panic!("only {} of {n} lines followed", lines.len()),
        }
    }
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_yields_verified_lines_from_its_start_through_an_outage() {
    if nats_missing() {
        return;
    }
    let Scene {
        mut cluster,
        h,
        origin,
        leases,
    } = scene(1).await;
    let x = leases[0].clone();
    let (server, _) = replica(&h, &cluster, "one").await;
    let publisher = server
        .proxy
        .telemetry
        .stream
        .publisher_id()
        .unwrap()
        .to_owned();
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let get = || fetch(&server, &x, &url);

    // A line stored before the follower's start is not followed.
    get().await;
    let stream = first_line_stored(&cluster).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let since = Timestamp::now();
    let mut follower = egress_stream::follow(
        cluster.location_as(Role::Replica, EGRESS),
        NatsOptions::default(),
        stream_key(&h).1,
        since,
    );
    get().await;
    // Its line (published as the replica gets to it) stored before the forged one goes in.
    assert!(holds(&stream, 2).await, "the second line was never stored");
    publish_raw(
        &stream,
        stream.subject(Some(&x)),
        &[],
        b"{\"forged\": true}",
    )
    .await;
    get().await;
    let lines = next_lines(&mut follower, 2).await;
    let seen: Vec<(u64, &str, Option<&str>)> = lines
        .iter()
        .map(|l| (l.sequence, l.publisher.as_str(), l.line.lease_id.as_deref()))
        .collect();
    assert_eq!(
        seen,
        [
            (2, publisher.as_str(), Some(x.as_str())),
            (4, publisher.as_str(), Some(x.as_str()))
        ]
    );
    assert_eq!(follower.set_aside().unsigned, 1);
    assert_eq!(follower.set_aside().total(), 1);
    drop(stream);

    // NATS away: the replica keeps its lines; back, the follower resumes after sequence 4.
    cluster.nodes[0].kill();
    get().await;
    get().await;
    cluster.nodes[0].start();
    let lines = next_lines(&mut follower, 2).await;
    let sequences: Vec<u64> = lines.iter().map(|l| l.sequence).collect();
    assert_eq!(sequences, [5, 6]);
    assert!(lines.iter().all(|l| l.publisher == publisher));
    get().await;
    let lines = next_lines(&mut follower, 1).await;
    assert_eq!(lines[0].sequence, 7);
    let payload: Value = serde_json::from_slice(&lines[0].payload).unwrap();
    assert_eq!(payload["lease_id"], x.as_str());
    // Nothing more, and nothing repeated.
    let more = tokio::time::timeout(Duration::from_millis(500), follower.next()).await;
    assert!(more.is_err(), "an extra line: {more:?}");
    server.shutdown().await;
}

#[test]
fn usage_and_serve_refuse_a_stream_without_a_private_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = leasegate_sync(&["usage", "--from", "nats://127.0.0.1:1/EGRESS"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("a stream needs --egress-stream-key FILE"),
        "{stderr}"
    );

    let key = dir.path().join("egress-stream.key");
    let out = leasegate_sync(&["keygen", "--egress-stream", "--out", key.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let text = std::fs::read_to_string(&key).unwrap();
    assert_eq!(text.len(), 65);
    assert!(text.trim_end().bytes().all(|b| b.is_ascii_hexdigit()));
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = leasegate_sync(&[
        "usage",
        "--from",
        "nats://127.0.0.1:1/EGRESS",
        "--egress-stream-key",
        key.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("readable by group or others (mode 644)"),
        "{stderr}"
    );

    let signing = dir.path().join("lease.key");
    let out = leasegate_sync(&["keygen", "--out", signing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let journal = dir.path().join("journal.jsonl");
    let out = leasegate_sync(&[
        "serve",
        "--journal",
        journal.to_str().unwrap(),
        "--key-file",
        signing.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "off",
        "--egress-stream",
        "nats://127.0.0.1:1/EGRESS",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--egress-stream needs --egress-stream-key FILE"),
        "{stderr}"
    );
}
