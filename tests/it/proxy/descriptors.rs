//! File descriptors: a proxy under a low descriptor limit fits its connection limit under it
//! (or refuses to start), and whatever one lease holder's connections take, it still reads
//! revocations, answers `/healthz` and logs its failed accepts once.

use crate::live::follow::revoke_cli;
use crate::support::harness::Harness;
use crate::support::leasegate_command_under;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A `serve` child under a descriptor limit, and its stderr, collected line by line.
pub(crate) struct Served {
    child: Child,
    pub(crate) proxy: SocketAddr,
    pub(crate) admin: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
}

/// `serve` on `h`'s journal with an admin API, `origin.test` on loopback, one connection
/// worker, silent connections kept a minute, and `more`.
fn serve_args<'a>(h: &'a Harness, more: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--journal",
        h.journal.to_str().unwrap(),
        "--key-file",
        h.key_path.to_str().unwrap(),
        "--resolve",
        "origin.test=127.0.0.1",
        "--allow-private",
        "127.0.0.1/32",
        "--worker-threads",
        "1",
        "--header-read-timeout",
        "60s",
    ];
    args.extend_from_slice(more);
    args
}

impl Served {
    /// [`serve_args`] under `ulimit {limit}`.
    pub(crate) fn start(h: &Harness, limit: &str, more: &[&str]) -> Served {
        Served::start_with_env(h, limit, more, &[])
    }

