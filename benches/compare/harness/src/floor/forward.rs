//! The floor's forwarder: an absolute-form `http://` request goes upstream in origin form with
//! hop-by-hop headers removed, over an idle connection of this worker's pool or a new one,
//! and the response comes back as it streams (leasegate's src/proxy/forward.rs and
//! src/proxy/upstream/pool.rs without the decision, metering, body checks and timeouts).
//!
//! Invariant: a pooled connection is used by the worker that opened it only (each worker's
//! pool is thread-local, as leasegate keys its pool by worker), and is put back only once
//! hyper says it is ready for another request.

use super::{answer, sockets, upstream_addr, FloorBody};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;

/// Idle connections kept per upstream address and worker (leasegate's `IDLE_PER_KEY`).
const IDLE_PER_KEY: usize = 32;

thread_local! {
    /// This worker's idle upstream connections.
    static IDLE: RefCell<HashMap<SocketAddr, Vec<SendRequest<Incoming>>>> =
        RefCell::new(HashMap::new());
}

pub async fn handle(req: Request<Incoming>) -> Response<FloorBody> {
    let uri = req.uri();
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return answer(
            StatusCode::BAD_REQUEST,
            "a proxy: send absolute-form requests or CONNECT".into(),
        );
    };
    if !scheme.eq_ignore_ascii_case("http") {
        return answer(
            StatusCode::BAD_REQUEST,
            format!("scheme {scheme} is not forwarded"),
        );
    }
    let port = authority.port_u16().unwrap_or(80);
    let Some(addr) = upstream_addr(authority.host(), port) else {
        return answer(
            StatusCode::BAD_GATEWAY,
            format!("{} is not in --resolve", authority.host()),
        );
    };

    let (mut parts, body) = req.into_parts();
    if !parts.headers.contains_key(header::HOST) {
        let host = parts
            .uri
            .authority()
            .map(|a| HeaderValue::from_str(a.as_str()));
        match host {
            Some(Ok(host)) => {
                parts.headers.insert(header::HOST, host);
            }
            _ => return answer(StatusCode::BAD_REQUEST, "no Host for the request".into()),
        }
    }
    let path = parts
        .uri
        .path_and_query()
        .filter(|p| !p.as_str().is_empty())
        .cloned()
        .unwrap_or_else(|| hyper::http::uri::PathAndQuery::from_static("/"));
    let mut origin_form = hyper::http::uri::Parts::default();
    origin_form.path_and_query = Some(path);
    parts.uri = match Uri::from_parts(origin_form) {
        Ok(uri) => uri,
        Err(error) => return answer(StatusCode::BAD_REQUEST, error.to_string()),
    };
    parts.version = hyper::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);

    let mut sender = match checkout(addr) {
        Some(sender) => sender,
        None => match connect(addr).await {
            Ok(sender) => sender,
            Err(why) => return answer(StatusCode::BAD_GATEWAY, why),
        },
    };
    let response = match sender.send_request(Request::from_parts(parts, body)).await {
        Ok(response) => response,
        Err(error) => return answer(StatusCode::BAD_GATEWAY, format!("{addr}: {error}")),
    };
    checkin(addr, sender);
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    Response::from_parts(parts, FloorBody::Relayed(body))
}

/// A new HTTP/1.1 client connection to `addr`, its connection task on this worker.
async fn connect(addr: SocketAddr) -> Result<SendRequest<Incoming>, String> {
    let stream = sockets::dial(addr)
        .await
        .map_err(|e| format!("{addr}: {e}"))?;
    let (sender, connection) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Incoming>(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake with {addr}: {e}"))?;
    tokio::spawn(connection);
    Ok(sender)
}

/// An idle, ready connection of this worker's to `addr`, if one is pooled.
fn checkout(addr: SocketAddr) -> Option<SendRequest<Incoming>> {
    IDLE.with_borrow_mut(|idle| {
        let list = idle.get_mut(&addr)?;
        while let Some(sender) = list.pop() {
            if sender.is_ready() {
                return Some(sender);
            }
        }
        None
    })
}

/// Pools a connection once its exchange has finished (the response body read to its end).
fn checkin(addr: SocketAddr, mut sender: SendRequest<Incoming>) {
    tokio::spawn(async move {
        if sender.ready().await.is_ok() {
            IDLE.with_borrow_mut(|idle| {
                let list = idle.entry(addr).or_default();
                if list.len() < IDLE_PER_KEY {
                    list.push(sender);
                }
            });
        }
    });
}

/// Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded (leasegate's list, without its own
/// lease header).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    header::PROXY_AUTHENTICATE,
];

/// Removes the hop-by-hop headers and those `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}
