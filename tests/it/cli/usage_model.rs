//! `leasegate usage` over model calls: per-lease token and cost columns, and `--format record`,
//! the lease record's `usage` object, for one lease or its subtree.

use crate::support::{granted_line, id, key, lease, leasegate, leasegate_ok};
use serde_json::{json, Value};

/// P, its child C, C's child G, and X beside them; E made no calls.
const P: u32 = 1;
const C: u32 = 2;
const G: u32 = 3;
const X: u32 = 4;
const E: u32 = 5;

fn model_line(lease: u32, model: Value) -> String {
    json!({
        "time": "2026-12-01T10:00:00.000Z", "lease_id": id(lease), "host": "api.openai.test",
        "verdict": "allow", "code": null, "bytes_up": 10, "bytes_down": 20, "kind": "https",
        "method": "POST", "path": "/v1/chat/completions", "model": model,
    })
    .to_string()
}

fn priced(input: u64, output: u64, cost: f64) -> Value {
    json!({"api": "openai", "name": "gpt-4o-mini", "input_tokens": input, "output_tokens": output, "cached_tokens": 0, "cost_usd": cost})
}

/// The egress log, the journal and the key file, in `dir`.
fn files(dir: &std::path::Path) -> (String, String, String) {
    let egress = [
        model_line(P, priced(10, 5, 0.001)),
        model_line(P, priced(20, 5, 0.002)),
        model_line(C, priced(100, 50, 0.01)),
        model_line(G, json!({"api": "anthropic", "name": null, "unmetered": "no usage in the response"})),
        model_line(X, json!({"api": "openai", "name": "mystery", "input_tokens": 7, "output_tokens": 3, "cached_tokens": 2, "cost_usd": null, "unpriced": true})),
        json!({"time": "2026-12-01T10:00:01.000Z", "lease_id": id(X), "host": "a.test", "verdict": "allow", "code": null, "bytes_up": 1, "bytes_down": 1}).to_string(),
    ];
    let key = key(9);
    let window = ("2026-12-01T09:00:00.000Z", "2099-01-01T00:00:00.000Z");
    let journal: Vec<String> = [(P, None), (C, Some(P)), (G, Some(C)), (X, None), (E, None)]
        .into_iter()
        .map(|(n, parent)| {
            let parent = parent.map(id);
            let signed = lease(&key, &id(n), parent.as_deref(), window, &["*"], &[]);
            granted_line(&signed, window.0)
        })
        .collect();
    let paths = ["egress.jsonl", "journal.jsonl", "lease.key"].map(|name| dir.join(name));
    std::fs::write(&paths[0], egress.join("\n") + "\n").unwrap();
    std::fs::write(&paths[1], journal.join("\n") + "\n").unwrap();
    std::fs::write(&paths[2], key.to_file_text()).unwrap();
    let [egress, journal, key] = paths.map(|p| p.to_str().unwrap().to_owned());
    (egress, journal, key)
}

/// The lease record schema's `usage` definition, compiled.
fn usage_schema() -> jsonschema::Validator {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schemas/lease-record.schema.json"
    );
    let record: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let schema = json!({"$ref": "#/definitions/usage", "definitions": record["definitions"]});
    jsonschema::draft7::new(&schema).unwrap()
}

