//! Path tricks and what the outputs show, with curl sending each target as written
//! (`--path-as-is`): the route rules and the meter match the path as the origin resolves it,
//! a path origins resolve differently is refused `path-ambiguous` before any secret is put in,
//! the origin gets the resolved path, and no output (the egress line, its copy on the egress
//! stream, the journal, the admin API, the metrics) holds a value, a canary or a placeholder,
//! in any encoding.

use super::brokered::{admin_answers, received, Brokered, CANARY, VALUE};
use super::budgets::{call_body, model_lines, model_view};
use crate::support::harness::*;
use crate::support::model_api::OPENAI_HOST;
use crate::support::model_proxy::ModelProxy;
use crate::support::nats::{NatsCluster, Role};
use leasegate::nats::{NatsOptions, NatsStream};
use leasegate::telemetry::egress_stream::{self, EgressKey, EgressStreamConfig};
use serde_json::json;
use std::time::Duration;

/// curl under `lease` with the target sent as written.
async fn as_is(b: &Brokered, lease: &str, args: &[&str]) -> CurlOutput {
    let mut all = vec!["--path-as-is"];
    all.extend_from_slice(args);
    b.curl(lease, &all).await
}

/// The egress lines of the first `n` requests inside tunnels (each curl's tunnel has a line of
/// its own too).
async fn inside(b: &Brokered, n: usize) -> Vec<serde_json::Value> {
    let lines = b.h.egress_lines(2 * n).await;
    let inside: Vec<_> = lines.into_iter().filter(|l| l["kind"] == "https").collect();
    assert_eq!(inside.len(), n, "{inside:?}");
    inside
}

fn refusal(out: &CurlOutput) -> Option<String> {
    out.header("x-leasegate-refusal")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_tricks_on_a_routed_secret_are_refused_before_anything_is_put_in() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    let bearer = format!("Authorization: Bearer {}", b.placeholder(&lease));
    // Each starts on a route (`GET /repo.git/**`, `GET /big/*`) and leaves it the way some
    // origin stack resolves it.
    for trick in [
        "/repo.git/..;/headers",
        "/repo.git/..;x=1/headers",
        "/repo.git/%2e%2e;/headers",
        "/repo.git/..%3B/headers",
        "/repo.git/a%2F..%2F..%2Fheaders",
        "/repo.git/a%5C..%5C..%5Cheaders",
        "/repo.git/%252e%252e/headers",
        "/repo.git/%c0%ae%c0%ae/headers",
        "/repo.git/a%00/../../headers",
        "/repo.git//../headers",
        "/big/..",
    ] {
        let out = as_is(&b, &lease, &["-H", &bearer, &b.url(trick)]).await;
        assert_eq!(out.status, 400, "{trick}: {}", out.body_text());
        assert_eq!(refusal(&out).as_deref(), Some("path-ambiguous"), "{trick}");
        assert!(
            out.body_text().contains("routes of secret \"github\""),
            "{trick}: {}",
            out.body_text()
        );
    }
    // Not misuse: the lease stays open, nothing was revoked, and the origin was never asked.
    assert_eq!(b.status(&lease).await, "open");
    assert!(b.h.revocations().await.is_empty());
    let lines = inside(&b, 11).await;
    assert!(lines
        .iter()
        .all(|l| l["code"] == "path-ambiguous" && l["status"] == 400));
    assert!(lines
        .iter()
        .all(|l| l["secrets"].as_array().is_none_or(Vec::is_empty)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_are_resolved_and_the_origin_gets_the_resolved_path() {
    let b = Brokered::start().await;
    let lease = b.lease.clone();
    // On a route once resolved: the secret goes in, and the origin is asked for `/request`.
    for path in ["/repo.git/../request", "/big/%2e%2e/request", "/./request"] {
        let out = as_is(&b, &lease, &[&b.url(path)]).await;
        assert_eq!(out.status, 200, "{path}: {}", out.body_text());
        let body = out.body_text();
        assert!(body.starts_with("GET /request\n"), "{path}: {body}");
        let bearer = sha_hex(format!("Bearer {VALUE}").as_bytes());
        assert_eq!(received(&body, "authorization"), Some(bearer), "{path}");
    }
    // Off every route once resolved: refused as outside them, the resolved path named.
    let out = as_is(&b, &lease, &[&b.url("/repo.git/../headers")]).await;
    assert_eq!(out.status, 403, "{}", out.body_text());
    assert_eq!(refusal(&out).as_deref(), Some("route-not-allowed"));
    assert_eq!(b.status(&lease).await, "open");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metered_host_meters_the_resolved_path_and_refuses_an_ambiguous_one() {
    let m = ModelProxy::start().await;
    let port = m.api.origin.addr.port();
    let ca = m.ca_pem.display().to_string();
    let proxy = proxy_url(&m.server, &m.lease);
    let key = format!("Authorization: Bearer {}", m.placeholder("openai"));
    let body = call_body("gpt-4o-mini", false);
    let call = |path: &'static str| {
        let url = format!("https://{OPENAI_HOST}:{port}{path}");
        let args: Vec<String> = [
            "--path-as-is",
            "-x",
            &proxy,
            "--cacert",
            &ca,
            "-H",
            &key,
            "-H",
            "content-type: application/json",
            "--data",
            &body,
            &url,
        ]
        .map(str::to_owned)
        .to_vec();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            curl(&args, &[]).await
        }
    };
    for path in [
        "/v1/chat%2Fcompletions",
        "/v1/chat/completions/..;/",
        "/v1\\chat\\completions",
    ] {
        let out = call(path).await;
        assert_eq!(out.status, 400, "{path}: {}", out.body_text());
        assert_eq!(refusal(&out).as_deref(), Some("path-ambiguous"), "{path}");
        assert!(out.body_text().contains("metered"), "{}", out.body_text());
    }
    assert!(m.api.seen().is_empty(), "an ambiguous call reached the API");
    // Resolved, it is the call: metered, and the API is asked for its own path.
    let out = call("/v1/./chat/%63ompletions").await;
    assert_eq!(out.status, 200, "{}", out.body_text());
    let seen = m.api.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].path, "/v1/chat/completions");
    let lines = model_lines(&m.h.egress, 1).await;
    assert_eq!(lines[0]["model"]["api"], "openai");
    let view = model_view(&m.server, &m.lease).await;
    assert_eq!(view["spent"]["calls"], json!(1));
}

