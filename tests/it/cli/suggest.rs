//! `leasegate suggest`: a report-mode recording becomes an allow list, and a lease issued from
//! it allows every recorded call and refuses the rest.

use crate::support::harness::{curl, http_origin, proxy_url, Harness};
use crate::support::leasegate;
use crate::support::{leasegate_ok, succeeded};
use leasegate::proxy::Mode;

/// Names the recorded session reaches, all served by one loopback origin.
const NAMES: &[(&str, &str)] = &[
    ("a.example.test", "127.0.0.1"),
    ("b.example.test", "127.0.0.1"),
    ("example.test", "127.0.0.1"),
    ("c.example.test", "127.0.0.1"),
];

/// Runs `leasegate suggest ARGS`; its stdout, asserting success.
async fn suggest(args: &[&str]) -> String {
    let mut argv = vec!["suggest"];
    argv.extend_from_slice(args);
    leasegate_ok(&argv).await
}

/// The `--allow-host` values of the flags line (the one line that is not a comment).
fn allow_hosts(flags: &str) -> Vec<String> {
    let line = flags
        .lines()
        .find(|l| !l.starts_with('#') && !l.is_empty())
        .unwrap_or_else(|| panic!("no flags line in {flags}"));
    line.split_whitespace()
        .filter(|w| *w != "--allow-host")
        .map(|w| w.trim_matches('\'').to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_issued_from_a_report_mode_recording_allows_what_was_recorded() {
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    // Record: a narrow lease, report mode, so calls beyond it pass and are logged.
    let recorded = h.lease(&["a.example.test"], &[]);
    let mut config = h.config(NAMES);
    config.mode = Mode::Report;
    let server = h.start(config).await;
    let proxy = proxy_url(&server, &recorded);
    let calls = [
        format!("http://a.example.test:{port}/one"),
        format!("http://a.example.test:{port}/two"),
        format!("http://b.example.test:{port}/"),
        format!("http://example.test:{port}/"),
        format!("http://127.0.0.1:{port}/"),
    ];
    for url in &calls {
        let out = curl(&["-x", &proxy, url], &[]).await;
        assert_eq!(out.status, 200, "{url}: {}", out.stderr);
    }
    // Neither reaches a host: no lease, and a name that does not resolve.
    let out = curl(
        &["-x", &server.addr.to_string(), "http://c.example.test/"],
        &[],
    )
    .await;
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("lease-missing")
    );
    let out = curl(&["-x", &proxy, "http://nowhere.test/"], &[]).await;
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("dns-failed")
    );
    let lines = h.egress_lines(7).await;
    assert_eq!(lines.iter().filter(|l| l["verdict"] == "report").count(), 3);
    server.shutdown().await;

    let egress = h.egress.to_str().unwrap();
    let flags = suggest(&["--from", egress]).await;
    assert_eq!(
        flags,
        format!(
            "# lease {recorded}: 5 call(s), 4 entries\n\
             # 2  a.example.test\n\
             # 1  127.0.0.1\n\
             # 1  b.example.test\n\
             # 1  example.test\n\
             --allow-host a.example.test --allow-host 127.0.0.1 --allow-host b.example.test --allow-host example.test\n"
        )
    );
    assert_eq!(
        suggest(&["--from", egress, "--lease", &recorded]).await,
        flags
    );
    assert_eq!(
        suggest(&[
            "--from",
            egress,
            "--lease",
            "00000000-0000-4000-8000-000000000000"
        ])
        .await,
        ""
    );
    assert_eq!(
        suggest(&["--from", egress, "--label", "agent"]).await,
        flags.replace(
            &format!("lease {recorded}: 5 call(s), 4 entries\n"),
            &format!("label agent: 5 call(s), 4 entries\n# leases: {recorded}\n")
        )
    );

    // Issue a lease from the suggestion and enforce it.
    let mut issue = vec![
        "issue",
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
    ];
    let hosts = allow_hosts(&flags);
    for host in &hosts {
        issue.extend(["--allow-host", host.as_str()]);
    }
    let issued = leasegate_ok(&issue).await;
    let suggested = issued.lines().next().unwrap().to_owned();
    let server = h.start(h.config(NAMES)).await;
    let proxy = proxy_url(&server, &suggested);
    for url in &calls {
        let out = curl(&["-x", &proxy, url], &[]).await;
        assert_eq!(out.status, 200, "{url}: {}", out.stderr);
        assert_eq!(out.header("x-leasegate-refusal"), None);
    }
    let out = curl(
        &["-x", &proxy, &format!("http://c.example.test:{port}/")],
        &[],
    )
    .await;
    assert_eq!(out.status, 403);
    assert_eq!(
        out.header("x-leasegate-refusal").as_deref(),
        Some("host-not-allowed")
    );
    server.shutdown().await;

    // The same recording (the enforced lease's calls are in the log now too: `--lease`
    // selects), collapsed: two siblings under example.test make `*.example.test`, which does
    // not match example.test itself, so that stays listed.
    assert_eq!(
        suggest(&["--from", egress, "--lease", &recorded, "--collapse", "2"]).await,
        format!(
            "# lease {recorded}: 5 call(s), 3 entries\n\
             # 3  *.example.test  (a.example.test, b.example.test)\n\
             # 1  127.0.0.1\n\
             # 1  example.test\n\
             --allow-host '*.example.test' --allow-host 127.0.0.1 --allow-host example.test\n"
        )
    );
    let json = suggest(&[
        "--from",
        egress,
        "--lease",
        &recorded,
        "--collapse",
        "2",
        "--format",
        "json",
    ])
    .await;
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        json["allow"],
        serde_json::json!({"hosts": ["*.example.test", "127.0.0.1", "example.test"]})
    );
}

