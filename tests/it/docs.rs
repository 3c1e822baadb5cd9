//! The reference pages agree with the code: every refusal code (with its status and whether it
//! revokes) is in docs/reference/refusal-codes.md, every metric `/metrics` can expose is in
//! docs/reference/metrics.md, and every relative link in the repository's Markdown resolves.

use crate::support::harness::{admin_text, curl, http_origin, proxy_url, Harness};
use leasegate::policy::Code;
use leasegate::telemetry::egress_stream::StreamFigures;
use leasegate::telemetry::metrics::{render, RegistryFigures};
use leasegate::telemetry::Metrics;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The cells of every table row whose first cell is a `code span`, keyed by that span.
fn table_rows(markdown: &str) -> BTreeMap<String, Vec<String>> {
    let mut rows = BTreeMap::new();
    for line in markdown.lines() {
        let Some(inner) = line.trim().strip_prefix('|') else {
            continue;
        };
        let cells: Vec<String> = inner
            .trim_end_matches('|')
            .split('|')
            .map(|cell| cell.trim().to_owned())
            .collect();
        let Some(name) = cells
            .first()
            .and_then(|c| c.strip_prefix('`'))
            .and_then(|c| c.strip_suffix('`'))
        else {
            continue;
        };
        rows.insert(name.to_owned(), cells[1..].to_vec());
    }
    rows
}

#[test]
fn every_refusal_code_is_in_the_reference_with_its_status_and_revocation() {
    let rows = table_rows(&read("docs/reference/refusal-codes.md"));
    let mut problems = Vec::new();
    for code in Code::ALL {
        let Some(cells) = rows.get(code.as_str()) else {
            problems.push(format!("{code}: missing"));
            continue;
        };
        let status = code.status().as_u16().to_string();
        if cells.first() != Some(&status) {
            problems.push(format!(
                "{code}: status {:?}, the code says {status}",
                cells.first()
            ));
        }
        let revokes = match (code.is_misuse(), code.is_policy()) {
            (true, _) => "always",
            (false, true) => "yes",
            (false, false) => "no",
        };
        if cells.get(1).map(String::as_str) != Some(revokes) {
            problems.push(format!(
                "{code}: revokes {:?}, the code says {revokes}",
                cells.get(1)
            ));
        }
    }
    let known: BTreeSet<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
    for name in rows.keys() {
        if !known.contains(name.as_str()) {
            problems.push(format!("{name}: documented, but no such code"));
        }
    }
    assert!(problems.is_empty(), "refusal-codes.md: {problems:#?}");
}

/// Metric names and types in Prometheus text, as a user queries them: a counter's samples
/// carry `_total`, a histogram's family name is its own.
fn exposed(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .map(|(name, kind)| {
            let name = match kind {
                "counter" if !name.ends_with("_total") => format!("{name}_total"),
                _ => name.to_owned(),
            };
            (name, kind.to_owned())
        })
        .collect()
}

/// Every exposed name is a row of metrics.md with the same type.
fn undocumented(exposed: &BTreeMap<String, String>) -> Vec<String> {
    let rows = table_rows(&read("docs/reference/metrics.md"));
    exposed
        .iter()
        .filter(|(name, kind)| rows.get(*name).and_then(|cells| cells.first()) != Some(kind))
        .map(|(name, kind)| format!("{name} ({kind})"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_a_running_proxy_exposes_is_documented() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["origin.test"], &[]);
    let server = h.start(h.config(&[("origin.test", "127.0.0.1")])).await;
    let url = format!("http://origin.test:{}/", origin.addr.port());
    let proxy = proxy_url(&server, &lease);
    assert_eq!(curl(&["-x", &proxy, &url], &[]).await.status, 200);
    h.egress_lines(1).await;
    let (status, text) = admin_text(&server, "/metrics").await;
    assert_eq!(status, 200);
    let names = exposed(&text);
    assert!(names.contains_key("leasegate_requests_total"), "{text}");
    let missing = undocumented(&names);
    assert!(missing.is_empty(), "not in metrics.md: {missing:#?}");
}

/// The families a running proxy shows only in some configurations (`--egress-stream`, a
/// readable descriptor count) are documented too, and nothing documented is gone.
#[test]
fn every_metric_family_the_renderer_knows_is_documented_and_no_other() {
    let figures = RegistryFigures {
        egress_stream: Some(StreamFigures {
            dropped: 0,
            up: true,
            backlog: 0,
            duplicates: 0,
        }),
        open_fds: Some(10),
        ..RegistryFigures::default()
    };
    let text = render(&Arc::new(Metrics::new(Duration::from_secs(1), 10)), figures);
    let names = exposed(&text);
    let missing = undocumented(&names);
    assert!(missing.is_empty(), "not in metrics.md: {missing:#?}");
    let stale: Vec<String> = table_rows(&read("docs/reference/metrics.md"))
        .into_keys()
        .filter(|name| !names.contains_key(name))
        .collect();
    assert!(stale.is_empty(), "in metrics.md, never exposed: {stale:#?}");
}

/// Every Markdown file of the repository, build outputs and hidden folders left out.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || name == "target" || name == "node_modules" {
            continue;
        }
        if path.is_dir() {
            markdown_files(&path, out);
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The lines of a Markdown file outside fenced code blocks.
fn prose_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            let fence = line.trim_start().starts_with("```");
            fenced ^= fence;
            !fence && !fenced
        })
        .collect()
}

/// The anchors of a Markdown file's headings.
fn anchors(text: &str) -> BTreeSet<String> {
    prose_lines(text)
        .into_iter()
        .filter(|line| line.starts_with('#'))
        .map(|line| anchor(line.trim_start_matches('#')))
        .collect()
}

/// The link targets of a Markdown file, code blocks and code spans left out.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose_lines(text) {
        let prose: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
        let mut rest = prose.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let end = rest.find(')').unwrap_or(rest.len());
            out.push(rest[..end].trim().to_owned());
            rest = &rest[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut files = Vec::new();
    markdown_files(root(), &mut files);
    assert!(files.len() > 10, "{files:?}");
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            let shown = file.strip_prefix(root()).unwrap().display();
            if !target.exists() {
                broken.push(format!("{shown}: {link} (no such file)"));
            } else if !fragment.is_empty()
                && target.extension().is_some_and(|e| e == "md")
                && !anchors(&std::fs::read_to_string(&target).unwrap()).contains(fragment)
            {
                broken.push(format!("{shown}: {link} (no such heading)"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}
