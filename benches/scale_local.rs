//! Scale on one machine, with the real release binary (`leasegate serve`) on a journal file:
//!
//! - restart-to-ready: spawn → admin `/readyz` 200 (target ≤ 10 s at 1,000,000 records);
//! - RSS per lease with N open leases (target ≤ 2 KB) and with N leases closed longer than
//!   `--closed-lease-retention` ago (target ≤ 256 bytes): (VmRSS − VmRSS with a journal of
//!   one such lease) / (N − 1), read from /proc once `/readyz` is 200 (the median of three
//!   starts up to 100,000 leases); beside it the same over an empty journal, which counts
//!   what any journal costs once (the fold's code paged in, the schemas compiled) as if it
//!   were the leases';
//! - fold time: restart-to-ready less that of an empty journal;
//! - where the bytes of one lease go: heap bytes (dhat) of its parsed JSON, of a ledger that
//!   folded it (compiled host lists included), of the registry, and of a retired lease, over
//!   a small sample.
//!
//! Leases come from an independent signer (benches/common), each with two allow patterns and
//! one deny. `cargo bench --bench scale_local`; `LEASES=10000,100000` picks the sizes (default
//! 10,000, 100,000 and 1,000,000), `SHAPES=open` or `closed` the journals (default both),
//! `BREAKDOWN=N` the sample (default 2,000; 0: skip), `KEEP=1` keeps the journals. Not
//! criterion: each figure is one long measurement with its own setup.

mod common;

use common::{keyring, lease_id, signed_lease};
use leasegate::contract::{Key, Timestamp};
use leasegate::registry::journal::fold_bytes;
use leasegate::registry::{Ledger, Registry};
use serde_json::{json, Value};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const DAY_MS: i64 = 86_400_000;

/// What journal to write.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// N grants, open for a day from now.
    Open,
    /// N grants and N `stopped` records dated 25 hours ago (past the 24 h default retention),
    /// each block of grants (5,000 per core) followed by its closings.
    ClosedLongAgo,
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::Open => "open",
            Shape::ClosedLongAgo => "closed",
        }
    }
}

/// The `granted` line of lease `n`, issued two days ago and open until a day from now.
fn granted(key: &Key, n: u64, now: Timestamp) -> Value {
    let issued = Timestamp::from_millis(now.as_millis() - 2 * DAY_MS);
    let expires = Timestamp::from_millis(now.as_millis() + DAY_MS);
    let lease = signed_lease(
        key,
        n,
        (&issued.to_string(), &expires.to_string()),
        &["*.github.com", "pypi.org"],
    );
    json!({"schema_version": "1.2", "at": issued.to_string(), "event": "granted",
           "lease_id": lease_id(n), "lease": lease})
}

fn stopped(n: u64, now: Timestamp) -> Value {
    let at = Timestamp::from_millis(now.as_millis() - 25 * 3_600_000);
    json!({"schema_version": "1.2", "at": at.to_string(), "event": "stopped",
           "lease_id": lease_id(n), "reason": "done"})
}

