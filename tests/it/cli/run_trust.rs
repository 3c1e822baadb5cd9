//! `leasegate run` against an admin API it cannot vouch for: the proxy's host is the
//! operator's, the lease token goes only over TLS or to loopback, and no inherited proxy
//! setting survives into the child.

use crate::support::harness::Harness;
use crate::support::leasegate_command;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";

/// A lease token of `LEASE` in form (these admin APIs are not leasegate: nothing verifies it).
const TOKEN: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c.s3cretAAAAAAAAAAAAAAAA";

/// A file holding [`TOKEN`] in `dir`, as `run --lease-token-file` takes it.
fn token_file(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("lease-token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    path.to_str().unwrap().to_owned()
}

/// What a listener heard: every connection's bytes, as text.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<String>>>);

impl Heard {
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }

    /// Reads what a connection sends until the request head ends (or 5 s pass); answers
    /// `answer` if given, but a request for placeholders as a leasegate older than them does.
    async fn serve<S: AsyncRead + AsyncWrite + Unpin>(&self, mut stream: S, answer: Option<&str>) {
        let mut bytes = Vec::new();
        let mut buf = [0u8; 4096];
        let read = async {
            while !bytes.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => bytes.extend_from_slice(&buf[..n]),
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), read).await;
        let head = String::from_utf8_lossy(&bytes).into_owned();
        let older = head
            .lines()
            .next()
            .is_some_and(|l| l.contains("/placeholders "));
        self.0.lock().unwrap().push(head);
        let answer = answer.map(|a| if older { NO_ROUTE } else { a });
        if let Some(answer) = answer {
            let _ = stream.write_all(answer.as_bytes()).await;
            let _ = stream.shutdown().await;
        }
    }

    /// A listener on `addr` that records every connection and answers `answer` (a raw HTTP
    /// response), over TLS with `tls`.
    async fn listen(
        addr: &str,
        answer: Option<String>,
        tls: Option<tokio_rustls::TlsAcceptor>,
    ) -> (SocketAddr, Heard) {
        let listener = TcpListener::bind(addr).await.unwrap();
        let local = listener.local_addr().unwrap();
        let heard = Heard::default();
        let recording = heard.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let (heard, answer, tls) = (recording.clone(), answer.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        Some(tls) => match tls.accept(stream).await {
                            Ok(stream) => heard.serve(stream, answer.as_deref()).await,
                            Err(e) => heard.0.lock().unwrap().push(format!("TLS failed: {e}")),
                        },
                        None => heard.serve(stream, answer.as_deref()).await,
                    }
                });
            }
        });
        (local, heard)
    }
}

/// A 200 answer to `GET /leases/{id}` with `view` as its body.
fn answer(view: &Value) -> String {
    let body = view.to_string();
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// What a leasegate older than placeholders answers for them.
const NO_ROUTE: &str = "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 23\r\nconnection: close\r\n\r\n{\"error\":\"no route /x\"}";

/// An open lease as an admin API that is not leasegate describes it: the proxy, with a
/// credential handed out, somewhere of its choosing.
fn view_pointing_at(proxy: SocketAddr) -> Value {
    json!({"lease_id": LEASE, "status": "open", "port": null,
        "proxy_url": format!("http://agent:handed-out@{proxy}"),
        "credentials": "token", "lease_port_credentials": "none"})
}

/// Two listeners on one port number: `127.0.0.1:P` (where the admin URL's host and the
/// answer's port lead) and `127.0.0.2:P` (the host the answer names).
async fn same_port_twice() -> ((SocketAddr, Heard), (SocketAddr, Heard)) {
    for _ in 0..20 {
        let elsewhere = Heard::listen("127.0.0.2:0", None, None).await;
        let port = elsewhere.0.port();
        if TcpListener::bind(("127.0.0.1", port)).await.is_ok() {
            let configured = Heard::listen(&format!("127.0.0.1:{port}"), None, None).await;
            return (configured, elsewhere);
        }
    }
    panic!("no port free on both 127.0.0.1 and 127.0.0.2");
}

/// `leasegate run --lease LEASE --admin ADMIN EXTRA... CHILD...`: exit code, stdout, stderr.
async fn run_under(admin: &str, extra: &[&str], child: &[&str]) -> (Option<i32>, String, String) {
    let mut args = vec!["run", "--lease", LEASE, "--admin", admin];
    args.extend(extra);
    args.extend(child);
    run(&args, &[]).await
}

/// `leasegate run ARGS` with `env` added (and no lease token file or proxy inherited): exit
/// code, stdout, stderr.
pub(crate) async fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut command = leasegate_command(args);
    command.env_remove("LEASEGATE_LEASE_TOKEN_FILE");
    command.env_remove("LEASEGATE_PROXY");
    for (name, value) in env {
        command.env(name, value);
    }
    output_of(command).await
}

