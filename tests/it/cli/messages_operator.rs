//! What an operator sees on a first try: the `--dev` banner's dashboard and local-test flags,
//! a guarded address's refusal with the way past it, and the errors of mistyped flags (a range
//! as a host pattern, a wildcard over a public suffix, a duration, a lease id, a filter that
//! matched nothing), each asserted as printed.

use super::messages::{issue_sync, key_and_journal, stderr_text};
use crate::support::{leasegate_command, succeeded};
use std::io::BufRead;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// A local origin on 127.0.0.1 answering `dev` to every request; its port.
pub(super) fn local_origin() -> u16 {
    let origin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = origin.local_addr().unwrap().port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for mut stream in origin.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = stream.read(&mut buf);
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\ndev");
        }
    });
    port
}

/// `serve --dev` on any port, in `dir`, with `extra` flags.
fn serve_dev(dir: &std::path::Path, extra: &[&str]) -> Command {
    let mut command = leasegate_command(&["serve", "--dev", "--listen", "127.0.0.1:0"]);
    command.args(extra).current_dir(dir);
    command
}

/// Kills the child when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `command`'s output, once it exits; fails the test if it still runs after a generous bound
/// (a `serve` that should have refused to start).
fn exited(mut command: Command) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// The first `n` lines of a child's stdout; fails the test, rather than hanging, if they do
/// not come within a generous bound.
fn first_lines(stdout: std::process::ChildStdout, n: usize) -> Vec<String> {
    let (send, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if send.send(line).is_err() {
                break;
            }
        }
    });
    let mut got = Vec::new();
    while got.len() < n {
        match lines.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => got.push(line),
            Err(_) => panic!("{n} lines expected within 30 s, got {got:?}"),
        }
    }
    got
}

/// `serve --dev` in `dir` with `--admin 127.0.0.1:0`, `--forward-ports 80,<port>` and `extra`,
/// the port lists otherwise as a newcomer has them: the running server, the banner's first
/// `n` lines and the demo lease's id.
fn dev_banner(
    dir: &std::path::Path,
    port: u16,
    extra: &[&str],
    n: usize,
) -> (Running, Vec<String>, String) {
    let forward = format!("80,{port}");
    let mut flags = vec!["--admin", "127.0.0.1:0", "--forward-ports", &forward];
    flags.extend(extra);
    let mut command = serve_dev(dir, &flags);
    command
        .env_remove("LEASEGATE_CONNECT_PORTS")
        .env_remove("LEASEGATE_FORWARD_PORTS")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let serve = Running(child);
    let lines = first_lines(stdout, n);
    let lease = lines[0]
        .split_once("with demo lease ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{lines:?}"))
        .to_owned();
    (serve, lines, lease)
}

/// curl through `proxy` to `url`: the status code, then the body (its newline kept).
fn curl_through(proxy: &str, url: &str) -> (String, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "",
            "-x",
            proxy,
            "-w",
            "\n%{http_code}",
            url,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or_default();
    (code.to_owned(), body.to_owned())
}

