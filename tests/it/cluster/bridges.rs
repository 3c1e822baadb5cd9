//! `leasegate journal import | export | mirror` against real nats-server processes, and the
//! read-only commands (`leases`, `verify`, `check`) on a stream.

use crate::support::harness::{eventually, Harness};
use crate::support::nats::{NatsCluster, Role};
use crate::support::nats_missing;
use crate::support::succeeded;
use crate::support::{granted_line, lease, leasegate, leasegate_command};
use leasegate::contract::record::{self, Revocation};
use leasegate::contract::{Key, Timestamp};
use leasegate::nats::NatsStream;
use serde_json::{Map, Value};
use std::io::Write;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Child;

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Appends `lines` (each with its newline) to the file in one write.
fn append_lines(file: &Path, lines: &[String]) {
    let mut text = String::new();
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
}

/// The stream's last sequence, once it answers (a node may be down).
async fn last_sequence(stream: &NatsStream) -> Option<u64> {
    stream.last_sequence().await.ok()
}

/// Waits until the stream's last sequence is at least `n`; returns it.
async fn until_holds(stream: &NatsStream, n: u64, limit: Duration) -> u64 {
    let reached = eventually(limit, || async {
        last_sequence(stream).await.filter(|last| *last >= n)
    })
    .await;
    match reached {
        Some(last) => last,
        None => panic!(
            "the stream holds {:?} messages, not {n}, after {limit:?}",
            last_sequence(stream).await
        ),
    }
}

/// `journal mirror FILE --to URL`, started; returns once it has caught up, with its report.
pub(crate) async fn start_mirror(file: &Path, url: &str) -> (Child, String) {
    let mut command = tokio::process::Command::from(leasegate_command(&[
        "journal",
        "mirror",
        path(file),
        "--to",
        url,
    ]));
    let mut child = command
        .env("RUST_LOG", "leasegate=warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let caught_up = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the mirror never caught up")
        .unwrap()
        .expect("the mirror exited before catching up");
    (child, caught_up)
}

/// `leases --json` on a journal (file or stream).
async fn leases_json(journal: &str, key: &Path) -> String {
    succeeded(
        &leasegate(&[
            "leases",
            "--journal",
            journal,
            "--key-file",
            path(key),
            "--json",
        ])
        .await,
    )
}

