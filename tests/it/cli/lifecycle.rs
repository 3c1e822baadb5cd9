//! The CLI end to end: keygen → issue → verify → leases → revoke → leases, and failures.

use crate::support::succeeded;
use crate::support::{data, leasegate_command};
use std::path::Path;
use std::process::{Command, Output};

use crate::support::leasegate_sync as run;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn issue_verify_leases_revoke_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");

    let out = run(&["keygen", "--out", s(&key)]);
    let fingerprint = succeeded(&out).trim().to_owned();
    assert!(
        fingerprint.starts_with("sha256:") && fingerprint.len() == 23,
        "{fingerprint}"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(
        !run(&["keygen", "--out", s(&key)]).status.success(),
        "never overwrites a key"
    );

    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "*.example.com",
        "--allow-host",
        "api.other.org",
        "--deny-host",
        "bad.example.com",
        "--name",
        "root-agent",
    ]);
    let parent = succeeded(&out).lines().next().unwrap().to_owned();
    assert_eq!(parent.len(), 36);

    // A child must stay inside its parent's hosts: one that names none of them is refused.
    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "example.com",
        "--parent",
        &parent,
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("refused (R2)") && stderr.contains("within parent lease"),
        "{stderr}"
    );
    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "*.sub.example.com",
        "--parent",
        &parent,
        "--ttl",
        "10m",
    ]);
    let child = succeeded(&out).lines().next().unwrap().to_owned();

    let out = run(&["verify", "--key-file", s(&key), s(&journal)]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        stdout(&out),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["verify", s(&journal)]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("signatures not checked"));

    let out = run(&["leases", "--journal", s(&journal), "--key-file", s(&key)]);
    let table = stdout(&out);
    let row = table.lines().find(|l| l.starts_with(&parent)).unwrap();
    assert!(
        row.contains(" open ") && row.contains("root-agent") && row.contains("bad.example.com"),
        "{table}"
    );

    let out = run(&[
        "revoke",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--lease",
        &parent,
        "--reason",
        "done here",
    ]);
    succeeded(&out);
    let out = run(&[
        "leases",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--json",
    ]);
    let rows: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let status = |id: &str| rows.iter().find(|r| r["lease_id"] == id).unwrap()["status"].clone();
    assert_eq!(status(&parent), "revoked");
    assert_eq!(status(&child), "ancestor-closed");

    let last = std::fs::read_to_string(&journal)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_owned();
    let record: serde_json::Value = serde_json::from_str(&last).unwrap();
    assert_eq!(record["event"], "revoked");
    assert_eq!(record["by"], "issuer");
    assert_eq!(record["reason"], "done here");
    assert_eq!(record["key_fingerprint"], fingerprint.as_str());
    assert_eq!(record["signature"].as_str().unwrap().len(), 64);
}