#[test]
fn serve_dev_names_the_dashboard_and_the_way_past_the_address_guard() {
    let dir = tempfile::tempdir().unwrap();
    let port = local_origin();
    let resolve = ["--resolve", "origin.test=127.0.0.1"];
    let (_serve, lines, lease) = dev_banner(dir.path(), port, &resolve, 4);
    let dashboard = lines[2]
        .strip_prefix("dashboard http://127.0.0.1:")
        .and_then(|rest| rest.strip_suffix('/'))
        .unwrap_or_else(|| panic!("{lines:?}"));
    assert!(dashboard.parse::<u16>().is_ok(), "{lines:?}");
    assert_eq!(
        lines[3],
        format!(
            "a server on this host needs --allow-private 127.0.0.0/8 (loopback is guarded), \
             --resolve NAME=127.0.0.1 to be reached by a test name, and its port in \
             --forward-ports (now 80,{port}) or --connect-ports (now 443)"
        )
    );
    // The URL the banner prints is the dashboard.
    let page = Command::new("curl")
        .args([
            "-sS",
            "--noproxy",
            "*",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(&lines[2]["dashboard ".len()..])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&page.stdout), "200");

    let proxy = lines[1]
        .split_whitespace()
        .find_map(|pair| pair.strip_prefix("http_proxy="))
        .unwrap()
        .to_owned();
    // A literal is not said to resolve; the flag that allows it is named.
    assert_eq!(
        curl_through(&proxy, &format!("http://127.0.0.1:{port}/")),
        (
            "403".to_owned(),
            format!(
                "leasegate refused GET 127.0.0.1:{port} for lease {lease}: address-not-allowed \
                 (127.0.0.1 is a guarded address (Loopback): --allow-private 127.0.0.1/32 \
                 allows it)\n"
            )
        )
    );
    // A test name resolves; --resolve is named too.
    assert_eq!(
        curl_through(&proxy, &format!("http://origin.test:{port}/")),
        (
            "403".to_owned(),
            format!(
                "leasegate refused GET origin.test:{port} for lease {lease}: \
                 address-not-allowed (origin.test resolves to 127.0.0.1, a guarded address \
                 (Loopback): --allow-private 127.0.0.1/32 allows it, or --resolve \
                 origin.test=ADDR gives the test name another address)\n"
            )
        )
    );
}

#[test]
fn the_banner_leaves_out_the_local_test_line_once_loopback_is_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = serve_dev(
        dir.path(),
        &["--admin", "off", "--allow-private", "127.0.0.0/8"],
    );
    command.stdout(Stdio::piped()).stderr(Stdio::null());
    let mut child = command.spawn().unwrap();
    let stdout = child.stdout.take().unwrap();
    let serve = Running(child);
    let mut lines = std::io::BufReader::new(stdout).lines();
    let banner = lines.next().unwrap().unwrap();
    assert!(banner.starts_with("leasegate (dev) on "), "{banner}");
    assert!(lines.next().unwrap().unwrap().starts_with("export "));
    // Nothing more: no admin API, and loopback is open.
    drop(serve);
    assert_eq!(lines.next().map(Result::unwrap), None);
}

#[test]
fn issue_refuses_a_range_and_a_wildcard_over_a_public_suffix_in_words() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    let issue = |hosts: &str, extra: &[&str]| {
        let mut args = vec![
            "issue",
            "--journal",
            &journal,
            "--key-file",
            &key,
            "--allow-host",
            hosts,
        ];
        args.extend(extra);
        exited(leasegate_command(&args))
    };
    let range = issue("10.0.0.0/8", &[]);
    assert_eq!(range.status.code(), Some(1));
    assert_eq!(
        stderr_text(&range),
        "leasegate: allow host '10.0.0.0/8': no range: a pattern is one host, not a CIDR \
         range: list the addresses or host names (a private range is opened to leases by \
         serve --allow-private 10.0.0.0/8)\n"
    );

    let refused = issue("api.example.com,*.COM", &[]);
    assert_eq!(refused.status.code(), Some(1));
    assert_eq!(
        stderr_text(&refused),
        "leasegate: allow host '*.COM' is a wildcard over the public suffix 'com': it reaches \
         every name anyone may register there. List the domains (e.g. '*.example.com'), or \
         pass --force to accept it\n"
    );
    assert!(!std::path::Path::new(&journal).exists(), "nothing issued");

    let forced = issue("api.example.com,*.COM", &["--force"]);
    let lease = succeeded(&forced);
    assert_eq!(
        stderr_text(&forced),
        "leasegate issue: warning: allow host '*.COM' is a wildcard over the public suffix \
         'com' (every name anyone may register there); accepted because of --force\n"
    );
    let journal_text = std::fs::read_to_string(&journal).unwrap();
    assert_eq!(journal_text.lines().count(), 1);
    assert!(journal_text.contains(lease.lines().next().unwrap()));
    assert!(journal_text.contains("\"*.com\""), "{journal_text}");

    // A test domain is no public suffix.
    issue_sync(&journal, &key, &["*.test"]);

    // `serve --dev` makes a lease from flags too.
    let dev = tempfile::tempdir().unwrap();
    let out = exited(serve_dev(
        dev.path(),
        &["--admin", "off", "--allow-host", "*.co.uk"],
    ));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_text(&out),
        "leasegate: allow host '*.co.uk' is a wildcard over the public suffix 'co.uk': it \
         reaches every name anyone may register there. List the domains (e.g. \
         '*.example.co.uk'), or pass --force to accept it\n"
    );
    let dev_journal = dev.path().join(".leasegate/journal.jsonl");
    assert!(!std::fs::read_to_string(dev_journal)
        .unwrap_or_default()
        .contains("\"granted\""));
}

