//! The floor's socket options, as leasegate sets them (src/proxy/listener.rs `set_inherited`,
//! src/proxy/congestion.rs, src/proxy/dialer.rs `TcpDialer`).
//!
//! Invariant: a socket with both ends on this host (a listener bound to loopback, a dial to a
//! loopback address) is switched from a pacing congestion control (BBR) to reno, and only
//! that one; every socket has Nagle off — accepted ones by inheriting TCP_NODELAY from the
//! listener where Linux allows it, dialled ones by setting it before the connect.

use nix::sys::socket::{setsockopt, sockopt};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::OnceLock;
use tokio::net::{TcpSocket, TcpStream};

/// What a pacing congestion control is switched to (any process may pick reno).
const UNPACED: &str = "reno";

/// Whether this system's default congestion control paces each socket with its own timer
/// where the interface has no fq qdisc (loopback has none): BBR does (read once).
fn default_paces() -> bool {
    static PACES: OnceLock<bool> = OnceLock::new();
    *PACES.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .is_ok_and(|name| name.trim().starts_with("bbr"))
    })
}

/// Switches `socket` (bound or to be connected at `ip`) to reno when `ip` is a loopback address
/// and the system's default paces; on a listener, what it accepts inherits the choice. A
/// refusal by the kernel leaves the socket as it was. Returns whether it switched.
pub fn unpace_loopback(socket: &impl AsFd, ip: IpAddr) -> bool {
    if !default_paces() || !ip.to_canonical().is_loopback() {
        return false;
    }
    setsockopt(
        socket,
        sockopt::TcpCongestion,
        &std::ffi::OsString::from(UNPACED),
    )
    .is_ok()
}

/// Sets on `listener` what the sockets it accepts inherit: loopback unpaced, and TCP_NODELAY.
/// Returns whether they inherit TCP_NODELAY (`false`: each must be set).
pub fn set_inherited(listener: &impl AsFd, local: SocketAddr) -> bool {
    unpace_loopback(listener, local.ip());
    setsockopt(listener, sockopt::TcpNoDelay, &true).is_ok()
}

/// Connects to `addr` with Nagle off and, to loopback, unpaced: leasegate's `TcpDialer`.
pub async fn dial(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    let _ = socket.set_nodelay(true);
    unpace_loopback(&socket, addr.ip());
    socket.connect(addr).await
}
