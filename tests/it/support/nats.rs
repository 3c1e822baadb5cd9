//! Real `nats-server` processes on loopback for the scale-out tests: one node, or a JetStream
//! cluster of three; nodes can be killed (-9), stopped and started again on the same ports and
//! store directories. Every node runs the accounts and permissions of `deploy/nats/` as shipped:
//! replicas connect as `lg-replica`, bridges as `lg-issuer`, compaction as `lg-compactor`, the
//! read-only commands as `lg-reader`, and the tests' own set-up (and attacks) as `lg-operator`.

use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};
use leasegate::registry::store::NatsLocation;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `nats-server` from Debian's package (`.ci/run` installs it when missing).
pub fn nats_server_bin() -> String {
    std::env::var("NATS_SERVER").unwrap_or_else(|_| "nats-server".to_owned())
}

/// `n` distinct free ports. The listeners are held until all are bound, so one call never
/// hands out the same port twice (the kernel may reuse a port released a moment before).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    held.iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// One `nats-server` with JetStream.
pub struct NatsNode {
    pub name: String,
    pub port: u16,
    config: PathBuf,
    child: Option<Child>,
}

impl NatsNode {
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts (or starts again) the process.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running", self.name);
        let log = std::fs::File::create(self.config.with_extension("log")).unwrap();
        let mut command = Command::new(nats_server_bin());
        for role in Role::ALL {
            command.env(role.password_variable(), role.password());
        }
        let child = command
            .arg("-c")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {}: {e} (install Debian's nats-server; .ci/run does)",
                    nats_server_bin()
                )
            });
        self.child = Some(child);
        // Generous: on a loaded 2-core CI machine a JetStream node can take seconds to listen.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(self.addr()).is_err() {
            assert!(Instant::now() < deadline, "{} did not listen", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Who a client connects as: the users of `deploy/nats/leasegate.conf`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Replica,
    Issuer,
    Compactor,
    Reader,
    Operator,
}

impl Role {
    const ALL: [Role; 5] = [
        Role::Replica,
        Role::Issuer,
        Role::Compactor,
        Role::Reader,
        Role::Operator,
    ];

    fn name(self) -> &'static str {
        match self {
            Role::Replica => "replica",
            Role::Issuer => "issuer",
            Role::Compactor => "compactor",
            Role::Reader => "reader",
            Role::Operator => "operator",
        }
    }

    fn password_variable(self) -> String {
        format!("LG_{}_PASSWORD", self.name().to_uppercase())
    }

    /// Test passwords (a ':' and an '@' in each, percent-encoded in URLs).
    fn password(self) -> String {
        format!("pw:{}@test", self.name())
    }

    fn userinfo(self) -> String {
        format!(
            "lg-{}:{}@",
            self.name(),
            self.password().replace(':', "%3A").replace('@', "%40")
        )
    }
}

/// One node or a cluster, with its temp directory.
pub struct NatsCluster {
    pub nodes: Vec<NatsNode>,
    /// Configurations, logs and stores; removed when the cluster is dropped.
    _dir: tempfile::TempDir,
}

impl NatsCluster {
    /// `n` JetStream nodes (1, or 3 for a cluster), started.
    pub fn start(n: usize) -> NatsCluster {
        NatsCluster::start_with(n, "")
    }

    /// [`NatsCluster::start`] with `extra` appended to every node's configuration.
    pub fn start_with(n: usize, extra: &str) -> NatsCluster {
        NatsCluster::start_configured(n, extra, "")
    }

    /// A cluster of `n` whose nodes do not tell clients of each other (`no_advertise`): a
    /// client given one node stays on it, so killing that node cuts the client off.
    pub fn start_unadvertised(n: usize) -> NatsCluster {
        NatsCluster::start_configured(n, "", "no_advertise: true, ")
    }

    /// `extra` appended to every node's configuration, `cluster` inside its cluster block.
    fn start_configured(n: usize, extra: &str, cluster: &str) -> NatsCluster {
        let dir = tempfile::tempdir().unwrap();
        let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/nats");
        for file in ["leasegate.conf", "permissions.conf"] {
            std::fs::copy(deploy.join(file), dir.path().join(file)).unwrap();
        }
        let free = free_ports(2 * n);
        let ports: Vec<(u16, u16)> = free.chunks(2).map(|p| (p[0], p[1])).collect();
        let mut nodes = Vec::new();
        for (i, (port, route)) in ports.iter().enumerate() {
            let name = format!("n{i}");
            let store = dir.path().join(&name);
            let mut config = format!(
                "include ./leasegate.conf\nserver_name: {name}\nlisten: 127.0.0.1:{port}\njetstream {{ store_dir: \"{}\" }}\n",
                store.display()
            );
            if n > 1 {
                let routes: Vec<String> = ports
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, (_, r))| format!("nats-route://127.0.0.1:{r}"))
                    .collect();
                config.push_str(&format!(
                    "cluster {{ name: lg, {cluster}listen: 127.0.0.1:{route}, routes: [{}] }}\n",
                    routes.join(", ")
                ));
            }
            config.push_str(extra);
            let path = dir.path().join(format!("{name}.conf"));
            std::fs::write(&path, config).unwrap();
            nodes.push(NatsNode {
                name,
                port: *port,
                config: path,
                child: None,
            });
        }
        for node in &mut nodes {
            node.start();
        }
        NatsCluster { nodes, _dir: dir }
    }

    /// `nats://<operator>@<every node>/<stream>`: unrestricted, for the tests' own work.
    pub fn url(&self, stream: &str) -> String {
        self.url_as(Role::Operator, stream)
    }

    /// `nats://<role>@<every node>/<stream>`.
    pub fn url_as(&self, role: Role, stream: &str) -> String {
        let servers: Vec<String> = self.nodes.iter().map(NatsNode::addr).collect();
        format!("nats://{}{}/{stream}", role.userinfo(), servers.join(","))
    }

    pub fn location(&self, stream: &str) -> NatsLocation {
        self.url(stream).parse().unwrap()
    }

    pub fn location_as(&self, role: Role, stream: &str) -> NatsLocation {
        self.url_as(role, stream).parse().unwrap()
    }

    /// `nats://<role>@<node>/<stream>`: one node only.
    pub fn location_of(role: Role, node: &NatsNode, stream: &str) -> NatsLocation {
        format!("nats://{}{}/{stream}", role.userinfo(), node.addr())
            .parse()
            .unwrap()
    }

    /// Waits until JetStream answers (a cluster elects its meta leader first, and on a loaded
    /// 2-core machine the nodes may take over 30 s to see each other as placement peers), then
    /// opens (creating) the journal stream `stream` with one replica per node.
    pub async fn journal(&self, stream: &str) -> NatsStream {
        let options = NatsOptions {
            replicas: self.nodes.len(),
            ..NatsOptions::default()
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match NatsStream::connect(&self.location(stream), &options, &StreamSpec::JOURNAL).await
            {
                Ok(stream) => return stream,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("JetStream never answered: {e}"),
            }
        }
    }
}

/// Publishes every line of a journal file to `stream` (in order, each acknowledged).
pub async fn publish_file(stream: &NatsStream, path: &std::path::Path) {
    let text = tokio::fs::read_to_string(path).await.unwrap();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let subject = stream.subject(value.get("lease_id").and_then(|v| v.as_str()));
        stream
            .publish(subject, line.as_bytes(), None)
            .await
            .unwrap();
    }
}
