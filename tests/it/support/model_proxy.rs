//! A proxy brokering the keys of the fake model API ([`ModelApi`]): OpenAI's secret (for
//! `api.openai.test`, put in as `Authorization: Bearer {value}`) and Anthropic's (for
//! `api.anthropic.test`, as `x-api-key`), both for agent "tester", and a lease allowing both
//! hosts. The agent holds only the placeholders; only the origin ever sees the keys.
//! [`Staged`] sets one up step by step: a price table, leases granted before the start,
//! replicas with the same broker and keys.

use super::harness::{http_origin, proxy_url, Harness, Origin};
use super::model_api::{Keys, ModelApi, ANTHROPIC_HOST, OPENAI_HOST};
use leasegate::config::ServeConfig;
use leasegate::intercept::Broker;
use leasegate::meter::prices::Prices;
use leasegate::secrets::placeholder;
use leasegate::server::Server;
use std::path::PathBuf;
use std::sync::Arc;

/// A host that is no model API (no secret is for it): plain HTTP, [`ModelProxy::plain`].
pub const PLAIN_HOST: &str = "plain.origin.test";

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
    /// What the proxy holds, for [`ModelProxy::another`].
    pub broker: Arc<Broker>,
    /// The origin of [`PLAIN_HOST`].
    pub plain: Origin,
}

/// A [`ModelProxy`] before its start: the fake API and the broker are up, the journal may
/// take more leases (`h.grant_budgeted`).
pub struct Staged {
    pub h: Harness,
    pub api: ModelApi,
    pub broker: Arc<Broker>,
    pub plain: Origin,
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
  {{ method = "GET", path = "/v1/models" }},
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
        Staged::new(None).await.start(adjust).await
    }

    /// Shuts the proxy down and starts it again on the same journal, broker and keys.
    pub async fn restart(mut self) -> ModelProxy {
        self.server.shutdown().await;
        self.server = serve(&self.h, &self.broker, |_| {}).await;
        self
    }

    /// Another proxy with the same broker and keys (a replica, once `adjust` puts its
    /// journal where the first one's is).
    pub async fn another(&self, adjust: impl FnOnce(&mut ServeConfig)) -> Server {
        serve(&self.h, &self.broker, adjust).await
    }
}

impl Staged {
    /// The fake API, the broker (with the price table `prices`, TOML, if given), the plain
    /// origin and the lease, nothing started yet.
    pub async fn new(prices: Option<&str>) -> Staged {
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
        let mut broker = h.broker(&hosts, &secrets_toml(), &values, Some(&api.ca));
        if let Some(table) = prices {
            let prices = Prices::parse(table).expect("a valid price table");
            let plain = Arc::into_inner(broker).expect("the broker is not shared yet");
            broker = Arc::new(plain.with_prices(Arc::new(prices)));
        }
        let lease = h.lease(&[OPENAI_HOST, ANTHROPIC_HOST, PLAIN_HOST], &[]);
        Staged {
            plain: http_origin().await,
            h,
            api,
            broker,
            lease,
        }
    }

    /// Starts the proxy, with `adjust` applied to the serve configuration first.
    pub async fn start(self, adjust: impl FnOnce(&mut ServeConfig)) -> ModelProxy {
        let server = serve(&self.h, &self.broker, adjust).await;
        ModelProxy {
            ca_pem: self.h.dir.path().join("ca/ca.pem"),
            h: self.h,
            server,
            api: self.api,
            lease: self.lease,
            broker: self.broker,
            plain: self.plain,
        }
    }
}

/// A proxy on `h`'s journal and keys holding `broker`, the model hosts and [`PLAIN_HOST`]
/// resolved to loopback.
async fn serve(h: &Harness, broker: &Arc<Broker>, adjust: impl FnOnce(&mut ServeConfig)) -> Server {
    let loopback = "127.0.0.1";
    let names = [
        (OPENAI_HOST, loopback),
        (ANTHROPIC_HOST, loopback),
        (PLAIN_HOST, loopback),
    ];
    let mut serve = h.serve_config(h.config(&names), None);
    serve.broker = Some(broker.clone());
    adjust(&mut serve);
    Server::start(serve).await.unwrap()
}

impl ModelProxy {
    /// The lease's placeholder for secret `id` (`openai` or `anthropic`).
    pub fn placeholder(&self, id: &str) -> String {
        placeholder::derive(&self.h.key, &self.lease, id)
    }

    /// What `leasegate run` gives an agent under the lease (the CA alone as its bundle, which
    /// is enough here), plus the SDKs' base URLs: the SDKs read all of these themselves.
    pub fn agent_env(&self) -> Vec<(&'static str, String)> {
        self.agent_env_of(&self.server, &self.lease)
    }

    /// [`ModelProxy::agent_env`] of `lease` through `server`.
    pub fn agent_env_of(&self, server: &Server, lease: &str) -> Vec<(&'static str, String)> {
        let placeholder = |secret| placeholder::derive(&self.h.key, lease, secret);
        vec![
            ("HTTPS_PROXY", proxy_url(server, lease)),
            ("SSL_CERT_FILE", self.ca_pem.to_str().unwrap().to_owned()),
            ("OPENAI_API_KEY", placeholder("openai")),
            ("ANTHROPIC_API_KEY", placeholder("anthropic")),
            ("OPENAI_BASE_URL", self.api.base_url(true)),
            ("ANTHROPIC_BASE_URL", self.api.base_url(false)),
        ]
    }
}