#[test]
fn every_duration_flag_names_the_format() {
    for (args, said) in [
        (
            vec!["issue", "--ttl", "forever"],
            "error: invalid value 'forever' for '--ttl <TTL>': not a duration: write a number \
             and a unit, e.g. 90s, 15m, 2h or 7d\n",
        ),
        (
            vec!["usage", "--from", "egress.jsonl", "--since", "3x"],
            "error: invalid value '3x' for '--since <SINCE>': unknown unit \"x\": write a \
             number and a unit, e.g. 90s, 15m, 2h or 7d\n",
        ),
        (
            vec!["serve", "--max-lease-lifetime", "forever"],
            "error: invalid value 'forever' for '--max-lease-lifetime <MAX_LEASE_LIFETIME>': \
             not a duration: write a number and a unit, e.g. 90s, 15m, 2h or 7d, or `off`\n",
        ),
    ] {
        let out = exited(leasegate_command(&args));
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = stderr_text(&out);
        assert!(text.starts_with(said), "{args:?}: {text}");
    }
}

#[test]
fn every_lease_flag_refuses_a_non_lease_id_in_the_same_words() {
    let dir = tempfile::tempdir().unwrap();
    let (key, journal) = key_and_journal(dir.path());
    issue_sync(&journal, &key, &["a.test"]);
    let said = |flag: &str| {
        format!(
            "error: invalid value 'not-a-uuid' for '{flag}': \"not-a-uuid\" is not a lease id \
             (a lower-case UUID)\n"
        )
    };
    let lease = "--lease <LEASE>";
    let k = ["--journal", &journal, "--key-file", &key];
    let with_k = |command: &'static str, rest: &[&'static str]| [&[command][..], &k, rest].concat();
    let bad = "not-a-uuid";
    for (args, flag) in [
        (with_k("check", &["--lease", bad, "a.test"]), lease),
        (vec!["run", "--lease", bad, "--", "true"], lease),
        (vec!["token", "--key-file", &key, "--lease", bad], lease),
        (with_k("revoke", &["--lease", bad, "--reason", "r"]), lease),
        (vec!["usage", "--from", &journal, "--lease", bad], lease),
        (vec!["suggest", "--from", &journal, "--lease", bad], lease),
        (
            with_k("issue", &["--allow-host", "a.test", "--parent", bad]),
            "--parent <PARENT>",
        ),
    ] {
        let out = exited(leasegate_command(&args));
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = stderr_text(&out);
        assert!(text.starts_with(&said(flag)), "{args:?}: {text}");
    }
    // `usage --lease _` still selects the lines without a lease.
    let empty = dir.path().join("egress.jsonl");
    std::fs::write(&empty, "").unwrap();
    let empty = empty.display().to_string();
    let out = exited(leasegate_command(&[
        "usage", "--from", &empty, "--lease", "_",
    ]));
    assert_eq!(out.status.code(), Some(0), "{}", stderr_text(&out));
}

