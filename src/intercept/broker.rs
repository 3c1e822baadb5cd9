//! The credential broker as the proxy holds it: the secrets in use, the leaf minter and the two
//! TLS sides of a terminated tunnel (leaves for the agent, verified TLS to the origin).
//!
//! Invariant: built only when every host pattern of every secret is within the CA's name
//! constraints (a secret the CA could not vouch for would be a tunnel that cannot be
//! terminated); the upstream side always verifies the origin's chain and name, against the
//! system's roots or the operator's `--upstream-ca`, never against nothing.

use super::ca::{CaError, InterceptCa};
use super::leaf::{server_config, LeafMinter};
use crate::contract::{Key, Lease};
use crate::meter::prices::{Prices, PricesError};
use crate::policy::pattern::HostPattern;
use crate::policy::TargetHost;
use crate::secrets::{placeholder, Secret, SecretSet, Secrets};
use rustls::pki_types::CertificateDer;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("the interception CA: {0}")]
    Ca(#[from] CaError),
    #[error(
        "secret {secret:?} is for {pattern}, which the interception CA's name constraints ({subtrees}) do not cover: make a CA for it with `leasegate ca init --host {pattern}`"
    )]
    NotCovered {
        secret: String,
        pattern: String,
        subtrees: String,
    },
    #[error("--upstream-ca {path}: {why}")]
    UpstreamCa { path: PathBuf, why: String },
    #[error(
        "no trust anchors for upstream TLS: the system has none readable ({0}); give --upstream-ca"
    )]
    NoRoots(String),
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
}

/// What a terminated tunnel needs.
pub struct Broker {
    /// The secrets in use (reloaded whole on SIGHUP).
    pub secrets: Arc<Secrets>,
    minter: Arc<LeafMinter>,
    /// The agent-facing side: leaves per SNI, ALPN h2 and http/1.1.
    server: Arc<rustls::ServerConfig>,
    /// The origin-facing side: verified, ALPN http/1.1.
    upstream: Arc<rustls::ClientConfig>,
    ca_pem: String,
    /// `--prices`: what metered calls cost (swapped whole on SIGHUP); `None`: every metered
    /// call is unpriced.
    prices: arc_swap::ArcSwapOption<Prices>,
    /// The price table's file, read again on SIGHUP.
    prices_path: Option<PathBuf>,
    /// The placeholders the checks derived, kept for the lease's next requests.
    pub placeholders: placeholder::Memo,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("secrets", &self.secrets)
            .field("minter", &self.minter)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// The broker of `secrets` under the CA in `ca_dir` (`ca.pem`, `ca-key.pem`), verifying
    /// origins against `upstream_ca` (PEM) or, without it, the system's roots.
    pub fn new(
        secrets: Arc<Secrets>,
        ca_dir: &Path,
        upstream_ca: Option<&Path>,
    ) -> Result<Broker, BrokerError> {
        let ca = InterceptCa::load_dir(ca_dir)?;
        check_covered(&secrets.current(), &ca)?;
        let ca_pem = pem(ca.cert_der());
        let minter = Arc::new(LeafMinter::new(ca));
        let server = Arc::new(server_config(minter.clone())?);
        let roots = match upstream_ca {
            Some(path) => read_roots(path)?,
            None => system_roots()?,
        };
        let mut upstream = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
        upstream.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Broker {
            secrets,
            minter,
            server,
            upstream: Arc::new(upstream),
            ca_pem,
            prices: arc_swap::ArcSwapOption::empty(),
            prices_path: None,
            placeholders: placeholder::Memo::default(),
        })
    }

    /// Checks a reloaded set before it is used: every secret still within the CA.
    pub fn covers(&self, set: &SecretSet) -> Result<(), BrokerError> {
        check_covered(set, self.minter.ca())
    }

    /// Whether the CA may vouch for `host` (a name inside its constraints); else the
    /// constraints, as an error names them.
    pub fn covers_name(&self, host: &TargetHost) -> Result<(), String> {
        let ca = self.minter.ca();
        match host {
            TargetHost::Name(name) if ca.permits(name).is_some() => Ok(()),
            _ => Err(ca.subtrees().join(", ")),
        }
    }

    /// The interception CA's certificate, PEM: what an agent's clients must trust.
    /// The broker, pricing metered calls with `prices`.
    pub fn with_prices(self, prices: Arc<Prices>) -> Broker {
        Broker {
            prices: arc_swap::ArcSwapOption::new(Some(prices)),
            ..self
        }
    }

    /// The broker, pricing metered calls with the table in `path` (read now, and again by
    /// [`Broker::reload_prices`]).
    pub fn with_prices_file(self, path: &Path) -> Result<Broker, PricesError> {
        let prices = Arc::new(Prices::load(path)?);
        Ok(Broker {
            prices_path: Some(path.to_owned()),
            ..self.with_prices(prices)
        })
    }

    /// Reads the price table's file again: the new table in whole, or, on any problem, the
    /// table in use kept and the problem returned. `None`: no file was given.
    pub fn reload_prices(&self) -> Option<Result<(), PricesError>> {
        let path = self.prices_path.as_deref()?;
        Some(Prices::load(path).map(|prices| self.prices.store(Some(Arc::new(prices)))))
    }

    /// The price table in use, if one was given.
    pub fn prices(&self) -> Option<Arc<Prices>> {
        self.prices.load_full()
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    pub fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.server.clone()
    }

    pub fn upstream_config(&self) -> Arc<rustls::ClientConfig> {
        self.upstream.clone()
    }

    /// Whether tunnels to `host` are terminated: some secret in `set` is for it. Addresses
    /// never are (the CA cannot vouch for one).
    pub fn terminates(set: &SecretSet, host: &TargetHost) -> bool {
        let TargetHost::Name(name) = host else {
            return false;
        };
        set.secrets().iter().any(|s| is_for(s, name))
    }

    /// The model API `host` is, when a secret for it has `meter` (the first such secret's).
    pub fn meter_for(set: &SecretSet, host: &TargetHost) -> Option<crate::meter::Api> {
        let TargetHost::Name(name) = host else {
            return None;
        };
        set.secrets()
            .iter()
            .filter(|s| is_for(s, name))
            .find_map(|s| s.spec().meter)
    }

    /// The placeholders `lease` may hold, each with the variable `run` sets: the secrets whose
    /// `agents` name the lease's manifest `agent.name`. `key` is the lease's signing key.
    pub fn placeholders(set: &SecretSet, lease: &Lease, key: &Key) -> Vec<Placeholder> {
        entitled(set, lease)
            .map(|secret| Placeholder {
                secret: secret.spec().id.clone(),
                env: secret.spec().env_name.clone(),
                value: placeholder::derive(key, &lease.id, &secret.spec().id),
            })
            .collect()
    }
}

