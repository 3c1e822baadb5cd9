//! Commands that only read a stream (`leases`, `check`, `journal verify`, `journal export`,
//! `usage --from`) on a stream that does not exist: a clear error naming it, a non-zero exit,
//! and the stream still does not exist afterwards. `serve` still creates it.

use crate::support::harness::Harness;
use crate::support::leasegate;
use crate::support::nats::{NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::nats::{NatsOptions, NatsStream, StreamSpec};

/// Whether `cluster` has a stream named `name` (asked through a stream of its own, whose
/// subjects overlap no leasegate stream's).
async fn exists(cluster: &NatsCluster, name: &str) -> bool {
    let probe = StreamSpec {
        prefix: "lgtest.probe",
        max_age: None,
    };
    let stream = NatsStream::connect(&cluster.location("PROBE"), &NatsOptions::default(), &probe)
        .await
        .unwrap();
    match stream.jetstream.get_stream(name).await {
        Ok(_) => true,
        Err(e) => {
            assert!(e.to_string().contains("stream not found"), "{e}");
            false
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_commands_do_not_create_a_missing_stream() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let h = Harness::new();
    let key = h.key_path.to_str().unwrap();
    // As the operator, who may create streams: only the command decides not to.
    let journal = cluster.url_as(Role::Operator, "NOPE");
    let egress = cluster.url_as(Role::Operator, "NOPE_EGRESS");
    let stream_key = super::usage::stream_key(&h).0.display().to_string();
    let lease = "00000000-0000-4000-8000-000000000000";
    let commands: [(&str, Vec<&str>); 5] = [
        (
            "leases",
            vec!["leases", "--journal", &journal, "--key-file", key],
        ),
        (
            "check",
            vec![
                "check",
                "--journal",
                &journal,
                "--key-file",
                key,
                "--lease",
                lease,
                "origin.test",
            ],
        ),
        ("verify", vec!["verify", &journal]),
        ("journal export", vec!["journal", "export", &journal]),
        (
            "usage",
            vec![
                "usage",
                "--from",
                &egress,
                "--egress-stream-key",
                &stream_key,
            ],
        ),
    ];
    for (name, args) in commands {
        let out = leasegate(&args).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name}: {stderr}");
        let stream = if name == "usage" {
            "NOPE_EGRESS"
        } else {
            "NOPE"
        };
        assert!(
            stderr.contains(&format!("the stream {stream} does not exist")),
            "{name}: {stderr}"
        );
        assert!(!exists(&cluster, stream).await, "{name} created {stream}");
    }
}
