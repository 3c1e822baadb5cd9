//! A loopback relay for the clients that cannot send proxy credentials (the JVM reads a proxy's
//! host and port from its properties, never a password): each request and CONNECT it takes is
//! passed to the proxy with the lease's `Proxy-Authorization` put on.
//!
//! Invariant: it listens on 127.0.0.1 only and serves a connection only when the socket on its
//! other end belongs to this user (the owner `/proc/net/tcp` names), who could read the lease's
//! credential from the agent's environment anyway; it dials the proxy `run` was given, nothing
//! else, and puts the credential on what goes there, replacing any the client sent. It lives
//! as long as `run` does.

use bytes::Bytes;
use http::header::{HeaderValue, PROXY_AUTHORIZATION};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Empty};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use std::net::{SocketAddr, SocketAddrV4};
use tokio::net::{TcpListener, TcpStream};

type Body = BoxBody<Bytes, hyper::Error>;

/// A relay to the proxy at `upstream`, listening on [`Relay::addr`].
pub struct Relay {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    /// Starts a relay to the proxy of `proxy_url` (`http://USER:PASSWORD@HOST:PORT`); `None`
    /// when the URL carries no credential (a lease's own port: the JVM needs no relay there).
    pub async fn start(proxy_url: &url::Url) -> std::io::Result<Option<Relay>> {
        let Some(password) = proxy_url.password() else {
            return Ok(None);
        };
        let credential = format!("{}:{}", proxy_url.username(), password);
        use base64::Engine;
        let basic = base64::engine::general_purpose::STANDARD.encode(credential);
        let auth = HeaderValue::from_str(&format!("Basic {basic}"))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let upstream = upstream_of(proxy_url)?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(accept(listener, upstream, auth));
        Ok(Some(Relay { addr, task }))
    }
}

/// The proxy's `host:port`, as `run` was told it.
fn upstream_of(url: &url::Url) -> std::io::Result<String> {
    let host = url.host_str().unwrap_or_default();
    let port = url.port_or_known_default().unwrap_or(3128);
    match host.contains(':') && !host.starts_with('[') {
        true => Ok(format!("[{host}]:{port}")),
        false => Ok(format!("{host}:{port}")),
    }
}

async fn accept(listener: TcpListener, upstream: String, auth: HeaderValue) {
    let own = own_uid();
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let Ok(local) = stream.local_addr() else {
            continue;
        };
        if own.is_none() || owner(peer, local) != own {
            eprintln!(
                "leasegate run: refused a connection to the JVM's relay from {peer}: not a \
                 process of this user"
            );
            continue;
        }
        let (upstream, auth) = (upstream.clone(), auth.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (upstream, auth) = (upstream.clone(), auth.clone());
                async move { Ok::<_, std::convert::Infallible>(pass(req, &upstream, auth).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .with_upgrades()
                .await;
        });
    }
}

/// `req` to the proxy with the credential on; a CONNECT the proxy answers 200 becomes a
/// tunnel between the two.
async fn pass(mut req: Request<Incoming>, upstream: &str, auth: HeaderValue) -> Response<Body> {
    req.headers_mut().insert(PROXY_AUTHORIZATION, auth);
    let io = match TcpStream::connect(upstream).await {
        Ok(io) => io,
        Err(e) => return failed(format!("leasegate run: the proxy at {upstream}: {e}")),
    };
    let handshake = hyper::client::conn::http1::handshake::<_, Body>(TokioIo::new(io));
    let (mut sender, conn) = match handshake.await {
        Ok(pair) => pair,
        Err(e) => return failed(format!("leasegate run: the proxy at {upstream}: {e}")),
    };
    tokio::spawn(conn.with_upgrades());
    if req.method() == Method::CONNECT {
        let client = hyper::upgrade::on(&mut req);
        let (parts, _) = req.into_parts();
        let empty = Empty::<Bytes>::new()
            .map_err(|never| match never {})
            .boxed();
        let connect = Request::from_parts(parts, empty);
        let mut answer = match sender.send_request(connect).await {
            Ok(answer) => answer,
            Err(e) => return failed(format!("leasegate run: the proxy at {upstream}: {e}")),
        };
        if answer.status() == StatusCode::OK {
            let proxy = hyper::upgrade::on(&mut answer);
            tokio::spawn(async move {
                if let (Ok(client), Ok(proxy)) = (client.await, proxy.await) {
                    let (mut client, mut proxy) = (TokioIo::new(client), TokioIo::new(proxy));
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut proxy).await;
                }
            });
        }
        return answer.map(|body| body.boxed());
    }
    match sender.send_request(req.map(|body| body.boxed())).await {
        Ok(answer) => answer.map(|body| body.boxed()),
        Err(e) => failed(format!("leasegate run: the proxy at {upstream}: {e}")),
    }
}