#[test]
fn suggest_says_when_its_filter_matched_no_line() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("egress.jsonl");
    let held = "0f000000-0000-4000-8000-000000000001";
    let line = |lease: Option<&str>, host: &str| {
        serde_json::json!({
            "time": "2026-01-01T10:00:00.000Z", "lease_id": lease, "label": null,
            "client": "127.0.0.1:5000", "listener": "127.0.0.1:3128", "kind": "http",
            "method": "GET", "host": host, "port": 80, "dialed": null, "verdict": "allow",
            "code": null, "status": 200, "bytes_up": 0, "bytes_down": 0, "duration_ms": 1.5,
        })
        .to_string()
    };
    std::fs::write(
        &log,
        format!(
            "{}\n{}\n{}\n",
            line(Some(held), "a.test"),
            line(Some(held), "b.test"),
            line(None, "c.test")
        ),
    )
    .unwrap();
    let log = log.display().to_string();
    let absent = "0f000000-0000-4000-8000-000000000002";
    let out = exited(leasegate_command(&[
        "suggest", "--from", &log, "--lease", absent,
    ]));
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        stderr_text(&out),
        format!(
            "leasegate suggest: no line of {log} matches --lease {absent}; its lines are of \
             {held} (2), no lease (1); nothing to suggest\n"
        )
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "");
}

