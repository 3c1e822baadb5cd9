//! `serve --secrets --ca-dir` (a CA from `ca init`): a bad file, or a secret the CA does not
//! cover, stops the start with its problems; a good one starts, SIGHUP reloads it whole or
//! keeps the set in use, and no value or canary reaches any output (stderr, the egress log,
//! the journal, /metrics, /status).

use crate::proxy::descriptors::Served;
use crate::support::harness::{curl, eventually, http_origin, Harness};
use crate::support::{leasegate_command, serve_piped, succeeded};
use std::path::Path;
use std::time::Duration;

const ENV_VALUE: &str = "ghp_envvalue0123456789abcdef";
const FILE_VALUE: &str = "search-filevalue-0123456789";
const CANARY: &str = "AKIACANARYDECOY000001";

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A secrets file with an env secret (LG_TEST_GITHUB_PAT), a file secret and a canary.
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
env = "LG_TEST_GITHUB_PAT"
routes = [{{ method = "GET", path = "/**" }}]
agents = ["tester"]
env_name = "GITHUB_TOKEN"

[[secret]]
id = "search"
hosts = ["origin.test"]
query = "key"
file = "{}"
agents = ["tester"]
env_name = "SEARCH_KEY"
"#,
            value_file.display()
        ),
    )
    .unwrap();
    path
}

/// An interception CA for `hosts` (`leasegate ca init`) in `dir/ca`, and the arguments that
/// give `serve` the secrets file `secrets` under it (origins verified against the CA's own
/// certificate: a test never depends on the machine's roots).
fn secrets_args(dir: &Path, hosts: &str, secrets: &Path) -> Vec<String> {
    let ca = dir.join("ca");
    succeeded(
        &leasegate_command(&["ca", "init", "--dir", s(&ca), "--host", hosts])
            .output()
            .unwrap(),
    );
    [
        "--secrets",
        s(secrets),
        "--ca-dir",
        s(&ca),
        "--upstream-ca",
        s(&ca.join("ca.pem")),
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The child's output once it exits; a child still running after 30 s (a start that should
/// have stopped) is killed and fails the test.
fn exited(child: std::process::Child) -> std::process::Output {
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output().unwrap()));
    rx.recv_timeout(std::time::Duration::from_secs(30))
        .unwrap_or_else(|_| {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            panic!("serve started with a bad secrets file")
        })
}

/// A temporary directory with a new signing key (`key`) and where a journal would go.
fn keyed_dir() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    succeeded(
        &leasegate_command(&["keygen", "--out", s(&key)])
            .output()
            .unwrap(),
    );
    let journal = dir.path().join("journal.jsonl");
    (dir, key, journal)
}