    /// [`Served::start`] with `env` added to the proxy's environment.
    pub(crate) fn start_with_env(
        h: &Harness,
        limit: &str,
        more: &[&str],
        env: &[(&str, &str)],
    ) -> Served {
        let mut child = leasegate_command_under(limit, &serve_args(h, more))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (lines, pipe) = (stderr.clone(), child.stderr.take().unwrap());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        let mut banner = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut banner)
            .unwrap();
        let logs = || stderr.lock().unwrap().join("\n");
        let proxy = banner
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no banner: {banner:?}\n{}", logs()));
        let deadline = Instant::now() + Duration::from_secs(10);
        let admin = loop {
            let found = stderr.lock().unwrap().iter().find_map(|line| {
                let (_, rest) = line.split_once("admin_addr=")?;
                rest.split_whitespace().next()?.parse().ok()
            });
            if let Some(admin) = found {
                break admin;
            }
            assert!(Instant::now() < deadline, "no admin address\n{}", logs());
            std::thread::sleep(Duration::from_millis(10));
        };
        Served {
            child,
            proxy,
            admin,
            stderr,
        }
    }

    /// Sends the proxy `signal`.
    pub(crate) fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, signal).unwrap();
    }

    pub(crate) fn logs(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Lines of stderr that report a failed accept.
    fn accept_failure_lines(&self) -> usize {
        self.stderr
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("accept failed") || l.contains("accept still failing"))
            .count()
    }

    /// Sets the running proxy's descriptor limit.
    fn set_limit(&self, soft: u64, hard: u64) {
        let out = std::process::Command::new("prlimit")
            .arg(format!("--pid={}", self.child.id()))
            .arg(format!("--nofile={soft}:{hard}"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An origin that echoes what it is sent.
pub(crate) async fn echo_origin() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    port
}

/// A CONNECT tunnel of `lease` to the echo origin, echoing, or `None` (refused, or not
/// answered within 5 s).
pub(crate) async fn tunnel(proxy: SocketAddr, lease: &str, port: u16) -> Option<TcpStream> {
    let attempt = async {
        let mut stream = TcpStream::connect(proxy).await.ok()?;
        let request = format!("CONNECT origin.test:{port} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if stream.read(&mut byte).await.ok()? == 0 {
                return None;
            }
            head.push(byte[0]);
        }
        if !head.starts_with(b"HTTP/1.1 200") {
            return None;
        }
        // Bytes through it: a spliced tunnel takes its pipes.
        stream.write_all(b"ping").await.ok()?;
        let mut echo = [0u8; 4];
        stream.read_exact(&mut echo).await.ok()?;
        (&echo == b"ping").then_some(stream)
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .ok()
        .flatten()
}

/// As many of `n` tunnels at once as open and echo.
pub(crate) async fn tunnels(proxy: SocketAddr, lease: &str, port: u16, n: usize) -> Vec<TcpStream> {
    let attempts = (0..n).map(|_| tunnel(proxy, lease, port));
    futures_util::future::join_all(attempts)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Connections that send half a request head and wait, as many of `n` as connect in 5 s.
pub(crate) async fn pending(proxy: SocketAddr, n: usize) -> Vec<TcpStream> {
    let attempts = (0..n).map(|_| async move {
        let attempt = async {
            let mut stream = TcpStream::connect(proxy).await.ok()?;
            stream
                .write_all(b"GET http://origin.test/ HTTP/1.1\r\n")
                .await
                .ok()?;
            Some(stream)
        };
        tokio::time::timeout(Duration::from_secs(5), attempt)
            .await
            .ok()
            .flatten()
    });
    futures_util::future::join_all(attempts)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// How many of `tunnels` are still open after `limit` (a closed one reads its end).
async fn still_open(tunnels: Vec<TcpStream>, limit: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + limit;
    let waits = tunnels.into_iter().map(|mut stream| async move {
        let mut buf = [0u8; 64];
        loop {
            match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
                Err(_) => return 1,
                Ok(Ok(0)) | Ok(Err(_)) => return 0,
                Ok(Ok(_)) => {}
            }
        }
    });
    futures_util::future::join_all(waits)
        .await
        .into_iter()
        .sum()
}

/// The status and body of `GET path` on the admin API, or `None` (no answer within 5 s).
async fn admin_get(admin: SocketAddr, path: &str) -> Option<(u16, String)> {
    let attempt = async {
        let mut stream = TcpStream::connect(admin).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.ok()?;
        let status = answer.get(9..12)?.parse().ok()?;
        let body = answer.split_once("\r\n\r\n")?.1.to_owned();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), attempt)
        .await
        .ok()
        .flatten()
}

/// Under a limit of 512 descriptors, one lease holder opens 150 echoing tunnels and 300
/// connections that never finish their head. Before, the proxy kept 10,000 connections under
/// 512 descriptors and reopened the journal on every poll: accepts took every descriptor
/// freed, the operator's revocation was never read and the tunnels kept relaying, `/healthz`
/// went unanswered, and `accept failed` was logged every 50 ms. Now the connection limit fits
/// under the descriptors, the journal stays open, and none of that happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_flood_under_a_low_descriptor_limit_delays_no_revocation() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let port = echo_origin().await;
    let served = Served::start(&h, "-n 512", &[]);

    let tunnels = tunnels(served.proxy, &lease, port, 150).await;
    assert!(
        tunnels.len() >= 20,
        "{} tunnels\n{}",
        tunnels.len(),
        served.logs()
    );
    let _pending = pending(served.proxy, 300).await;

    let (status, _) = admin_get(served.admin, "/healthz")
        .await
        .unwrap_or_else(|| panic!("/healthz did not answer\n{}", served.logs()));
    assert_eq!(status, 200);
    // As an operator does: `leasegate revoke`, appending to the journal.
    revoke_cli(&h, &lease).await;
    let open = tunnels.len();
    let left = still_open(tunnels, Duration::from_secs(5)).await;
    assert_eq!(
        left,
        0,
        "{left} of {open} tunnels still open 5 s after the revocation\n{}",
        served.logs()
    );
    assert!(
        served.accept_failure_lines() <= 2,
        "the accept failures flood the log\n{}",
        served.logs()
    );
}

/// Descriptors run out under a running proxy (its limit lowered below what it holds: as when
/// anything but connections takes them). Before, `/healthz` went unanswered, the follower could
/// not open the journal, so the revocation was never read, and every failed accept was logged.
/// Now the admin API takes the spare descriptor, `/readyz` says why it is not ready, the held
/// journal is read, the failures are logged once and counted, and all recovers with the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_running_out_under_a_running_proxy_leave_revocation_and_health_working() {
    let h = Harness::new();
    let lease = h.lease(&["origin.test"], &[]);
    let port = echo_origin().await;
    let served = Served::start(&h, "-n 1024", &["--max-connections", "100"]);
    let tunnels = tunnels(served.proxy, &lease, port, 60).await;
    assert_eq!(tunnels.len(), 60, "{}", served.logs());

    served.set_limit(64, 1024);
    // Waiting in the backlog: every accept fails, every 50 ms, for a second and more.
    let _waiting = pending(served.proxy, 20).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let (status, body) = admin_get(served.admin, "/healthz")
        .await
        .unwrap_or_else(|| panic!("/healthz did not answer\n{}", served.logs()));
    assert_eq!((status, body.trim()), (200, r#"{"status":"ok"}"#));
    let (status, body) = admin_get(served.admin, "/readyz")
        .await
        .unwrap_or_else(|| panic!("/readyz did not answer\n{}", served.logs()));
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("out of file descriptors"), "{body}");

    // As an operator does: `leasegate revoke`, appending to the journal.
    revoke_cli(&h, &lease).await;
    let left = still_open(tunnels, Duration::from_secs(5)).await;
    assert_eq!(
        left,
        0,
        "tunnels still open after the revocation\n{}",
        served.logs()
    );
    assert_eq!(
        served.accept_failure_lines(),
        1,
        "said once, then counted\n{}",
        served.logs()
    );

    served.set_limit(1024, 1024);
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        if let Some((200, _)) = admin_get(served.admin, "/readyz").await {
            break admin_get(served.admin, "/metrics").await.unwrap().1;
        }
        assert!(
            Instant::now() < deadline,
            "never ready again\n{}",
            served.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let failed: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix(r#"leasegate_accept_errors_total{listener="proxy"} "#))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(failed >= 10, "{metrics}");
    assert!(metrics.contains("process_max_fds 1024"), "{metrics}");
}

/// The descriptor limit is raised to the hard limit at start; the default connection limit is
/// lowered to what fits under it, and said; an operator's own number that cannot fit stops the
/// start, naming the numbers and the fixes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_limit_fits_under_the_descriptor_limit_or_the_start_stops() {
    let h = Harness::new();
    // 96 fixed, 4 for the one worker, 64 kept free: 164; 7 per connection.
    let served = Served::start(&h, "-n 256", &[]);
    let logs = served.logs();
    assert!(
        logs.contains("serving at most 13 connections") && logs.contains("limit=256"),
        "{logs}"
    );
    let _held = pending(served.proxy, 13).await;
    let mut one_more = TcpStream::connect(served.proxy).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), one_more.read_to_string(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(
        answer.starts_with("HTTP/1.1 429")
            && answer.contains("too-many-connections (all 13 in use)"),
        "{answer}"
    );
    drop(served);

    let served = Served::start(&h, "-Sn 256 && ulimit -Hn 4096", &[]);
    let logs = served.logs();
    assert!(
        logs.contains("file descriptor limit raised to the hard limit from=256 to=4096")
            && logs.contains("WARN leasegate::descriptors: the file descriptor limit is too low")
            && logs.contains("serving at most 561 connections"),
        "{logs}"
    );
    drop(served);

    // Room for 2,833 connections: the default is lowered without a warning.
    let served = Served::start(&h, "-n 20000", &[]);
    let logs = served.logs();
    assert!(
        logs.contains("INFO leasegate::descriptors: serving at most 2833 connections")
            && !logs.contains("WARN leasegate::descriptors"),
        "{logs}"
    );
    drop(served);

    let mut child =
        leasegate_command_under("-n 256", &serve_args(&h, &["--max-connections", "1000"]))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    let _ = child.wait();
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{stderr}");
    assert!(
        stderr.contains(
            "leasegate: --max-connections 1000 needs 7164 file descriptors (7 per connection, \
             164 besides) but the limit is 256 (hard 256): raise it"
        ) && stderr.contains("or lower --max-connections to 13 at most"),
        "{stderr}"
    );
}