async fn record(egress: &str, lease: u32, more: &[&str]) -> Value {
    let lease = id(lease);
    let mut args = vec![
        "usage", "--from", egress, "--lease", &lease, "--format", "record",
    ];
    args.extend_from_slice(more);
    let out = leasegate_ok(&args).await;
    assert_eq!(out.lines().count(), 1, "{out}");
    let record: Value = serde_json::from_str(&out).unwrap();
    let schema = usage_schema();
    assert!(schema.is_valid(&record), "{record} is not a usage object");
    record
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_record_holds_what_was_measured_and_counts_what_was_not() {
    let dir = tempfile::tempdir().unwrap();
    let (egress, journal, key) = files(dir.path());
    assert!(
        !usage_schema().is_valid(&json!({"tokens": -1})),
        "the schema check can fail"
    );
    let p = id(P);
    let printed = leasegate_ok(&[
        "usage", "--from", &egress, "--lease", &p, "--format", "record",
    ])
    .await;
    assert_eq!(
        printed,
        "{\"tokens\":40,\"cost_usd\":0.003,\"model_calls\":2,\"unmetered_calls\":0,\"unpriced_calls\":0}\n",
        "the contract's members first"
    );

    assert_eq!(
        record(&egress, P, &[]).await,
        json!({"tokens": 40, "cost_usd": 0.003, "model_calls": 2, "unmetered_calls": 0, "unpriced_calls": 0})
    );
    // A metered call without a price: tokens are known, the cost is not.
    assert_eq!(
        record(&egress, X, &[]).await,
        json!({"tokens": 10, "model_calls": 1, "unmetered_calls": 0, "unpriced_calls": 1})
    );
    // Only an unmetered call: neither is known.
    assert_eq!(
        record(&egress, G, &[]).await,
        json!({"model_calls": 1, "unmetered_calls": 1, "unpriced_calls": 0})
    );
    assert_eq!(
        record(&egress, E, &[]).await,
        json!({"model_calls": 0, "unmetered_calls": 0, "unpriced_calls": 0})
    );
    let subtree = ["--subtree", "--journal", &journal, "--key-file", &key];
    assert_eq!(
        record(&egress, P, &subtree).await,
        json!({"tokens": 190, "cost_usd": 0.013, "model_calls": 4, "unmetered_calls": 1, "unpriced_calls": 0})
    );
    assert_eq!(
        record(&egress, C, &subtree).await,
        json!({"tokens": 150, "cost_usd": 0.01, "model_calls": 2, "unmetered_calls": 1, "unpriced_calls": 0})
    );

    // Refused before reading anything: a record is one lease's, a subtree needs the journal.
    let out = leasegate(&["usage", "--from", &egress, "--format", "record"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");

    let out = leasegate(&["usage", "--from", &egress, "--lease", &p, "--subtree"]).await;
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = leasegate(&[
        "usage", "--from", &egress, "--lease", "_", "--format", "record",
    ])
    .await;
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("needs a lease id"),
        "{out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_shows_model_columns_and_the_json_a_model_object() {
    let dir = tempfile::tempdir().unwrap();
    let (egress, journal, key) = files(dir.path());
    let table = leasegate_ok(&["usage", "--from", &egress]).await;
    let rows: Vec<&str> = table.lines().collect();
    assert!(
        rows[0].ends_with(
            "MODEL_CALLS  TOKENS_IN  TOKENS_OUT  CACHED  TOKENS  COST_USD  UNMETERED  UNPRICED"
        ),
        "{table}"
    );
    let row = |n: u32| {
        rows.iter()
            .find(|r| r.starts_with(&id(n)))
            .copied()
            .unwrap()
    };
    let cells = |n: u32| row(n).split_whitespace().rev().take(8).collect::<Vec<_>>();
    assert_eq!(
        cells(P),
        ["0", "0", "0.003", "40", "0", "10", "30", "2"],
        "{table}"
    );
    assert_eq!(
        cells(X),
        ["1", "0", "-", "10", "2", "3", "7", "1"],
        "{table}"
    );

    let json = leasegate_ok(&["usage", "--from", &egress, "--format", "json"]).await;
    let lines: Vec<Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |n: u32| lines.iter().find(|l| l["lease_id"] == id(n)).unwrap();
    assert_eq!(
        of(C)["model"],
        json!({"calls": 1, "input_tokens": 100, "output_tokens": 50, "cached_tokens": 0, "tokens": 150, "cost_usd": 0.01, "unmetered": 0, "unpriced": 0})
    );
    assert_eq!(of(G)["model"]["unmetered"], 1);
    assert_eq!(of(G)["model"]["cost_usd"], Value::Null);

    // --subtree keeps the rows of the lease and its descendants.
    let c = id(C);
    let json = leasegate_ok(&[
        "usage",
        "--from",
        &egress,
        "--json",
        "--lease",
        &c,
        "--subtree",
        "--journal",
        &journal,
        "--key-file",
        &key,
    ])
    .await;
    let mut leases: Vec<String> = json
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["lease_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    leases.sort();
    assert_eq!(leases, [id(C), id(G)]);
}
