//! A `nats-server` with JetStream (Debian's package) for the benchmarks that need a stream.
//!
//! Invariant: the server listens on loopback only, keeps its store in a directory of its own,
//! and is killed when its handle drops.
#![allow(dead_code)] // not every benchmark needs a stream

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One `nats-server -js` on a free loopback port, killed on drop.
pub struct Nats {
    child: Child,
    pub port: u16,
    _dir: tempfile::TempDir,
}

impl Nats {
    /// A server whose configuration file also holds `extra` (e.g. `max_payload: 65536`).
    pub fn start_with(extra: &str) -> Nats {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let config = dir.path().join("nats.conf");
        let store = dir.path().join("store");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\njetstream {{ store_dir: {:?} }}\n{extra}",
                store.display().to_string()
            ),
        )
        .unwrap();
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("nats-server (Debian's package) is needed: {e}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not listen");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nats {
            child,
            port,
            _dir: dir,
        }
    }

    /// The journal URL of `stream` on this server.
    pub fn url(&self, stream: &str) -> String {
        format!("nats://127.0.0.1:{}/{stream}", self.port)
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
