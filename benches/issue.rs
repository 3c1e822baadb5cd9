//! Leases issued per second through the admin API (`POST /leases`), answered only once the
//! grant is folded, on two journals in one run:
//!
//! - a journal file (`serve`'s default: every append fsynced), and the same on tmpfs, where
//!   an fsync costs nothing: the difference is what the disk's flushes cost;
//! - a JetStream stream on a three-node R3 cluster of `nats-server` processes (Debian's
//!   package) on loopback, with the users of `deploy/nats/`; skipped, and said so, without
//!   `nats-server`.
//!
//! Each journal gets roots at concurrency 1 and 16, and children of one parent (`fan_out`
//! 256) at concurrency 16: each round issues 240 children, which are completed
//! (`POST /leases/{id}/complete`) after the round and outside its figures, so the parent's
//! `fan_out` never fills (the tmpfs file gets the roots only). The root policy's `fan_out`
//! ceiling is raised to 256 for that parent; the per-caller issuing rate is out of the way.
//! Every answer must be 201; others are counted and shown. `records/lease` counts the
//! journal's records written in the timed windows: a manifest that asks no `depth` or
//! `fan_out` is narrowed, so each lease is a `granted` and a `narrowed` record, each appended
//! and folded before the answer.
//!
//! The clients run on the main thread (a current-thread runtime, keep-alive HTTP/1.1 over
//! loopback), the proxy on a runtime of its own, so the CPU columns are the proxy's (the
//! process less the client's thread), the client's thread, and the three `nats-server`s'.
//!
//! `cargo bench --bench issue` (`ROUNDS=N` rounds, 5 by default; `ROUND_MS=N` per round of
//! roots, 1500 by default). Not criterion: each row is a few timed rounds against one server.

#[allow(dead_code)] // the benchmarks' shared helpers: this one needs only `serve_config`
mod common;
#[allow(dead_code)] // the tests' helpers, shared
#[path = "../tests/it/support/nats.rs"]
mod nats_support;

use bytes::Bytes;
use common::{serve_config, setting};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use leasegate::contract::narrow::RootPolicy;
use leasegate::contract::Key;
use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};
use leasegate::registry::JournalLocation;
use leasegate::server::Server;
use nats_support::{NatsCluster, Role};
use nix::sys::resource::{getrusage, UsageWho};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Children issued per round: under the parent's `fan_out` of [`FAN_OUT`], with room to spare.
const CHILDREN_PER_ROUND: usize = 240;

/// The parent's `budget.fan_out` (and the root policy's ceiling, so it is not clamped to 8).
const FAN_OUT: u64 = 256;

/// Answers kept per row to show what failed.
const FAILURES_SHOWN: usize = 3;

/// Where the journal is, and how to count its records.
enum Journal {
    File(PathBuf),
    Nats(Box<NatsStream>),
}

impl Journal {
    /// Records in the journal now.
    async fn records(&self) -> u64 {
        match self {
            Journal::File(path) => std::fs::read(path)
                .map(|bytes| bytes.iter().filter(|&&b| b == b'\n').count() as u64)
                .unwrap_or(0),
            Journal::Nats(stream) => stream.last_sequence().await.unwrap_or(0),
        }
    }
}

/// What a row issues.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    /// Roots, for a while.
    Roots,
    /// [`CHILDREN_PER_ROUND`] children of one parent, completed after the round.
    Children,
}

/// A keep-alive connection to the admin API.
struct Client {
    addr: SocketAddr,
    sender: Option<SendRequest<Full<Bytes>>>,
}

impl Client {
    fn new(addr: SocketAddr) -> Client {
        Client { addr, sender: None }
    }

    /// `POST path` with `body`: the status and the answer's body, or why there is none (the
    /// connection is made again on the next call).
    async fn post(&mut self, path: &str, body: Bytes) -> Result<(u16, Bytes), String> {
        if self.sender.is_none() {
            let stream = tokio::net::TcpStream::connect(self.addr)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            stream.set_nodelay(true).map_err(|e| e.to_string())?;
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            tokio::spawn(conn);
            self.sender = Some(sender);
        }
        let sender = self.sender.as_mut().unwrap();
        let request = http::Request::post(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        let answered = async {
            sender.ready().await?;
            let response = sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, body))
        };
        match answered.await {
            Ok(answer) => Ok(answer),
            Err(e) => {
                self.sender = None;
                Err(e.to_string())
            }
        }
    }
}

