//! The floor's CONNECT: dial, answer 200, then splice both ways (leasegate's
//! src/proxy/connect.rs without the decision, the ClientHello check and the egress line).
//!
//! Invariant: the client hears 200 only once the upstream is connected (a failed dial is
//! 502); the bytes hyper read past the CONNECT head reach the upstream first, in order.

use super::{answer, sockets, splice, upstream_addr, FloorBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

pub async fn handle(req: Request<Incoming>) -> Response<FloorBody> {
    let Some(authority) = req.uri().authority() else {
        return answer(StatusCode::BAD_REQUEST, "CONNECT needs HOST:PORT".into());
    };
    let Some(port) = authority.port_u16() else {
        return answer(StatusCode::BAD_REQUEST, "CONNECT needs a port".into());
    };
    let Some(addr) = upstream_addr(authority.host(), port) else {
        return answer(
            StatusCode::BAD_GATEWAY,
            format!("{} is not in --resolve", authority.host()),
        );
    };
    let upstream = match sockets::dial(addr).await {
        Ok(upstream) => upstream,
        Err(error) => return answer(StatusCode::BAD_GATEWAY, format!("{addr}: {error}")),
    };
    tokio::spawn(tunnel(req, upstream));
    Response::new(FloorBody::Said(None))
}

/// Once hyper has sent the 200: the client's socket back from hyper, then the relay.
async fn tunnel(req: Request<Incoming>, mut upstream: TcpStream) {
    let Ok(upgraded) = hyper::upgrade::on(req).await else {
        return;
    };
    match upgraded.downcast::<TokioIo<TcpStream>>() {
        Ok(parts) => {
            if !parts.read_buf.is_empty() && upstream.write_all(&parts.read_buf).await.is_err() {
                return;
            }
            splice::relay(parts.io.into_inner(), upstream).await;
        }
        // The floor serves plain sockets only, so hyper always hands one back; anything else
        // is copied rather than dropped.
        Err(upgraded) => {
            let _ = tokio::io::copy_bidirectional(&mut TokioIo::new(upgraded), &mut upstream).await;
        }
    }
}
