//! How names become addresses: fixed answers first (`--resolve`, the test harness), then the
//! system's resolver, asynchronously and within a timeout. A layer below `config` and `proxy`:
//! the configuration holds a [`Resolver`], the proxy asks it.
//!
//! Invariant: a lookup never blocks a runtime thread and never outlives its timeout; with the
//! system resolver off, only fixed answers resolve.

use hickory_resolver::config::{
    LookupIpStrategy, NameServerConfigGroup, ResolverConfig, ResolverOpts,
};
use hickory_resolver::name_server::TokioConnectionProvider;
use hickory_resolver::TokioResolver;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Why a name gave no address to check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("{name} has no addresses")]
    NoAddresses { name: String },
    #[error("{name} does not resolve: {reason}")]
    Failed { name: String, reason: String },
    #[error("resolving {name} timed out after {after:?}")]
    TimedOut { name: String, after: Duration },
}

/// How names become addresses.
#[derive(Debug, Clone, Default)]
pub struct Resolver {
    /// Fixed answers (`--resolve NAME=ADDR`, and the test harness), consulted first.
    pub overrides: HashMap<String, Vec<IpAddr>>,
    /// Fall back to the system resolver for other names.
    pub system: bool,
    /// The system resolver, built on first use and shared by clones (one cache, one set of
    /// name-server connections per proxy).
    pub dns: SystemDns,
}

impl Resolver {
    pub fn system() -> Resolver {
        Resolver {
            overrides: HashMap::new(),
            system: true,
            dns: SystemDns::default(),
        }
    }

    /// Resolves `name` once, within `timeout`. The lookup is asynchronous (hickory), so a
    /// timed-out one is dropped, not left running on a blocking thread.
    pub async fn resolve(
        &self,
        name: &str,
        port: u16,
        timeout: Duration,
    ) -> Result<Vec<SocketAddr>, ResolveError> {
        if let Some(ips) = self.overrides.get(name) {
            return Ok(ips.iter().map(|&ip| SocketAddr::new(ip, port)).collect());
        }
        if !self.system {
            return Err(ResolveError::Failed {
                name: name.to_owned(),
                reason: "no fixed answer and the system resolver is off".to_owned(),
            });
        }
        let lookup = async { self.dns.get().await.lookup_ip(name).await };
        match tokio::time::timeout(timeout, lookup).await {
            Ok(Ok(found)) => {
                let addrs: Vec<SocketAddr> =
                    found.iter().map(|ip| SocketAddr::new(ip, port)).collect();
                if addrs.is_empty() {
                    Err(ResolveError::NoAddresses {
                        name: name.to_owned(),
                    })
                } else {
                    Ok(addrs)
                }
            }
            Ok(Err(e)) if e.is_nx_domain() => Err(ResolveError::Failed {
                name: name.to_owned(),
                reason: "no such name".to_owned(),
            }),
            Ok(Err(e)) if e.is_no_records_found() => Err(ResolveError::NoAddresses {
                name: name.to_owned(),
            }),
            Ok(Err(e)) => Err(ResolveError::Failed {
                name: name.to_owned(),
                reason: e.to_string(),
            }),
            Err(_) => Err(ResolveError::TimedOut {
                name: name.to_owned(),
                after: timeout,
            }),
        }
    }
}

/// The system's resolver configuration (`/etc/resolv.conf`, `/etc/hosts`) as an async
/// resolver, read once on first use.
#[derive(Clone, Default)]
pub struct SystemDns(Arc<tokio::sync::OnceCell<TokioResolver>>);

impl std::fmt::Debug for SystemDns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.initialized() {
            "SystemDns(loaded)"
        } else {
            "SystemDns(not yet loaded)"
        })
    }
}

impl SystemDns {
    async fn get(&self) -> &TokioResolver {
        self.0
            .get_or_init(|| async {
                // Reading the two files is blocking I/O: off the runtime's threads.
                tokio::task::spawn_blocking(system_resolver)
                    .await
                    .unwrap_or_else(|_| fallback_resolver())
            })
            .await
    }
}

fn system_resolver() -> TokioResolver {
    match TokioResolver::builder_tokio() {
        Ok(mut builder) => {
            // Both families, as getaddrinfo answers: the guard checks every address.
            builder.options_mut().ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
            builder.build()
        }
        Err(error) => {
            tracing::warn!(%error, "reading /etc/resolv.conf failed: asking a name server on this host, as the C library does");
            fallback_resolver()
        }
    }
}

/// What the C library does without a usable `/etc/resolv.conf`: a name server on this host
/// (never a public resolver chosen by us). `/etc/hosts` is still read.
fn fallback_resolver() -> TokioResolver {
    let local = [
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ];
    let config = ResolverConfig::from_parts(
        None,
        vec![],
        NameServerConfigGroup::from_ips_clear(&local, 53, true),
    );
    let mut options = ResolverOpts::default();
    options.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
        .with_options(options)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[tokio::test]
    async fn overrides_answer_first_and_unknown_names_fail_without_the_system_resolver() {
        let mut resolver = Resolver::default();
        resolver
            .overrides
            .insert("origin.test".into(), vec!["192.0.2.7".parse().unwrap()]);
        assert_eq!(
            resolver
                .resolve("origin.test", 8080, Duration::from_secs(1))
                .await
                .unwrap(),
            vec!["192.0.2.7:8080".parse::<SocketAddr>().unwrap()]
        );
        let error = resolver
            .resolve("other.test", 80, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(
            matches!(&error, ResolveError::Failed { name, .. } if name == "other.test"),
            "{error:?}"
        );
        assert!(error
            .to_string()
            .starts_with("other.test does not resolve: "));
    }

    #[tokio::test]
    async fn localhost_resolves_through_the_hosts_file() {
        let addrs = Resolver::system()
            .resolve("localhost", 443, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(
            addrs
                .iter()
                .all(|a| a.ip().is_loopback() && a.port() == 443)
                && !addrs.is_empty(),
            "{addrs:?}"
        );
    }

    #[tokio::test]
    async fn a_lookup_that_outlives_its_timeout_is_dropped_and_says_so() {
        // A name server that never answers: the lookup can only end by its timeout.
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let config = ResolverConfig::from_parts(
            None,
            vec![],
            NameServerConfigGroup::from_ips_clear(
                &[silent.local_addr().unwrap().ip()],
                silent.local_addr().unwrap().port(),
                true,
            ),
        );
        let dns = SystemDns::default();
        let built =
            TokioResolver::builder_with_config(config, TokioConnectionProvider::default()).build();
        assert!(dns.0.set(built).is_ok());
        let resolver = Resolver {
            system: true,
            dns,
            ..Resolver::default()
        };
        let started = Instant::now();
        let error = resolver
            .resolve("nowhere.example", 80, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(
            error,
            ResolveError::TimedOut {
                name: "nowhere.example".into(),
                after: Duration::from_millis(200)
            }
        );
        assert_eq!(
            error.to_string(),
            "resolving nowhere.example timed out after 200ms"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
