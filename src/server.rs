//! Starting and stopping a proxy: load the journal, bind, serve until shut down.
//!
//! Invariant: the guard knows every address we listen on before the first connection is
//! accepted, so no request can be routed back into leasegate.

use crate::config::ServeConfig;
use crate::proxy::upstream::Pool;
use crate::proxy::{self, Proxy};
use crate::registry::Registry;
use crate::telemetry::EgressLog;
use std::net::SocketAddr;
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
    pub proxy: Arc<Proxy>,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    /// Loads the journal, binds the listener and starts serving.
    pub async fn start(config: ServeConfig) -> Result<Server, StartError> {
        let registry = Registry::load(config.journal.clone(), config.keyring.clone(), true)
            .map_err(|source| StartError::Journal {
                path: config.journal.display().to_string(),
                source,
            })?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| StartError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
        let egress = match config.egress {
            Some(destination) => EgressLog::open(destination)
                .await
                .map_err(StartError::Egress)?,
            None => EgressLog::disabled(),
        };
        let mut proxy_config = config.proxy;
        proxy_config.guard.own.push(addr);
        let proxy = Arc::new(Proxy {
            config: proxy_config,
            registry: Arc::new(registry),
            egress,
            pool: Arc::new(Pool::default()),
        });
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(proxy::serve(
            listener,
            proxy.clone(),
            None,
            shutdown.clone(),
        ));
        tracing::info!(%addr, "leasegate proxy listening");
        Ok(Server {
            addr,
            proxy,
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
