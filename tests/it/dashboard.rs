//! Watching leasegate: the Grafana dashboard's queries against the real `/metrics`.

use crate::harness::{admin_text, curl, http_origin, proxy_url, Harness};
use serde_json::Value;
use std::collections::BTreeSet;

/// The Grafana dashboard shipped in `deploy/grafana`.
const GRAFANA: &str = include_str!("../../deploy/grafana/leasegate.json");

/// The names of the samples in Prometheus text (`name{labels} value` or `name value`).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// The `leasegate_*` metric names a PromQL expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(start) = rest.find("leasegate_") {
        let tail = &rest[start..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Every query string in a dashboard: panel targets' `expr` and template variables'
/// `definition`/`query`.
fn queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "definition" | "query", Value::String(q)) => out.push(q.clone()),
                    _ => queries(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| queries(v, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_grafana_query_reads_a_metric_that_metrics_exposes() {
    let dashboard: Value = serde_json::from_str(GRAFANA).expect("leasegate.json is JSON");
    assert!(dashboard["panels"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));

    // Traffic, so that the per-lease series exist: one allowed call, one refused.
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h
        .start(h.config(&[("origin.test", "127.0.0.1"), ("other.test", "127.0.0.1")]))
        .await;
    let proxy = proxy_url(&server, &lease);
    let port = origin.addr.port();
    let allowed = curl(&["-x", &proxy, &format!("http://origin.test:{port}/")], &[]).await;
    assert_eq!(allowed.status, 200);
    let refused = curl(&["-x", &proxy, &format!("http://other.test:{port}/")], &[]).await;
    assert_eq!(refused.status, 403);
    h.egress_lines(2).await;

    let (status, text) = admin_text(&server, "/metrics").await;
    assert_eq!(status, 200);
    let exposed = sample_names(&text);

    let mut all = Vec::new();
    queries(&dashboard, &mut all);
    let expressions = all.iter().filter(|q| q.contains("leasegate_")).count();
    assert!(expressions >= 10, "only {expressions} queries: {all:?}");
    for query in &all {
        for name in metric_names(query) {
            assert!(
                exposed.contains(&name),
                "{name} (in {query:?}) is not in /metrics; it has {exposed:?}"
            );
        }
    }
    // The metrics the dashboard is for are all there.
    let read: BTreeSet<String> = all.iter().flat_map(|q| metric_names(q)).collect();
    for name in [
        "leasegate_requests_total",
        "leasegate_bytes_total",
        "leasegate_decision_seconds_bucket",
        "leasegate_open_tunnels",
        "leasegate_journal_append_failures_total",
        "leasegate_store_lag_seconds",
        "leasegate_store_reconnects_total",
        "leasegate_store_pending_appends",
    ] {
        assert!(read.contains(name), "the dashboard does not show {name}");
    }
}
