//! Starting and stopping a proxy: load the journal, bind every listener, follow the journal,
//! keep per-lease ports in step, serve until shut down.
//!
//! Invariant: the guard knows every address we listen on (proxy, admin, the per-lease range)
//! before the first connection is accepted, so no request can be routed back into leasegate;
//! `/readyz` turns 200 only once the journal is loaded and every listener is bound.

use crate::admin::{self, AdminState};
use crate::config::ServeConfig;
use crate::proxy::lease_ports::LeasePorts;
use crate::proxy::upstream::Pool;
use crate::proxy::{self, Proxy};
use crate::registry::Registry;
use crate::telemetry::EgressLog;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("reading the journal {path}: {source}")]
    Journal {
        path: String,
        source: std::io::Error,
    },
    #[error("listening on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("opening the egress log: {0}")]
    Egress(std::io::Error),
}

/// A running proxy.
pub struct Server {
    /// The bound proxy address (useful with port 0).
    pub addr: SocketAddr,
    /// The bound admin address, if any.
    pub admin_addr: Option<SocketAddr>,
    pub proxy: Arc<Proxy>,
    pub ports: Option<Arc<LeasePorts>>,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

async fn bind(addr: SocketAddr) -> Result<(TcpListener, SocketAddr), StartError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| StartError::Bind { addr, source })?;
    Ok((listener, bound))
}

impl Server {
    /// Loads the journal, binds the listeners and starts serving.
    pub async fn start(config: ServeConfig) -> Result<Server, StartError> {
        let registry = Registry::load(config.journal.clone(), config.keyring.clone(), true)
            .map_err(|source| StartError::Journal {
                path: config.journal.display().to_string(),
                source,
            })?;
        let (listener, addr) = bind(config.listen).await?;
        let admin = match config.admin {
            Some(admin) => Some(bind(admin).await?),
            None => None,
        };
        let egress = match config.egress {
            Some(destination) => EgressLog::open(destination)
                .await
                .map_err(StartError::Egress)?,
            None => EgressLog::disabled(),
        };
        let mut proxy_config = config.proxy;
        proxy_config.guard.own.push(addr);
        proxy_config
            .guard
            .own
            .extend(admin.as_ref().map(|(_, a)| *a));
        if let Some((range, ip)) = &config.lease_ports {
            proxy_config.guard.own_ranges.push((*ip, range.clone()));
        }
        let registry = Arc::new(registry);
        let proxy = Arc::new(Proxy {
            config: proxy_config,
            registry: registry.clone(),
            egress,
            pool: Arc::new(Pool::default()),
        });
        let shutdown = CancellationToken::new();
        tokio::spawn(registry.follow(shutdown.clone()));
        let ports = config
            .lease_ports
            .map(|(range, ip)| Arc::new(LeasePorts::new(range, ip)));
        if let Some(ports) = &ports {
            tokio::spawn(ports.clone().run(proxy.clone(), shutdown.clone()));
        }
        let task = tokio::spawn(proxy::serve(
            listener,
            proxy.clone(),
            None,
            shutdown.clone(),
        ));
        let admin_addr = admin.as_ref().map(|(_, a)| *a);
        if let Some((admin_listener, admin_addr)) = admin {
            let state = Arc::new(AdminState {
                proxy: proxy.clone(),
                ports: ports.clone(),
                proxy_addr: addr,
                ready: Default::default(),
            });
            tokio::spawn(admin::serve(
                admin_listener,
                state.clone(),
                shutdown.clone(),
            ));
            state.ready.store(true, Ordering::SeqCst);
            tracing::info!(%admin_addr, "admin API listening");
        }
        tracing::info!(%addr, "leasegate proxy listening");
        Ok(Server {
            addr,
            admin_addr,
            proxy,
            ports,
            shutdown,
            task,
        })
    }

    /// Stops accepting and waits for the accept loop to end.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}