#[test]
fn a_tampered_lease_fails_verify() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");
    succeeded(&run(&["keygen", "--out", s(&key)]));
    succeeded(&run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "api.example.com",
    ]));
    let line = std::fs::read_to_string(&journal).unwrap();
    let record: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    let lease_file = dir.path().join("lease.json");
    std::fs::write(&lease_file, record["lease"].to_string()).unwrap();
    assert_eq!(
        run(&["verify", "--key-file", s(&key), s(&lease_file)])
            .status
            .code(),
        Some(0)
    );

    let tampered = line.replace("api.example.com", "evil.example.com");
    std::fs::write(&journal, &tampered).unwrap();
    let out = run(&["verify", "--key-file", s(&key), s(&journal)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("line 1: granted lease not loaded: signature does not verify"),
        "{}",
        stdout(&out)
    );

    let mut lease = record["lease"].clone();
    lease["manifest"]["allow"]["hosts"][0] = "evil.example.com".into();
    std::fs::write(&lease_file, lease.to_string()).unwrap();
    let out = run(&["verify", "--key-file", s(&key), s(&lease_file)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("signature does not verify"));
}

#[test]
fn verify_reads_fixtures_with_an_injected_clock_and_reports_paths() {
    let key = data("contract/vectors/test-key.txt");
    let lease = data("contract/fixtures/valid/agent-lease.populated.json");
    let at = |now: &str| {
        run(&[
            "verify",
            "--key-file",
            s(&key),
            "--allow-test-key",
            "--now",
            now,
            s(&lease),
        ])
        .status
        .code()
    };
    assert_eq!(at("2026-09-15T10:05:00.000Z"), Some(0));
    assert_eq!(
        at("2026-09-15T10:15:00.000Z"),
        Some(1),
        "expired at its expires_at"
    );
    let out = run(&[
        "verify",
        "--key-file",
        s(&key),
        "--now",
        "2026-09-15T10:05:00.000Z",
        s(&lease),
    ]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "the test key is refused without --allow-test-key"
    );

    let bad = data("contract/fixtures/invalid/agent-lease.bad-signature-shape.json");
    let out = run(&["verify", s(&bad)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains(": /signature: "), "{}", stdout(&out));
    assert_eq!(run(&["verify", "/nonexistent/file"]).status.code(), Some(2));
}

#[test]
fn flags_read_environment_variables() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");
    succeeded(&run(&["keygen", "--out", s(&key)]));
    let out = leasegate_command(&["issue"])
        .env("LEASEGATE_JOURNAL", &journal)
        .env("LEASEGATE_KEY_FILE", &key)
        .env("LEASEGATE_ALLOW_HOST", "a.example.com,b.example.com")
        .env("LEASEGATE_NAME", "from-env")
        .output()
        .unwrap();
    succeeded(&out);
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(
        text.contains(r#""hosts":["a.example.com","b.example.com"]"#) && text.contains("from-env")
    );
}

#[test]
fn check_explains_the_verdict_and_the_deciding_pattern() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    let journal = dir.path().join("journal.jsonl");
    succeeded(&run(&["keygen", "--out", s(&key)]));
    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "*.example.com",
        "--deny-host",
        "bad.example.com",
    ]);
    let parent = stdout(&out).lines().next().unwrap().to_owned();
    let out = run(&[
        "issue",
        "--journal",
        s(&journal),
        "--key-file",
        s(&key),
        "--allow-host",
        "*.example.com",
        "--parent",
        &parent,
    ]);
    let child = stdout(&out).lines().next().unwrap().to_owned();
    let check = |target: &str| {
        run(&[
            "check",
            "--journal",
            s(&journal),
            "--key-file",
            s(&key),
            "--lease",
            &child,
            target,
        ])
    };

    let out = check("api.example.com:443");
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).starts_with("allow\n"), "{}", stdout(&out));
    assert!(
        stdout(&out).contains(&format!("by *.example.com in lease {child}")),
        "{}",
        stdout(&out)
    );

    let out = check("bad.example.com");
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).starts_with("refuse host-denied 403"),
        "{}",
        stdout(&out)
    );
    assert!(
        // The child carries its parent's denials (deny lists are united at issue).
        stdout(&out).contains(&format!("denied by bad.example.com in lease {child}")),
        "{}",
        stdout(&out)
    );

    let out = check("example.com");
    assert!(
        stdout(&out).starts_with("refuse host-not-allowed 403"),
        "{}",
        stdout(&out)
    );
    let out = check("a@b.example.com");
    assert!(
        stdout(&out).starts_with("refuse bad-target 400"),
        "{}",
        stdout(&out)
    );
}

#[test]
fn serve_dev_prints_a_working_export_line() {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    // An origin for the demo lease to reach, via --resolve and --allow-private.
    let origin_port = super::messages_operator::local_origin();
    let mut child = leasegate_command(&[])
        .current_dir(dir.path())
        .args([
            "serve",
            "--dev",
            "--admin",
            "off",
            "--listen",
            "127.0.0.1:0",
            "--allow-host",
            "origin.test",
            "--resolve",
            "origin.test=127.0.0.1",
            "--allow-private",
            "127.0.0.1/32",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let _banner = lines.next().unwrap().unwrap();
    let export = lines.next().unwrap().unwrap();
    let url = export
        .strip_prefix("export HTTP_PROXY=")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("{export}"))
        .to_owned();
    let out = Command::new("curl")
        .args([
            "-sS",
            "-x",
            &url,
            &format!("http://origin.test:{origin_port}/"),
        ])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "dev",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dir.path().join(".leasegate/dev.key").exists());
    let journal = std::fs::read_to_string(dir.path().join(".leasegate/journal.jsonl")).unwrap();
    assert!(journal.contains("\"event\":\"granted\""));
}

#[test]
fn completions_name_every_subcommand_and_an_unknown_shell_is_a_usage_error() {
    let out = run(&["completions", "bash"]);
    assert!(out.status.success(), "{out:?}");
    let script = stdout(&out);
    assert!(script.contains("complete -F _leasegate"), "{script}");
    // The words offered after `leasegate`: its flags, then its subcommands.
    let top = script
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("opts=\"-h -V --log-format"))
        .expect("the top-level word list");
    let words: Vec<&str> = top
        .trim_start_matches("opts=\"")
        .trim_end_matches('"')
        .split(' ')
        .collect();
    for command in [
        "keygen",
        "issue",
        "revoke",
        "verify",
        "leases",
        "serve",
        "check",
        "run",
        "token",
        "health",
        "usage",
        "suggest",
        "journal",
        "completions",
    ] {
        assert!(words.contains(&command), "{command} missing from {top}");
    }
    assert!(script.contains("--allow-host"), "flags are completed too");
    for shell in ["zsh", "fish"] {
        let out = run(&["completions", shell]);
        assert!(out.status.success() && !out.stdout.is_empty(), "{shell}");
    }
    let out = run(&["completions", "tcsh"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'tcsh'"));
}
