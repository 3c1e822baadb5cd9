//! The Python client (`clients/python`) and the examples (`examples/`) against a real proxy.
//! `tests/data/python_client/flow.py` issues a root and a narrower child through the package,
//! runs agents under the child (curl, and a standard-library Python agent calling the fake
//! model API through the broker), completes both and provokes the errors; the orchestrator and
//! `issue.sh` run against `serve --dev`. Each runs in a network namespace with only loopback
//! ([`in_loopback_only_namespace`]), so an agent that ignored its lease's proxy would fail, and
//! with proxy variables naming a proxy nobody runs, which the admin client must never use.

use crate::support::harness::http_origin;
use crate::support::model_api::{ANTHROPIC_HOST, OPENAI_HOST};
use crate::support::model_proxy::{ModelProxy, OPENAI_KEY, PLAIN_HOST};
use crate::support::netns::in_loopback_only_namespace;
use crate::support::{data, leasegate_command, leasegate_sync, missing, succeeded};
use leasegate::proxy::OnRefusal;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncBufReadExt;

/// The operator's admin token in the first test.
const ADMIN_TOKEN: &str = "python-client-test-admin-token";

/// A proxy nobody runs, in every proxy variable the scripts inherit.
const NOBODYS_PROXY: &str = "http://127.0.0.1:9";

/// The variables a script never inherits from the test's environment.
const CLEARED: [&str; 16] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "GIT_SSL_CAINFO",
    "NODE_EXTRA_CA_CERTS",
    "LEASEGATE_ADMIN_URL",
    "LEASEGATE_ADMIN_TOKEN",
    "LEASEGATE_ADMIN_TOKEN_FILE",
];

