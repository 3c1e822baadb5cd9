//! The deployment files as a user runs them: the compose file's one-shot tools run with the
//! image's environment (the Dockerfile's `ENV`, the service's `environment`, its entrypoint),
//! with the container paths mapped to a temporary directory. No Docker engine is needed.

use crate::support::bin;
use crate::support::succeeded;
use serde_yaml_ng::Value as Yaml;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

const DOCKERFILE: &str = include_str!("../../../deploy/Dockerfile");
const COMPOSE: &str = include_str!("../../../deploy/compose.yaml");

/// The `ENV` variables of the Dockerfile's last stage (`ENV A=B \` continued lines).
fn image_env() -> BTreeMap<String, String> {
    let last_stage = DOCKERFILE.rsplit("\nFROM ").next().expect("a FROM line");
    let mut env = BTreeMap::new();
    let mut in_env = false;
    for line in last_stage.lines() {
        let line = line.trim();
        let rest = match line.strip_prefix("ENV ") {
            Some(rest) => rest,
            None if in_env => line,
            None => continue,
        };
        in_env = line.ends_with('\\');
        let pair = rest.trim_end_matches('\\').trim();
        let (name, value) = pair.split_once('=').expect("ENV NAME=VALUE");
        env.insert(name.to_owned(), value.to_owned());
    }
    assert!(env.contains_key("LEASEGATE_KEY_FILE"), "{env:?}");
    env
}

/// A compose `${NAME:-default}` with nothing set: the default.
fn interpolate_defaults(value: &str) -> String {
    let mut out = String::new();
    let mut rest = value;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').expect("closing brace") + start;
        let inner = &rest[start + 2..end];
        out.push_str(inner.split_once(":-").map_or("", |(_, default)| default));
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

/// One compose service as a command line: its entrypoint and its environment over the image's,
/// with container paths mapped under `root`.
fn service_command(name: &str, root: &Path) -> Command {
    let compose: Yaml = serde_yaml_ng::from_str(COMPOSE).expect("compose.yaml parses");
    let service = &compose["services"][name];
    let entrypoint: Vec<String> = service["entrypoint"]
        .as_sequence()
        .unwrap_or_else(|| panic!("service {name} has an entrypoint list"))
        .iter()
        .map(|part| part.as_str().expect("string").to_owned())
        .collect();
    assert_eq!(entrypoint[0], "leasegate", "{entrypoint:?}");

    let mut env = image_env();
    if let Some(map) = service["environment"].as_mapping() {
        for (key, value) in map {
            let value = match value {
                Yaml::String(text) => interpolate_defaults(text),
                other => serde_yaml_ng::to_string(other).unwrap().trim().to_owned(),
            };
            env.insert(key.as_str().expect("name").to_owned(), value);
        }
    }
    let mapped = |value: &str| {
        value
            .replace("/run/secrets", &root.join("secrets").display().to_string())
            .replace(
                "/var/lib/leasegate",
                &root.join("state").display().to_string(),
            )
    };
    let mut command = Command::new(bin());
    command
        .args(&entrypoint[1..])
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, mapped(v))))
        .current_dir(root.join("state"));
    command
}

fn stdout_of(command: &mut Command) -> String {
    succeeded(&command.output().expect("runs"))
}

#[test]
fn compose_issuer_and_token_print_one_value_each() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("secrets")).unwrap();
    std::fs::create_dir_all(dir.path().join("state")).unwrap();
    let key = dir.path().join("secrets/leasegate.key");
    stdout_of(Command::new(bin()).args(["keygen", "--out"]).arg(&key));

    // `LEASE_ID=$(docker compose run --rm -T issuer)`
    let printed = stdout_of(&mut service_command("issuer", dir.path()));
    let lease_id = printed.strip_suffix('\n').expect("one line");
    assert!(
        leasegate::contract::lease::is_lease_id(lease_id),
        "issuer printed {printed:?}"
    );
    let journal = std::fs::read_to_string(dir.path().join("state/journal.jsonl")).unwrap();
    assert_eq!(journal.lines().count(), 1, "{journal}");
    assert!(
        journal.contains(&format!("\"lease_id\":\"{lease_id}\"")),
        "{journal}"
    );
    assert!(journal.contains("\"example.com\""), "{journal}");

    // `LEASE_TOKEN=$(docker compose run --rm -T token --lease "$LEASE_ID")`
    let printed = stdout_of(service_command("token", dir.path()).args(["--lease", lease_id]));
    let token = printed.strip_suffix('\n').expect("one line");
    assert!(!token.contains('\n'), "{printed:?}");
    let (id, tag) = token.split_once('.').expect("<lease-id>.<tag>");
    assert_eq!(id, lease_id);
    assert!(!tag.is_empty(), "{printed:?}");

    // Plain `issue` prints the id, the same token and the expiry, one per line.
    let printed = stdout_of(
        Command::new(bin())
            .args(["issue", "--allow-host", "example.org", "--journal"])
            .arg(dir.path().join("state/journal.jsonl"))
            .arg("--key-file")
            .arg(&key),
    );
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(lines.len(), 3, "{printed}");
    assert!(lines[1].starts_with(&format!("{}.", lines[0])), "{printed}");
    assert!(lines[2].starts_with("expires_at "), "{printed}");
    let printed = stdout_of(
        Command::new(bin())
            .args(["token", "--lease", lines[0], "--key-file"])
            .arg(&key),
    );
    assert_eq!(printed.trim_end(), lines[1]);
}