/// An egress line that reached `host` under `lease`.
fn reached(lease: &str, host: &str) -> String {
    reached_labelled(lease, "agent", host)
}

/// An egress line that reached `host` under `lease`, its client sending `label`.
fn reached_labelled(lease: &str, label: &str, host: &str) -> String {
    serde_json::json!({
        "time": "2026-01-01T10:00:00.000Z", "lease_id": lease, "label": label,
        "client": "127.0.0.1:5000", "listener": "127.0.0.1:3128", "kind": "connect",
        "method": "CONNECT", "host": host, "port": 443, "dialed": "192.0.2.1:443",
        "verdict": "report", "code": "host-not-allowed", "status": 200,
        "bytes_up": 10, "bytes_down": 10, "duration_ms": 1.0,
    })
    .to_string()
}

#[tokio::test]
async fn collapse_never_widens_to_a_public_suffix() {
    let lease = "00000001-0000-4000-8000-000000000000";
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("egress.jsonl");
    let hosts = [
        "a.co.uk",
        "b.co.uk",
        "www.shop.co.uk",
        "api.shop.co.uk",
        "one.github.io",
        "two.github.io",
    ];
    let text: Vec<String> = hosts.iter().map(|h| reached(lease, h)).collect();
    std::fs::write(&log, text.join("\n")).unwrap();
    let out = suggest(&["--from", log.to_str().unwrap(), "--collapse", "2"]).await;
    assert_eq!(
        out,
        format!(
            "# lease {lease}: 6 call(s), 5 entries\n\
             # 2  *.shop.co.uk  (api.shop.co.uk, www.shop.co.uk)\n\
             # 1  a.co.uk\n\
             # 1  b.co.uk\n\
             # 1  one.github.io\n\
             # 1  two.github.io\n\
             --allow-host '*.shop.co.uk' --allow-host a.co.uk --allow-host b.co.uk --allow-host one.github.io --allow-host two.github.io\n"
        )
    );
    // stdin, and a collapse below 2 is refused.
    let mut child = tokio::process::Command::from(crate::support::leasegate_command(&[
        "suggest", "--from", "-",
    ]))
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    use tokio::io::AsyncWriteExt;
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(text.join("\n").as_bytes()).await.unwrap();
    drop(stdin);
    let piped = child.wait_with_output().await.unwrap();
    assert_eq!(
        String::from_utf8(piped.stdout).unwrap(),
        format!(
            "# lease {lease}: 6 call(s), 6 entries\n\
             # 1  a.co.uk\n\
             # 1  api.shop.co.uk\n\
             # 1  b.co.uk\n\
             # 1  one.github.io\n\
             # 1  two.github.io\n\
             # 1  www.shop.co.uk\n\
             --allow-host a.co.uk --allow-host api.shop.co.uk --allow-host b.co.uk --allow-host one.github.io --allow-host two.github.io --allow-host www.shop.co.uk\n"
        )
    );
    let out = leasegate(&["suggest", "--from", "-", "--collapse", "1"]).await;
    assert!(!out.status.success());
}

