//! Shared test helpers: contract data, signed leases, the built binary and running it
//! (`leasegate_ok`: it must succeed), and the one way a test skips (`skip`: never under
//! `CI=true`, where a missing tool or privilege fails the test).

pub mod harness;
pub mod model_api;
pub mod model_proxy;
pub mod nats;
pub mod netns;
pub mod openapi;
pub mod tls_hello;

use leasegate::contract::lease::sign;
use leasegate::contract::{Key, Timestamp};
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

pub fn data(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(rel)
}

pub fn read_json(rel: &str) -> Value {
    serde_json::from_slice(&std::fs::read(data(rel)).unwrap()).unwrap()
}

pub fn t(text: &str) -> Timestamp {
    Timestamp::parse(text).unwrap()
}

/// A deterministic key for tests (never the published test key).
pub fn key(seed: u8) -> Key {
    Key::from_bytes([seed; 32])
}

/// A lease id from a small number, in the contract's UUID form.
pub fn id(n: u32) -> String {
    format!("{n:08x}-0000-4000-8000-000000000000")
}

/// A signed lease built by hand.
pub fn lease(
    key: &Key,
    lease_id: &str,
    parent: Option<&str>,
    window: (&str, &str),
    allow: &[&str],
    deny: &[&str],
) -> Value {
    let mut manifest = json!({
        "schema_version": "1.2",
        "agent": {"name": "tester", "kind": "external", "runtime_agent": "unknown"},
        "intent": {"purpose": "test"},
        "allow": {"tools": [], "read_paths": [], "write_paths": [], "hosts": allow, "commands": []},
        "deny": {"commands": [], "paths": [], "hosts": deny},
        "budget": {},
        "approvals": [],
    });
    let mut lease = json!({
        "schema_version": "1.2",
        "lease_id": lease_id,
        "declared_hash": "0".repeat(64),
        "issued_at": window.0,
        "expires_at": window.1,
        "issuer_session_id": "tests",
    });
    if let Some(parent) = parent {
        manifest["parent_lease_id"] = parent.into();
        lease["parent_lease_id"] = parent.into();
    }
    lease["manifest"] = manifest;
    sign(&mut lease, key).unwrap();
    lease
}

/// A `granted` journal line for a lease.
pub fn granted_line(lease: &Value, at: &str) -> String {
    json!({
        "schema_version": "1.2",
        "at": at,
        "event": "granted",
        "lease_id": lease["lease_id"],
        "lease": lease,
    })
    .to_string()
}

/// A closing or other event line without a lease.
pub fn event_line(event: &str, lease_id: &str, at: &str, extra: Value) -> String {
    let mut line = json!({"schema_version": "1.0", "at": at, "event": event, "lease_id": lease_id});
    for (k, v) in extra.as_object().unwrap() {
        line[k] = v.clone();
    }
    line.to_string()
}

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_leasegate")
}

/// The one way tests run the built binary: `args`, with RUST_LOG cleared and every port open
/// to tunnels and forwarded requests (origins listen on random ports; a test of the port
/// defaults removes `LEASEGATE_CONNECT_PORTS` and `LEASEGATE_FORWARD_PORTS`).
pub fn leasegate_command(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(bin());
    command.args(args);
    with_test_env(&mut command);
    command
}

/// [`leasegate_command`] under a file descriptor limit: `ulimit` runs with `limit` as its
/// arguments in a shell that then becomes the binary (`-n 256`: soft and hard limit 256).
pub fn leasegate_command_under(limit: &str, args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new("bash");
    command
        .arg("-c")
        .arg(format!("ulimit {limit} && exec \"$0\" \"$@\""))
        .arg(bin())
        .args(args);
    with_test_env(&mut command);
    command
}

fn with_test_env(command: &mut std::process::Command) {
    command
        .env_remove("RUST_LOG")
        .env("LEASEGATE_CONNECT_PORTS", "1-65535")
        .env("LEASEGATE_FORWARD_PORTS", "1-65535");
}

/// `serve` on `journal` under `key` with per-lease ports in `range` (no admin listener, any
/// proxy port; its data directory beside the journal), its stderr piped for the test to read.
pub fn serve_lease_ports(journal: &str, key: &str, range: &str) -> std::process::Child {
    let data = std::path::Path::new(journal).with_file_name("data");
    let data = data.to_str().unwrap();
    serve_piped(journal, key, &["--lease-ports", range, "--data-dir", data])
}

