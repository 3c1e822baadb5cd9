//! `leasegate run` under leases from `POST /leases`: served the instant the answer arrives, never
//! started under a closed lease, waiting (bounded) for one not read yet, and ending the lease
//! as the child ends.

use super::run_trust::run;
use crate::support::harness::{admin_call, Harness};
use leasegate::server::Server;
use serde_json::{json, Value};

/// Issues a lease of `hosts` through the admin API; its id and a file holding its token.
async fn issue(server: &Server, dir: &std::path::Path, n: usize) -> (String, String) {
    let body = json!({
        "manifest": {"agent": {"name": "runner"}, "intent": {"purpose": "run under it"},
                     "allow": {"hosts": ["origin.test"]}},
        "lifetime_seconds": 600,
    });
    let (status, text) = admin_call(server, "POST", "/leases", None, &[], &body.to_string()).await;
    assert_eq!(status, 201, "{text}");
    let answer: Value = serde_json::from_str(&text).unwrap();
    let id = answer["lease_id"].as_str().unwrap().to_owned();
    let path = dir.join(format!("token-{n}"));
    std::fs::write(&path, answer["token"].as_str().unwrap()).unwrap();
    (id, path.display().to_string())
}

/// `leasegate run --lease LEASE --lease-token-file TOKEN --admin ADMIN ARGS...`: exit code,
/// stdout, stderr.
async fn run_lease(
    lease: &str,
    token: &str,
    admin: &str,
    args: &[&str],
) -> (Option<i32>, String, String) {
    let mut argv = vec![
        "run",
        "--lease",
        lease,
        "--lease-token-file",
        token,
        "--admin",
        admin,
    ];
    argv.extend(args);
    run(&argv, &[]).await
}

fn admin_url(server: &Server) -> String {
    format!("http://{}", server.admin_addr.unwrap())
}

fn events(h: &Harness, event: &str) -> Vec<Value> {
    std::fs::read_to_string(&h.journal)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["event"] == event)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_is_served_the_instant_post_leases_answers() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let admin = admin_url(&server);
    for n in 0..100 {
        let (id, token) = issue(&server, h.dir.path(), n).await;
        // No waiting allowed: a lease the proxy had not folded would be a 404 here.
        let (code, _, stderr) =
            run_lease(&id, &token, &admin, &["--wait", "0s", "--", "true"]).await;
        assert_eq!(code, Some(0), "try {n}: {stderr}");
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_never_starts_under_a_closed_lease_and_says_why() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let admin = admin_url(&server);
    let (id, token) = issue(&server, h.dir.path(), 0).await;
    let (status, _) = admin_call(
        &server,
        "POST",
        &format!("/leases/{id}/revoke"),
        None,
        &[],
        r#"{"reason": "the task was cancelled"}"#,
    )
    .await;
    assert_eq!(status, 200);
    let marker = h.dir.path().join("started");
    let (code, _, stderr) = run_lease(
        &id,
        &token,
        &admin,
        &["--", "touch", marker.to_str().unwrap()],
    )
    .await;
    assert_eq!(code, Some(125), "{stderr}");
    assert!(!marker.exists(), "the child never started");
    assert!(
        stderr.contains("status revoked, revoked by issuer at ")
            && stderr.contains(": the task was cancelled"),
        "{stderr}"
    );
    // `revoke --admin` answers once the revocation is folded: no race with the next `run`.
    for n in 1..=20 {
        let (id, token) = issue(&server, h.dir.path(), n).await;
        let out = crate::support::leasegate_sync(&[
            "revoke",
            "--admin",
            &admin,
            "--lease",
            &id,
            "--reason",
            "cancelled",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("revoked {id}")
        );
        let (code, _, stderr) = run_lease(
            &id,
            &token,
            &admin,
            &["--", "touch", marker.to_str().unwrap()],
        )
        .await;
        assert_eq!(code, Some(125), "try {n}: {stderr}");
        assert!(!marker.exists());
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_waits_for_a_grant_not_read_yet_within_its_bound() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let admin = admin_url(&server);
    // Written to the journal behind the proxy's back: the follower has not read it yet.
    let id = h.lease(&["origin.test"], &[]);
    let token = h.dir.path().join("token");
    std::fs::write(&token, leasegate::contract::token::mint(&h.key, &id)).unwrap();
    let (code, _, stderr) = run(
        &[
            "run",
            "--lease",
            &id,
            "--lease-token-file",
            token.to_str().unwrap(),
            "--admin",
            &admin,
            "--",
            "true",
        ],
        &[],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    // One never issued: a clear error once the bound has passed.
    let never = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";
    let (code, _, stderr) = run(
        &[
            "run", "--lease", never, "--admin", &admin, "--wait", "300ms", "--", "true",
        ],
        &[],
    )
    .await;
    assert_eq!(code, Some(125), "{stderr}");
    assert!(
        stderr.contains(&format!("lease {never} is not served by the proxy at"))
            && stderr.contains("after 300ms"),
        "{stderr}"
    );
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_on_exit_completes_on_zero_and_stops_otherwise() {
    let h = Harness::new();
    let server = h.start(h.config(&[])).await;
    let admin = admin_url(&server);
    let (done, token) = issue(&server, h.dir.path(), 0).await;
    let (code, _, stderr) =
        run_lease(&done, &token, &admin, &["--complete-on-exit", "--", "true"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("lease {done} completed")),
        "{stderr}"
    );
    let completed = events(&h, "completed");
    assert_eq!(completed.len(), 1);
    assert_eq!(completed[0]["lease_id"], done);
    assert_eq!(completed[0]["reason"], "the agent exited with code 0");

    let (failed, token) = issue(&server, h.dir.path(), 1).await;
    let (code, _, stderr) = run_lease(
        &failed,
        &token,
        &admin,
        &["--complete-on-exit", "--", "sh", "-c", "exit 3"],
    )
    .await;
    assert_eq!(code, Some(3), "the child's code stays ours: {stderr}");
    let stopped = events(&h, "stopped");
    assert_eq!(stopped.len(), 1);
    assert_eq!(stopped[0]["lease_id"], failed);
    assert_eq!(stopped[0]["reason"], "the agent exited with code 3");
    // The lease is closed: a second run does not start.
    let (code, _, stderr) = run_lease(&failed, &token, &admin, &["--", "true"]).await;
    assert_eq!(code, Some(125));
    assert!(stderr.contains("status stopped, stopped at "), "{stderr}");
    server.shutdown().await;
}