/// `s` with every byte percent-encoded, upper and lower case.
fn encodings(s: &str) -> [String; 2] {
    let upper: String = s.bytes().map(|b| format!("%{b:02X}")).collect();
    [upper.clone(), upper.to_lowercase()]
}

/// Whether `text` holds `needle` raw or in one of its [`encodings`].
fn shows(text: &str, needle: &str) -> bool {
    let [upper, lower] = encodings(needle);
    text.contains(needle) || text.contains(&upper) || text.contains(&lower)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_output_shows_a_value_canary_or_placeholder_from_a_path_or_query() {
    let cluster = NatsCluster::start(1);
    let location = cluster.location_as(Role::Replica, "EGRESS");
    let b = Brokered::start_with(None, |serve| {
        let key = std::env::temp_dir().join(format!("lg-egress-{}.key", std::process::id()));
        EgressKey::write_new(&key).unwrap();
        serve.egress_stream = Some(EgressStreamConfig {
            location,
            nats: NatsOptions::default(),
            max_age: egress_stream::DEFAULT_MAX_AGE,
            backlog: egress_stream::DEFAULT_BACKLOG,
            key: EgressKey::load(&key).unwrap(),
        });
        let _ = std::fs::remove_file(&key);
    })
    .await;
    let (lease, second, stranger) = (b.lease.clone(), b.second.clone(), b.stranger.clone());
    let placeholder = b.placeholder(&second);
    let [encoded_value, _] = encodings(VALUE);
    // The real value in the path (revokes `lease`); the placeholder in a path and a query
    // name where its secret is not for (revokes `second`); the canary, encoded, in a query
    // name, and the value encoded in a path, under a lease the secret does not list (neither
    // is found by the exact scans; both must still be kept out of the outputs).
    let out = as_is(&b, &lease, &[&b.url(&format!("/request/{VALUE}"))]).await;
    assert_eq!(refusal(&out).as_deref(), Some("secret-exposed"));
    let target = format!("/headers/{placeholder}?{placeholder}=1");
    let out = as_is(&b, &second, &[&b.url(&target)]).await;
    assert_eq!(refusal(&out).as_deref(), Some("secret-misdirected"));
    let [encoded_canary, _] = encodings(CANARY);
    let target = format!("/headers/x{encoded_value}y?{encoded_canary}=1");
    let out = as_is(&b, &stranger, &[&b.url(&target)]).await;
    assert_eq!(out.status, 200, "{}", out.body_text());
    let target = format!("/headers/{encoded_value}?{encoded_canary}=1&q={VALUE}");
    let out = as_is(&b, &stranger, &[&b.url(&target)]).await;
    assert_eq!(refusal(&out).as_deref(), Some("secret-exposed"));

    let lines = inside(&b, 4).await;
    let paths: Vec<&str> = lines.iter().map(|l| l["path"].as_str().unwrap()).collect();
    assert_eq!(
        paths,
        [
            "/request/[redacted]",
            "/headers/[redacted]?[redacted]=[redacted]",
            "/headers/[redacted]?[redacted]=[redacted]",
            "/headers/[redacted]?[redacted]=[redacted]&q=[redacted]",
        ]
    );
    let stream = eventually(Duration::from_secs(20), || async {
        let spec = egress_stream::spec(egress_stream::DEFAULT_MAX_AGE);
        let stream =
            NatsStream::connect(&cluster.location("EGRESS"), &NatsOptions::default(), &spec)
                .await
                .ok()?;
        let all = stream.read_all().await.ok()?;
        (all.len() >= 4).then_some(all)
    })
    .await
    .expect("the egress stream never held the four lines");
    let mut outputs: Vec<(String, String)> = stream
        .iter()
        .map(|(seq, payload)| {
            (
                format!("stream #{seq}"),
                String::from_utf8_lossy(payload).into(),
            )
        })
        .collect();
    for file in [&b.h.egress, &b.h.journal] {
        outputs.push((
            file.display().to_string(),
            std::fs::read_to_string(file).unwrap(),
        ));
    }
    outputs.extend(admin_answers(&b, &[&lease, &second, &stranger]).await);
    for (name, text) in &outputs {
        for needle in [VALUE, CANARY, placeholder.as_str(), "lgp_"] {
            assert!(!shows(text, needle), "{name} shows {needle:?}:\n{text}");
        }
    }
    // The stream carried the redacted paths, as the line did.
    assert!(outputs[0].1.contains("[redacted]"), "{}", outputs[0].1);
}