/// A root lease's body for worker `n`.
fn root_body(n: usize) -> Bytes {
    Bytes::from(
        json!({
            "manifest": {
                "agent": {"name": format!("worker-{n}")},
                "intent": {"purpose": "bench"},
                "allow": {"hosts": ["api.openai.com", "*.github.com"], "tools": ["gh/search"]},
                "budget": {"tokens": 100000},
            },
            "lifetime_seconds": 3600,
        })
        .to_string(),
    )
}

/// The parent of the children rows: a root whose `fan_out` holds a round's children.
fn parent_body() -> Bytes {
    Bytes::from(
        json!({
            "manifest": {
                "agent": {"name": "orchestrator"},
                "intent": {"purpose": "bench"},
                "allow": {"hosts": ["api.openai.com", "*.github.com"], "tools": ["gh/search"]},
                "budget": {"tokens": 10_000_000, "fan_out": FAN_OUT},
            },
            "lifetime_seconds": 3600,
        })
        .to_string(),
    )
}

/// A child's body for worker `n` under `parent`.
fn child_body(n: usize, parent: &str) -> Bytes {
    Bytes::from(
        json!({
            "manifest": {
                "agent": {"name": format!("subagent-{n}")},
                "intent": {"purpose": "bench: one search"},
                "allow": {"hosts": ["api.openai.com"], "tools": ["gh/search"]},
                "budget": {"tokens": 1000},
            },
            "parent_lease_id": parent,
            "lifetime_seconds": 600,
        })
        .to_string(),
    )
}

/// One round's answers, as the workers gather them.
#[derive(Default)]
struct Tally {
    latencies: Vec<Duration>,
    issued: u64,
    failures: u64,
    shown: Vec<String>,
    /// The children issued (to complete after the round).
    children: Vec<String>,
}

impl Tally {
    fn failed(&mut self, what: String) {
        self.failures += 1;
        if self.shown.len() < FAILURES_SHOWN {
            self.shown.push(what);
        }
    }
}

/// CPU time: this process, this (the client's) thread, and the `nats-server`s we started.
#[derive(Clone, Copy)]
struct Cpu {
    process: Duration,
    client: Duration,
    nats: Duration,
}

impl Cpu {
    fn now() -> Cpu {
        let used = |who| {
            let usage = getrusage(who).unwrap();
            let micros = |t: nix::sys::time::TimeVal| {
                Duration::from_micros((t.tv_sec() * 1_000_000 + t.tv_usec()) as u64)
            };
            micros(usage.user_time()) + micros(usage.system_time())
        };
        Cpu {
            process: used(UsageWho::RUSAGE_SELF),
            client: used(UsageWho::RUSAGE_THREAD),
            nats: nats_cpu(),
        }
    }
}

/// utime + stime of our child processes named `nats-server`, from `/proc` (in USER_HZ, 100 a
/// second on Linux).
fn nats_cpu() -> Duration {
    let me = std::process::id().to_string();
    let mut ticks = 0u64;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((name, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        if !name.ends_with("(nats-server") {
            continue;
        }
        // From field 3 (state) on: ppid is field 4, utime 14, stime 15.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1) != Some(&me.as_str()) {
            continue;
        }
        for i in [11, 12] {
            ticks += fields.get(i).and_then(|t| t.parse().ok()).unwrap_or(0);
        }
    }
    Duration::from_millis(ticks * 10)
}

/// One row's figures over its rounds.
struct Row {
    name: String,
    concurrency: usize,
    rates: Vec<f64>,
    latencies: Vec<Duration>,
    issued: u64,
    failures: u64,
    shown: Vec<String>,
    /// CPU over the timed windows only.
    cpu: (Duration, Duration, Duration),
    /// Journal records written in the timed windows.
    records: u64,
    nats: bool,
}

