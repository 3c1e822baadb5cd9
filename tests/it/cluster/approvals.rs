//! Approvals on a NATS journal: replicas of one stream share `<STREAM>_APPROVALS`, so a
//! decision taken on one releases the call held on another, and a replica started afterwards
//! reads what was decided. Real `nats-server`, replicas with the least-privilege replica user.

use crate::support::harness::{admin_call, eventually, http_origin, raw_to_close, Harness};
use crate::support::nats::{publish_file, NatsCluster, Role};
use crate::support::nats_missing;
use leasegate::registry::{JournalLocation, StoreOptions};
use leasegate::server::Server;
use serde_json::{json, Value};
use std::time::Duration;

const TOKEN: &str = "cluster-approvals-token";

/// A replica of `LG` whose `notes` MCP server is the origin at `port`, with an admin token.
async fn replica(h: &Harness, cluster: &NatsCluster, port: u16, data: &str) -> Server {
    let mut proxy = h.config(&[("origin.test", "127.0.0.1")]);
    let mcp = format!("notes=http://origin.test:{port}/mcp");
    crate::support::harness::with_mcp_server(&mut proxy, &mcp);
    let mut config = h.serve_config(proxy, None);
    config.journal = JournalLocation::Nats(cluster.location_as(Role::Replica, "LG"));
    config.store = StoreOptions {
        data_dir: h.dir.path().join(data),
        ..StoreOptions::default()
    };
    config.store.nats.replicas = cluster.nodes.len();
    config.admin_token = Some(TOKEN.into());
    Server::start(config).await.unwrap()
}

async fn approval(server: &Server, id: &str) -> Value {
    let (_, body) = admin_call(
        server,
        "GET",
        &format!("/approvals/{id}"),
        Some(TOKEN),
        &[],
        "",
    )
    .await;
    serde_json::from_str(&body).unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_on_one_replica_releases_the_call_held_on_another_through_the_stream() {
    if nats_missing() {
        return;
    }
    let cluster = NatsCluster::start(1);
    let stream = cluster.journal("LG").await;
    let h = Harness::new();
    let origin = http_origin().await;
    let port = origin.addr.port();
    let lease = h.lease_from(
        &["origin.test"],
        json!({"allow": {"tools": ["notes/send_mail"]}, "approvals": ["notes/send_mail"]}),
        None,
    );
    publish_file(&stream, &h.journal).await;
    let a = replica(&h, &cluster, port, "a").await;
    let b = replica(&h, &cluster, port, "b").await;
    let body = r#"{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"send_mail"}}"#;
    let call = crate::support::harness::mcp_post_to("origin.test", port, &lease, body);
    let proxy = a.addr;
    let held = tokio::spawn(async move { raw_to_close(proxy, call.as_bytes()).await });
    let id = eventually(Duration::from_secs(20), || async {
        let (_, body) = admin_call(&b, "GET", "/approvals", Some(TOKEN), &[], "").await;
        let listed: Value = serde_json::from_str(&body).ok()?;
        let first = listed["approvals"].get(0)?;
        assert!(
            listed["store"].as_str().unwrap().contains("LG_APPROVALS"),
            "{listed}"
        );
        first["id"].as_str().map(str::to_owned)
    })
    .await
    .expect("replica b lists the call held on a");
    assert_eq!(
        approval(&b, &id).await["replica"],
        approval(&a, &id).await["replica"]
    );
    let (status, answer) = admin_call(
        &b,
        "POST",
        &format!("/approvals/{id}"),
        Some(TOKEN),
        &[],
        r#"{"decision":"approve","reason":"from b"}"#,
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let answer = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the call held on a goes on")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(
        origin.connections.load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    // A replica started now reads the decision from the stream.
    let c = replica(&h, &cluster, port, "c").await;
    let seen = approval(&c, &id).await;
    assert_eq!(seen["status"], "approved", "{seen}");
    assert_eq!(seen["decision"]["reason"], "from b");
}
