//! `POST /leases` on replicas sharing one stream: a parent's `fan_out` holds when children are
//! asked for at the same instant on two replicas, and an idempotency key names one lease on
//! every replica.

use super::scale_out::replica;
use crate::support::harness::{admin_call, admin_get, Harness};
use crate::support::nats::NatsCluster;
use crate::support::nats_missing;
use leasegate::server::Server;
use serde_json::{json, Value};

async fn post(server: &Server, headers: &[(&str, &str)], body: &Value) -> (u16, Value) {
    let (status, text) =
        admin_call(server, "POST", "/leases", None, headers, &body.to_string()).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
    )
}

fn asking(host: &str, budget: Value, parent: Option<&str>) -> Value {
    let mut body = json!({
        "manifest": {"agent": {"name": "w"}, "intent": {"purpose": "replicas"},
                     "allow": {"hosts": [host]}, "budget": budget},
        "lifetime_seconds": 600,
    });
    if let Some(parent) = parent {
        body["parent_lease_id"] = parent.into();
    }
    body
}

/// A one-node NATS cluster with two replicas on its stream `LG` (`None`: no nats-server, and
/// not in CI).
async fn two_replicas() -> Option<(NatsCluster, Harness, Server, Server)> {
    if nats_missing() {
        return None;
    }
    let cluster = NatsCluster::start(1);
    let _stream = cluster.journal("LG").await;
    let h = Harness::new();
    let a = replica(&h, &cluster, "LG", "a").await;
    let c = replica(&h, &cluster, "LG", "c").await;
    Some((cluster, h, a, c))
}

/// How many children of `parent` replica `server` lists.
async fn children(server: &Server, parent: &str) -> usize {
    let (status, page) = admin_get(server, &format!("/leases?parent={parent}")).await;
    assert_eq!(status, 200, "{page}");
    page["leases"].as_array().unwrap().len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_never_exceed_a_parents_fan_out() {
    let Some((_cluster, _h, a, c)) = two_replicas().await else {
        return;
    };
    for round in 0..10 {
        let (status, parent) =
            post(&a, &[], &asking("*.x.test", json!({"fan_out": 1}), None)).await;
        assert_eq!(status, 201, "{parent}");
        let id = parent["lease_id"].as_str().unwrap();
        // Served on the other replica too before the race starts.
        crate::support::harness::eventually(std::time::Duration::from_secs(10), || async {
            (admin_get(&c, &format!("/leases/{id}")).await.0 == 200).then_some(())
        })
        .await
        .expect("the parent reaches the other replica");
        let body = asking("a.x.test", json!({}), Some(id));
        let ((sa, va), (sc, vc)) = tokio::join!(post(&a, &[], &body), post(&c, &[], &body));
        let mut statuses = [sa, sc];
        statuses.sort();
        assert_eq!(statuses, [201, 409], "round {round}: {va} {vc}");
        let refused = if sa == 409 { &va } else { &vc };
        assert_eq!(
            refused["reasons"],
            json!(["vendor:leasegate:fan-out-full"]),
            "{refused}"
        );
        let granted = if sa == 201 { (&a, &va) } else { (&c, &vc) };
        let child = granted.1["lease_id"].as_str().unwrap();
        for replica in [&a, &c] {
            crate::support::harness::eventually(std::time::Duration::from_secs(10), || async {
                (admin_get(replica, &format!("/leases/{child}")).await.0 == 200).then_some(())
            })
            .await
            .expect("the granted child is on both replicas");
            assert_eq!(children(replica, id).await, 1, "round {round}");
        }
        let _ = granted.0;
    }
    a.shutdown().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_names_one_lease_on_every_replica() {
    let Some((_cluster, _h, a, c)) = two_replicas().await else {
        return;
    };
    for round in 0..10 {
        let key = format!("job-{round}");
        let headers = [("Idempotency-Key", key.as_str())];
        let body = asking("k.test", json!({"tokens": 10}), None);
        let ((sa, va), (sc, vc)) =
            tokio::join!(post(&a, &headers, &body), post(&c, &headers, &body));
        assert!(
            matches!(sa, 200 | 201) && matches!(sc, 200 | 201),
            "{va} {vc}"
        );
        assert_eq!(va["lease_id"], vc["lease_id"], "round {round}");
        // A retry on either replica finds it; another body under the key is refused.
        let (status, again) = post(&c, &headers, &body).await;
        assert_eq!((status, &again["lease_id"]), (200, &va["lease_id"]));
        let other = asking("k.test", json!({"tokens": 11}), None);
        let (status, _) = post(&a, &headers, &other).await;
        assert_eq!(status, 422);
    }
    let (_, page) = admin_get(&a, "/leases?counts=true").await;
    assert_eq!(page["total"], 10, "one lease per key: {page}");
    a.shutdown().await;
    c.shutdown().await;
}
