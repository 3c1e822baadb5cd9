//! The admin API: health, readiness and lease lookups (what `leasegate run` asks).
//!
//! Invariant: read-only views of the registry; every answer is JSON, errors included.

use crate::contract::Timestamp;
use crate::proxy::lease_ports::LeasePorts;
use crate::proxy::{full, Body, Proxy};
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What the admin API reads.
pub struct AdminState {
    pub proxy: Arc<Proxy>,
    pub ports: Option<Arc<LeasePorts>>,
    /// The shared proxy listener, for credential proxy URLs.
    pub proxy_addr: SocketAddr,
    /// Set once the journal is loaded and every listener is bound.
    pub ready: AtomicBool,
}

/// Serves the admin API until `shutdown`.
pub async fn serve(listener: TcpListener, state: Arc<AdminState>, shutdown: CancellationToken) {
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let state = state.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, std::convert::Infallible>(route(&state, req)) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn json_response(status: StatusCode, value: Value) -> Response<Body> {
    let mut response = Response::new(full(value.to_string() + "\n"));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    json_response(status, json!({"error": message.into()}))
}

fn route(state: &AdminState, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().trim_end_matches('/');
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    match (req.method(), segments.as_slice()) {
        (&Method::GET, ["healthz"]) => json_response(StatusCode::OK, json!({"status": "ok"})),
        (&Method::GET, ["readyz"]) => {
            if state.ready.load(Ordering::SeqCst) {
                json_response(StatusCode::OK, json!({"ready": true}))
            } else {
                json_response(StatusCode::SERVICE_UNAVAILABLE, json!({"ready": false}))
            }
        }
        (&Method::GET, ["leases", id]) => lease(state, id),
        (_, ["healthz" | "readyz"] | ["leases", _]) => {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
        }
        _ => error(StatusCode::NOT_FOUND, format!("no route {path}")),
    }
}

/// One lease as the admin API shows it.
pub fn lease_view(state: &AdminState, id: &str, now: Timestamp) -> Option<Value> {
    let snapshot = state.proxy.registry.snapshot();
    let lease = snapshot.ledger.lease(id)?;
    let port = state.ports.as_ref().and_then(|p| p.port_of(id));
    let proxy_url = match (port, &state.ports) {
        (Some(port), Some(ports)) => format!("http://{}", SocketAddr::new(ports.bind, port)),
        _ => format!("http://agent:{id}@{}", state.proxy_addr),
    };
    Some(json!({
        "lease_id": lease.id,
        "parent_lease_id": lease.parent,
        "agent": lease.agent_name,
        "status": snapshot.ledger.status(id, now).map(|s| s.as_str()),
        "issued_at": lease.issued_at,
        "expires_at": lease.expires_at,
        "allow_hosts": lease.allow_hosts,
        "deny_hosts": lease.deny_hosts,
        "port": port,
        "proxy_url": proxy_url,
    }))
}

fn lease(state: &AdminState, id: &str) -> Response<Body> {
    match lease_view(state, id, Timestamp::now()) {
        Some(view) => json_response(StatusCode::OK, view),
        None => error(StatusCode::NOT_FOUND, format!("no lease {id}")),
    }
}
