//! `leasegate run` and Deno and Bun: each runtime's own `fetch` reads the proxy variables
//! `run` sets, for `https://` and `http://` URLs, with the proxy's default kinds of port (the
//! HTTPS origin's open to tunnels, the plain one's to forwarded requests), in a network
//! namespace with only loopback, so a runtime that went around the proxy would fail. What a
//! refusal looks like to each is pinned here and in docs/guide/clients.md.

use crate::cli::run_node::RunSetup;
use crate::cli::run_trust::run;
use crate::proxy::clients::node::runtime_in_cache;
use crate::support::netns::in_loopback_only_namespace;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deno_and_bun_fetch_reach_the_proxy_under_run() {
    let (Some(deno), Some(bun)) = (
        runtime_in_cache("@deno/linux-x64-glibc/deno"),
        runtime_in_cache("@oven/bun-linux-x64/bin/bun"),
    ) else {
        return;
    };
    if !in_loopback_only_namespace().await {
        return;
    }
    let s = RunSetup::start().await;
    let (h, lease, admin, ca, urls) = (&s.h, &s.lease, &s.admin, &s.ca, &s.urls);
    let script = crate::support::data("clients/fetch_all.mjs");
    let (deno, bun) = (deno.to_str().unwrap(), bun.to_str().unwrap());
    let deno_env = [("DENO_CERT", ca.as_str()), ("DENO_NO_UPDATE_CHECK", "1")];
    let bun_env = [("NODE_EXTRA_CA_CERTS", ca.as_str()), ("DO_NOT_TRACK", "1")];
    let runtimes = [
        (
            "deno",
            vec![deno, "run", "--allow-net", "--allow-env"],
            deno_env,
        ),
        ("bun", vec![bun], bun_env),
    ];
    for (name, command, env) in runtimes {
        let mut args = vec!["run", "--lease", &lease, "--admin", &admin, "--"];
        args.extend(command);
        args.push(script.to_str().unwrap());
        args.extend(urls.iter().map(String::as_str));
        let (code, stdout, stderr) = run(&args, &env).await;
        assert_eq!(code, Some(0), "{name}: {stdout}\n{stderr}");
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), 4, "{name}: {stdout}\n{stderr}");
        for (url, line) in urls.iter().zip(&lines[..2]) {
            assert_eq!(
                *line,
                format!("{url} status 200 hello from origin"),
                "{name}: {stderr}"
            );
        }
        // A refused tunnel: Bun names the status and the code, Deno neither.
        let refused = match name {
            "deno" => format!(
                "{} error fetch failed | error sending request for url ({}): client error \
                 (Connect): unsuccessful tunnel",
                urls[2], urls[2]
            ),
            _ => format!(
                "{} error Proxy refused to open a tunnel: 403 host-denied",
                urls[2]
            ),
        };
        assert_eq!(lines[2], refused, "{name}: {stderr}");
        // A refused forwarded request is an answer: the proxy's one-line body.
        let forwarded = format!("{} status 403 leasegate refused GET denied.test:", urls[3]);
        assert!(lines[3].starts_with(&forwarded), "{name}: {stdout}");
        assert!(lines[3].contains(": host-denied ("), "{name}: {stdout}");
        assert!(!stderr.contains("Warning"), "{name}: {stderr}");
    }
    // Each runtime's four calls, under the lease: `https://` ones as tunnels, `http://` ones
    // forwarded (both runtimes send absolute-form requests).
    let lines = h.egress_lines(8).await;
    assert!(
        lines.iter().all(|l| l["lease_id"] == lease.as_str()),
        "{lines:#?}"
    );
    let kinds = |kind: &str| lines.iter().filter(|l| l["kind"] == kind).count();
    assert_eq!((kinds("connect"), kinds("http")), (4, 4), "{lines:#?}");
}
