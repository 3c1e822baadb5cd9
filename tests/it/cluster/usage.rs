//! Usage across replicas: every replica publishes its egress lines to one NATS stream
//! (`--egress-stream`), `leasegate usage` sums them; the request path does not depend on NATS.

use crate::support::harness::through;
use crate::support::harness::{curl, eventually, http_origin, proxy_url, raw, Harness, Origin};
use crate::support::leasegate_ok;
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::nats::{NatsOptions, NatsStream};
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::server::Server;
use leasegate::telemetry::egress::Destination;
use leasegate::telemetry::egress_stream::{self, EgressKey, EgressStreamConfig};
use serde_json::Value;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The egress stream's name in these tests.
pub const EGRESS: &str = "EGRESS";

/// The replicas' shared key (`--egress-stream-key`), made in the harness's directory on first
/// use: its file and the key.
pub fn stream_key(h: &Harness) -> (PathBuf, EgressKey) {
    let path = h.dir.path().join("egress-stream.key");
    if !path.exists() {
        EgressKey::write_new(&path).unwrap();
    }
    let key = EgressKey::load(&path).unwrap();
    (path, key)
}

pub fn stream_config(h: &Harness, cluster: &NatsCluster, backlog: usize) -> EgressStreamConfig {
    EgressStreamConfig {
        location: cluster.location_as(Role::Replica, EGRESS),
        nats: NatsOptions::default(),
        max_age: egress_stream::DEFAULT_MAX_AGE,
        backlog,
        key: stream_key(h).1,
    }
}

/// A replica on `cluster`'s journal stream `LG`, with its own egress log file, publishing to
/// the egress stream.
pub async fn replica(h: &Harness, cluster: &NatsCluster, name: &str) -> (Server, PathBuf) {
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.journal = JournalLocation::Nats(cluster.location_as(Role::Replica, "LG"));
    config.store = StoreOptions {
        data_dir: h.dir.path().join(name),
        ..StoreOptions::default()
    };
    let egress = h.dir.path().join(format!("{name}-egress.jsonl"));
    config.egress = Some(Destination::File(egress.clone()));
    config.egress_stream = Some(stream_config(h, cluster, egress_stream::DEFAULT_BACKLOG));
    (Server::start(config).await.unwrap(), egress)
}

/// Opens the egress stream (retrying while the server comes up).
pub async fn egress_stream(cluster: &NatsCluster) -> NatsStream {
    let spec = egress_stream::spec(egress_stream::DEFAULT_MAX_AGE);
    eventually(Duration::from_secs(20), || async {
        NatsStream::connect(&cluster.location(EGRESS), &NatsOptions::default(), &spec)
            .await
            .ok()
    })
    .await
    .expect("the egress stream never opened")
}

/// A one-node cluster whose journal stream `LG` grants `leases` leases to origin.test, and an
/// origin to call.
pub struct Scene {
    pub cluster: NatsCluster,
    pub h: Harness,
    pub origin: Origin,
    pub leases: Vec<String>,
}

pub async fn scene(leases: usize) -> Scene {
    let cluster = NatsCluster::start(1);
    let journal = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let leases = (0..leases)
        .map(|_| h.lease(&["origin.test"], &[]))
        .collect();
    publish_file(&journal, &h.journal).await;
    Scene {
        cluster,
        h,
        origin,
        leases,
    }
}

/// A request for `url` through `server` under `lease`, which must be answered 200.
pub async fn fetch(server: &Server, lease: &str, url: &str) {
    let out = through(server, lease, url).await;
    assert_eq!(out.status, 200, "{}", out.stderr);
}

/// The egress stream, once it holds the first line.
pub async fn first_line_stored(cluster: &NatsCluster) -> NatsStream {
    let stream = egress_stream(cluster).await;
    assert!(
        holds(&stream, 1).await,
        "the first line was never published"
    );
    stream
}

/// Whether `stream` comes to hold `n` messages (its last sequence) within 10 seconds.
pub async fn holds(stream: &NatsStream, n: u64) -> bool {
    eventually(Duration::from_secs(10), || async {
        (stream.last_sequence().await.ok()? == n).then_some(())
    })
    .await
    .is_some()
}

/// Runs `leasegate usage --egress-stream-key KEY ARGS` with `h`'s stream key; its stdout,
/// asserting success.
pub async fn usage(h: &Harness, args: &[&str]) -> String {
    let key = stream_key(h).0;
    let mut argv = vec!["usage", "--egress-stream-key", key.to_str().unwrap()];
    argv.extend_from_slice(args);
    leasegate_ok(&argv).await
}