/// One round: `clients` issue roots until `window` is over, or [`CHILDREN_PER_ROUND`]
/// children of `parent` between them.
async fn round(
    clients: &mut [Client],
    shape: Shape,
    parent: &str,
    window: Duration,
) -> (Tally, Duration) {
    let tally = Rc::new(RefCell::new(Tally::default()));
    let tickets = Rc::new(RefCell::new(CHILDREN_PER_ROUND));
    let started = Instant::now();
    let deadline = started + window;
    let workers = clients.iter_mut().enumerate().map(|(n, client)| {
        let (tally, tickets) = (tally.clone(), tickets.clone());
        async move {
            loop {
                let body = match shape {
                    Shape::Roots if Instant::now() >= deadline => break,
                    Shape::Roots => root_body(n),
                    Shape::Children => {
                        let mut left = tickets.borrow_mut();
                        if *left == 0 {
                            break;
                        }
                        *left -= 1;
                        child_body(n, parent)
                    }
                };
                let sent = Instant::now();
                let answer = client.post("/leases", body).await;
                let took = sent.elapsed();
                let mut tally = tally.borrow_mut();
                match answer {
                    Ok((201, body)) => {
                        tally.latencies.push(took);
                        tally.issued += 1;
                        if shape == Shape::Children {
                            let answer: Value =
                                serde_json::from_slice(&body).unwrap_or(Value::Null);
                            match answer["lease_id"].as_str() {
                                Some(id) if answer["parent_lease_id"] == parent => {
                                    tally.children.push(id.to_owned())
                                }
                                _ => {
                                    tally.failed(format!("201, not a child of {parent}: {answer}"))
                                }
                            }
                        }
                    }
                    Ok((status, body)) => {
                        tally.failed(format!("{status} {}", String::from_utf8_lossy(&body)))
                    }
                    Err(e) => tally.failed(e),
                }
            }
        }
    });
    futures_util::future::join_all(workers).await;
    let took = started.elapsed();
    let tally = Rc::try_unwrap(tally).ok().unwrap().into_inner();
    (tally, took)
}

/// Completes `ids`, spread over `clients`: the failures, each said once.
async fn complete(clients: &mut [Client], ids: Vec<String>) -> Vec<String> {
    let queue = Rc::new(RefCell::new(ids));
    let workers = clients.iter_mut().map(|client| {
        let queue = queue.clone();
        async move {
            let mut failed = Vec::new();
            loop {
                let Some(id) = queue.borrow_mut().pop() else {
                    break;
                };
                match client
                    .post(&format!("/leases/{id}/complete"), Bytes::new())
                    .await
                {
                    Ok((200, _)) => {}
                    Ok((status, body)) => failed.push(format!(
                        "complete: {status} {}",
                        String::from_utf8_lossy(&body)
                    )),
                    Err(e) => failed.push(format!("complete: {e}")),
                }
            }
            failed
        }
    });
    futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// `rounds` timed rounds (after one untimed warm-up) of `shape` at `concurrency` against the
/// admin API at `admin`, whose journal is `journal`.
async fn row(
    name: &str,
    admin: SocketAddr,
    journal: &Journal,
    shape: Shape,
    concurrency: usize,
    (rounds, window): (u64, Duration),
) -> Row {
    let mut clients: Vec<Client> = (0..concurrency).map(|_| Client::new(admin)).collect();
    let mut parent = String::new();
    if shape == Shape::Children {
        let (status, body) = clients[0].post("/leases", parent_body()).await.unwrap();
        assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["manifest"]["budget"]["fan_out"], FAN_OUT, "{answer}");
        parent = answer["lease_id"].as_str().unwrap().to_owned();
    }
    let mut figures = Row {
        name: format!(
            "{name}, {}",
            match shape {
                Shape::Roots => "roots",
                Shape::Children => "children",
            }
        ),
        concurrency,
        rates: Vec::new(),
        latencies: Vec::new(),
        issued: 0,
        failures: 0,
        shown: Vec::new(),
        cpu: Default::default(),
        records: 0,
        nats: matches!(journal, Journal::Nats(_)),
    };
    for n in 0..=rounds {
        let warm_up = n == 0;
        let window = if warm_up { window / 4 } else { window };
        let records = journal.records().await;
        let before = Cpu::now();
        let (tally, took) = round(&mut clients, shape, &parent, window).await;
        let after = Cpu::now();
        let written = journal.records().await - records;
        let completions = match shape {
            Shape::Children => complete(&mut clients, tally.children).await,
            Shape::Roots => Vec::new(),
        };
        // Every answer counts, the warm-up's too.
        figures.failures += tally.failures + completions.len() as u64;
        for f in tally.shown.into_iter().chain(completions) {
            if figures.shown.len() < FAILURES_SHOWN {
                figures.shown.push(f);
            }
        }
        if warm_up {
            continue;
        }
        figures.rates.push(tally.issued as f64 / took.as_secs_f64());
        figures.latencies.extend(tally.latencies);
        figures.issued += tally.issued;
        let client = after.client - before.client;
        figures.cpu.0 += after.process - before.process - client;
        figures.cpu.1 += client;
        figures.cpu.2 += after.nats - before.nats;
        figures.records += written;
    }
    figures
}