/// A newcomer's first hour, as the README walks it, with the real binary: `serve --dev` with
/// the flags its banner names for a local server; the banner's `export` line pasted into a
/// shell, so `curl` reaches the origin through the proxy and the admin API around it; the
/// demo lease in `leases`; curl, Python, Node and Java agents under `run` with the lease's
/// token; `suggest` from what they reached; a tightened lease under which a call elsewhere
/// is refused and the agents show why; the running proxy's own verdict from `check
/// --admin`; and `health` given the admin API as a URL.
#[test]
fn the_readme_walk_through_works_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let port = local_origin();
    let flags = [
        "--allow-private",
        "127.0.0.0/8",
        "--resolve",
        "origin.test=127.0.0.1",
        "--resolve",
        "other.test=127.0.0.1",
    ];
    let (_serve, lines, lease) = dev_banner(dir.path(), port, &flags, 3);
    let export = &lines[1];
    assert!(export.starts_with("export HTTP_PROXY="), "{lines:?}");
    let admin = lines[2]
        .strip_prefix("dashboard ")
        .and_then(|url| url.strip_suffix('/'))
        .unwrap_or_else(|| panic!("{lines:?}"))
        .to_owned();
    let origin = format!("http://origin.test:{port}/");

    // The export line, pasted: curl goes through the proxy to the origin, and to the admin
    // API directly (NO_PROXY), which the proxy would have refused.
    let shell = |script: String| {
        let out = Command::new("sh")
            .arg("-c")
            .arg(script)
            .current_dir(dir.path())
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(shell(format!("{export}; curl -sS {origin}")), "dev");
    assert_eq!(
        shell(format!(
            "{export}; curl -sS -o /dev/null -w '%{{http_code}}' {admin}/healthz"
        )),
        "200"
    );

    // The demo lease, open, in the dev journal under the dev key.
    let leases = leasegate_command(&[
        "leases",
        "--journal",
        ".leasegate/journal.jsonl",
        "--key-file",
        ".leasegate/dev.key",
        "--status",
        "open",
    ])
    .current_dir(dir.path())
    .output()
    .unwrap();
    let listed = succeeded(&leases);
    assert!(listed.contains(&lease), "{listed}");

    // Agents under `run`, with the lease's own token: curl, Python, Node and Java, none with
    // proxy settings of its own. The demo lease (`*`) lets `other.test` through too.
    let under_run = |lease: &str, token: &str, agent: &[&str]| {
        std::fs::write(dir.path().join("lease-token"), token).unwrap();
        let mut args = vec!["run", "--lease", lease, "--admin", &admin];
        args.extend(["--lease-token-file", "lease-token", "--"]);
        args.extend(agent);
        let out = leasegate_command(&args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        succeeded(&out)
    };
    let token_of = |lease: &str| {
        let args = [
            "token",
            "--lease",
            lease,
            "--key-file",
            ".leasegate/dev.key",
        ];
        let out = leasegate_command(&args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        succeeded(&out).trim().to_owned()
    };
    let demo_token = token_of(&lease);
    let other = format!("http://other.test:{port}/");
    let python =
        format!("import urllib.request; print(urllib.request.urlopen({origin:?}).read().decode())");
    let node = crate::support::data("clients/node/get_all.cjs");
    let java = crate::support::data("clients/JavaGet.java");
    assert_eq!(
        under_run(&lease, &demo_token, &["curl", "-sS", &origin]),
        "dev"
    );
    assert_eq!(
        under_run(&lease, &demo_token, &["python3", "-c", &python]),
        "dev\n"
    );
    let node_said = under_run(
        &lease,
        &demo_token,
        &["node", node.to_str().unwrap(), &origin],
    );
    assert_eq!(
        node_said,
        format!("fetch {origin} status 200 dev\nget {origin} status 200 dev\n")
    );
    let java_said = under_run(
        &lease,
        &demo_token,
        &["java", java.to_str().unwrap(), &other],
    );
    assert_eq!(java_said, format!("{other} status 200 dev\n"));

    // `suggest` reads what the lease reached from the egress log: the list to tighten it to.
    let suggest = leasegate_command(&[
        "suggest",
        "--from",
        ".leasegate/egress.jsonl",
        "--lease",
        &lease,
    ])
    .current_dir(dir.path())
    .output()
    .unwrap();
    let suggested = succeeded(&suggest);
    let flags: Vec<&str> = suggested
        .lines()
        .filter(|l| l.starts_with("--allow-host"))
        .flat_map(|l| l.split_whitespace())
        .collect();
    assert_eq!(
        flags,
        ["--allow-host", "origin.test", "--allow-host", "other.test"],
        "{suggested}"
    );

    // Tightened: a lease for `origin.test` alone, issued through the admin API; the agent's
    // call elsewhere is refused, and each client shows why.
    let mut issue = vec![
        "issue",
        "--admin",
        &admin,
        "--admin-token-file",
        ".leasegate/admin-token",
    ];
    issue.extend(["--allow-host", "origin.test", "--print", "id"]);
    let issued = leasegate_command(&issue)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let tight = succeeded(&issued).trim().to_owned();
    let tight_token = token_of(&tight);
    let java_said = under_run(
        &tight,
        &tight_token,
        &["java", java.to_str().unwrap(), &origin, &other],
    );
    let lines: Vec<&str> = java_said.lines().collect();
    assert_eq!(lines[0], format!("{origin} status 200 dev"), "{java_said}");
    assert!(
        lines[1].starts_with(&format!("{other} status 403 host-not-allowed leasegate refused GET other.test:{port} for lease {tight}: host-not-allowed")),
        "{java_said}"
    );
    let node_said = under_run(
        &tight,
        &tight_token,
        &["node", node.to_str().unwrap(), &other],
    );
    assert!(
        node_said.starts_with(&format!("fetch {other} error leasegate refused CONNECT other.test:{port} for lease {tight}: host-not-allowed")),
        "{node_said}"
    );

    // The running proxy's own verdict (its --forward-ports), with the dev admin token.
    let check = leasegate_command(&[
        "check",
        "--admin",
        &admin,
        "--admin-token-file",
        ".leasegate/admin-token",
        "--lease",
        &lease,
        &origin,
    ])
    .current_dir(dir.path())
    .output()
    .unwrap();
    let said = succeeded(&check);
    assert!(
        said.starts_with(&format!("allow\n  origin.test:{port} is allowed by *")),
        "{said}"
    );

    // `health` takes the admin API as the URL the other commands take.
    let health = leasegate_command(&["health", "--admin", &admin])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(health.status.code(), Some(0), "{}", stderr_text(&health));
}
