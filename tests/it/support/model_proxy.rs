//! A proxy brokering the keys of the fake model API ([`ModelApi`]): OpenAI's secret (for
//! `api.openai.test`, put in as `Authorization: Bearer {value}`) and Anthropic's (for
//! `api.anthropic.test`, as `x-api-key`), both for agent "tester", and a lease allowing both
//! hosts. The agent holds only the placeholders; only the origin ever sees the keys.

use super::harness::{proxy_url, Harness};
use super::model_api::{Keys, ModelApi, ANTHROPIC_HOST, OPENAI_HOST};
use leasegate::config::ServeConfig;
use leasegate::secrets::placeholder;
use leasegate::server::Server;
use std::path::PathBuf;

/// The real keys: in the proxy's secrets, never in the agent's hands.
pub const OPENAI_KEY: &str = "sk-proj-brokeredopenai0123456789abcdef";
pub const ANTHROPIC_KEY: &str = "sk-ant-api03-brokeredanthropic0123456789";

pub struct ModelProxy {
    pub h: Harness,
    pub server: Server,
    pub api: ModelApi,
    /// The interception CA, as the agent's clients trust it.
    pub ca_pem: PathBuf,
    /// A lease of agent "tester", allowing both hosts.
    pub lease: String,
}

fn secrets_toml() -> String {
    format!(
        r#"[[secret]]
id = "openai"
hosts = ["{OPENAI_HOST}"]
header = "Authorization"
format = "Bearer {{value}}"
env = "LG_OPENAI_KEY"
routes = [
  {{ method = "POST", path = "/v1/chat/completions" }}, {{ method = "POST", path = "/v1/responses" }},
]
agents = ["tester"]
env_name = "OPENAI_API_KEY"
meter = "openai"

[[secret]]
id = "anthropic"
hosts = ["{ANTHROPIC_HOST}"]
header = "x-api-key"
format = "{{value}}"
env = "LG_ANTHROPIC_KEY"
routes = [{{ method = "POST", path = "/v1/messages" }}]
agents = ["tester"]
env_name = "ANTHROPIC_API_KEY"
meter = "anthropic"
"#
    )
}

impl ModelProxy {
    pub async fn start() -> ModelProxy {
        ModelProxy::start_with(|_| {}).await
    }

    /// [`ModelProxy::start`] with `adjust` applied to the serve configuration first.
    pub async fn start_with(adjust: impl FnOnce(&mut ServeConfig)) -> ModelProxy {
        let h = Harness::new();
        let keys = Keys {
            openai: OPENAI_KEY.into(),
            anthropic: ANTHROPIC_KEY.into(),
        };
        let api = ModelApi::start(h.dir.path(), keys).await;
        let hosts = [OPENAI_HOST, ANTHROPIC_HOST];
        let values = [
            ("LG_OPENAI_KEY", OPENAI_KEY),
            ("LG_ANTHROPIC_KEY", ANTHROPIC_KEY),
        ];
        let broker = h.broker(&hosts, &secrets_toml(), &values, Some(&api.ca));
        let lease = h.lease(&hosts, &[]);
        let config = h.config(&[(OPENAI_HOST, "127.0.0.1"), (ANTHROPIC_HOST, "127.0.0.1")]);
        let mut serve = h.serve_config(config, None);
        serve.broker = Some(broker);
        adjust(&mut serve);
        let server = Server::start(serve).await.unwrap();
        ModelProxy {
            ca_pem: h.dir.path().join("ca/ca.pem"),
            h,
            server,
            api,
            lease,
        }
    }

    /// The lease's placeholder for secret `id` (`openai` or `anthropic`).
    pub fn placeholder(&self, id: &str) -> String {
        placeholder::derive(&self.h.key, &self.lease, id)
    }

    /// What `leasegate run` gives an agent under the lease (the CA alone as its bundle, which
    /// is enough here), plus the SDKs' base URLs: the SDKs read all of these themselves.
    pub fn agent_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("HTTPS_PROXY", proxy_url(&self.server, &self.lease)),
            ("SSL_CERT_FILE", self.ca_pem.to_str().unwrap().to_owned()),
            ("OPENAI_API_KEY", self.placeholder("openai")),
            ("ANTHROPIC_API_KEY", self.placeholder("anthropic")),
            ("OPENAI_BASE_URL", self.api.base_url(true)),
            ("ANTHROPIC_BASE_URL", self.api.base_url(false)),
        ]
    }
}
