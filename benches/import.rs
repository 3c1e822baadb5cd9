//! `journal import` into a three-node R3 stream (`nats-server`, Debian's package, on loopback
//! with the users of `deploy/nats/`): lines per second for a file of `LINES` grants of
//! `LINES` leases, then a second run that finds every line in the stream (publishes nothing),
//! then the ceiling: the same lines published again by a bare loop (512 in flight, no parsing,
//! no hashing, no ordering; new message ids) into the same stream — what the three servers on
//! this machine take at most, whatever the importer does.
//!
//! `cargo bench --bench import` (`LINES=N`, 200,000 by default). Not criterion: one timed run
//! of the release binary, as an operator runs it.

mod common;
#[allow(dead_code)] // the tests' helpers, shared
#[path = "../tests/it/support/nats.rs"]
mod nats_support;

use common::{lease_id, setting, signed_lease};
use leasegate::contract::{Key, Timestamp};
use nats_support::{NatsCluster, Role};
use serde_json::json;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

/// `lines` grants, one per lease, signed with `key`.
fn journal(path: &Path, key: &Key, lines: u64) {
    let now = Timestamp::now();
    let expires = Timestamp::from_millis(now.as_millis() + 86_400_000);
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for n in 0..lines {
        let lease = signed_lease(
            key,
            n,
            (&now.to_string(), &expires.to_string()),
            &["origin.test"],
        );
        let line = json!({"schema_version": "1.2", "at": now.to_string(), "event": "granted",
                          "lease_id": lease_id(n), "lease": lease});
        serde_json::to_writer(&mut file, &line).unwrap();
        file.write_all(b"\n").unwrap();
    }
    file.flush().unwrap();
}

/// CPU seconds (user + system) of this process's waited-for children so far.
fn children_cpu() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes the struct it is given; RUSAGE_CHILDREN is a valid selector.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr());
        usage.assume_init()
    };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Runs `journal import` of `file` to `url`; its wall time, CPU time and stdout.
fn import(file: &Path, url: &str) -> (f64, f64, String) {
    let cpu = children_cpu();
    let started = Instant::now();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasegate"))
        .args(["journal", "import", file.to_str().unwrap(), "--to", url])
        .env("RUST_LOG", "leasegate=warn")
        .output()
        .unwrap();
    let took = started.elapsed().as_secs_f64();
    assert!(out.status.success(), "{out:?}");
    let used = children_cpu() - cpu;
    (
        took,
        used,
        String::from_utf8_lossy(&out.stdout).trim().to_owned(),
    )
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let lines = setting("LINES", 200_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let key = Key::from_bytes([7; 32]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("journal.jsonl");
    journal(&file, &key, lines);
    let cluster = NatsCluster::start(3);
    runtime.block_on(cluster.journal("LEASES"));
    let url = cluster.url_as(Role::Issuer, "LEASES");

    let (took, cpu, said) = import(&file, &url);
    println!(
        "import of {lines} lines into a 3-node R3 stream: {took:.2} s, {:.0} lines/s, the importer's CPU {cpu:.2} s ({said})",
        lines as f64 / took
    );
    let (again, cpu, said) = import(&file, &url);
    println!("the same file again: {again:.2} s, the importer's CPU {cpu:.2} s ({said})");

    let took = runtime.block_on(ceiling(&cluster, &file));
    println!(
        "the ceiling (the same lines again by a bare publish loop, 512 in flight): {took:.2} s, {:.0} lines/s",
        lines as f64 / took
    );
}

/// Publishes every line of `file` into the stream again under new message ids, 512
/// acknowledgements awaited at once and nothing else done per line; its wall time.
async fn ceiling(cluster: &NatsCluster, file: &Path) -> f64 {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let stream = cluster.journal("LEASES").await;
    let bytes = std::fs::read(file).unwrap();
    let started = Instant::now();
    let mut in_flight = FuturesUnordered::new();
    let done = |r: std::io::Result<u64>| {
        r.unwrap();
    };
    for (n, line) in bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .enumerate()
    {
        if in_flight.len() >= 512 {
            done(in_flight.next().await.unwrap());
        }
        let (stream, id) = (&stream, format!("ceiling-{n}"));
        in_flight.push(async move {
            let subject = stream.subject(Some(&lease_id(n as u64)));
            stream.publish(subject, line, Some(&id)).await
        });
    }
    while let Some(landed) = in_flight.next().await {
        done(landed);
    }
    started.elapsed().as_secs_f64()
}