/// Writes the journal of `n` leases of `shape`, signing on every core, lines in lease order.
fn write_journal(path: &Path, key: &Key, n: u64, shape: Shape) {
    const CHUNK: u64 = 5_000;
    let now = Timestamp::now();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get() as u64);
    let mut out = BufWriter::new(std::fs::File::create(path).unwrap());
    let mut start = 0;
    while start < n {
        let chunks: Vec<Vec<u8>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| start + t * CHUNK)
                .filter(|&from| from < n)
                .map(|from| {
                    scope.spawn(move || {
                        let mut bytes = Vec::new();
                        for i in from..(from + CHUNK).min(n) {
                            serde_json::to_writer(&mut bytes, &granted(key, i, now)).unwrap();
                            bytes.push(b'\n');
                        }
                        bytes
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for chunk in chunks {
            out.write_all(&chunk).unwrap();
        }
        let end = (start + threads * CHUNK).min(n);
        if shape == Shape::ClosedLongAgo {
            // Leases come and go: each block of grants is followed by its closings.
            for i in start..end {
                serde_json::to_writer(&mut out, &stopped(i, now)).unwrap();
                out.write_all(b"\n").unwrap();
            }
        }
        start = end;
    }
    out.flush().unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The status code of `GET /readyz`, if the admin API answers.
fn readyz(port: u16) -> Option<u16> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer.split(' ').nth(1)?.parse().ok()
}

/// A `/proc/PID/status` figure in bytes (`VmRSS`, `VmHWM`).
fn proc_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .unwrap()
        * 1024
}

/// A `leasegate serve` on `journal`, killed on drop.
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What one start of the binary measured.
struct Started {
    ready: Duration,
    rss: u64,
    /// Of `rss`, what is not file-backed (the binary's code and data pages are).
    anon: u64,
    peak: u64,
    /// CPU seconds (user and system, every thread) the process used until ready: on a busy
    /// machine, what the fold would take on an idle one is about this over the cores.
    cpu: f64,
}

/// User and system CPU seconds of process `pid` (/proc/PID/stat, at 100 ticks a second).
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

/// Starts `leasegate serve` on `journal`, waits for `/readyz` 200, and reads its memory.
fn serve(journal: &Path, key_file: &Path) -> Started {
    let admin = free_port();
    let started = Instant::now();
    let child = Command::new(env!("CARGO_BIN_EXE_leasegate"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0", "--egress-log", "off"])
        .args(["--admin", &format!("127.0.0.1:{admin}")])
        .arg("--journal")
        .arg(journal)
        .arg("--key-file")
        .arg(key_file)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serve = Serve(child);
    let deadline = started + Duration::from_secs(600);
    while readyz(admin) != Some(200) {
        assert!(Instant::now() < deadline, "serve was not ready in 10 min");
        std::thread::sleep(Duration::from_millis(10));
    }
    let ready = started.elapsed();
    let cpu = cpu_seconds(serve.0.id());
    // Let the follower's first polls settle.
    std::thread::sleep(Duration::from_millis(500));
    let pid = serve.0.id();
    Started {
        ready,
        rss: proc_bytes(pid, "VmRSS"),
        anon: proc_bytes(pid, "RssAnon"),
        peak: proc_bytes(pid, "VmHWM"),
        cpu,
    }
}

/// [`serve`] `runs` times: the start with the median RSS.
fn serve_median(journal: &Path, key_file: &Path, runs: usize) -> Started {
    let mut starts: Vec<Started> = (0..runs).map(|_| serve(journal, key_file)).collect();
    starts.sort_by_key(|s| s.rss);
    starts.swap_remove(runs / 2)
}

fn heap_bytes() -> i64 {
    dhat::HeapStats::get().curr_bytes as i64
}

/// Heap bytes per lease, over `n` leases: the parsed lease JSON, a ledger that folded their
/// grants, and the registry `serve` keeps.
fn breakdown(runtime: &tokio::runtime::Runtime, dir: &Path, key: &Key, n: u64) {
    let journal = dir.join("breakdown.jsonl");
    write_journal(&journal, key, n, Shape::Open);
    let bytes = std::fs::read(&journal).unwrap();
    let lines: Vec<&str> = std::str::from_utf8(&bytes).unwrap().lines().collect();
    // Compiles the schemas (once per process) before anything is counted.
    fold_bytes(&mut Ledger::new(keyring(key)), lines[0].as_bytes());
    let _profiler = dhat::Profiler::builder().testing().build();
    let per = |before: i64, after: i64| (after - before) as f64 / n as f64;

    let base = heap_bytes();
    let values: Vec<Value> = lines
        .iter()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["lease"].take())
        .collect();
    let json = per(base, heap_bytes());
    drop(values);

    let base = heap_bytes();
    let mut ledger = Ledger::new(keyring(key));
    fold_bytes(&mut ledger, &bytes);
    let ledger_bytes = per(base, heap_bytes());
    drop(ledger);

    let base = heap_bytes();
    let registry = runtime
        .block_on(Registry::load(
            journal.clone(),
            Ledger::new(keyring(key)),
            false,
        ))
        .unwrap();
    let registry_bytes = per(base, heap_bytes());
    drop(registry);

    let closed = dir.join("breakdown-closed.jsonl");
    write_journal(&closed, key, n, Shape::ClosedLongAgo);
    let closed_bytes = std::fs::read(&closed).unwrap();
    let base = heap_bytes();
    let mut ledger = Ledger::new(keyring(key)).retaining_closed(Duration::from_secs(86_400));
    fold_bytes(&mut ledger, &closed_bytes);
    let retired_bytes = per(base, heap_bytes());
    assert_eq!(ledger.retired_count() as u64, n);
    drop(ledger);

    println!("heap per lease over {n} leases (dhat):");
    println!("  a lease's parsed JSON alone (serde_json::Value): {json:>7.0} B");
    println!("  ledger after the fold (all it holds):            {ledger_bytes:>7.0} B");
    println!("  registry (ledger, compiled host lists, store):   {registry_bytes:>7.0} B");
    println!("  ledger of leases retired (closed 25 h ago):      {retired_bytes:>7.0} B");
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let sizes: Vec<u64> = std::env::var("LEASES")
        .unwrap_or_else(|_| "10000,100000,1000000".into())
        .split(',')
        .map(|n| n.trim().parse().expect("LEASES: numbers, comma-separated"))
        .collect();
    let sample: u64 = std::env::var("BREAKDOWN")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(2_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // KEEP: the journals stay (their paths are printed), for profiling a fold by hand.
    let keep = std::env::var_os("KEEP").is_some();
    let tmp = tempfile::tempdir().unwrap();
    let (_cleanup, dir) = if keep {
        (None, tmp.keep())
    } else {
        let dir = tmp.path().to_owned();
        (Some(tmp), dir)
    };
    let key = Key::from_bytes([7; 32]);
    let key_file: PathBuf = dir.as_path().join("bench.key");
    std::fs::write(&key_file, key.to_file_text()).unwrap();

    if sample > 0 {
        breakdown(&runtime, dir.as_path(), &key, sample);
    }
    let empty = dir.as_path().join("empty.jsonl");
    std::fs::write(&empty, b"").unwrap();
    let base = serve_median(&empty, &key_file, 3);
    println!(
        "empty journal: ready in {:.2} s, RSS {:.1} MB (anonymous {:.1} MB)",
        base.ready.as_secs_f64(),
        base.rss as f64 / 1e6,
        base.anon as f64 / 1e6
    );
    let shapes = std::env::var("SHAPES").unwrap_or_else(|_| "open,closed".into());
    let shapes: Vec<Shape> = shapes
        .split(',')
        .map(|s| match s.trim() {
            "open" => Shape::Open,
            "closed" => Shape::ClosedLongAgo,
            other => panic!("SHAPES: open and/or closed, not {other:?}"),
        })
        .collect();
    // What any journal costs whatever its length (the fold's code paged in, the schemas
    // compiled, the arenas of the threads that prepared lines): a journal of one lease of
    // each shape. A lease's own cost is what N of them add to it.
    let one: Vec<Started> = shapes
        .iter()
        .map(|&shape| {
            let journal = dir.as_path().join("one.jsonl");
            write_journal(&journal, &key, 1, shape);
            let one = serve_median(&journal, &key_file, 3);
            println!(
                "one {} lease: RSS {:.1} MB (anonymous {:.1} MB)",
                shape.name(),
                one.rss as f64 / 1e6,
                one.anon as f64 / 1e6
            );
            one
        })
        .collect();
    let per_lease = |rss: u64, over: u64, n: u64| rss.saturating_sub(over) as f64 / n as f64;

    println!(
        "| leases | journal records | state | RSS (anonymous) | RSS per lease | per lease over an empty journal | peak RSS | fold | restart to /readyz 200 | CPU until ready |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &n in &sizes {
        for (&shape, one) in shapes.iter().zip(&one) {
            let journal = dir.as_path().join("journal.jsonl");
            write_journal(&journal, &key, n, shape);
            // Small journals: the median of three starts (a few hundred KB of noise is a lot
            // of bytes per lease at 10,000).
            let started = serve_median(&journal, &key_file, if n <= 100_000 { 3 } else { 1 });
            let (records, state) = match shape {
                Shape::Open => (n, "open"),
                Shape::ClosedLongAgo => (2 * n, "closed 25 h ago"),
            };
            println!(
                "| {n} | {records} | {state} | {:.1} MB ({:.1} MB) | {:.0} B | {:.0} B | {:.1} MB | {:.2} s | {:.2} s | {:.1} s |",
                started.rss as f64 / 1e6,
                started.anon as f64 / 1e6,
                per_lease(started.rss, one.rss, n - 1),
                per_lease(started.rss, base.rss, n),
                started.peak as f64 / 1e6,
                started.ready.saturating_sub(base.ready).as_secs_f64(),
                started.ready.as_secs_f64(),
                started.cpu,
            );
            if keep {
                let kept = dir.join(format!("journal-{n}-{}.jsonl", shape.name()));
                std::fs::rename(&journal, &kept).unwrap();
                println!("kept {}", kept.display());
            } else {
                std::fs::remove_file(&journal).unwrap();
            }
        }
    }
}
