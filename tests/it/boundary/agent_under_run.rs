//! The agent under `leasegate run` as the attacker: what it holds (its own lease token) opens
//! only its own lease on the admin API, and nothing of the operator's is in its reach — no
//! `LEASEGATE_*` variable, no inherited descriptor, no readable `/proc` of `run`, no readable
//! operator credential named in the environment.

use crate::admin::placeholders::{ask, start, TOKEN as ADMIN_TOKEN};
use crate::support::harness::Harness;
use leasegate::contract::token;
use std::os::unix::fs::PermissionsExt;

/// With lease A's token, the agent reads A's view and placeholders — and for every other route,
/// B's included, is refused without a byte of B's credentials; it cannot revoke anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_token_opens_its_own_lease_and_nothing_else() {
    let h = Harness::new();
    let a = h.lease_for_agent("coder", &["origin.test"]);
    let b = h.lease_for_agent("coder", &["origin.test", "elsewhere.test"]);
    let server = start(&h, Some(ADMIN_TOKEN), true).await;
    let (a_token, b_token) = (token::mint(&h.key, &a), token::mint(&h.key, &b));
    let b_placeholder = leasegate::secrets::placeholder::derive(&h.key, &b, "github");

    let (status, view) = ask(&server, "GET", &format!("/leases/{a}"), Some(&a_token)).await;
    assert_eq!(status, 200, "{view}");
    assert!(
        view.contains(&format!(r#""proxy_url":"http://agent:{a}@"#)),
        "its own credential (the id: --credentials id): {view}"
    );
    let (status, own) = ask(
        &server,
        "GET",
        &format!("/leases/{a}/placeholders"),
        Some(&a_token),
    )
    .await;
    assert_eq!(status, 200, "{own}");
    assert!(own.contains(&leasegate::secrets::placeholder::derive(
        &h.key, &a, "github"
    )));

    let refused = [
        ("GET", "/leases".to_owned()),
        ("GET", "/leases?parent=".to_owned() + &a),
        ("GET", format!("/leases/{b}")),
        ("GET", format!("/leases/{b}/placeholders")),
        ("GET", format!("/leases/{b}/requests")),
        ("GET", format!("/leases/{a}/requests")),
        ("POST", format!("/leases/{b}/revoke")),
        ("POST", format!("/leases/{a}/revoke")),
        ("GET", "/refusals".to_owned()),
        ("GET", "/metrics".to_owned()),
        ("GET", "/status".to_owned()),
        ("GET", "/rates".to_owned()),
        ("GET", "/readyz".to_owned()),
    ];
    for (method, path) in &refused {
        let (status, body) = ask(&server, method, path, Some(&a_token)).await;
        assert_eq!(status, 403, "{method} {path}: {body}");
        assert!(
            body.contains("a lease's proxy token reads only that lease"),
            "{body}"
        );
        for secret in [&b_token, &b_placeholder, &b] {
            assert!(!body.contains(secret.as_str()), "{method} {path}: {body}");
        }
    }
    // A forged tag, or another key's token, is no one: 401.
    let forged = format!("{a}.AAAAAAAAAAAAAAAAAAAAAA");
    let other_key = token::mint(&leasegate::contract::Key::generate(), &a);
    for bad in [forged.as_str(), other_key.as_str()] {
        let (status, body) = ask(&server, "GET", &format!("/leases/{a}"), Some(bad)).await;
        assert_eq!(status, 401, "{body}");
        assert!(!body.contains(&a_token));
    }
    // Nothing was revoked: B is open, and so is A.
    for id in [&a, &b] {
        let (status, view) = ask(&server, "GET", &format!("/leases/{id}"), Some(ADMIN_TOKEN)).await;
        assert_eq!(status, 200);
        assert!(view.contains(r#""status":"open""#), "{view}");
    }
    assert!(h.revocations().await.is_empty());
    server.shutdown().await;
}

/// What `run` itself is, to its child: the child runs as an unprivileged user (as root, the
/// test drops `run` and the child to `nobody` with setpriv: root reads every process anyway).
/// The child finds no `LEASEGATE_*` variable but its lease id, no descriptor `run` inherited,
/// and cannot read `run`'s environment or descriptors; an operator credential the environment
/// names and this user can read stops the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_of_the_operators_is_in_the_childs_reach() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let mut serve = h.serve_config(h.config(&[]), None);
    serve.admin_token = Some(ADMIN_TOKEN.to_owned());
    let server = leasegate::server::Server::start(serve).await.unwrap();
    let admin = format!("http://{}", server.admin_addr.unwrap());

    // Files `nobody` can read where they are the lease's, and cannot where the operator's.
    let dir = tempfile::Builder::new()
        .prefix("run-reach")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let write = |name: &str, text: &str, mode: u32| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let lease_token = write("lease-token", &token::mint(&h.key, &lease), 0o644);
    let held = write("held-open", "OPERATOR-DESCRIPTOR-SECRET\n", 0o644);
    let admin_token = write("admin-token", &format!("{ADMIN_TOKEN}\n"), 0o000);
    let probe = write(
        "probe.sh",
        "env | grep '^LEASEGATE_' | sort\n\
         if [ -e /proc/self/fd/7 ]; then echo 'fd 7 inherited'; else echo 'fd 7 closed'; fi\n\
         if cat /proc/$PPID/environ >/dev/null 2>&1; then echo 'environ read'; else echo 'environ sealed'; fi\n\
         if ls /proc/$PPID/fd >/dev/null 2>&1; then echo 'fds listed'; else echo 'fds sealed'; fi\n",
        0o755,
    );
    let is_root = crate::support::is_root();
    // `run` is started by a shell that opens descriptor 7 (not close-on-exec) first.
    let launch = |env: Vec<(&'static str, String)>| {
        let drop_to_nobody = match is_root {
            true => "setpriv --reuid=65534 --regid=65534 --clear-groups ",
            false => "",
        };
        let mut command = crate::support::leasegate_command(&[]);
        let bin = command.get_program().to_owned();
        command = std::process::Command::new("sh");
        command
            .arg("-c")
            .arg(format!(
                "exec 7<\"$1\"; exec {drop_to_nobody}\"$0\" run --lease \"$2\" --admin \"$3\" \
                 --lease-token-file \"$4\" -- sh \"$5\""
            ))
            .arg(bin)
            .args([&held, &lease, &admin, &lease_token, &probe])
            .env_remove("LEASEGATE_LEASE_TOKEN_FILE")
            .env("LEASEGATE_ADMIN_TOKEN_FILE", &admin_token)
            .env("LEASEGATE_CONNECT_PORTS", "1-65535");
        for (name, value) in env {
            command.env(name, value);
        }
        crate::cli::run_trust::output_of(command)
    };

    let (code, stdout, stderr) = launch(Vec::new()).await;
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert_eq!(
        stdout,
        format!("LEASEGATE_LEASE_ID={lease}\nfd 7 closed\nenviron sealed\nfds sealed\n"),
        "{stderr}"
    );

    // An operator credential this user can read: not started.
    let readable = write("readable-admin-token", "s3cret\n", 0o644);
    for var in ["LEASEGATE_ADMIN_TOKEN_FILE", "LEASEGATE_KEY_FILE"] {
        let (code, stdout, stderr) = launch(vec![(var, readable.clone())]).await;
        assert_eq!((code, stdout.as_str()), (Some(125), ""), "{stderr}");
        assert_eq!(
            stderr,
            format!(
                "leasegate run: not starting sh {probe}: {var} names {readable}, an operator \
                 credential this user can read, and so could the agent. Run the agent as a user \
                 that cannot read it (or unset {var} for `run`)\n"
            )
        );
    }
    server.shutdown().await;
}
