//! `serve --secrets`: a bad file stops the start with its problems; a good one starts, and no
//! value or canary reaches any output (stderr, stdout, the egress log, the journal, /metrics,
//! /status).

use crate::support::harness::{curl, http_origin};
use crate::support::{leasegate_command, leasegate_ok, succeeded};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;

const ENV_VALUE: &str = "ghp_envvalue0123456789abcdef";
const FILE_VALUE: &str = "search-filevalue-0123456789";
const CANARY: &str = "AKIACANARYDECOY000001";

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A secrets file with an env secret (GITHUB_PAT), a file secret and a canary.
fn secrets_file(dir: &Path) -> std::path::PathBuf {
    let value_file = dir.join("search.key");
    std::fs::write(&value_file, format!("{FILE_VALUE}\n")).unwrap();
    let path = dir.join("secrets.toml");
    std::fs::write(
        &path,
        format!(
            r#"# Decoys: never sent by anyone honest.
canaries = ["{CANARY}"]

[[secret]]
id = "github"
hosts = ["origin.test"]
header = "Authorization"
format = "Bearer {{value}}"
env = "GITHUB_PAT"
routes = [{{ method = "GET", path = "/**" }}]
agents = ["coder"]
env_name = "GITHUB_TOKEN"

[[secret]]
id = "search"
hosts = ["origin.test"]
query = "key"
file = "{}"
agents = ["coder"]
env_name = "SEARCH_KEY"
"#,
            value_file.display()
        ),
    )
    .unwrap();
    path
}

/// The child's output once it exits; a child still running after 30 s (a start that should
/// have stopped) is killed and fails the test.
fn exited(mut child: std::process::Child) -> std::process::Output {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve started with a bad secrets file");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn serve_with_a_bad_secrets_file_stops_with_its_problems() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    succeeded(
        &leasegate_command(&["keygen", "--out", s(&key)])
            .output()
            .unwrap(),
    );
    let journal = dir.path().join("journal.jsonl");
    let secrets = secrets_file(dir.path());
    let serve = |secrets: &Path| {
        leasegate_command(&[
            "serve",
            "--admin",
            "off",
            "--listen",
            "127.0.0.1:0",
            "--journal",
            s(&journal),
            "--key-file",
            s(&key),
            "--secrets",
            s(secrets),
        ])
        .env_remove("GITHUB_PAT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
    };
    // The variable the file names is not set.
    let out = exited(serve(&secrets));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "leasegate: the secrets file {} is not valid:\n  secret \"github\", field env: the \
             environment variable GITHUB_PAT is not set (or is not UTF-8) in the proxy's \
             environment\n",
            secrets.display()
        )
    );
    // A problem of the file itself.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[secret]]\nid = \"github\"\nhosts = [\"*\"]\nheader = \"Authorization\"\nenv = \"X\"\nagents = [\"coder\"]\nenv_name = \"GITHUB_TOKEN\"\n",
    )
    .unwrap();
    let out = exited(serve(&bad));
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "secret \"github\", field hosts: '*' would send the secret to every host: list the \
             hosts it is for"
        ),
        "{stderr}"
    );
    // No journal, no egress log: nothing started.
    assert!(!journal.exists() || std::fs::read_to_string(&journal).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_secrets_starts_and_no_output_holds_a_value() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");
    let egress = dir.path().join("egress.jsonl");
    let stderr_file = dir.path().join("stderr.log");
    leasegate_ok(&["keygen", "--out", s(&key)]).await;
    let issue = |host: &'static str| {
        let (journal, key) = (journal.clone(), key.clone());
        async move {
            leasegate_ok(&[
                "issue",
                "--journal",
                s(&journal),
                "--key-file",
                s(&key),
                "--allow-host",
                host,
                "--name",
                "coder",
                "--print",
                "id",
            ])
            .await
            .trim()
            .to_owned()
        }
    };
    let lease = issue("origin.test").await;
    let secrets = secrets_file(dir.path());
    let origin = http_origin().await;

    let mut child = tokio::process::Command::from(leasegate_command(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--egress-log",
        s(&egress),
        "--secrets",
        s(&secrets),
        "--resolve",
        "origin.test=127.0.0.1",
        "--allow-private",
        "127.0.0.1/32",
    ]))
    .env("GITHUB_PAT", ENV_VALUE)
    .env("RUST_LOG", "info")
    .stdout(Stdio::piped())
    .stderr(std::fs::File::create(&stderr_file).unwrap())
    .kill_on_drop(true)
    .spawn()
    .unwrap();
    let stdout = child.stdout.take().unwrap().into_owned_fd().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        let mut lines = BufReader::new(std::fs::File::from(stdout)).lines();
        lines.next().and_then(Result::ok).unwrap_or_default()
    })
    .await
    .unwrap();
    let proxy = first
        .rsplit(' ')
        .next()
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .unwrap_or_else(|| {
            panic!(
                "no address: {first:?}\n{}",
                std::fs::read_to_string(&stderr_file).unwrap_or_default()
            )
        });
    let log = std::fs::read_to_string(&stderr_file).unwrap();
    let admin = log
        .lines()
        .find_map(|l| {
            Some(
                l.split_once("admin_addr=")?
                    .1
                    .split_whitespace()
                    .next()?
                    .to_owned(),
            )
        })
        .unwrap_or_else(|| panic!("no admin address in the log:\n{log}"));
    assert!(
        log.contains("secrets loaded") && log.contains("secrets=2") && log.contains("canaries=1"),
        "{log}"
    );

    // Traffic: one allowed request and one refused (which revokes: a journal record).
    let url = format!("http://origin.test:{}/hello", origin.addr.port());
    let via = format!("http://agent:{lease}@{proxy}");
    let ok = curl(&["-x", &via, &url], &[]).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    let refused = curl(&["-x", &via, "http://elsewhere.test/"], &[]).await;
    assert_eq!(refused.status, 403, "{refused:?}");
    let metrics = curl(&[&format!("http://{admin}/metrics")], &[]).await;
    assert_eq!(metrics.status, 200);
    let status = curl(&[&format!("http://{admin}/status")], &[]).await;
    assert_eq!(status.status, 200, "{status:?}");

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().await.unwrap().success());

    let journal_text = std::fs::read_to_string(&journal).unwrap();
    assert!(journal_text.contains("\"revoked\""), "{journal_text}");
    let egress_text = std::fs::read_to_string(&egress).unwrap();
    assert_eq!(egress_text.lines().count(), 2, "{egress_text}");
    let outputs = [
        ("stdout", first),
        ("stderr", std::fs::read_to_string(&stderr_file).unwrap()),
        ("egress log", egress_text),
        ("journal", journal_text),
        ("/metrics", metrics.body_text()),
        ("/status", status.body_text()),
    ];
    for (name, text) in &outputs {
        assert!(!text.is_empty(), "{name} is empty");
        for secret in [ENV_VALUE, FILE_VALUE, CANARY] {
            assert!(!text.contains(secret), "{name} holds {secret}:\n{text}");
        }
    }
}