/// Issues a lease for `agent` (its manifest's `agent.name`) into the harness journal; its id.
async fn issue_for(h: &Harness, agent: &str) -> String {
    crate::live::follow::issue_cli(h, "*", &["--name", agent]).await
}

/// `--agent` is the agent a lease's signed manifest names, not the label its client sends: a
/// lease of "evil" sending the label "victim-agent" does not steer the victim's list. The
/// label still groups, naming every lease it came from and warning that it spans two agents.
#[tokio::test]
async fn agent_is_the_manifests_and_a_label_names_its_leases() {
    let h = Harness::new();
    let victim = issue_for(&h, "victim-agent").await;
    let evil = issue_for(&h, "evil").await;
    let log = h.dir.path().join("recorded.jsonl");
    let lines = [
        reached_labelled(&victim, "victim-agent", "api.victim.test"),
        reached_labelled(&evil, "victim-agent", "exfil.evil.test"),
        reached_labelled(&evil, "evil", "more.evil.test"),
    ];
    std::fs::write(&log, lines.join("\n")).unwrap();
    let log = log.to_str().unwrap();
    let journal = [
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
    ];

    let mut args = vec!["--from", log, "--agent", "victim-agent"];
    args.extend(journal);
    assert_eq!(
        suggest(&args).await,
        format!(
            "# agent victim-agent: 1 call(s), 1 entry\n\
             # leases: {victim}\n\
             # 1  api.victim.test\n\
             --allow-host api.victim.test\n"
        )
    );
    let mut args = vec!["--from", log, "--agent", "evil"];
    args.extend(journal);
    let evils = suggest(&args).await;
    assert!(
        evils.contains("exfil.evil.test") && evils.contains("more.evil.test"),
        "{evils}"
    );
    // Without the journal there is no manifest to read: a usage error that says so.
    let out = leasegate(&["suggest", "--from", log, "--agent", "victim-agent"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--journal"));

    // The label: both leases contributed, and they are two manifest agents.
    let (first, second) = match victim < evil {
        true => (&victim, &evil),
        false => (&evil, &victim),
    };
    let mut args = vec!["--from", log, "--label", "victim-agent"];
    args.extend(journal);
    let mut argv = vec!["suggest"];
    argv.extend(&args);
    let out = leasegate(&argv).await;
    let stdout = succeeded(&out);
    assert!(
        stdout.starts_with(&format!(
            "# label victim-agent: 2 call(s), 2 entries\n# leases: {first}, {second}\n# warning: "
        )),
        "{stdout}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warning = format!(
        "label \"victim-agent\" spans leases of different manifest agents (agent \"evil\": {evil}; agent \"victim-agent\": {victim})"
    );
    assert!(stderr.contains(&warning), "{stderr}");
    args.extend(["--format", "json"]);
    let json: serde_json::Value = serde_json::from_str(&suggest(&args).await).unwrap();
    assert_eq!(json["label"], "victim-agent");
    assert_eq!(json["leases"], serde_json::json!([first, second]));
    assert!(
        json["warning"].as_str().unwrap().starts_with(&warning),
        "{json}"
    );
    // Without the journal the leases are named, and nothing can be said of their agents.
    let bare = suggest(&["--from", log, "--label", "victim-agent"]).await;
    assert!(
        bare.contains(&format!("# leases: {first}, {second}\n")),
        "{bare}"
    );
    assert!(!bare.contains("warning"), "{bare}");
}