#[test]
fn serve_with_a_bad_secrets_file_stops_with_its_problems() {
    let (dir, key, journal) = keyed_dir();
    let secrets = secrets_file(dir.path());
    // The variable the file names is one no environment sets.
    let ca_args = secrets_args(dir.path(), "origin.test", &secrets);
    let serve = |secrets: &Path| {
        let mut args: Vec<&str> = ca_args.iter().map(String::as_str).collect();
        args[1] = s(secrets);
        exited(serve_piped(s(&journal), s(&key), &args))
    };
    let out = serve(&secrets);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!(
            "leasegate: the secrets file {} is not valid:\n  secret \"github\", field env: the \
             environment variable LG_TEST_GITHUB_PAT is not set (or is not UTF-8) in the proxy's \
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
    let out = serve(&bad);
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

/// A secret for a host the CA does not cover stops the start: the CA could not vouch for the
/// tunnels to it.
#[test]
fn serve_with_a_secret_the_ca_does_not_cover_stops() {
    let (dir, key, journal) = keyed_dir();
    let uncovered = dir.path().join("uncovered.toml");
    std::fs::write(
        &uncovered,
        "[[secret]]\nid = \"deploy\"\nhosts = [\"deploy.other.test\"]\nheader = \"X-Key\"\nenv = \"PATH\"\nagents = [\"coder\"]\nenv_name = \"DEPLOY_KEY\"\n",
    )
    .unwrap();
    let args = secrets_args(dir.path(), "origin.test", &uncovered);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = exited(serve_piped(s(&journal), s(&key), &args));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "leasegate: secret \"deploy\" is for deploy.other.test, which the interception CA's \
         name constraints (origin.test) do not cover: make a CA for it with `leasegate ca init \
         --host deploy.other.test`\n"
    );
    assert!(!journal.exists() || std::fs::read_to_string(&journal).unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_secrets_starts_and_no_output_holds_a_value() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let other = h.lease(&["origin.test"], &[]);
    let secrets = secrets_file(h.dir.path());
    let origin = http_origin().await;
    let args = secrets_args(h.dir.path(), "origin.test", &secrets);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let served = Served::start_with_env(
        &h,
        "-n 1024",
        &args,
        &[("LG_TEST_GITHUB_PAT", ENV_VALUE), ("RUST_LOG", "info")],
    );
    let log = served.logs();
    assert!(
        log.contains("secrets loaded") && log.contains("secrets=2") && log.contains("canaries=1"),
        "{log}"
    );

    // Traffic: one allowed request and one refused (which revokes: a journal record).
    let url = format!("http://origin.test:{}/hello", origin.addr.port());
    let via = format!("http://agent:{lease}@{}", served.proxy);
    let ok = curl(&["-x", &via, &url], &[]).await;
    assert_eq!(ok.status, 200, "{ok:?}");
    let refused = curl(&["-x", &via, "http://elsewhere.test/"], &[]).await;
    assert_eq!(refused.status, 403, "{refused:?}");
    let admin = served.admin;
    let metrics = curl(&[&format!("http://{admin}/metrics")], &[]).await;
    assert_eq!(metrics.status, 200);
    let status = curl(&[&format!("http://{admin}/status")], &[]).await;
    assert_eq!(status.status, 200, "{status:?}");
    assert_eq!(h.egress_lines(2).await.len(), 2);
    assert_eq!(h.revocations().await.len(), 1);

    // SIGHUP: a broken file leaves the set in use (and the proxy up); a good one replaces it.
    let hangup = |want: &'static str| hangup(&served, want);
    let good = std::fs::read_to_string(&secrets).unwrap();
    std::fs::write(
        &secrets,
        good.replace("hosts = [\"origin.test\"]\nquery", "hosts = [\"*\"]\nquery"),
    )
    .unwrap();
    hangup("secrets file not reloaded, the secrets in use stay").await;
    assert!(
        served
            .logs()
            .contains("secret \"search\", field hosts: '*' would send the secret to every host"),
        "{}",
        served.logs()
    );
    let again = curl(
        &[
            "-x",
            &format!("http://agent:{other}@{}", served.proxy),
            &url,
        ],
        &[],
    )
    .await;
    assert_eq!(
        again.status, 200,
        "the proxy is still up after a bad reload: {again:?}"
    );
    let one = &good[..good.find("\n[[secret]]\nid = \"search\"").unwrap()];
    std::fs::write(&secrets, one).unwrap();
    hangup("secrets reloaded").await;
    let reloaded = served.logs();
    let line = reloaded
        .lines()
        .find(|l| l.contains("secrets reloaded"))
        .unwrap();
    assert!(
        line.contains("secrets=1") && line.contains("canaries=1"),
        "{line}"
    );

    let outputs = [
        ("stderr", served.logs()),
        ("egress log", std::fs::read_to_string(&h.egress).unwrap()),
        ("journal", std::fs::read_to_string(&h.journal).unwrap()),
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

/// A price table of one model.
const PRICES: &str =
    "[[model]]\nname = \"gpt-4o-mini*\"\ninput_per_million = 0.15\noutput_per_million = 0.6\n";

/// A secrets file or price table cut short (a write caught half-way) never widens anything:
/// the start stops with its problem, and a reload keeps what is in use and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_secrets_file_or_price_table_stops_the_start_and_is_never_reloaded() {
    let h = Harness::new();
    let secrets = secrets_file(h.dir.path());
    let good = std::fs::read_to_string(&secrets).unwrap();
    let prices = h.dir.path().join("prices.toml");
    let mut args = secrets_args(h.dir.path(), "origin.test", &secrets);
    args.extend(["--prices".to_owned(), s(&prices).to_owned()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let env = [("LG_TEST_GITHUB_PAT", ENV_VALUE), ("RUST_LOG", "info")];
    // Cut inside the second secret's table, and inside the model's entry.
    let cut_secrets = &good[..good.find("query = \"key\"").unwrap()];
    let cut_prices = &PRICES[..PRICES.find("output_per_million").unwrap()];
    for (what, secrets_text, prices_text, problem) in [
        ("secrets", cut_secrets, PRICES, "the secrets file"),
        ("prices", good.as_str(), cut_prices, "the price table"),
    ] {
        std::fs::write(&secrets, secrets_text).unwrap();
        std::fs::write(&prices, prices_text).unwrap();
        let mut command = leasegate_command(&[
            "serve",
            "--admin",
            "off",
            "--journal",
            s(&h.journal),
            "--key-file",
            s(&h.key_path),
            "--listen",
            "127.0.0.1:0",
        ]);
        command
            .args(&args)
            .envs(env)
            .stdout(std::process::Stdio::null());
        let out = exited(
            command
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        assert_eq!(out.status.code(), Some(1), "{what}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(problem) && stderr.contains("not valid"),
            "{what}: {stderr}"
        );
    }

    std::fs::write(&secrets, &good).unwrap();
    std::fs::write(&prices, PRICES).unwrap();
    let served = Served::start_with_env(&h, "-n 1024", &args, &env);
    let hangup = |want: &'static str| hangup(&served, want);
    std::fs::write(&secrets, cut_secrets).unwrap();
    std::fs::write(&prices, cut_prices).unwrap();
    hangup("price table not reloaded, the prices in use stay").await;
    let logs = served.logs();
    assert!(
        logs.contains("secrets file not reloaded, the secrets in use stay"),
        "{logs}"
    );
    // Still the whole set: two secrets, the proxy up.
    let status = curl(&[&format!("http://{}/status", served.admin)], &[]).await;
    assert_eq!(status.status, 200, "{status:?}");
    std::fs::write(&prices, PRICES).unwrap();
    hangup("price table reloaded").await;
}

/// Sends `served` a SIGHUP and waits (20 s at most) for `want` in its log.
async fn hangup(served: &Served, want: &str) {
    served.signal(nix::sys::signal::Signal::SIGHUP);
    eventually(Duration::from_secs(20), || async {
        served.logs().contains(want).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("no {want:?} after SIGHUP:\n{}", served.logs()))
}