/// Runs `command` (a `leasegate run`, killed if it outlives the test): exit code, stdout,
/// stderr.
pub(crate) async fn output_of(command: std::process::Command) -> (Option<i32>, String, String) {
    let mut command = tokio::process::Command::from(command);
    command.kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), command.output())
        .await
        .expect("run finishes within 60 s")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A local process answering on the admin URL names a proxy of its own: the child's proxy
/// variables keep the admin URL's host (or `--proxy`), take only the answer's port, and the
/// host the answer named hears nothing — no credential, no connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_takes_no_proxy_host_from_the_admin_api() {
    let ((configured, at_configured), (elsewhere, at_elsewhere)) = same_port_twice().await;
    let (admin, at_admin) = Heard::listen(
        "127.0.0.1:0",
        Some(answer(&view_pointing_at(elsewhere))),
        None,
    )
    .await;
    let admin = format!("http://{admin}");
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir);
    // The child uses what it was given: curl through $HTTP_PROXY.
    let child = [
        "--",
        "sh",
        "-c",
        "echo $HTTP_PROXY; curl -s -m 5 -o /dev/null http://origin.test/; true",
    ];

    // Without a token the credential is the one the answer handed out.
    let (code, stdout, stderr) = run_under(&admin, &[], &child).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout.trim(),
        format!("http://agent:handed-out@127.0.0.1:{}", configured.port())
    );
    assert!(
        at_configured.all()[0].contains("Proxy-Authorization: Basic"),
        "{:?}",
        at_configured.all()
    );

    let (code, stdout, stderr) = run_under(&admin, &["--lease-token-file", &token], &child).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout.trim(),
        format!("http://agent:{TOKEN}@127.0.0.1:{}", configured.port())
    );
    // An admin API without placeholders: said once, and the child runs without them.
    assert_eq!(
        stderr,
        format!(
            "leasegate run: warning: the admin API at {admin} does not hand out placeholders (a \
             leasegate older than brokered credentials): the child gets no placeholders and does \
             not trust the interception CA\n"
        )
    );
    // Loopback: the lease token may go there.
    assert!(at_admin
        .all()
        .iter()
        .any(|h| h.contains(&format!("authorization: Bearer {TOKEN}"))));

    // With --proxy, the proxy is that one, whatever the answer says.
    let (proxy, at_proxy) = Heard::listen("127.0.0.1:0", None, None).await;
    let proxy = format!("http://{proxy}");
    let (code, stdout, stderr) = run_under(
        &admin,
        &["--proxy", &proxy, "--lease-token-file", &token],
        &child,
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout.trim(),
        format!("http://agent:{TOKEN}@{}", &proxy[7..])
    );
    assert_eq!(at_proxy.all().len(), 1);

    assert_eq!(
        at_elsewhere.all(),
        Vec::<String>::new(),
        "the host the admin API named heard nothing"
    );
}

/// A plain-HTTP admin URL beyond loopback gets no lease token: `run` refuses before it
/// connects (192.0.2.1 is TEST-NET-1: nothing answers there, a connection would hang or fail
/// with another message).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_sends_no_lease_token_in_plain_http_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let token = token_file(&dir);
    let started = std::time::Instant::now();
    let (code, stdout, stderr) = run_under(
        "http://192.0.2.1:3129",
        &["--lease-token-file", &token],
        &["--", "echo", "ran"],
    )
    .await;
    assert_eq!(code, Some(125));
    assert_eq!(stdout, "");
    assert_eq!(
        stderr,
        "leasegate run: not sending the lease token in plain HTTP to http://192.0.2.1:3129: its \
         host is 192.0.2.1, beyond loopback. Use an https:// admin URL (with --admin-ca if its \
         certificate is not from a public CA), or reach the admin API on loopback (an SSH \
         tunnel, `kubectl port-forward`)\n"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "refused without waiting on a connection"
    );
}