/// `export URL` to stdout.
async fn export(url: &str) -> Vec<u8> {
    let output = leasegate(&["journal", "export", url]).await;
    succeeded(&output);
    output.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_twice_then_export_is_the_file_byte_for_byte() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let parent = h.lease(&["*.example.com"], &[]);
    let child = h.lease_with(
        &["api.example.com"],
        &[],
        Some(&parent),
        Timestamp::now(),
        Duration::from_secs(600),
    );
    h.lease(&["other.test"], &[]);
    leasegate::commands::issue::revoke(&h.journal, &h.key, &child, "done", Timestamp::now())
        .unwrap();
    let source = std::fs::read(&h.journal).unwrap();
    let imported = leasegate(&["journal", "import", path(&h.journal), "--to", &issuer]).await;
    assert_eq!(
        succeeded(&imported),
        "imported 4 lines, 0 already in the stream\n"
    );
    let again = leasegate(&["journal", "import", path(&h.journal), "--to", &issuer]).await;
    assert_eq!(
        succeeded(&again),
        "imported 0 lines, 4 already in the stream\n"
    );
    assert_eq!(stream.read_all().await.unwrap().len(), 4);
    assert_eq!(export(&url).await, source);
    let out = h.dir.path().join("exported.jsonl");
    let exported = leasegate(&["journal", "export", &url, "--out", path(&out)]).await;
    assert_eq!(succeeded(&exported), "");
    assert_eq!(std::fs::read(&out).unwrap(), source);
    let leftovers: Vec<_> = std::fs::read_dir(h.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // Each message sits on its lease's subject, byte for byte.
    let lines: Vec<&[u8]> = source
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .collect();
    for (sequence, line) in (1..).zip(&lines) {
        let message = stream.stream.get_raw_message(sequence).await.unwrap();
        let record: serde_json::Value = serde_json::from_slice(line).unwrap();
        assert_eq!(
            message.subject.as_str(),
            format!("leasegate.journal.{}", record["lease_id"].as_str().unwrap())
        );
        assert_eq!(&message.payload[..], *line);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_publishes_only_the_copies_the_stream_lacks() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let (x, y) = (r#"{"lease_id":"x","n":1}"#, r#"{"lease_id":"y","n":2}"#);
    let first = h.dir.path().join("first.jsonl");
    std::fs::write(&first, format!("{x}\n")).unwrap();
    let imported = leasegate(&["journal", "import", path(&first), "--to", &issuer]).await;
    assert_eq!(
        succeeded(&imported),
        "imported 1 lines, 0 already in the stream\n"
    );
    // x twice in the file, once in the stream: one more x. An empty line carries nothing; a
    // last line without its newline may still be being written.
    let whole = h.dir.path().join("whole.jsonl");
    std::fs::write(&whole, format!("{x}\n{y}\n\n{x}\n{{\"lease_id\":\"z\"")).unwrap();
    let imported = leasegate(&["journal", "import", path(&whole), "--to", &issuer]).await;
    assert_eq!(
        succeeded(&imported),
        "imported 2 lines, 1 already in the stream; the last line has no newline and was left out\n"
    );
    assert_eq!(export(&url).await, format!("{x}\n{y}\n{x}\n").into_bytes());
    let ids: Vec<String> = futures_util::future::join_all((1..=3).map(|sequence| {
        let stream = &stream;
        async move {
            let message = stream.stream.get_raw_message(sequence).await.unwrap();
            message
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .unwrap()
                .as_str()
                .to_owned()
        }
    }))
    .await;
    let sha = |line: &str| leasegate::contract::keys::sha256_hex(line.as_bytes());
    assert_eq!(
        ids,
        [
            format!("{}#1", sha(x)),
            format!("{}#1", sha(y)),
            format!("{}#2", sha(x))
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_verify_and_check_read_a_stream() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let open = h.lease(&["api.example.com"], &[]);
    let revoked = h.lease(&["api.example.com"], &[]);
    leasegate::commands::issue::revoke(&h.journal, &h.key, &revoked, "done", Timestamp::now())
        .unwrap();
    succeeded(&leasegate(&["journal", "import", path(&h.journal), "--to", &issuer]).await);
    let journal = path(&h.journal);
    assert_eq!(
        leases_json(&url, &h.key_path).await,
        leases_json(journal, &h.key_path).await
    );
    let table = succeeded(
        &leasegate(&["leases", "--journal", &url, "--key-file", path(&h.key_path)]).await,
    );
    assert!(table.contains(&open) && table.contains(&revoked), "{table}");
    let verify = leasegate(&["verify", "--key-file", path(&h.key_path), &url]).await;
    assert_eq!(
        succeeded(&verify),
        format!(
            "{}: valid (schema, rules and signatures)\n",
            cluster.location_as(Role::Reader, "LG")
        )
    );
    let check = |lease: String| {
        let (url, key) = (url.clone(), path(&h.key_path).to_owned());
        async move {
            leasegate(&[
                "check",
                "--journal",
                &url,
                "--key-file",
                &key,
                "--lease",
                &lease,
                "api.example.com",
            ])
            .await
        }
    };
    let allowed = check(open).await;
    assert!(succeeded(&allowed).starts_with("allow\n"), "{allowed:?}");
    let refused = check(revoked).await;
    assert_eq!(refused.status.code(), Some(1));
    let text = String::from_utf8_lossy(&refused.stdout);
    assert!(text.starts_with("refuse "), "{text}");
}

/// `n` synthetic records: JSON lines on `n / 10` lease ids, each line distinct.
fn synthetic(from: usize, n: usize) -> Vec<String> {
    (from..from + n)
        .map(|i| {
            format!(
                r#"{{"lease_id":"{:08x}-0000-4000-8000-000000000000","n":{i}}}"#,
                i / 10
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_survives_kill_9_and_publishes_every_line_once() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let file = h.dir.path().join("issuer.jsonl");
    append_lines(&file, &synthetic(0, 20));
    let (mut mirror, caught_up) = start_mirror(&file, &issuer).await;
    assert_eq!(
        caught_up,
        format!(
            "mirroring {} to {}: caught up (20 lines published, 0 already in the stream)",
            file.display(),
            cluster.location_as(Role::Issuer, "LG")
        )
    );
    // A line written in two pieces is published once whole.
    let torn = r#"{"lease_id":"torn","n":-1}"#;
    {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&file)
            .unwrap();
        f.write_all(&torn.as_bytes()[..10]).unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        f.write_all(format!("{}\n", &torn[10..]).as_bytes())
            .unwrap();
    }
    until_holds(&stream, 21, Duration::from_secs(10)).await;
    // Killed in the middle of a burst.
    append_lines(&file, &synthetic(20, 2000));
    let killed_at = until_holds(&stream, 100, Duration::from_secs(10)).await;
    mirror.start_kill().unwrap();
    mirror.wait().await.unwrap();
    // A publish the kill cut off in flight lands now or never.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let after_kill = last_sequence(&stream).await.unwrap();
    eprintln!("mirror killed with {killed_at}..{after_kill} of 2021 lines in the stream");
    append_lines(&file, &synthetic(2020, 100));
    let started = Instant::now();
    let (mirror, caught_up) = start_mirror(&file, &issuer).await;
    let total = 2121;
    assert_eq!(
        caught_up,
        format!(
            "mirroring {} to {}: caught up ({} lines published, {after_kill} already in the stream)",
            file.display(),
            cluster.location_as(Role::Issuer, "LG"),
            total - after_kill
        )
    );
    until_holds(&stream, total, Duration::from_secs(30)).await;
    eprintln!("restarted mirror caught up in {:?}", started.elapsed());
    // And it keeps following.
    append_lines(&file, &synthetic(3000, 5));
    until_holds(&stream, total + 5, Duration::from_secs(10)).await;
    stop(mirror).await;
    assert_eq!(last_sequence(&stream).await, Some(total + 5));
    assert_eq!(export(&url).await, std::fs::read(&file).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_waits_for_the_server_and_retries_through_an_outage() {
    if nats_missing() {
        return;
    }
    let mut cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let file = h.dir.path().join("issuer.jsonl");
    append_lines(&file, &synthetic(0, 10));
    // Started while the server is down: it waits for it.
    cluster.nodes[0].kill();
    let starting = tokio::spawn({
        let (file, issuer) = (file.clone(), issuer.clone());
        async move { start_mirror(&file, &issuer).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.nodes[0].start();
    let (mirror, caught_up) = starting.await.unwrap();
    assert!(
        caught_up.ends_with("caught up (10 lines published, 0 already in the stream)"),
        "{caught_up}"
    );
    // Lines written while the server is down (longer than an ack's timeout) are published,
    // in order, once it is back.
    cluster.nodes[0].kill();
    let outage = Instant::now();
    for i in 0..10 {
        append_lines(&file, &synthetic(10 + i * 5, 5));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    cluster.nodes[0].start();
    until_holds(&stream, 60, Duration::from_secs(30)).await;
    eprintln!(
        "60 lines in the stream {:?} after the outage began",
        outage.elapsed()
    );
    stop(mirror).await;
    assert_eq!(last_sequence(&stream).await, Some(60));
    assert_eq!(export(&url).await, std::fs::read(&file).unwrap());
}

/// SIGTERM, then the mirror exits 0.
async fn stop(mut mirror: Child) {
    let pid = nix::unistd::Pid::from_raw(mirror.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(10), mirror.wait())
        .await
        .expect("the mirror ignored SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

/// Signed grants and revocations: `grants` leases, every third one revoked a batch later.
fn grants_and_revocations(key: &Key, grants: usize) -> Vec<Vec<String>> {
    let now = Timestamp::now();
    let (issued, expires) = (
        now.to_string(),
        now.saturating_add_millis(3_600_000).to_string(),
    );
    let at = now.to_string();
    let mut batches = Vec::new();
    let mut revoke_next: Vec<String> = Vec::new();
    for chunk in (0..grants).collect::<Vec<_>>().chunks(150) {
        let mut batch: Vec<String> = std::mem::take(&mut revoke_next)
            .into_iter()
            .map(|id| {
                let revocation = Revocation {
                    lease_id: &id,
                    parent_lease_id: None,
                    by: "issuer",
                    reason: "done",
                    extra: Map::new(),
                };
                record::revoked(&revocation, key, now).unwrap().to_string()
            })
            .collect();
        for &n in chunk {
            let id = format!("{n:08x}-0000-4000-8000-{:012x}", 0xb41d6e);
            let signed = lease(key, &id, None, (&issued, &expires), &["h.test"], &[]);
            batch.push(granted_line(&signed, &at));
            if n % 3 == 0 {
                revoke_next.push(id);
            }
        }
        batches.push(batch);
    }
    batches.push(
        revoke_next
            .into_iter()
            .map(|id| {
                let revocation = Revocation {
                    lease_id: &id,
                    parent_lease_id: None,
                    by: "issuer",
                    reason: "done",
                    extra: Map::new(),
                };
                record::revoked(&revocation, key, now).unwrap().to_string()
            })
            .collect(),
    );
    batches
}

/// Each lease's lines in the order given.
fn by_lease(journal: &[u8]) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut leases = std::collections::BTreeMap::<String, Vec<String>>::new();
    for line in String::from_utf8_lossy(journal).lines() {
        let record: Value = serde_json::from_str(line).unwrap();
        let lease = record["lease_id"].as_str().unwrap_or_default().to_owned();
        leases.entry(lease).or_default().push(line.to_owned());
    }
    leases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_carries_5000_records_across_a_node_killed_in_a_3_node_cluster() {
    if nats_missing() {
        return;
    }
    let started = Instant::now();
    let mut cluster = NatsCluster::start(3);
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let h = Harness::new();
    let file = h.dir.path().join("issuer.jsonl");
    let batches = grants_and_revocations(&h.key, 3750);
    let records: usize = batches.iter().map(Vec::len).sum();
    assert_eq!(records, 5000);
    eprintln!(
        "{records} signed records generated in {:?}",
        started.elapsed()
    );
    // Three proxy replicas follow the stream through it all.
    let mut replicas = Vec::new();
    for name in ["a", "b", "c"] {
        let mut config = h.serve_config(h.config(&[]), None);
        config.journal =
            leasegate::registry::JournalLocation::Nats(cluster.location_as(Role::Replica, "LG"));
        config.store.data_dir = h.dir.path().join(name);
        replicas.push(leasegate::server::Server::start(config).await.unwrap());
    }
    let (mirror, _) = start_mirror(&file, &issuer).await;
    let publishing = Instant::now();
    let mut written = 0;
    for (i, batch) in batches.iter().enumerate() {
        append_lines(&file, batch);
        written += batch.len();
        if i == batches.len() / 2 {
            // Kill the stream's leader (-9) once the mirror is busy, and bring it back later.
            until_holds(&stream, written as u64 / 2, Duration::from_secs(30)).await;
            let leader = leader_of(&stream).await;
            let index = cluster.nodes.iter().position(|n| n.name == leader).unwrap();
            let held = last_sequence(&stream).await;
            cluster.nodes[index].kill();
            eprintln!(
                "killed the leader {leader} with {held:?} of {written} records in the stream"
            );
            tokio::time::sleep(Duration::from_millis(1500)).await;
            cluster.nodes[index].start();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    until_holds(&stream, records as u64, Duration::from_secs(45)).await;
    eprintln!(
        "{records} records in the stream {:?} after the first was written",
        publishing.elapsed()
    );
    stop(mirror).await;
    assert_eq!(last_sequence(&stream).await, Some(records as u64));
    // Every line once, each lease's lines in file order (lines of different leases are in
    // flight at once, and a retry after the kill may land one after a later line of another).
    assert_eq!(
        by_lease(&export(&url).await),
        by_lease(&std::fs::read(&file).unwrap())
    );
    let from_file = leases_json(path(&file), &h.key_path).await;
    assert_eq!(from_file.lines().count(), 3750);
    let sorted = |text: &str| {
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        lines.sort();
        lines
    };
    assert_eq!(
        sorted(&leases_json(&url, &h.key_path).await),
        sorted(&from_file)
    );
    // Every replica ends with the fold of the exported stream.
    let states = |rows: Vec<Value>| -> std::collections::BTreeMap<String, String> {
        rows.iter()
            .map(|r| (r["lease_id"].to_string(), r["status"].to_string()))
            .collect()
    };
    let expected = states(
        from_file
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    );
    for replica in &replicas {
        let converged = eventually(Duration::from_secs(10), || async {
            let rows = crate::support::harness::all_leases(replica).await?;
            (states(rows) == expected).then_some(())
        })
        .await;
        assert!(converged.is_some(), "a replica did not converge");
    }
    eprintln!("whole test {:?}", started.elapsed());
}

/// The name of the node leading the stream (waiting for an election to settle).
async fn leader_of(stream: &NatsStream) -> String {
    let leader = eventually(Duration::from_secs(10), || async {
        let info = stream.stream.get_info().await.ok()?;
        info.cluster?.leader
    })
    .await;
    leader.expect("the stream has no leader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_behind_tls_is_reached_with_nats_tls_ca_only() {
    if nats_missing() {
        return;
    }
    let h = Harness::new();
    let cert =
        rcgen::generate_simple_self_signed(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .unwrap();
    let (ca, key) = (h.dir.path().join("nats.pem"), h.dir.path().join("nats.key"));
    std::fs::write(&ca, cert.cert.pem()).unwrap();
    std::fs::write(&key, cert.key_pair.serialize_pem()).unwrap();
    let cluster = NatsCluster::start_with(
        1,
        &format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\" }}\n",
            ca.display(),
            key.display()
        ),
    );
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let url = cluster.url_as(Role::Reader, "LG");
    let lease = h.lease(&["origin.test"], &[]);
    let journal = path(&h.journal);
    let imported = leasegate(&[
        "journal",
        "import",
        journal,
        "--to",
        &issuer,
        "--nats-tls-ca",
        path(&ca),
    ])
    .await;
    succeeded(&imported);
    let listed = leasegate(&[
        "leases",
        "--journal",
        &url,
        "--nats-tls-ca",
        path(&ca),
        "--key-file",
        path(&h.key_path),
        "--json",
    ])
    .await;
    let row: Value = serde_json::from_str(&succeeded(&listed)).unwrap();
    assert_eq!(row["lease_id"], lease.as_str());
    assert_eq!(row["status"], "open");
    // Without the CA the server's certificate is not trusted: a clear error, nothing read.
    let refused = leasegate(&["leases", "--journal", &url, "--key-file", path(&h.key_path)]).await;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("cannot reach NATS"), "{stderr}");
    // A credentials file that cannot be read is named.
    let missing = h.dir.path().join("missing.creds");
    let refused = leasegate(&[
        "leases",
        "--journal",
        &url,
        "--nats-tls-ca",
        path(&ca),
        "--nats-creds",
        path(&missing),
        "--key-file",
        path(&h.key_path),
    ])
    .await;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("missing.creds"), "{stderr}");
}

/// A line larger than the server takes can never be published. It must not wedge the lines
/// behind it: a revocation written after it reaches the stream, and a replica, through both
/// `import` (which then exits non-zero naming the line) and `mirror` (which moves on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_line_does_not_hold_back_the_revocations_behind_it() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start_with(1, "max_payload: 65536\n");
    let stream = cluster.journal("LG").await;
    let issuer = cluster.url_as(Role::Issuer, "LG");
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let oversized = format!(
        r#"{{"lease_id":"{lease}","event":"heartbeat","pad":"{}"}}"#,
        "x".repeat(100 * 1024)
    );
    h.append(&oversized).await;
    leasegate::commands::issue::revoke(&h.journal, &h.key, &lease, "done", Timestamp::now())
        .unwrap();

    let imported = leasegate(&["journal", "import", path(&h.journal), "--to", &issuer]).await;
    assert_eq!(imported.status.code(), Some(1), "{imported:?}");
    let stderr = String::from_utf8_lossy(&imported.stderr);
    assert!(
        stderr.contains(&format!("line 2 of {}: ", h.journal.display()))
            && stderr.contains("more than the 65280 a message may carry"),
        "{stderr}"
    );
    let held = stream.read_all().await.unwrap();
    assert_eq!(held.len(), 2, "the grant and the revocation");
    let last: Value = serde_json::from_slice(&held[1].1).unwrap();
    assert_eq!(last["event"], "revoked");
    let replica = crate::cluster::scale_out::replica(&h, &cluster, "LG", "a").await;
    let (_, view) = crate::support::harness::admin_get(&replica, &format!("/leases/{lease}")).await;
    assert_eq!(view["status"], "revoked");

    // The mirror: the file it follows gets another oversized line, then a second revocation.
    let file = h.dir.path().join("issuer.jsonl");
    let other = h.lease(&["origin.test"], &[]);
    let text = std::fs::read_to_string(&h.journal).unwrap();
    std::fs::write(&file, text.lines().last().unwrap().to_owned() + "\n").unwrap();
    let (mut mirror, caught_up) = start_mirror(&file, &issuer).await;
    assert!(
        caught_up.ends_with("(1 lines published, 0 already in the stream)"),
        "{caught_up}"
    );
    append_lines(&file, &[oversized.replace(&lease, &other)]);
    let revocation = record::revoked(
        &Revocation {
            lease_id: &other,
            parent_lease_id: None,
            by: "issuer",
            reason: "after the oversized line",
            extra: Map::new(),
        },
        &h.key,
        Timestamp::now(),
    )
    .unwrap();
    append_lines(&file, &[revocation.to_string()]);
    until_holds(&stream, 4, Duration::from_secs(10)).await;
    let closed = eventually(Duration::from_secs(5), || async {
        let (_, view) =
            crate::support::harness::admin_get(&replica, &format!("/leases/{other}")).await;
        (view["status"] == "revoked").then_some(())
    })
    .await;
    assert!(closed.is_some(), "the revocation behind the oversized line");
    mirror.kill().await.unwrap();
}