/// A lease's stand-in for one secret.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Placeholder {
    pub secret: String,
    pub env: String,
    #[serde(rename = "placeholder")]
    pub value: String,
}

/// Whether `secret` is for the DNS name `name`.
pub fn is_for(secret: &Secret, name: &str) -> bool {
    secret.spec().hosts.iter().any(|p| p.matches(name))
}

/// The secrets of `set` that `lease` is entitled to (see [`is_entitled`]).
pub fn entitled<'a>(set: &'a SecretSet, lease: &'a Lease) -> impl Iterator<Item = &'a Secret> {
    set.secrets().iter().filter(move |s| is_entitled(s, lease))
}

/// Whether `lease` may use `secret`: its manifest's `agent.name` is one of the secret's
/// `agents`.
pub fn is_entitled(secret: &Secret, lease: &Lease) -> bool {
    !lease.agent_name.is_empty() && secret.spec().agents.contains(&lease.agent_name)
}

fn check_covered(set: &SecretSet, ca: &InterceptCa) -> Result<(), BrokerError> {
    for secret in set.secrets() {
        for pattern in &secret.spec().hosts {
            let name = match pattern {
                HostPattern::Exact(name) => name.clone(),
                // `*.a.test` needs `a.test`'s subtree: a probe name under it.
                HostPattern::Subdomains(suffix) => format!("x.{suffix}"),
                HostPattern::Any => String::new(),
            };
            if ca.permits(&name).is_none() {
                return Err(BrokerError::NotCovered {
                    secret: secret.spec().id.clone(),
                    pattern: pattern.to_string(),
                    subtrees: ca.subtrees().join(", "),
                });
            }
        }
    }
    Ok(())
}

fn pem(der: &CertificateDer<'_>) -> String {
    use base64::Engine;
    let text = base64::engine::general_purpose::STANDARD.encode(der.as_ref());
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in text.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

fn read_roots(path: &Path) -> Result<rustls::RootCertStore, BrokerError> {
    use rustls::pki_types::pem::PemObject;
    let bad = |why: String| BrokerError::UpstreamCa {
        path: path.to_owned(),
        why,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
        roots
            .add(cert.map_err(|e| bad(e.to_string()))?)
            .map_err(|e| bad(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(bad("no certificate in it".into()));
    }
    Ok(roots)
}

/// The system's trust store (rustls-native-certs: the platform's own bundle, which an operator
/// keeps current, rather than a copy compiled into the binary).
fn system_roots() -> Result<rustls::RootCertStore, BrokerError> {
    let found = rustls_native_certs::load_native_certs()
        .map_err(|e| BrokerError::NoRoots(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(found);
    if roots.is_empty() {
        return Err(BrokerError::NoRoots("the store is empty".into()));
    }
    Ok(roots)
}
