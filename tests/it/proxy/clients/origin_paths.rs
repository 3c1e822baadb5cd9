//! The path normaliser against how real origin stacks resolve the same request targets: Go's
//! `net/http` server (`http.ReadRequest` and a `ServeMux`) and the WHATWG URL parser of Node
//! (what Express, Fastify and browsers use), both run by the test
//! (`tests/data/paths/resolve.{go,cjs}`). `tests/data/paths/origins.tsv` holds each target
//! with what leasegate makes of it and what each stack does; every column is checked, and
//! every path leasegate accepts is shown to be the path both stacks serve.

use super::client;
use super::go::go_client;
use crate::support::{data, missing};
use leasegate::policy::path::normalise;

/// A row's columns, as the table spells them.
#[derive(Debug, PartialEq, Eq)]
struct Row {
    raw: String,
    ours: String,
    go: String,
    node: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_normaliser_resolves_paths_as_go_and_node_origins_do() {
    if missing(
        &["go", "node"],
        "apt-get install golang-go nodejs; .ci/run does",
    ) {
        return;
    }
    let table = std::fs::read_to_string(data("paths/origins.tsv")).unwrap();
    let golden: Vec<Row> = table
        .lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let cols: Vec<&str> = line.split('\t').collect();
            assert_eq!(cols.len(), 4, "{line:?}");
            Row {
                raw: unescape(cols[0]),
                ours: cols[1].to_owned(),
                go: cols[2].to_owned(),
                node: cols[3].to_owned(),
            }
        })
        .collect();
    let raws: Vec<&str> = golden.iter().map(|r| r.raw.as_str()).collect();

    let dir = tempfile::tempdir().unwrap();
    let program = go_client(dir.path(), "../paths/resolve.go", "resolve").await;
    let go = client(program.to_str().unwrap(), &raws, &[], dir.path()).await;
    assert!(
        go.status.success(),
        "{}",
        String::from_utf8_lossy(&go.stderr)
    );
    let script = data("paths/resolve.cjs");
    let mut args = vec![script.to_str().unwrap()];
    args.extend(&raws);
    let node = client("node", &args, &[], dir.path()).await;
    assert!(
        node.status.success(),
        "{}",
        String::from_utf8_lossy(&node.stderr)
    );
    let (go, node) = (lines(&go.stdout), lines(&node.stdout));
    assert_eq!((go.len(), node.len()), (raws.len(), raws.len()));

    let actual: Vec<Row> = raws
        .iter()
        .zip(go.iter().zip(&node))
        .map(|(raw, (go, node))| Row {
            raw: (*raw).to_owned(),
            ours: match normalise(raw) {
                Ok(normal) => normal,
                Err(why) => format!("refused {why:?}"),
            },
            go: go.clone(),
            node: node.clone(),
        })
        .collect();
    let shown: String = actual
        .iter()
        .map(|r| format!("{}\t{}\t{}\t{}\n", escape(&r.raw), r.ours, r.go, r.node))
        .collect();
    assert_eq!(actual, golden, "the table as it is now:\n{shown}");

    // What leasegate accepts is what both stacks serve: Go the decoded path with slashes
    // merged (after its redirect to the clean path), Node the same path with escapes of
    // unreserved characters decoded.
    for row in &actual {
        let Ok(normal) = normalise(&row.raw) else {
            continue;
        };
        let served = row.go.strip_prefix("redirect ").unwrap_or(&row.go);
        assert_eq!(served, go_view(&normal), "Go, for {:?}", row.raw);
        let pathname: String = serde_json::from_str(&row.node).unwrap();
        assert_eq!(
            normalise(&pathname).as_ref(),
            Ok(&normal),
            "Node, for {:?}",
            row.raw
        );
    }
}

/// `normal` as Go's handler would see it: percent-decoded, `//` merged, then shown the way
/// `resolve.go` shows it (bytes outside printable ASCII, and `%`, as `%XX`).
fn go_view(normal: &str) -> String {
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(normal).collect();
    let mut merged: Vec<u8> = Vec::with_capacity(decoded.len());
    for &b in &decoded {
        if !(b == b'/' && merged.last() == Some(&b'/')) {
            merged.push(b);
        }
    }
    merged
        .iter()
        .map(|&b| match b {
            b'!'..=b'~' if b != b'%' => char::from(b).to_string(),
            b => format!("%{b:02X}"),
        })
        .collect()
}

fn lines(out: &[u8]) -> Vec<String> {
    String::from_utf8(out.to_vec())
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The table writes a tab or a backslash in a target as `\t` and `\\`.
fn unescape(cell: &str) -> String {
    cell.replace("\\t", "\t").replace("\\\\", "\\")
}

fn escape(raw: &str) -> String {
    raw.replace('\\', "\\\\").replace('\t', "\\t")
}
