//! `GET /leases/{id}/placeholders`: an entitled lease's placeholders (as the proxy derives
//! them) and the interception CA, only for a caller with the admin token, never a value.

use crate::support::harness::{raw, status_of, Harness};
use leasegate::intercept::ca;
use leasegate::secrets::placeholder;
use leasegate::server::Server;
use serde_json::{json, Value};
use std::time::Duration;

pub(crate) const VALUE: &str = "ghp_placeholdervalue0123456789";
pub(crate) const OTHER_VALUE: &str = "deploy-othervalue-0123456789";
pub(crate) const TOKEN: &str = "s3cret";

/// `github` for the agent `coder`, `deploy` for the agent `deployer`.
const SECRETS: &str = r#"
[[secret]]
id = "github"
hosts = ["origin.test"]
header = "Authorization"
format = "Bearer {value}"
env = "LG_TEST_GITHUB_PAT"
agents = ["coder"]
env_name = "GITHUB_TOKEN"

[[secret]]
id = "deploy"
hosts = ["*.origin.test"]
header = "X-Deploy-Key"
env = "LG_TEST_DEPLOY_KEY"
agents = ["deployer"]
env_name = "DEPLOY_KEY"
"#;

/// `method path` on the admin API with `token` as bearer token: status and body text.
pub(crate) async fn ask(
    server: &Server,
    method: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, String) {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let answer = raw(
        server.admin_addr.unwrap(),
        format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{auth}Content-Type: application/json\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status_of(&answer), body)
}

fn json_of(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The harness's server with `token` as admin token and, if `with_broker`, the secrets of
/// [`SECRETS`] under a CA for `origin.test` (`ca/` in the harness's directory).
pub(crate) async fn start(h: &Harness, token: Option<&str>, with_broker: bool) -> Server {
    let mut config = h.serve_config(h.config(&[]), None);
    config.admin_token = token.map(str::to_owned);
    if with_broker {
        // Origins verified against a CA of their own (the system may have no roots).
        let upstream = ca::make(&["upstream.test".into()], Duration::from_secs(3600)).unwrap();
        let upstream_pem = h.dir.path().join("upstream-ca.pem");
        std::fs::write(&upstream_pem, &upstream.cert_pem).unwrap();
        config.broker = Some(h.broker(
            &["origin.test"],
            SECRETS,
            &[
                ("LG_TEST_GITHUB_PAT", VALUE),
                ("LG_TEST_DEPLOY_KEY", OTHER_VALUE),
            ],
            Some(&upstream_pem),
        ));
    }
    Server::start(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entitled_lease_gets_its_placeholders_and_the_ca() {
    let h = Harness::new();
    let coder = h.lease_for_agent("coder", &["origin.test"]);
    let tester = h.lease(&["origin.test"], &[]);
    let server = start(&h, Some(TOKEN), true).await;
    let ca_pem = std::fs::read_to_string(h.dir.path().join("ca").join("ca.pem")).unwrap();
    let path = |lease: &str| format!("/leases/{lease}/placeholders");
    let mut bodies = Vec::new();

    let (status, body) = ask(&server, "GET", &path(&coder), Some(TOKEN)).await;
    assert_eq!(status, 200, "{body}");
    let answer = json_of(&body);
    assert_eq!(answer["lease"], coder.as_str());
    assert_eq!(
        answer["placeholders"],
        json!([{
            "secret": "github",
            "env": "GITHUB_TOKEN",
            "placeholder": placeholder::derive(&h.key, &coder, "github"),
        }])
    );
    // The CA's certificate, whatever the line endings it was written with.
    assert_eq!(
        answer["ca"].as_str().unwrap().replace('\r', ""),
        ca_pem.replace('\r', "")
    );
    bodies.push(body);

    // A lease whose agent no secret names: none, and still the CA.
    let (status, body) = ask(&server, "GET", &path(&tester), Some(TOKEN)).await;
    assert_eq!(status, 200, "{body}");
    let answer = json_of(&body);
    assert_eq!(answer["placeholders"], json!([]));
    assert!(answer["ca"]
        .as_str()
        .unwrap()
        .starts_with("-----BEGIN CERTIFICATE-----"));
    bodies.push(body);

    // Without the token: refused, saying why; a wrong token is not the admin API's caller.
    let (status, body) = ask(&server, "GET", &path(&coder), None).await;
    assert_eq!(status, 401, "{body}");
    bodies.push(body);
    let (status, body) = ask(&server, "GET", &path(&coder), Some("wrong")).await;
    assert_eq!(status, 401, "{body}");
    bodies.push(body);

    let unknown = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    let (status, body) = ask(&server, "GET", &path(unknown), Some(TOKEN)).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(json_of(&body)["error"], format!("no lease {unknown}"));
    bodies.push(body);
    let (status, body) = ask(&server, "POST", &path(&coder), Some(TOKEN)).await;
    assert_eq!(status, 405, "{body}");
    bodies.push(body);

    for body in &bodies {
        for value in [VALUE, OTHER_VALUE] {
            assert!(!body.contains(value), "an answer holds a value: {body}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_file_nobody_gets_placeholders_and_without_secrets_none_exist() {
    let h = Harness::new();
    let coder = h.lease_for_agent("coder", &["origin.test"]);
    let path = format!("/leases/{coder}/placeholders");

    // No token configured: nobody is authenticated, so nobody is shown a placeholder.
    let open = start(&h, None, true).await;
    let (status, body) = ask(&open, "GET", &path, None).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(
        json_of(&body)["error"],
        "a lease's placeholders are shown only to a caller with the admin token or the \
         lease's own proxy token: send Authorization: Bearer <token> (`leasegate token` mints a \
         lease's)"
    );
    assert!(!body.contains("lgp_"), "{body}");
    // Its own token is enough, even where no admin token is configured.
    let own = leasegate::contract::token::mint(&h.key, &coder);
    let (status, body) = ask(&open, "GET", &path, Some(&own)).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&placeholder::derive(&h.key, &coder, "github")));
    open.shutdown().await;

    // No --secrets: an empty list and no CA.
    let plain = start(&h, Some(TOKEN), false).await;
    let (status, body) = ask(&plain, "GET", &path, Some(TOKEN)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        json_of(&body),
        json!({"lease": coder, "placeholders": [], "ca": null})
    );
}