/// The sample at quantile `q` of sorted `samples` (nearest rank), in ms.
fn ms_at(samples: &[Duration], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let i = ((samples.len() as f64 * q).ceil() as usize).saturating_sub(1);
    samples[i].as_secs_f64() * 1e3
}

fn print_table(rows: &mut [Row]) {
    println!(
        "{:<31} {:>4} {:>9} {:>13} {:>7} {:>7} {:>22} {:>8} {:>6}",
        "journal, leases",
        "conc",
        "leases/s",
        "(min-max)",
        "p50 ms",
        "p99 ms",
        "CPU/lease proxy+client",
        "records",
        "failed"
    );
    println!(
        "{:<31} {:>4} {:>9} {:>13} {:>7} {:>7} {:>22} {:>8} {:>6}",
        "", "", "median", "over rounds", "", "", "(+nats-server) us", "/lease", ""
    );
    for row in rows.iter_mut() {
        let mut rates = row.rates.clone();
        rates.sort_by(f64::total_cmp);
        row.latencies.sort();
        let per = |d: Duration| d.as_secs_f64() * 1e6 / row.issued.max(1) as f64;
        let mut cpu = format!("{:.0}+{:.0}", per(row.cpu.0), per(row.cpu.1));
        if row.nats {
            cpu.push_str(&format!(" (+{:.0})", per(row.cpu.2)));
        }
        println!(
            "{:<31} {:>4} {:>9.0} {:>13} {:>7.2} {:>7.2} {:>22} {:>8.2} {:>6}",
            row.name,
            row.concurrency,
            rates[rates.len() / 2],
            format!("{:.0}-{:.0}", rates[0], rates[rates.len() - 1]),
            ms_at(&row.latencies, 0.5),
            ms_at(&row.latencies, 0.99),
            cpu,
            row.records as f64 / row.issued.max(1) as f64,
            row.failures
        );
    }
    for row in rows.iter() {
        for failure in &row.shown {
            println!(
                "  failed ({}, conc {}): {failure}",
                row.name, row.concurrency
            );
        }
    }
}

/// `samples` appends of a `line_bytes` line to a fresh file in `dir`, each fdatasynced: p50
/// and p99 in ms.
fn fsync_probe(dir: &Path, line_bytes: usize, samples: usize) -> (f64, f64) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("probe.jsonl"))
        .unwrap();
    let mut line = vec![b'x'; line_bytes];
    line.push(b'\n');
    let mut took = Vec::new();
    for _ in 0..samples {
        let started = Instant::now();
        file.write_all(&line).unwrap();
        file.sync_data().unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    (ms_at(&took, 0.5), ms_at(&took, 0.99))
}

/// `samples` publishes of a `line_bytes` message to an R3 stream of its own on `cluster`, each
/// awaited to its ack: p50 and p99 in ms.
async fn ack_probe(cluster: &NatsCluster, line_bytes: usize, samples: usize) -> (f64, f64) {
    let spec = StreamSpec {
        prefix: "benchprobe",
        max_age: None,
    };
    let options = NatsOptions {
        replicas: 3,
        ..NatsOptions::default()
    };
    let stream = NatsStream::connect(&cluster.location("PROBE"), &options, &spec)
        .await
        .unwrap();
    let line = vec![b'x'; line_bytes];
    let mut took = Vec::new();
    for _ in 0..samples {
        let started = Instant::now();
        stream
            .publish(stream.subject(None), &line, None)
            .await
            .unwrap();
        took.push(started.elapsed());
    }
    took.sort();
    (ms_at(&took, 0.5), ms_at(&took, 0.99))
}

/// The 1-minute load average.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// A proxy following `journal` with its admin API on a free loopback port, no issuing rate
/// in the way, and a root policy whose `fan_out` ceiling lets the parent have [`FAN_OUT`].
fn config(journal: JournalLocation, dir: &Path, key: &Key) -> leasegate::config::ServeConfig {
    let mut config = serve_config(journal, dir, key);
    config.admin = Some("127.0.0.1:0".parse().unwrap());
    config.issuing.rate = NonZeroU32::new(1_000_000).unwrap();
    config.issuing.root = RootPolicy {
        max_fan_out: Some(FAN_OUT),
        ..RootPolicy::default()
    };
    config
}

