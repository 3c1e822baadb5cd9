//! TCP congestion control for connections that never leave this host.
//!
//! Invariant: only a socket whose both ends are on this host (one accepted by a listener bound
//! to a loopback address, one dialled to a loopback address) is switched, only away from a
//! congestion control that paces (BBR), and only to reno, which Linux lets any process pick.
//! Every other socket keeps the system's choice.
//!
//! Why: BBR paces every socket with its own timer when the interface has no `fq` qdisc to do
//! it, and loopback has none. Pacing guards a bottleneck queue; between two sockets of one host
//! there is no queue to guard, only the timer's cost. A download through the proxy on loopback
//! (the sidecar deployment: the agent's `HTTPS_PROXY` is `127.0.0.1`) paid it on the proxy's
//! sending hop: 0.61–0.71× the direct throughput on two cores with the proxy's sockets on BBR,
//! 1.15–1.55× with them on reno (direct is itself one paced hop), and 6–10 % less proxy CPU
//! per forwarded keep-alive request (docs/performance.md, "Bulk and BBR").

use std::net::IpAddr;

/// What a pacing congestion control is switched to.
#[cfg(target_os = "linux")]
const UNPACED: &str = "reno";

/// Whether this system's default congestion control paces each socket (read once).
#[cfg(target_os = "linux")]
fn default_paces() -> bool {
    static PACES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PACES.get_or_init(|| {
        let Ok(name) = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control") else {
            return false;
        };
        let name = name.trim();
        let pacing = paces(name);
        if pacing {
            tracing::info!(
                system = name,
                "loopback connections use {UNPACED}: {name} paces every socket with a timer \
                 where the interface has no fq qdisc, and loopback has no queue to pace for"
            );
        }
        pacing
    })
}

/// Whether the congestion control `name` paces each socket by itself.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
pub(crate) fn paces(name: &str) -> bool {
    name.starts_with("bbr")
}

/// Whether a socket between `local` (or a listener bound there) and its peer stays on this
/// host: a loopback address.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn on_this_host(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Switches `socket` (bound or to be connected at `ip`) off a pacing congestion control when
/// `ip` is a loopback address. On a listener, the sockets it accepts inherit the choice, so
/// this costs one system call per listener, not one per connection. Returns whether it
/// switched; a refusal by the kernel only leaves the socket as it was.
pub fn unpace_loopback(socket: &impl std::os::fd::AsFd, ip: IpAddr) -> bool {
    #[cfg(target_os = "linux")]
    {
        unpace_if(socket, ip, default_paces())
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (socket, ip);
        false
    }
}

/// [`unpace_loopback`], with whether the socket paces given.
#[cfg(target_os = "linux")]
fn unpace_if(socket: &impl std::os::fd::AsFd, ip: IpAddr, pacing: bool) -> bool {
    use nix::sys::socket::{setsockopt, sockopt::TcpCongestion};
    if !pacing || !on_this_host(ip) {
        return false;
    }
    match setsockopt(socket, TcpCongestion, &std::ffi::OsString::from(UNPACED)) {
        Ok(()) => true,
        Err(error) => {
            tracing::debug!(%error, %ip, "cannot switch a loopback socket to {UNPACED}");
            false
        }
    }
}

/// The congestion control `socket` uses (tests).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn current(socket: &impl std::os::fd::AsFd) -> String {
    let name = nix::sys::socket::getsockopt(socket, nix::sys::socket::sockopt::TcpCongestion)
        .expect("TCP_CONGESTION");
    name.to_string_lossy().trim_end_matches('\0').to_owned()
}

#[cfg(test)]
mod tests {
    use super::{current as congestion, on_this_host, paces};
    use std::net::{TcpListener, TcpStream};

    /// A loopback listener switched off pacing hands reno to what it accepts; the same
    /// listener left alone (not pacing, or not on loopback) hands on the system's choice.
    #[cfg(target_os = "linux")]
    #[test]
    fn an_unpaced_loopback_listener_accepts_reno_connections() {
        let default = {
            let probe = TcpListener::bind("127.0.0.1:0").unwrap();
            congestion(&probe)
        };
        for (ip, pacing, switched) in [
            ("127.0.0.1", true, true),
            ("127.0.0.1", false, false),
            ("10.0.0.1", true, false),
            ("0.0.0.0", true, false),
        ] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            assert_eq!(
                super::unpace_if(&listener, ip.parse().unwrap(), pacing),
                switched,
                "{ip} pacing {pacing}"
            );
            let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (accepted, _) = listener.accept().unwrap();
            let want = if switched { "reno" } else { default.as_str() };
            assert_eq!(congestion(&accepted), want, "{ip} pacing {pacing}");
        }
    }

    /// The real dialer's connections to loopback are unpaced wherever the system paces.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_dial_to_loopback_is_unpaced_where_the_system_paces() {
        use crate::proxy::dialer::{Dialer, TcpDialer};
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let default = congestion(&listener);
        let guard = crate::policy::Guard {
            allow_private: vec!["127.0.0.1/32".parse().unwrap()],
            ..Default::default()
        };
        let addr = guard
            .check(&[listener.local_addr().unwrap()], None)
            .dialable[0];
        let stream = TcpDialer.connect(addr).await.unwrap();
        let want = if paces(&default) {
            "reno"
        } else {
            default.as_str()
        };
        assert_eq!(congestion(&stream), want, "system default {default}");
        assert!(stream.nodelay().unwrap(), "Nagle stays off");
    }

    #[test]
    fn only_bbr_paces() {
        for name in ["bbr", "bbr2", "bbr3"] {
            assert!(paces(name), "{name}");
        }
        for name in ["reno", "cubic", "dctcp", "vegas", ""] {
            assert!(!paces(name), "{name}");
        }
    }

    #[test]
    fn loopback_in_either_family_stays_on_this_host() {
        for ip in ["127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"] {
            assert!(on_this_host(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "0.0.0.0",
            "::",
            "10.0.0.1",
            "192.168.1.1",
            "::ffff:10.0.0.1",
            "fe80::1",
        ] {
            assert!(!on_this_host(ip.parse().unwrap()), "{ip}");
        }
    }
}