fn failed(message: String) -> Response<Body> {
    let body = http_body_util::Full::new(Bytes::from(message + "\n"))
        .map_err(|never| match never {})
        .boxed();
    let mut answer = Response::new(body);
    *answer.status_mut() = StatusCode::BAD_GATEWAY;
    answer
}

/// This process's user.
fn own_uid() -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

/// The user owning the socket at `peer` connected to `local` (IPv4, as the relay listens): in
/// `/proc/net/tcp`, or in `tcp6` for a client's IPv6 socket (the JVM's) with a mapped address.
fn owner(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let (SocketAddr::V4(peer), SocketAddr::V4(local)) = (peer, local) else {
        return None;
    };
    let read = |path| std::fs::read_to_string(path).ok();
    read("/proc/net/tcp")
        .and_then(|table| owner_in(&table, peer, local, false))
        .or_else(|| owner_in(&read("/proc/net/tcp6")?, peer, local, true))
}

/// An address as `/proc/net/tcp` (or, `mapped`, `tcp6`) prints it: each 32-bit word of the
/// address in the machine's order, in hex, then the port.
fn proc_hex(a: SocketAddrV4, mapped: bool) -> String {
    let word = |bytes: [u8; 4]| format!("{:08X}", u32::from_ne_bytes(bytes));
    let v4 = word(a.ip().octets());
    match mapped {
        false => format!("{v4}:{:04X}", a.port()),
        true => format!(
            "{}{}{}{v4}:{:04X}",
            word([0; 4]),
            word([0; 4]),
            word([0, 0, 0xff, 0xff]),
            a.port()
        ),
    }
}

/// [`owner`] read from the text of `/proc/net/tcp` (`tcp6`, `mapped`): the line whose local
/// address is `peer` and remote address `local`, its `uid` column.
fn owner_in(table: &str, peer: SocketAddrV4, local: SocketAddrV4, mapped: bool) -> Option<u32> {
    let (from, to) = (proc_hex(peer, mapped), proc_hex(local, mapped));
    table.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&from.as_str()) && fields.get(2) == Some(&to.as_str()))
            .then(|| fields.get(7)?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_of_a_peer_socket_is_read_from_its_line() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:9C40 0100007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 12345 1 0 20 4 30 10 -1\n\
   1: 0100007F:C350 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 12346 1 0 20 4 30 10 -1\n";
        let (a, b) = (
            "127.0.0.1:40000".parse().unwrap(),
            "127.0.0.1:50000".parse().unwrap(),
        );
        if cfg!(target_endian = "little") {
            assert_eq!(owner_in(table, a, b, false), Some(1000));
            assert_eq!(owner_in(table, b, a, false), Some(0));
            assert_eq!(proc_hex(a, true), "0000000000000000FFFF00000100007F:9C40");
        }
        let elsewhere = "127.0.0.1:1".parse().unwrap();
        assert_eq!(owner_in(table, a, elsewhere, false), None);
    }

    #[test]
    fn a_connection_of_this_process_is_its_users() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let local = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(local).unwrap();
        let (_, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        assert_eq!(owner(peer, local), own_uid());
        assert!(own_uid().is_some());
        // An IPv6 socket's mapped address, as the JVM connects.
        let mapped = std::net::SocketAddr::new(
            std::net::Ipv4Addr::LOCALHOST.to_ipv6_mapped().into(),
            local.port(),
        );
        let _v6 = std::net::TcpStream::connect(mapped).unwrap();
        let (_, peer) = listener.accept().unwrap();
        assert_eq!(owner(peer, local), own_uid());
    }
}