#[test]
fn image_keeps_its_healthcheck_and_a_stripped_binary() {
    assert!(
        DOCKERFILE.contains("HEALTHCHECK")
            && DOCKERFILE.contains("CMD [\"leasegate\", \"health\"]"),
        "the image's health check is `leasegate health`"
    );
    assert!(DOCKERFILE.contains("--format docker"), "podman note");
    assert!(DOCKERFILE.contains("--profile dist"));
    let manifest = include_str!("../../../Cargo.toml");
    let dist = manifest
        .split("[profile.dist]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .expect("a [profile.dist] section");
    assert!(dist.contains("strip = \"symbols\""), "{dist}");
    assert!(dist.contains("split-debuginfo = \"packed\""), "{dist}");
}

/// The image's file system without Docker: `deploy/rootfs.sh` (what the Dockerfile runs) lays
/// the binary and its libraries into a tree, and the binary runs there under chroot with
/// nothing else: it issues, serves, and answers its own health check. Needs root (chroot);
/// CI runs as root.
#[test]
fn image_tree_runs_under_chroot() {
    if !crate::support::is_root() {
        return crate::support::skip("chroot needs root (CI runs as root)");
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("rootfs");
    let status = Command::new("sh")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/rootfs.sh"))
        .arg(bin())
        .arg(&root)
        .status()
        .unwrap();
    assert!(status.success());
    let mut files: Vec<String> = walk(&root)
        .into_iter()
        .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    files.sort();
    assert!(
        files.contains(&"usr/local/bin/leasegate".to_owned()),
        "{files:?}"
    );
    assert!(files.iter().any(|f| f.ends_with("/libc.so.6")), "{files:?}");
    std::fs::create_dir_all(root.join("state")).unwrap();

    let in_image = |args: &[&str]| {
        let mut command = Command::new("/usr/sbin/chroot");
        command
            .arg(&root)
            .arg("/usr/local/bin/leasegate")
            .args(args)
            .env_clear();
        command
    };
    stdout_of(&mut in_image(&["keygen", "--out", "/state/key"]));
    let printed = stdout_of(&mut in_image(&[
        "issue",
        "--journal",
        "/state/journal.jsonl",
        "--key-file",
        "/state/key",
        "--allow-host",
        "example.com",
        "--print",
        "id",
    ]));
    assert!(
        leasegate::contract::lease::is_lease_id(printed.trim_end()),
        "{printed:?}"
    );

    let admin = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let admin_addr = admin.local_addr().unwrap().to_string();
    drop(admin);
    let mut serve = in_image(&[
        "serve",
        "--journal",
        "/state/journal.jsonl",
        "--key-file",
        "/state/key",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        &admin_addr,
        "--data-dir",
        "/state/data",
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let healthy = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(50));
        in_image(&["health", "--admin", &admin_addr])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    let _ = serve.kill();
    let _ = serve.wait();
    assert!(
        healthy,
        "`leasegate health` never passed inside the image tree"
    );
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn compose_binds_lease_ports_only_where_the_agents_are() {
    let compose: Yaml = serde_yaml_ng::from_str(COMPOSE).expect("compose.yaml parses");
    let leasegate = &compose["services"]["leasegate"];
    let bind: std::net::IpAddr = leasegate["environment"]["LEASEGATE_LEASE_PORT_BIND"]
        .as_str()
        .expect("the lease port bind is set")
        .parse()
        .expect("an address");
    assert!(
        !bind.is_unspecified() && !bind.is_loopback(),
        "{bind}: every network, or no other container"
    );
    // The bind is leasegate's own fixed address on `agents`, inside that network's subnet.
    let on_agents = leasegate["networks"]["agents"]["ipv4_address"].as_str();
    assert_eq!(on_agents, Some(bind.to_string().as_str()));
    let agents = &compose["networks"]["agents"];
    assert_eq!(agents["internal"].as_bool(), Some(true));
    let subnet: ipnet::IpNet = agents["ipam"]["config"][0]["subnet"]
        .as_str()
        .expect("a fixed subnet")
        .parse()
        .unwrap();
    assert!(subnet.contains(&bind), "{bind} outside {subnet}");
    // Nothing is published beyond the host's loopback, lease ports least of all.
    for published in leasegate["ports"].as_sequence().expect("ports") {
        let published = published.as_str().unwrap();
        assert!(published.starts_with("127.0.0.1:"), "{published}");
    }
    // Its assignments live on the journal's volume.
    assert_eq!(
        leasegate["environment"]["LEASEGATE_DATA_DIR"].as_str(),
        Some("/var/lib/leasegate")
    );
    let volumes = leasegate["volumes"].as_sequence().unwrap();
    assert!(volumes
        .iter()
        .any(|v| v.as_str() == Some("journal:/var/lib/leasegate")));
}

/// The agent's container mounts nothing and gets no secret: neither the signing key nor the
/// interception CA's key can be read from it; only the proxy's service mounts them.
#[test]
fn compose_gives_the_agent_no_key() {
    let compose: Yaml = serde_yaml_ng::from_str(COMPOSE).expect("compose.yaml parses");
    let agent = &compose["services"]["agent"];
    assert!(agent.get("volumes").is_none(), "{agent:?}");
    assert!(agent.get("secrets").is_none(), "{agent:?}");
    assert!(agent.get("volumes_from").is_none(), "{agent:?}");
    // The brokered-credentials mounts are the proxy's, named where the guide says.
    assert!(COMPOSE.contains("- ./ca:/etc/leasegate/ca:ro"));
    assert!(COMPOSE.contains("LEASEGATE_CA_DIR: /etc/leasegate/ca"));
}

/// Every Kubernetes manifest passes the Kubernetes schemas strictly (`kubernetes-validate`
/// carries them, so no cluster or network is needed; no cluster runs here), and a broken copy
/// of the agent Pod does not, so the check can fail.
#[test]
fn k8s_manifests_pass_the_kubernetes_schemas() {
    let install = "pip install kubernetes-validate; .ci/run does";
    if crate::support::missing(&["kubernetes-validate"], install) {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/k8s");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.iter().any(|f| f.ends_with("agent.yaml")), "{files:?}");
    let validate = |files: &[std::path::PathBuf]| {
        Command::new("kubernetes-validate")
            .arg("--strict")
            .arg("--no-warn")
            .args(files)
            .output()
            .unwrap()
    };
    let out = validate(&files);
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("passed for resource pod/agent"), "{said}");
    let broken = tempfile::tempdir().unwrap();
    let path = broken.path().join("agent.yaml");
    let agent = std::fs::read_to_string(dir.join("agent.yaml")).unwrap();
    let bad = agent.replace(
        "readOnlyRootFilesystem: true",
        "readOnlyRootFilesystem: \"yes\"",
    );
    assert_ne!(bad, agent);
    std::fs::write(&path, bad).unwrap();
    let out = validate(&[path]);
    assert!(!out.status.success(), "a broken Pod passed");
}

/// The agent Pod is one the agents' NetworkPolicy confines (its namespace, its label), whose
/// only way out is leasegate's proxy port: egress to the leasegate pods on 3128 alone, no DNS.
/// Its proxy URL comes from a Secret in every spelling clients read, and it holds no API
/// credentials or service links.
#[test]
fn k8s_agent_pod_leaves_only_through_leasegate() {
    let read = |name: &str| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("deploy/k8s")
                .join(name),
        )
        .unwrap();
        serde_yaml_ng::Deserializer::from_str(&text)
            .map(|doc| Yaml::deserialize(doc).unwrap())
            .collect::<Vec<Yaml>>()
    };
    use serde::Deserialize;
    let pod = read("agent.yaml").remove(0);
    let policies = read("networkpolicy.yaml");
    let policy = policies
        .iter()
        .find(|p| p["metadata"]["name"] == "agents-egress-only-via-leasegate")
        .unwrap();
    assert_eq!(pod["kind"], "Pod");
    assert_eq!(
        pod["metadata"]["namespace"],
        policy["metadata"]["namespace"]
    );
    for (label, value) in policy["spec"]["podSelector"]["matchLabels"]
        .as_mapping()
        .unwrap()
    {
        assert_eq!(&pod["metadata"]["labels"][label.as_str().unwrap()], value);
    }
    assert_eq!(policy["spec"]["policyTypes"][0], "Egress");
    let egress = policy["spec"]["egress"].as_sequence().unwrap();
    assert_eq!(egress.len(), 1, "one way out: {egress:?}");
    assert_eq!(egress[0]["ports"].as_sequence().unwrap().len(), 1);
    assert_eq!(egress[0]["ports"][0]["port"], 3128);
    assert_eq!(
        egress[0]["to"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"],
        "leasegate"
    );
    let spec = &pod["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false);
    assert_eq!(spec["enableServiceLinks"], false);
    let env = spec["containers"][0]["env"].as_sequence().unwrap();
    let names: Vec<&str> = env.iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"]
    );
    for var in env {
        assert_eq!(
            var["valueFrom"]["secretKeyRef"]["name"], "agent-proxy",
            "{var:?}"
        );
        assert!(
            var.get("value").is_none(),
            "a proxy URL in the manifest: {var:?}"
        );
    }
}