/// An https:// admin URL: the token goes once the certificate verifies under --admin-ca, and
/// not at all when it does not (the public roots do not know a self-signed certificate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_sends_the_lease_token_over_tls_to_a_verified_admin_api() {
    let dir = tempfile::tempdir().unwrap();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let ca = dir.path().join("admin-ca.pem");
    std::fs::write(&ca, cert.cert.pem()).unwrap();
    let acceptor = {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()));
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(cert.cert.der().to_vec())], key)
        .unwrap();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    };
    let (proxy, _) = Heard::listen("127.0.0.1:0", None, None).await;
    let (admin, at_admin) = Heard::listen(
        "127.0.0.1:0",
        Some(answer(&view_pointing_at(proxy))),
        Some(acceptor),
    )
    .await;
    let admin = format!("https://localhost:{}", admin.port());
    let token = token_file(&dir);
    let token = token.as_str();
    let child = ["--", "sh", "-c", "echo $HTTPS_PROXY"];

    let (code, _, stderr) = run_under(&admin, &["--lease-token-file", token], &child).await;
    assert_eq!(code, Some(125));
    assert!(stderr.contains("TLS"), "{stderr}");
    assert!(at_admin.all().iter().all(|h| !h.contains("s3cret")));

    let ca = ca.to_str().unwrap();
    let (code, stdout, stderr) = run_under(
        &admin,
        &["--lease-token-file", token, "--admin-ca", ca],
        &child,
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout.trim(),
        format!("http://agent:{TOKEN}@localhost:{}", proxy.port())
    );
    assert!(at_admin
        .all()
        .iter()
        .any(|h| h.contains(&format!("authorization: Bearer {TOKEN}"))));
}

/// Every inherited proxy setting, in any case, is gone in the child; the canonical ones point
/// at the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_clears_every_case_of_every_proxy_variable() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[])).await;
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let (code, stdout, stderr) = run(
        &["run", "--lease", &lease, "--admin", &admin, "--", "env"],
        &[
            ("No_Proxy", "*"),
            ("FTP_PROXY", "http://elsewhere.test:21"),
            ("Socks_Proxy", "socks5://elsewhere.test:1080"),
            ("npm_config_noproxy", "*"),
            ("HTTPS_PROXY", "http://elsewhere.test:3128"),
        ],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    let expected = format!("http://agent:{lease}@{}", server.addr);
    let mut proxies: Vec<&str> = stdout
        .lines()
        .filter(|line| {
            let name = line.split('=').next().unwrap().to_ascii_lowercase();
            name.ends_with("proxy") && name != "node_use_env_proxy"
        })
        .collect();
    proxies.sort();
    assert_eq!(
        proxies,
        [
            format!("ALL_PROXY={expected}"),
            format!("HTTPS_PROXY={expected}"),
            format!("HTTP_PROXY={expected}"),
            // The inherited `No_Proxy=*` is gone; NO_PROXY names the admin API's host alone.
            "NO_PROXY=127.0.0.1".to_owned(),
            format!("all_proxy={expected}"),
            format!("http_proxy={expected}"),
            format!("https_proxy={expected}"),
            "no_proxy=127.0.0.1".to_owned(),
        ]
    );
    server.shutdown().await;
}

/// With the TLS listener the admin API names an `https://` proxy, so `run` (which takes the
/// scheme from it without `--proxy`) gives its child the TLS listener as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_names_an_https_proxy_when_it_serves_tls() {
    let h = Harness::new();
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let (cert_path, key_path) = (
        h.dir.path().join("proxy.pem"),
        h.dir.path().join("proxy.key"),
    );
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.key_pair.serialize_pem()).unwrap();
    let lease = h.lease(&["origin.test"], &[]);
    let mut config = h.serve_config(h.config(&[]), None);
    config.tls = Some((cert_path, key_path));
    let server = leasegate::server::Server::start(config).await.unwrap();
    let (status, view) =
        crate::support::harness::admin_get(&server, &format!("/leases/{lease}")).await;
    assert_eq!(status, 200);
    assert_eq!(view["proxy_url"], format!("https://{}", server.addr));
    let admin = format!("http://{}", server.admin_addr.unwrap());
    let (code, stdout, stderr) = run(
        &[
            "run",
            "--lease",
            &lease,
            "--admin",
            &admin,
            "--",
            "sh",
            "-c",
            "echo $HTTPS_PROXY",
        ],
        &[],
    )
    .await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(
        stdout.trim(),
        format!("https://agent:{lease}@{}", server.addr)
    );
    server.shutdown().await;
}
