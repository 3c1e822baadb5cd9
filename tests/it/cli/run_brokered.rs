//! `leasegate run` with brokered credentials: the child holds the lease's placeholders in
//! their variables and trusts the interception CA through files that go when it exits; no
//! secret's value reaches it.

use crate::admin::placeholders::{start, OTHER_VALUE, TOKEN, VALUE};
use crate::cli::run_trust::run;
use crate::support::harness::Harness;
use leasegate::secrets::placeholder;
use std::collections::BTreeMap;
use std::path::Path;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_child_gets_its_placeholders_and_trusts_the_ca() {
    let h = Harness::new();
    let lease = h.lease_for_agent("coder", &["origin.test"]);
    let server = start(&h, Some(TOKEN), true).await;
    let ca_pem = std::fs::read_to_string(h.dir.path().join("ca").join("ca.pem")).unwrap();
    // The child shows its environment and the two files it was pointed at.
    let script = "env; echo '--- ca'; cat \"$NODE_EXTRA_CA_CERTS\"; echo '--- bundle'; \
                  cat \"$SSL_CERT_FILE\"";
    let (code, stdout, stderr) = run_under(
        &h,
        &server,
        &lease,
        &["sh", "-c", script],
        // An inherited variable of the same name is replaced, not kept.
        &[("GITHUB_TOKEN", "inherited")],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stderr, "");
    let (env, files) = stdout.split_once("--- ca\n").unwrap();
    let (ca, bundle) = files.split_once("--- bundle\n").unwrap();
    let env: BTreeMap<&str, &str> = env.lines().filter_map(|l| l.split_once('=')).collect();

    assert_eq!(
        env["GITHUB_TOKEN"],
        placeholder::derive(&h.key, &lease, "github")
    );
    assert!(!env.contains_key("DEPLOY_KEY"), "not entitled: {env:?}");
    for value in [VALUE, OTHER_VALUE] {
        assert!(!stdout.contains(value), "the child saw a value:\n{stdout}");
    }
    let unix = |pem: &str| pem.replace('\r', "");
    assert_eq!(unix(ca), unix(&ca_pem));
    assert!(
        unix(bundle).ends_with(&unix(&ca_pem)),
        "the bundle ends in the CA:\n{bundle}"
    );
    let bundle_path = Path::new(env["SSL_CERT_FILE"]);
    assert_eq!(bundle_path.file_name().unwrap(), "bundle.pem");
    for name in ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"] {
        assert_eq!(Path::new(env[name]), bundle_path, "{name}");
    }
    let dir = bundle_path.parent().unwrap();
    assert_eq!(Path::new(env["NODE_EXTRA_CA_CERTS"]), dir.join("ca.pem"));
    assert!(!dir.exists(), "{} outlived the child", dir.display());
    server.shutdown().await;
}

/// A lease no secret is for, under a proxy with secrets: no placeholder, the CA still.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unentitled_child_gets_the_ca_and_no_placeholder() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = start(&h, Some(TOKEN), true).await;
    let (code, stdout, stderr) = run_under(&h, &server, &lease, &["env"], &[]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stdout.contains("lgp_"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("SSL_CERT_FILE=") && l.ends_with("/bundle.pem")),
        "{stdout}"
    );
    server.shutdown().await;
}

/// `leasegate run --lease LEASE` of `command` against `server`'s admin API with the lease's own
/// token (a token file ending in a newline, as editors write them).
async fn run_under(
    h: &Harness,
    server: &leasegate::server::Server,
    lease: &str,
    command: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String, String) {
    let token = h.dir.path().join("lease-token");
    let minted = leasegate::contract::token::mint(&h.key, lease);
    std::fs::write(&token, format!("{minted}\n")).unwrap();
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let mut args = vec![
        "run",
        "--lease",
        lease,
        "--admin",
        &admin,
        "--lease-token-file",
        token.to_str().unwrap(),
        "--",
    ];
    args.extend_from_slice(command);
    run(&args, env).await
}