/// The rows of `shapes` (what, at which concurrency) on `server`, which is shut down after.
fn rows_of(
    name: &str,
    (proxy, clients): (&tokio::runtime::Runtime, &tokio::runtime::Runtime),
    server: Server,
    journal: &Journal,
    shapes: &[(Shape, usize)],
    timing: (u64, Duration),
) -> Vec<Row> {
    let admin = server.admin_addr.unwrap();
    let rows = shapes
        .iter()
        .map(|&(shape, concurrency)| {
            clients.block_on(row(name, admin, journal, shape, concurrency, timing))
        })
        .collect();
    proxy.block_on(server.shutdown());
    rows
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let rounds = setting("ROUNDS", 5);
    let window = Duration::from_millis(setting("ROUND_MS", 1500));
    println!("cargo bench --bench issue");
    println!(
        "POST /leases over keep-alive loopback HTTP/1.1, every answer after the fold; {rounds} \
         rounds each (roots: {} ms a round; children: {CHILDREN_PER_ROUND} a round, completed \
         after it); {} CPUs",
        window.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // Other work on the machine shows in every figure.
    let load = load_average();
    let proxy = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let key = Key::from_bytes([7; 32]);
    let all = [(Shape::Roots, 1), (Shape::Roots, 16), (Shape::Children, 16)];
    let timing = (rounds, window);
    // Started first: the nodes elect their meta leader while the file rows run.
    let nats_server = std::process::Command::new(nats_support::nats_server_bin())
        .arg("--version")
        .output()
        .is_ok();
    let cluster = nats_server.then(|| NatsCluster::start(3));

    let mut rows = Vec::new();
    let disk = tempfile::tempdir().unwrap();
    // Before the rows too: the disk's flushes vary with what else writes to it.
    let fsync_before = fsync_probe(disk.path(), 1024, 200);
    let path = disk.path().join("journal.jsonl");
    std::fs::write(&path, "").unwrap();
    let server = proxy
        .block_on(Server::start(config(
            JournalLocation::File(path.clone()),
            disk.path(),
            &key,
        )))
        .unwrap();
    let journal = Journal::File(path.clone());
    rows.extend(rows_of(
        "file (fsync)",
        (&proxy, &clients),
        server,
        &journal,
        &all,
        timing,
    ));
    let bytes = std::fs::metadata(&path).unwrap().len();
    let line_bytes = (bytes / clients.block_on(journal.records()).max(1)) as usize;

    let shm = Path::new("/dev/shm");
    let tmpfs = shm
        .is_dir()
        .then(|| tempfile::tempdir_in(shm).ok())
        .flatten();
    if let Some(tmpfs) = &tmpfs {
        let path = tmpfs.path().join("journal.jsonl");
        std::fs::write(&path, "").unwrap();
        let server = proxy
            .block_on(Server::start(config(
                JournalLocation::File(path.clone()),
                tmpfs.path(),
                &key,
            )))
            .unwrap();
        rows.extend(rows_of(
            "tmpfs file (fsync free)",
            (&proxy, &clients),
            server,
            &Journal::File(path),
            &all[..2],
            timing,
        ));
    }

    let mut probes = vec![
        (
            "one append + fdatasync, journal's disk, before the file rows (1024 B)",
            fsync_before,
        ),
        (
            "one append + fdatasync, journal's disk, after them",
            fsync_probe(disk.path(), line_bytes, 200),
        ),
    ];
    if let Some(tmpfs) = &tmpfs {
        probes.push((
            "one append + fdatasync, tmpfs",
            fsync_probe(tmpfs.path(), line_bytes, 200),
        ));
    }
    match &cluster {
        None => println!(
            "nats: `{}` is not installed (Debian's package nats-server): the stream rows are \
             skipped",
            nats_support::nats_server_bin()
        ),
        Some(cluster) => {
            let stream = proxy.block_on(cluster.journal("LEASES"));
            let mut config = config(
                JournalLocation::Nats(cluster.location_as(Role::Replica, "LEASES")),
                disk.path(),
                &key,
            );
            config.store.nats.replicas = 3;
            let server = proxy.block_on(Server::start(config)).unwrap();
            rows.extend(rows_of(
                "nats R3 (3 nodes)",
                (&proxy, &clients),
                server,
                &Journal::Nats(Box::new(stream)),
                &all,
                timing,
            ));
            probes.push((
                "one R3 publish + ack, on a stream of its own",
                proxy.block_on(ack_probe(cluster, line_bytes, 200)),
            ));
        }
    }
    println!();
    print_table(&mut rows);
    println!();
    for (what, (p50, p99)) in probes {
        println!("probe: {what}: p50 {p50:.2} ms, p99 {p99:.2} ms");
    }
    println!(
        "(probes write {line_bytes} B, the journal's mean record, unless said; load average at \
         the start {load}, now {})",
        load_average()
    );
}
