//! What a user sees: refusal status lines in real clients, the dev banner, default egress
//! log, journal path mistakes, messages.

use crate::support::harness::{curl, http_origin, proxy_url, raw, Harness};
use crate::support::leasegate_command;
use crate::support::succeeded;

/// The first line of a raw response.
fn status_line(response: &str) -> &str {
    response.lines().next().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusal_code_is_the_reason_phrase() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let second = h.lease(&["origin.test"], &[]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;

    let answer = raw(
        server.addr,
        b"GET http://origin.test/ HTTP/1.1\r\nHost: origin.test\r\n\r\n",
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 407 lease-missing",
        "{answer}"
    );

    let auth = base64_basic(&lease);
    let answer = raw(
        server.addr,
        format!(
            "CONNECT denied.test:443 HTTP/1.1\r\nHost: denied.test:443\r\n\
             Proxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 403 host-denied", "{answer}");
    assert!(
        answer
            .to_lowercase()
            .contains("\r\nx-leasegate-refusal: host-denied\r\n"),
        "{answer}"
    );
    assert!(
        answer.ends_with(&format!(
            "\r\n\r\nleasegate refused CONNECT denied.test:443 for lease {lease}: host-denied \
             (denied.test is denied by denied.test in lease {lease})\n"
        )),
        "{answer}"
    );

    // A refusal revokes its lease by default: the next case needs a lease of its own.
    let auth = base64_basic(&second);
    let answer = raw(
        server.addr,
        format!(
            "GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\
             Proxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(
        status_line(&answer),
        "HTTP/1.1 403 host-not-allowed",
        "{answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_prints_the_refusal_code() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let second = h.lease(&["origin.test"], &["denied.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;
    let proxy = proxy_url(&server, &lease);

    // Plain HTTP: curl -v shows the status line as received.
    let out = curl(
        &[
            "-v",
            "-x",
            &proxy,
            &format!("http://denied.test:{}/", origin.addr.port()),
        ],
        &[],
    )
    .await;
    assert_eq!(out.status, 403, "{out:?}");
    assert!(
        out.stderr.contains("< HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.headers.starts_with("HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.headers
    );

    // CONNECT: the tunnel's refusal, as curl reports it (a refusal revoked the first lease).
    let out = curl(
        &["-v", "https://denied.test:443/"],
        &[("HTTPS_PROXY", &proxy_url(&server, &second))],
    )
    .await;
    assert_eq!(out.exit, 56, "{out:?}");
    assert!(
        out.stderr.contains("< HTTP/1.1 403 host-denied\r\n"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr
            .contains("curl: (56) CONNECT tunnel failed, response 403"),
        "{}",
        out.stderr
    );
}

/// `agent:<lease>` as Basic credentials.
fn base64_basic(lease: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(format!("agent:{lease}"))
}

/// A `serve --dev` child in `dir` and its first two stdout lines (banner, export line).
struct DevServe {
    child: std::process::Child,
    banner: String,
    export: String,
}

impl Drop for DevServe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve_dev(dir: &std::path::Path, extra: &[&str]) -> DevServe {
    use std::io::BufRead;
    let mut child = leasegate_command(&["serve", "--dev", "--admin", "off"])
        .args(extra)
        .current_dir(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let banner = lines.next().unwrap().unwrap();
    let export = lines.next().unwrap().unwrap();
    DevServe {
        child,
        banner,
        export,
    }
}

/// The lease id a dev banner names.
fn banner_lease(banner: &str) -> String {
    banner
        .split_once("with demo lease ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{banner}"))
        .to_owned()
}

fn granted_count(dir: &std::path::Path) -> usize {
    std::fs::read_to_string(dir.join(".leasegate/journal.jsonl"))
        .unwrap_or_default()
        .matches("\"event\":\"granted\"")
        .count()
}

#[test]
fn serve_dev_exports_every_proxy_variable_and_logs_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let origin_port = super::messages_operator::local_origin();
    let dev = serve_dev(
        dir.path(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--allow-host",
            "origin.test",
            "--resolve",
            "origin.test=127.0.0.1",
            "--allow-private",
            "127.0.0.1/32",
        ],
    );
    let lease = banner_lease(&dev.banner);
    let addr = dev
        .banner
        .strip_prefix("leasegate (dev) on ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .to_owned();
    assert_eq!(
        dev.banner,
        format!(
            "leasegate (dev) on {addr} with demo lease {lease} (issued); refusals are logged, \
             not revoking (--on-refusal revoke to revoke); egress log .leasegate/egress.jsonl"
        )
    );
    let url = format!("http://agent:{lease}@{addr}");
    assert_eq!(
        dev.export,
        format!(
            "export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} \
             ALL_PROXY={url} all_proxy={url} NO_PROXY=127.0.0.1,localhost \
             no_proxy=127.0.0.1,localhost"
        )
    );

    // curl reads only the lower-case http_proxy for http:// URLs: the export line works.
    let curl_env = |target: &str| {
        let mut command = std::process::Command::new("curl");
        command
            .args(["-sS", "-w", " %{http_code}", target])
            .env_clear();
        command.env("PATH", std::env::var("PATH").unwrap_or_default());
        for pair in dev.export.trim_start_matches("export ").split(' ') {
            let (k, v) = pair.split_once('=').unwrap();
            command.env(k, v);
        }
        let out = command.output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let allowed = format!("http://origin.test:{origin_port}/");
    assert_eq!(curl_env(&allowed), "dev 200");
    // A refusal is logged, and the lease still works afterwards.
    let refused = curl_env(&format!("http://elsewhere.test:{origin_port}/"));
    assert!(refused.ends_with(" 403"), "{refused}");
    assert!(refused.contains(": host-not-allowed ("), "{refused}");
    assert_eq!(curl_env(&allowed), "dev 200");
    // What listens on loopback (the admin API, here the origin) is reached directly: no line.
    assert_eq!(
        curl_env(&format!("http://127.0.0.1:{origin_port}/")),
        "dev 200"
    );
    // Lines are written just after the response: wait for the third.
    let egress_path = dir.path().join(".leasegate/egress.jsonl");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline
        && std::fs::read_to_string(&egress_path)
            .unwrap_or_default()
            .lines()
            .count()
            < 3
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    drop(dev);
    let journal = std::fs::read_to_string(dir.path().join(".leasegate/journal.jsonl")).unwrap();
    assert!(!journal.contains("\"event\":\"revoked\""), "{journal}");
    let egress = std::fs::read_to_string(&egress_path).unwrap();
    assert_eq!(egress.lines().count(), 3, "{egress}");
    assert!(egress.contains("\"code\":\"host-not-allowed\""), "{egress}");
}

#[test]
fn serve_dev_twice_reuses_the_open_demo_lease() {
    let dir = tempfile::tempdir().unwrap();
    let first = serve_dev(dir.path(), &["--listen", "127.0.0.1:0"]);
    let lease = banner_lease(&first.banner);
    assert!(first.banner.contains(" (issued); "), "{}", first.banner);
    drop(first);
    let second = serve_dev(dir.path(), &["--listen", "127.0.0.1:0"]);
    assert_eq!(banner_lease(&second.banner), lease);
    assert!(second.banner.contains(" (reused); "), "{}", second.banner);
    assert_eq!(granted_count(dir.path()), 1);
    drop(second);
    // Other hosts: another lease, and the one for `*` is closed, not left open for a day.
    let third = serve_dev(
        dir.path(),
        &["--listen", "127.0.0.1:0", "--allow-host", "example.com"],
    );
    let narrower = banner_lease(&third.banner);
    assert_ne!(narrower, lease);
    assert!(
        third.banner.contains(&format!(
            " (issued; closed the demo lease {lease} for other hosts); "
        )),
        "{}",
        third.banner
    );
    assert_eq!(granted_count(dir.path()), 2);
    let journal = std::fs::read_to_string(dir.path().join(".leasegate/journal.jsonl")).unwrap();
    let revoked: Vec<&str> = journal
        .lines()
        .filter(|l| l.contains("\"event\":\"revoked\""))
        .collect();
    assert_eq!(revoked.len(), 1, "{journal}");
    assert!(revoked[0].contains(&lease), "{}", revoked[0]);
    assert!(
        revoked[0].contains("superseded: serve --dev now hands out a demo lease for example.com")
    );
}

#[test]
fn serve_dev_issues_nothing_when_the_port_is_taken() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let out = leasegate_command(&["serve", "--dev", "--admin", "off", "--listen", &addr])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The cause once, not twice.
    assert_eq!(
        stderr,
        format!("leasegate: listening on {addr}: Address already in use (os error 98)\n")
    );
    assert_eq!(granted_count(dir.path()), 0);
}

#[test]
fn listen_accepts_a_name() {
    let dir = tempfile::tempdir().unwrap();
    let dev = serve_dev(dir.path(), &["--listen", "localhost:0"]);
    assert!(
        dev.banner.starts_with("leasegate (dev) on 127.0.0.1:")
            || dev.banner.starts_with("leasegate (dev) on [::1]:"),
        "{}",
        dev.banner
    );
    let out = leasegate_command(&["serve", "--dev", "--listen", "no-port"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "invalid value 'no-port' for '--listen <LISTEN>': \"no-port\": expected ADDR:PORT or \
             NAME:PORT, e.g. 127.0.0.1:3128"
        ),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identification_refusals_name_the_target_in_the_egress_log() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("denied.test", "127.0.0.1")]))
        .await;

    let answer = raw(
        server.addr,
        b"CONNECT origin.test:443 HTTP/1.1\r\nHost: origin.test:443\r\n\r\n",
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 407 lease-missing");
    let line = h.egress_line(1).await;
    assert_eq!(
        (&line["code"], &line["host"], &line["port"]),
        (&"lease-missing".into(), &"origin.test".into(), &443.into()),
        "{line}"
    );

    let unknown = base64_basic("00000000-0000-4000-8000-000000000000");
    let answer = raw(
        server.addr,
        format!(
            "GET http://Origin.test:8080/x HTTP/1.1\r\nHost: origin.test:8080\r\n\
             Proxy-Authorization: Basic {unknown}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    assert_eq!(status_line(&answer), "HTTP/1.1 407 lease-unknown");
    let line = h.egress_line(2).await;
    assert_eq!(
        (&line["code"], &line["host"], &line["port"]),
        (&"lease-unknown".into(), &"origin.test".into(), &8080.into()),
        "{line}"
    );

    // A denied host revokes the lease; its next request is lease-revoked, target named.
    let auth = base64_basic(&lease);
    let connect = |host: &str| {
        format!(
            "CONNECT {host}:443 HTTP/1.1\r\nHost: {host}:443\r\n\
             Proxy-Authorization: Basic {auth}\r\n\r\n"
        )
    };
    let answer = raw(server.addr, connect("denied.test").as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 403 host-denied");
    let answer = raw(server.addr, connect("origin.test").as_bytes()).await;
    assert_eq!(status_line(&answer), "HTTP/1.1 403 lease-revoked");
    let line = h.egress_line(4).await;
    assert_eq!(
        (&line["code"], &line["host"], &line["port"]),
        (&"lease-revoked".into(), &"origin.test".into(), &443.into()),
        "{line}"
    );
}

/// A key file and a journal path in `dir` (the journal not created).
pub(super) fn key_and_journal(dir: &std::path::Path) -> (String, String) {
    let key = dir.join("lease.key");
    std::fs::write(&key, leasegate::contract::Key::generate().to_file_text()).unwrap();
    (
        key.display().to_string(),
        dir.join("journal.jsonl").display().to_string(),
    )
}

/// `leasegate issue` into `journal` under `key` for `hosts`; the new lease's id.
pub(super) fn issue_sync(journal: &str, key: &str, hosts: &[&str]) -> String {
    let mut args = vec!["issue", "--journal", journal, "--key-file", key];
    for host in hosts {
        args.extend(["--allow-host", host]);
    }
    succeeded(&leasegate_command(&args).output().unwrap())
        .lines()
        .next()
        .unwrap()
        .to_owned()
}

/// Starts `serve` with `args`, returns the child and its first stdout line.
fn serve_line(args: &[&str]) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = leasegate_command(&["serve", "--admin", "off", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().and_then(Result::ok).unwrap_or_default();
    (child, line)
}

#[test]
fn the_egress_log_is_on_by_default_beside_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    std::fs::write(&journal, "").unwrap();
    let (mut child, line) = serve_line(&["--journal", &journal, "--key-file", &key]);
    let egress = dir.path().join("egress.jsonl");
    let addr = line.rsplit(' ').next().unwrap().to_owned();
    assert_eq!(
        line,
        format!(
            "leasegate (egress log {}) listening on {addr}",
            egress.display()
        )
    );
    let out = std::process::Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "-x"])
        .arg(format!("http://{addr}"))
        .arg("http://example.test/")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "407");
    // The line is written within moments; poll briefly.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let mut text = String::new();
    while std::time::Instant::now() < deadline && !text.contains('\n') {
        text = std::fs::read_to_string(&egress).unwrap_or_default();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let line: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(line["code"], "lease-missing");
    assert_eq!(line["host"], "example.test");

    let quiet = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(quiet.path());
    std::fs::write(&journal, "").unwrap();
    let (mut child, line) = serve_line(&[
        "--journal",
        &journal,
        "--key-file",
        &key,
        "--egress-log",
        "off",
    ]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        line.starts_with("leasegate (egress log off) listening on 127.0.0.1:"),
        "{line}"
    );
    assert!(!quiet.path().join("egress.jsonl").exists());
    assert!(!std::path::Path::new("off").exists());
}

pub(super) fn stderr_text(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn serve_creates_a_missing_journal_and_its_directory_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let (mut child, line) = serve_line(&["--journal", &journal, "--key-file", &key]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("leasegate (egress log "), "{line}");
    assert_eq!(std::fs::read(&journal).unwrap(), b"");

    let nested = dir.path().join("state/journal.jsonl");
    let nested_text = nested.display().to_string();
    let out = leasegate_command(&[
        "serve",
        "--admin",
        "off",
        "--listen",
        "127.0.0.1:0",
        "--journal",
        &nested_text,
        "--key-file",
        &key,
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_text(&out),
        format!(
            "leasegate: the journal {nested_text}: its directory {} does not exist (give \
             --create-journal to create it)\n",
            dir.path().join("state").display()
        )
    );
    assert!(!dir.path().join("state").exists());

    let (mut child, line) = serve_line(&[
        "--journal",
        &nested_text,
        "--key-file",
        &key,
        "--create-journal",
    ]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("leasegate (egress log "), "{line}");
    assert!(nested.exists());
}

#[test]
fn leases_and_check_refuse_a_missing_journal() {
    let dir = tempfile::tempdir().unwrap();
    let (key, _) = key_and_journal(dir.path());
    let missing = dir.path().join("jornal.jsonl").display().to_string();
    let expected =
        format!("leasegate: no journal at {missing} (check --journal; `serve` creates it)\n");
    let out = leasegate_command(&["leases", "--journal", &missing, "--key-file", &key])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr_text(&out), expected);
    assert_eq!(out.stdout, b"");
    let out = leasegate_command(&[
        "check",
        "--journal",
        &missing,
        "--key-file",
        &key,
        "--lease",
        "00000000-0000-4000-8000-000000000000",
        "example.com:443",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr_text(&out), expected);
    assert_eq!(out.stdout, b"");
}

/// A lease id typed in upper case (as a heading may show it) is taken, in lower case.
#[test]
fn a_lease_id_is_taken_in_any_case() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let lease = issue_sync(&journal, &key, &["a.test"]);
    let upper = lease.to_uppercase();
    let token = succeeded(
        &leasegate_command(&["token", "--lease", &upper, "--key-file", &key])
            .output()
            .unwrap(),
    );
    assert!(token.starts_with(&format!("{lease}.")), "{token}");
    let out = check_out(&journal, &key, &upper, &["a.test:443"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr_text(&out));
    assert_eq!(stderr_text(&out), "");
    // --resolve without --resolve-names would be ignored: said so.
    let out = check_out(
        &journal,
        &key,
        &lease,
        &["--resolve", "a.test=10.0.0.5", "a.test:443"],
    );
    assert_eq!(
        stderr_text(&out),
        "leasegate check: warning: --resolve (or LEASEGATE_RESOLVE) is not used: check resolves \
         no name without --resolve-names\n"
    );
}

/// `leasegate check --journal J --key-file K --lease L EXTRA...`.
fn check_out(journal: &str, key: &str, lease: &str, extra: &[&str]) -> std::process::Output {
    leasegate_command(&[
        "check",
        "--journal",
        journal,
        "--key-file",
        key,
        "--lease",
        lease,
    ])
    .args(extra)
    .output()
    .unwrap()
}

/// A key file that signs none of the journal's leases: `leases` and `serve` stop, naming the
/// key the journal was signed with; with some leases verifying, `leases` lists them and says
/// how many it left out.
#[test]
fn the_wrong_key_fails_loudly_and_a_partial_fold_says_what_it_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    issue_sync(&journal, &key, &["a.test"]);
    issue_sync(&journal, &key, &["b.test"]);
    let wrong = dir.path().join("wrong.key");
    std::fs::write(&wrong, leasegate::contract::Key::generate().to_file_text()).unwrap();
    let wrong = wrong.display().to_string();
    let fingerprint = leasegate::contract::Key::load(std::path::Path::new(&key))
        .unwrap()
        .fingerprint()
        .to_string();
    let out = leasegate_command(&["leases", "--journal", &journal, "--key-file", &wrong])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(out.stdout, b"", "no empty table");
    let said = stderr_text(&out);
    assert!(
        said.contains(&format!(
            "leasegate: no lease of the journal verifies under the keyring: 2 grant(s) signed with {fingerprint}"
        )),
        "{said}"
    );
    let out = leasegate_command(&[
        "serve",
        "--journal",
        &journal,
        "--key-file",
        &wrong,
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "off",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_text(&out).contains("no lease of the journal verifies under the keyring"),
        "{}",
        stderr_text(&out)
    );
    // One lease of the wrong key besides the two: listed, and the one left out is counted.
    issue_sync(&journal, &wrong, &["c.test"]);
    let out = leasegate_command(&["leases", "--journal", &journal, "--key-file", &key])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).lines().count(),
        3,
        "a head and two rows"
    );
    let said = stderr_text(&out);
    assert!(
        said.contains("leasegate: 1 grant(s) of the journal not verified (signed with sha256:"),
        "{said}"
    );
}

#[test]
fn a_skipped_line_is_named_by_its_place_in_the_journal_not_in_a_read() {
    use std::io::{BufRead, Write};
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    issue_sync(&journal, &key, &["example.com"]);
    // Past the first read (4 MiB): 600,000 blank lines (counted, not folded), then a bad one.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    file.write_all(&b"        \n".repeat(600_000)).unwrap();
    file.write_all(b"{not json\n").unwrap();
    drop(file);
    let bad = 1 + 600_000 + 1;
    let mut child = crate::support::serve_piped(&journal, &key, &[]);
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut next_skipped = |seen: &mut Vec<String>| {
        for line in stderr.by_ref().map_while(Result::ok) {
            let done = line.contains("journal lines skipped lines=");
            seen.push(line);
            if done {
                return;
            }
        }
    };
    next_skipped(&mut seen);
    let folded = seen.last().unwrap().clone();
    // Then, followed: the next line of the journal is the one after.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    file.write_all(b"{still not json\n").unwrap();
    next_skipped(&mut seen);
    let _ = child.kill();
    let _ = child.wait();
    let text = seen.join("\n");
    assert!(
        folded.contains(&format!("journal lines skipped lines={bad} ")),
        "{text}"
    );
    assert!(
        seen.last()
            .unwrap()
            .contains(&format!("journal lines skipped lines={} ", bad + 1)),
        "{text}"
    );
}

#[test]
fn a_lease_port_held_elsewhere_is_reported_as_such_without_colour() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let lease = issue_sync(&journal, &key, &["example.com"]);
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let range = format!("{port}-{port}");
    let mut child = crate::support::serve_lease_ports(&journal, &key, &range);
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut seen = Vec::new();
    for line in stderr.lines().map_while(Result::ok) {
        let done = line.contains("lease_ports");
        seen.push(line);
        if done {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = seen.join("\n");
    assert!(!text.contains('\u{1b}'), "{text:?}");
    let warning = seen.last().unwrap();
    assert!(
        warning.ends_with(&format!(
            " WARN leasegate::proxy::lease_ports: its lease port {port} is held by another \
             process: this lease is reachable by credentials only lease={lease}"
        )),
        "{text}"
    );
    assert!(!text.contains("Some("), "{text}");
    drop(held);
}

#[test]
fn verify_and_revoke_say_each_thing_once() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let other = dir.path().join("other.key");
    std::fs::write(&other, leasegate::contract::Key::generate().to_file_text()).unwrap();
    let other = other.display().to_string();
    let mut lease = String::new();
    for _ in 0..3 {
        lease = issue_sync(&journal, &key, &["example.com"]);
    }
    let fingerprint = |path: &str| {
        leasegate::contract::Key::load(std::path::Path::new(path))
            .unwrap()
            .fingerprint()
            .to_owned()
    };
    let out = leasegate_command(&[
        "revoke",
        "--journal",
        &journal,
        "--key-file",
        &other,
        "--lease",
        &lease,
        "--reason",
        "test",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_text(&out),
        format!(
            "leasegate: lease {lease} is not in the journal under the key {} (a lease signed \
             with another key, or a mistyped id)\n",
            fingerprint(&other)
        )
    );

    std::fs::write(
        &journal,
        format!("{}garbage\n", std::fs::read_to_string(&journal).unwrap()),
    )
    .unwrap();
    let out = leasegate_command(&["verify", "--key-file", &key, &journal])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // The result on stdout, problems then the verdict; nothing on stderr.
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "{journal}: line 4: not JSON: expected value at line 1 column 1\n\
             {journal}: 1 problem(s) (schema, rules and signatures)\n"
        )
    );
    assert_eq!(stderr_text(&out), "");
}

#[test]
fn a_host_pattern_outside_the_schema_is_explained_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    issue_sync(&journal, &key, &["example.com"]);
    let text = std::fs::read_to_string(&journal).unwrap();
    std::fs::write(
        &journal,
        text.replacen("\"example.com\"", "\"ex_ample.com\"", 1),
    )
    .unwrap();
    let out = leasegate_command(&["verify", &journal]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!(
            "{journal}: line 1: schema: /declared/allow/hosts/0: \"ex_ample.com\" is not a host \
             pattern: only letters, digits, '-' and '.' (an international name as its A-labels, \
             'xn--...')\n{journal}: 1 problem(s) (schema and rules only: no --key-file given, \
             signatures not checked)\n"
        )
    );
}

#[test]
fn check_takes_a_url_and_says_dns_failed() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let lease = issue_sync(&journal, &key, &["api.github.com", "*.invalid"]);
    let check = |extra: &[&str]| {
        let out = check_out(&journal, &key, &lease, extra);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    for (url, port) in [
        ("https://api.github.com/x", 443),
        ("http://api.github.com/x", 80),
        ("https://api.github.com:8443/", 8443),
    ] {
        assert_eq!(
            check(&[url]),
            (
                Some(0),
                format!(
                    "allow\n  api.github.com:{port} is allowed by api.github.com in lease \
                     {lease} (and by every ancestor)\n  names not resolved: pass \
                     --resolve-names to check the addresses\n"
                )
            ),
            "{url}"
        );
    }
    let (code, said) = check(&["https://other.github.com/"]);
    assert_eq!(code, Some(1));
    assert!(said.starts_with("refuse host-not-allowed 403\n"), "{said}");

    // `.invalid` never resolves (RFC 6761).
    let (code, said) = check(&[
        "--resolve-names",
        "--dns-timeout",
        "2s",
        "http://nothing.invalid/",
    ]);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.starts_with("refuse dns-failed 502\n  nothing.invalid "),
        "{said}"
    );
}

#[test]
fn serve_dev_with_tls_exports_https_proxy_urls() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    std::fs::write(dir.path().join("proxy.pem"), cert.cert.pem()).unwrap();
    std::fs::write(dir.path().join("proxy.key"), cert.key_pair.serialize_pem()).unwrap();
    let dev = serve_dev(
        dir.path(),
        &[
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            "proxy.pem",
            "--tls-key",
            "proxy.key",
        ],
    );
    let lease = banner_lease(&dev.banner);
    let addr = dev
        .banner
        .strip_prefix("leasegate (dev) on ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap()
        .to_owned();
    let url = format!("https://agent:{lease}@{addr}");
    assert_eq!(
        dev.export,
        format!(
            "export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} \
             ALL_PROXY={url} all_proxy={url} NO_PROXY=127.0.0.1,localhost \
             no_proxy=127.0.0.1,localhost"
        )
    );
}

/// Runs `program` with `args` and `HTTPS_PROXY`/`HTTP_PROXY` set to `proxy`; (exit, stderr).
async fn client(program: &str, args: &[&str], proxy: &str) -> (Option<i32>, String) {
    let out = tokio::process::Command::new(program)
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", "/nonexistent")
        .env("HTTPS_PROXY", proxy)
        .env("HTTP_PROXY", proxy)
        .output()
        .await
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_git_print_what_they_print_on_a_refusal() {
    let h = Harness::new();
    let mut config = h.config(&[]);
    config.on_refusal = leasegate::proxy::OnRefusal::Log;
    let lease = h.lease(&["allowed.test"], &[]);
    let server = h.start(config).await;
    let proxy = proxy_url(&server, &lease);

    let python = |url: &str| {
        format!(
            "import urllib.request, urllib.error\n\
             try:\n    urllib.request.urlopen('{url}')\n\
             except urllib.error.HTTPError as e:\n    print(e)\n\
             except urllib.error.URLError as e:\n    print(e)\n"
        )
    };
    let out = tokio::process::Command::new("python3")
        .args(["-c", &python("https://elsewhere.test/")])
        .env_clear()
        .env("HTTPS_PROXY", &proxy)
        .output()
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "<urlopen error Tunnel connection failed: 403 host-not-allowed>\n"
    );
    let out = tokio::process::Command::new("python3")
        .args(["-c", &python("http://elsewhere.test/")])
        .env_clear()
        .env("HTTP_PROXY", &proxy)
        .output()
        .await
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "HTTP Error 403: host-not-allowed\n"
    );

    let (code, stderr) = client(
        "git",
        &["ls-remote", "https://elsewhere.test/repo.git"],
        &proxy,
    )
    .await;
    assert_eq!(code, Some(128));
    assert_eq!(
        stderr,
        "fatal: unable to access 'https://elsewhere.test/repo.git/': CONNECT tunnel failed, \
         response 403\n"
    );
}

/// `check --admin` asks the running proxy, so its answer is the proxy's: its port lists and
/// resolver decide, not this command's defaults (here the proxy opens tunnels to 8443 only,
/// and resolves `origin.test`); what the journal-reading `check` would say with its defaults
/// differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_with_admin_gives_the_running_proxys_answer() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &["denied.test"]);
    let mut config = h.config(&[("origin.test", "127.0.0.1")]);
    config.connect_ports = leasegate::policy::Ports::only(8443);
    config.forward_ports = leasegate::policy::Ports::only(80);
    let server = h.start(config).await;
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let check = |target: &'static str| {
        let (admin, lease) = (admin.clone(), lease.clone());
        async move {
            let out = tokio::task::spawn_blocking(move || {
                leasegate_command(&["check", "--admin", &admin, "--lease", &lease, target]).output()
            })
            .await
            .unwrap()
            .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (code, said, err) = check("origin.test:8443").await;
    assert_eq!(code, Some(0), "{said}{err}");
    assert!(
        said.starts_with(&format!(
            "allow\n  origin.test:8443 is allowed by origin.test in lease {lease}"
        )) && said.contains("\n  may dial 127.0.0.1:8443\n"),
        "{said}"
    );
    let (code, said, _) = check("origin.test").await;
    assert_eq!(code, Some(1));
    assert!(said.starts_with("refuse port-not-allowed 403\n"), "{said}");
    // A CONNECT to a port open to forwarded requests only is one, as the proxy serves it.
    let (code, said, _) = check("origin.test:80").await;
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.starts_with("allow\n  origin.test:80 is allowed"),
        "{said}"
    );
    let (code, said, _) = check("https://denied.test:8443/").await;
    assert_eq!(code, Some(1));
    assert!(said.starts_with("refuse host-denied 403\n"), "{said}");
    // Nothing was written: the lease is still open, though a denied host revokes a request.
    let (code, said, _) = check("origin.test:8443").await;
    assert_eq!(code, Some(0), "{said}");
}