/// Publishes `payload` on `subject` as a replica holding `key` would, under `nonce`.
pub async fn publish_sealed(
    stream: &NatsStream,
    key: &EgressKey,
    subject: String,
    nonce: &str,
    payload: &[u8],
) {
    let sealed = egress_stream::seal(key, &subject, nonce.to_owned(), payload);
    stream
        .jetstream
        .publish_with_headers(
            subject,
            sealed.headers(),
            bytes::Bytes::copy_from_slice(payload),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// `usage --json` output, parsed: one object per lease.
pub fn rows(json_lines: &str) -> Vec<Value> {
    json_lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

pub fn row<'a>(rows: &'a [Value], lease: &str) -> &'a Value {
    rows.iter()
        .find(|r| r["lease_id"] == lease)
        .unwrap_or_else(|| panic!("no row for {lease}: {rows:?}"))
}

/// Every line of an egress log file, parsed.
fn file_lines(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// One sample of Prometheus text from the admin API.
pub async fn metric(server: &Server, series: &str) -> Option<f64> {
    let answer = raw(
        server.admin_addr.unwrap(),
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    answer
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_sums_the_egress_of_every_replica() {
    if nats_missing() {
        return;
    }
    let Scene {
        cluster,
        h,
        origin,
        leases,
    } = scene(2).await;
    let [a, b] = [&leases[0], &leases[1]].map(String::clone);
    let (one, one_egress) = replica(&h, &cluster, "one").await;
    let (two, two_egress) = replica(&h, &cluster, "two").await;
    let base = format!("http://origin.test:{}", origin.addr.port());

    // Lease a: 2 downloads of 1000 bytes on one, an upload of 300 bytes on two (its answer,
    // "300 <sha256 hex>", is 68 bytes), then a refusal on two.
    for _ in 0..2 {
        let out = curl(
            &["-x", &proxy_url(&one, &a), &format!("{base}/big/1000")],
            &[],
        )
        .await;
        assert_eq!((out.status, out.body.len()), (200, 1000), "{}", out.stderr);
    }
    let upload = "x".repeat(300);
    let out = curl(
        &[
            "-x",
            &proxy_url(&two, &a),
            "--data-binary",
            &upload,
            &format!("{base}/upload"),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 200, "{}", out.stderr);
    assert!(out.body_text().starts_with("300 "), "{}", out.body_text());
    let out = through(&two, &a, "http://denied.test/").await;
    assert_eq!(out.status, 403);
    // Lease b: one download of 5000 bytes on two.
    let out = curl(
        &["-x", &proxy_url(&two, &b), &format!("{base}/big/5000")],
        &[],
    )
    .await;
    assert_eq!((out.status, out.body.len()), (200, 5000), "{}", out.stderr);

    // A drain publishes what is queued before it returns.
    one.shutdown().await;
    two.shutdown().await;
    let (one_lines, two_lines) = (file_lines(&one_egress), file_lines(&two_egress));
    assert_eq!((one_lines.len(), two_lines.len()), (2, 3));
    let refusal = two_lines.iter().find(|l| l["verdict"] == "refuse").unwrap();
    assert_eq!(
        (
            &refusal["code"],
            &refusal["bytes_up"],
            &refusal["bytes_down"]
        ),
        (
            &Value::from("host-not-allowed"),
            &Value::from(0),
            &Value::from(0)
        )
    );

    // The stream holds every line of both files, byte for byte.
    let stream = egress_stream(&cluster).await;
    let mut published: Vec<String> = stream
        .read_all()
        .await
        .unwrap()
        .into_iter()
        .map(|(_, m)| String::from_utf8(m.to_vec()).unwrap())
        .collect();
    let mut logged: Vec<String> = [&one_egress, &two_egress]
        .iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    published.sort();
    logged.sort();
    assert_eq!(published, logged);

    let url = cluster.url_as(Role::Reader, EGRESS);
    let report = usage(&h, &["--from", &url, "--json"]).await;
    let all = rows(&report);
    assert_eq!(all.len(), 2, "{report}");
    let row_a = row(&all, &a);
    assert_eq!(row_a["calls"], 4);
    assert_eq!(row_a["refused"], 1);
    assert_eq!(
        row_a["refusals"],
        serde_json::json!({"host-not-allowed": 1})
    );
    // What every replica's lines of the lease say (heads included: more than the bodies).
    let summed = |lease: &str, field: &str| -> u64 {
        one_lines
            .iter()
            .chain(&two_lines)
            .filter(|l| l["lease_id"] == lease)
            .map(|l| l[field].as_u64().unwrap())
            .sum()
    };
    assert_eq!(row_a["bytes_up"], summed(&a, "bytes_up"));
    assert_eq!(row_a["bytes_down"], summed(&a, "bytes_down"));
    assert!(summed(&a, "bytes_up") > 300 && summed(&a, "bytes_down") > 2000 + 68);
    assert_eq!(
        row_a["top_hosts"],
        serde_json::json!([{"host": "origin.test", "calls": 3}, {"host": "denied.test", "calls": 1}])
    );
    let row_b = row(&all, &b);
    assert_eq!(
        (
            &row_b["calls"],
            &row_b["refused"],
            &row_b["bytes_up"],
            &row_b["bytes_down"]
        ),
        (
            &Value::from(1),
            &Value::from(0),
            &Value::from(summed(&b, "bytes_up")),
            &Value::from(summed(&b, "bytes_down"))
        )
    );
    assert!(summed(&b, "bytes_down") > 5000);
    // Lease a was busier: it comes first.
    assert_eq!(all[0]["lease_id"], a.as_str());

    // The same report from the files, concatenated.
    let both = h.dir.path().join("both.jsonl");
    std::fs::write(&both, logged.join("\n") + "\n").unwrap();
    assert_eq!(
        usage(&h, &["--from", both.to_str().unwrap(), "--json"]).await,
        report
    );

    // --lease filters.
    let only_b = rows(&usage(&h, &["--from", &url, "--lease", &b, "--json"]).await);
    assert_eq!(only_b, vec![row_b.clone()]);

    // --since: a line logged two hours ago (published now) counts without it, not within 1h.
    let mut old: Value = serde_json::from_str(
        logged
            .iter()
            .find(|l| l.contains(&b))
            .expect("a line of lease b"),
    )
    .unwrap();
    let two_hours_ago = leasegate::contract::Timestamp::now().saturating_add_millis(-7_200_000);
    old["time"] = two_hours_ago.to_string().into();
    publish_sealed(
        &stream,
        &stream_key(&h).1,
        stream.subject(Some(&b)),
        "test-1",
        old.to_string().as_bytes(),
    )
    .await;
    let with_old = rows(&usage(&h, &["--from", &url, "--lease", &b, "--json"]).await);
    assert_eq!(with_old[0]["calls"], 2);
    assert_eq!(with_old[0]["bytes_down"], 2 * summed(&b, "bytes_down"));
    let recent = rows(
        &usage(
            &h,
            &["--from", &url, "--lease", &b, "--since", "1h", "--json"],
        )
        .await,
    );
    assert_eq!(recent, vec![row_b.clone()]);
    let none = usage(&h, &["--from", &url, "--since", "1ms", "--json"]).await;
    assert_eq!(none, "");

    // The table: a header and a row per lease, busiest first.
    let table = usage(&h, &["--from", &url]).await;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("LEASE"), "{table}");
    assert!(lines[1].starts_with(&a), "{table}");
    assert!(lines[2].starts_with(&b), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_on_while_nats_is_down_and_what_overflows_is_counted() {
    if nats_missing() {
        return;
    }
    let mut cluster = NatsCluster::start(1);
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    // The journal is the harness's file: only the egress stream depends on NATS.
    let mut config = h.serve_config(h.config(&[("origin.test", "127.0.0.1")]), None);
    config.egress_stream = Some(stream_config(&h, &cluster, 8));
    let server = Server::start(config).await.unwrap();
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let get = || fetch(&server, &lease, &url);

    get().await;
    drop(first_line_stored(&cluster).await);

    cluster.nodes[0].kill();
    // This line is the publisher's batch, retried until NATS is back.
    get().await;
    let down = eventually(Duration::from_secs(10), || async {
        let up = metric(&server, "leasegate_egress_stream_up").await?;
        let backlog = metric(&server, "leasegate_egress_stream_backlog").await?;
        (up == 0.0 && backlog == 1.0).then_some(())
    })
    .await;
    assert!(down.is_some(), "the publisher never noticed NATS was gone");

    // 20 more: 8 wait in the backlog, 12 are dropped; every request is served meanwhile.
    let started = Instant::now();
    for _ in 0..20 {
        get().await;
    }
    let took = started.elapsed();
    assert!(took < Duration::from_secs(10), "20 requests took {took:?}");
    // Within a second, by the next `/metrics` render.
    let counted = eventually(Duration::from_secs(10), || async {
        let dropped = metric(&server, "leasegate_egress_stream_dropped_total").await;
        let backlog = metric(&server, "leasegate_egress_stream_backlog").await;
        (dropped, backlog)
            .eq(&(Some(12.0), Some(9.0)))
            .then_some(())
    })
    .await;
    assert!(
        counted.is_some(),
        "12 dropped and 9 in the backlog, never seen"
    );
    // The egress log file is not affected.
    assert_eq!(h.egress_lines(22).await.len(), 22);

    // NATS back: the kept lines are published, once each.
    cluster.nodes[0].start();
    let stream = egress_stream(&cluster).await;
    let caught_up = eventually(Duration::from_secs(30), || async {
        (stream.last_sequence().await.ok()? >= 10).then_some(())
    })
    .await;
    assert!(caught_up.is_some(), "the backlog was never published");
    let drained = eventually(Duration::from_secs(10), || async {
        let up = metric(&server, "leasegate_egress_stream_up").await?;
        let backlog = metric(&server, "leasegate_egress_stream_backlog").await?;
        (up == 1.0 && backlog == 0.0).then_some(())
    })
    .await;
    assert!(drained.is_some());
    server.shutdown().await;
    let messages = stream.read_all().await.unwrap();
    assert_eq!(messages.len(), 10);
    let mut distinct: Vec<_> = messages.iter().map(|(_, m)| m.clone()).collect();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 10);
}

#[test]
fn usage_from_a_missing_file_says_which() {
    let out = crate::support::leasegate_sync(&["usage", "--from", "/nonexistent/egress.jsonl"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("leasegate: reading /nonexistent/egress.jsonl: "),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
}