fn repo(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn path_text(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// What a script did.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    /// Its stdout, asserting that it exited 0.
    fn ok(&self, what: &str) -> &str {
        assert_eq!(
            self.code,
            Some(0),
            "{what} failed\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout,
            self.stderr
        );
        &self.stdout
    }
}

/// Runs `program args` in `cwd` with `env` on top of this environment without [`CLEARED`],
/// with [`NOBODYS_PROXY`] as its proxy and no bytecode written into the repository; at most
/// 120 s.
async fn script(program: &str, args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Ran {
    let mut command = tokio::process::Command::new(program);
    command.args(args).current_dir(cwd).kill_on_drop(true);
    for name in CLEARED {
        command.env_remove(name);
    }
    for name in ["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "http_proxy"] {
        command.env(name, NOBODYS_PROXY);
    }
    command
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("LC_ALL", "C.UTF-8");
    for (name, value) in env {
        command.env(name, value);
    }
    let limit = Duration::from_secs(120);
    let out = match tokio::time::timeout(limit, command.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("cannot run {program}: {e}"),
        Err(_) => panic!("{program} {args:?} ran for more than {limit:?}"),
    };
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The journal's records of `event`.
fn records(journal: &Path, event: &str) -> Vec<Value> {
    std::fs::read_to_string(journal)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["event"] == event)
        .collect()
}

/// The one record of `event` for `lease` (panics unless there is exactly one).
fn record_of(journal: &Path, event: &str, lease: &str) -> Value {
    let mut found: Vec<Value> = records(journal, event)
        .into_iter()
        .filter(|r| r["lease_id"] == lease)
        .collect();
    assert_eq!(found.len(), 1, "{event} records of {lease}: {found:?}");
    found.pop().unwrap()
}

/// Every record of `journal` verifies under `key`.
fn verifies(journal: &Path, key: &Path) {
    succeeded(&leasegate_sync(&[
        "verify",
        path_text(journal),
        "--key-file",
        path_text(key),
    ]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_issues_a_narrower_child_runs_agents_under_it_and_completes() {
    if missing(&["python3", "curl"], "apt-get install python3 curl") {
        return;
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let m = ModelProxy::start_with(|serve| {
        serve.admin_token = Some(ADMIN_TOKEN.into());
        // One child lease serves the allowed and the refused call, then completes.
        serve.proxy.on_refusal = OnRefusal::Log;
    })
    .await;
    let token_file = m.h.dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN_TOKEN}\n")).unwrap();
    let port = m.plain.addr.port();
    let plain = format!("http://{PLAIN_HOST}:{port}/");
    // The root allows it, the child does not.
    let refused = format!("http://{ANTHROPIC_HOST}:{port}/");
    let openai = m.api.base_url(true);
    let admin = format!("http://{}", m.server.admin_addr.unwrap());
    let package = repo("clients/python/src");
    let ran = script(
        "python3",
        &[
            path_text(&data("python_client/flow.py")),
            &plain,
            &refused,
            &openai,
        ],
        m.h.dir.path(),
        &[
            ("PYTHONPATH", path_text(&package)),
            ("LEASEGATE_ADMIN_URL", &admin),
            ("LEASEGATE_ADMIN_TOKEN_FILE", path_text(&token_file)),
        ],
    )
    .await;
    let stdout = ran.ok("flow.py");
    let seen: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let (root, child) = (
        seen["root"].as_str().unwrap(),
        seen["child"].as_str().unwrap(),
    );
    let tokens = seen["tokens"].as_u64().unwrap();
    assert!(tokens > 0, "{seen}");
    assert_eq!(seen["child_usage"]["tokens"], tokens, "{seen}");
    assert_eq!(
        seen["root_usage"], seen["child_usage"],
        "the root's subtree"
    );

    let journal = &m.h.journal;
    // Two grants beside the harness's own lease: the replay under the same Idempotency-Key
    // wrote none.
    let granted: Vec<Value> = records(journal, "granted")
        .into_iter()
        .filter(|r| r["lease_id"] != m.lease.as_str())
        .collect();
    assert_eq!(granted.len(), 2, "{granted:?}");
    assert_eq!(granted[0]["lease_id"], root);
    assert_eq!(granted[1]["lease_id"], child);
    assert_eq!(granted[1]["lease"]["manifest"]["parent_lease_id"], root);
    assert_eq!(
        granted[1]["declared"]["allow"]["hosts"],
        json!([PLAIN_HOST, OPENAI_HOST, "evil.test"]),
        "what was asked"
    );
    assert_eq!(
        granted[1]["lease"]["manifest"]["allow"]["hosts"],
        json!([PLAIN_HOST, OPENAI_HOST]),
        "what was granted"
    );
    assert_eq!(granted[1]["lease"]["manifest"]["budget"]["tokens"], 600);
    let narrowed = record_of(journal, "narrowed", child);
    assert_eq!(narrowed["parent_lease_id"], root);
    let reason = narrowed["reason"].as_str().unwrap();
    assert!(reason.starts_with("allow.hosts -1"), "{reason}");
    assert_eq!(
        seen["child_narrowed"],
        json!(reason.split("; ").collect::<Vec<_>>()),
        "the answer's narrowed is the record's reason"
    );
    // Completed, each once, with what the proxy measured: the child's call, in both.
    let completed = records(journal, "completed");
    assert_eq!(completed.len(), 2, "{completed:?}");
    assert_eq!(completed[0]["lease_id"], child);
    assert_eq!(completed[0]["reason"], "the sub-agent is done");
    assert_eq!(completed[1]["lease_id"], root);
    for record in &completed {
        assert_eq!(record["usage"]["tokens"], tokens, "{record}");
        assert_eq!(record["usage"]["cost_usd"], seen["child_usage"]["cost_usd"]);
    }
    // The empty purpose was refused by the contract and recorded under the error's id.
    let refusal = seen["refusal_id"].as_str().unwrap();
    let refused_record = record_of(journal, "refused", refusal);
    assert!(
        refused_record["declared_hash"].as_str().is_some(),
        "{refused_record}"
    );
    verifies(journal, &m.h.key_path);

    // The agents' calls, all under the child: the allowed one, the refused one, and the model
    // call with the real key put in by the proxy (the agent held a placeholder).
    let lines = m.h.egress_lines(4).await;
    let line = |host: &str, kind: &str| {
        lines
            .iter()
            .find(|l| l["host"] == host && l["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind} line for {host}: {lines:?}"))
            .clone()
    };
    let allowed = line(PLAIN_HOST, "http");
    assert_eq!(
        (
            &allowed["lease_id"],
            &allowed["verdict"],
            &allowed["status"]
        ),
        (&json!(child), &json!("allow"), &json!(200))
    );
    let denied = line(ANTHROPIC_HOST, "http");
    assert_eq!(
        (&denied["lease_id"], &denied["verdict"], &denied["code"]),
        (&json!(child), &json!("refuse"), &json!("host-not-allowed"))
    );
    assert_eq!(denied["status"], 403);
    let call = line(OPENAI_HOST, "https");
    assert_eq!(call["lease_id"], child);
    assert_eq!(call["secrets"], json!(["openai"]));
    let model = &call["model"];
    assert_eq!(
        model["input_tokens"].as_u64().unwrap() + model["output_tokens"].as_u64().unwrap(),
        tokens,
        "{model}"
    );
    let calls = m.api.seen();
    assert_eq!(calls.len(), 1);
    assert_eq!(
        calls[0].header("authorization"),
        Some(format!("Bearer {OPENAI_KEY}").as_str())
    );
    m.server.shutdown().await;
}

/// `serve --dev` in `dir` (any ports; `names` resolved to loopback, which it may reach), and
/// the admin API's URL from its banner.
async fn serve_dev(dir: &Path, names: &[&str]) -> (tokio::process::Child, String) {
    let resolve: Vec<String> = names.iter().map(|n| format!("{n}=127.0.0.1")).collect();
    let resolve = resolve.join(",");
    let mut command = tokio::process::Command::from(leasegate_command(&[
        "serve",
        "--dev",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--allow-private",
        "127.0.0.1/32",
        "--resolve",
        &resolve,
    ]));
    command
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = command.spawn().unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut banner = Vec::new();
    let admin = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(url) = line.strip_prefix("dashboard ") {
                return url.trim_end_matches('/').to_owned();
            }
            banner.push(line);
        }
        panic!("serve --dev ended its banner without a dashboard line: {banner:?}");
    })
    .await
    .expect("serve --dev names its dashboard within 30 s");
    // Its stdout stays open (and read) for as long as it runs.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, admin)
}

/// The id after `prefix` on the line of `text` that starts with it.
fn id_after<'t>(text: &'t str, prefix: &str) -> &'t str {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}: {text}"));
    &line[..36]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_examples_run_against_serve_dev() {
    if missing(
        &["python3", "curl", "bash"],
        "apt-get install python3 curl bash",
    ) {
        return;
    }
    if !in_loopback_only_namespace().await {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let origin = http_origin().await;
    let (_serve, admin) = serve_dev(dir.path(), &["alpha.test", "beta.test"]).await;
    let journal = dir.path().join(".leasegate/journal.jsonl");
    let key = dir.path().join(".leasegate/dev.key");
    let port = origin.addr.port();
    let (alpha, beta) = (
        format!("http://alpha.test:{port}/"),
        format!("http://beta.test:{port}/"),
    );
    // No token in the environment: both find the one `serve --dev` wrote in their directory.
    let admin_env = [("LEASEGATE_ADMIN_URL", admin.as_str())];

    // No PYTHONPATH: the orchestrator finds the package in the repository itself.
    let ran = script(
        "python3",
        &[
            path_text(&repo("examples/orchestrator.py")),
            "--researcher-url",
            &alpha,
            "--writer-url",
            &beta,
        ],
        dir.path(),
        &admin_env,
    )
    .await;
    let out = ran.ok("orchestrator.py");
    let researcher = id_after(out, "issued researcher ");
    let writer = id_after(out, "issued writer ");
    let sub_agent = id_after(out, "issued sub-agent ");
    for printed in [
        format!(
            "issued sub-agent {sub_agent} under researcher {researcher}, issued with its \
             token: hosts alpha.test; tokens 2000"
        ),
        "  narrowed: allow.hosts -1".to_owned(),
        format!("researcher: {alpha} -> 200 hello from origin"),
        format!("writer: {beta} -> 200 hello from origin"),
        format!("sub-agent: {alpha} -> 200 hello from origin"),
        format!("sub-agent: {beta} -> 403 host-not-allowed"),
        format!("completed sub-agent {sub_agent}: tokens unmeasured, cost unmeasured"),
        format!("completed researcher {researcher}: tokens unmeasured, cost unmeasured"),
        format!("completed writer {writer}: tokens unmeasured, cost unmeasured"),
    ] {
        assert!(out.lines().any(|l| l == printed), "{printed:?} in:\n{out}");
    }
    assert_eq!(
        record_of(&journal, "granted", sub_agent)["lease"]["manifest"]["parent_lease_id"],
        researcher
    );
    let narrowed = record_of(&journal, "narrowed", sub_agent);
    assert_eq!(narrowed["parent_lease_id"], researcher);
    assert!(narrowed["reason"]
        .as_str()
        .unwrap()
        .starts_with("allow.hosts -1"));
    for lease in [sub_agent, researcher, writer] {
        let done = record_of(&journal, "completed", lease);
        assert_eq!(done["usage"], json!({}), "nothing metered: {done}");
        assert_eq!(done["reason"], "the orchestrator is done");
    }

    let ran = script(
        "bash",
        &[path_text(&repo("examples/issue.sh")), &alpha],
        dir.path(),
        &admin_env,
    )
    .await;
    let out = ran.ok("issue.sh");
    let root = id_after(out, "root ");
    let child = id_after(out, "child ");
    for printed in [
        format!("root {root}: hosts [\"alpha.test\"], tokens 10000"),
        format!("child {child} of {root}: hosts [\"alpha.test\"], tokens 1000"),
        format!("curl {alpha} under the child: 200 hello from origin"),
        format!("completed child {child}: usage {{}}"),
        format!("completed root {root}: usage {{}}"),
    ] {
        assert!(out.lines().any(|l| l == printed), "{printed:?} in:\n{out}");
    }
    assert!(
        out.contains("  narrowed: [\"allow.hosts -1\""),
        "the child's narrowing: {out}"
    );
    let narrowed = record_of(&journal, "narrowed", child);
    assert_eq!(narrowed["parent_lease_id"], root);
    assert_eq!(record_of(&journal, "completed", child)["usage"], json!({}));
    assert_eq!(
        record_of(&journal, "completed", root)["reason"],
        "issue.sh is done"
    );
    // The demo lease and the five issued here; each issued one completed once.
    assert_eq!(records(&journal, "granted").len(), 6);
    assert_eq!(records(&journal, "completed").len(), 5);
    verifies(&journal, &key);

    // A wrong token: the script stops at the first call and says why.
    let ran = script(
        "bash",
        &[path_text(&repo("examples/issue.sh")), &alpha],
        dir.path(),
        &[
            ("LEASEGATE_ADMIN_URL", admin.as_str()),
            ("LEASEGATE_ADMIN_TOKEN", "not-the-token"),
        ],
    )
    .await;
    assert_eq!(ran.code, Some(1), "{}{}", ran.stdout, ran.stderr);
    assert!(
        ran.stderr.contains("POST /leases answered 401"),
        "{}",
        ran.stderr
    );
    assert_eq!(records(&journal, "granted").len(), 6);
}