/// `serve` on `journal` under `key` with `more` flags (no admin listener, any proxy port), its
/// stderr piped for the test to read.
pub fn serve_piped(journal: &str, key: &str, more: &[&str]) -> std::process::Child {
    let mut args = vec![
        "serve",
        "--admin",
        "off",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        journal,
        "--key-file",
        key,
    ];
    args.extend_from_slice(more);
    leasegate_command(&args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// The proxy address a `serve` child announces on its first stdout line (its banner ends with
/// the address it listens on).
pub async fn served_addr(child: &mut tokio::process::Child) -> String {
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap());
    let mut banner = String::new();
    tokio::io::AsyncBufReadExt::read_line(&mut stdout, &mut banner)
        .await
        .unwrap();
    banner.trim().rsplit(' ').next().unwrap().to_owned()
}

/// Runs the binary from an async test without blocking the runtime's threads (which may be
/// serving the proxy under test).
pub async fn leasegate(args: &[&str]) -> std::process::Output {
    tokio::process::Command::from(leasegate_command(args))
        .output()
        .await
        .unwrap()
}

/// Runs the binary from a plain `#[test]`.
pub fn leasegate_sync(args: &[&str]) -> std::process::Output {
    leasegate_command(args).output().unwrap()
}

/// [`leasegate`] that must succeed: its stdout. A failure shows the arguments, the exit status,
/// stderr and stdout.
pub async fn leasegate_ok(args: &[&str]) -> String {
    expect_success(&format!("{args:?}"), &leasegate(args).await)
}

/// The stdout of `out`, asserting that its command succeeded; a failure shows the exit status,
/// stderr and stdout.
#[track_caller]
pub fn succeeded(out: &std::process::Output) -> String {
    expect_success("the command", out)
}

#[track_caller]
fn expect_success(what: &str, out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8")
}

/// Whether `command` is on `PATH` (or, named by a path, is a file).
pub fn has_command(command: &str) -> bool {
    if command.contains('/') {
        return Path::new(command).is_file();
    }
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path)
            .any(|dir| std::fs::metadata(dir.join(command)).is_ok_and(|m| m.is_file()))
    })
}

/// Whether this process runs as root (its real user id is 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|status| {
            status
                .lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Whether any of `commands` is missing, which [`skip`]s the calling test (a failure unless
/// a partial run is asked for) with `install`, the way to install it.
pub fn missing(commands: &[&str], install: &str) -> bool {
    let absent: Vec<&str> = commands
        .iter()
        .copied()
        .filter(|command| !has_command(command))
        .collect();
    if !absent.is_empty() {
        skip(&format!("{} missing ({install})", absent.join(" and ")));
    }
    !absent.is_empty()
}

/// Whether `nats-server` is [`missing`].
pub fn nats_missing() -> bool {
    missing(
        &[&nats::nats_server_bin()],
        "apt-get install nats-server; .ci/run does",
    )
}

/// Whether this run is CI's (`CI=true`), where no test may pass by skipping.
pub fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Ends a test that cannot run on this machine: it fails with `why` (which says what is missing
/// and how to install it), so that no test passes by skipping; `tests/setup.sh` installs what
/// the suite uses. With `LEASEGATE_TESTS_SKIP=1` (a partial run, never under `CI=true`) it
/// prints `SKIPPED <test>: <why>` on stderr (even when libtest captures the test's output)
/// instead, and the test returns.
#[track_caller]
pub fn skip(why: &str) {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a test");
    let partial = std::env::var("LEASEGATE_TESTS_SKIP").is_ok_and(|v| v == "1");
    assert!(
        partial && !is_ci(),
        "{test} cannot run: {why}. tests/setup.sh installs what the tests use \
         (LEASEGATE_TESTS_SKIP=1 for a partial run that skips it, outside CI)"
    );
    // Past libtest's capture (which takes only `eprintln!`), so that it shows in a passing run.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// `line` (a journal record) signed by `signer`.
pub fn signed_line(line: &str, signer: &Key) -> String {
    let mut record: Value = serde_json::from_str(line).unwrap();
    sign(&mut record, signer).unwrap();
    record.to_string()
}

/// Asserts that `line` is valid against the egress log's published schema.
pub fn egress_schema_valid(line: &Value) {
    static SCHEMA: std::sync::LazyLock<jsonschema::Validator> = std::sync::LazyLock::new(|| {
        let schema: Value =
            serde_json::from_str(include_str!("../../../schemas/egress-event.schema.json"))
                .unwrap();
        jsonschema::draft7::new(&schema).unwrap()
    });
    let problems: Vec<String> = SCHEMA.iter_errors(line).map(|e| e.to_string()).collect();
    assert!(problems.is_empty(), "{line}: {problems:?}");
}
