//! The address guard (SSRF and DNS rebinding): which resolved addresses may be dialled.
//!
//! Invariant: an [`UpstreamAddr`] can only be built here, by [`Guard::check`], so nothing can
//! dial an address the guard has not seen; and no exception or mode ever yields a socket
//! address leasegate itself listens on.

use super::target::TargetHost;
use super::verdict::HostPolicy;
use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::LazyLock;

/// A socket address that passed the guard: the only kind of address the proxy dials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UpstreamAddr(SocketAddr);

impl UpstreamAddr {
    pub fn socket_addr(self) -> SocketAddr {
        self.0
    }
}

impl std::fmt::Display for UpstreamAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Ranges no request reaches by default, with the reason shown in refusals.
static GUARDED: LazyLock<Vec<(IpNet, &'static str)>> = LazyLock::new(|| {
    [
        ("0.0.0.0/8", "unspecified (0/8)"),
        ("127.0.0.0/8", "loopback"),
        ("10.0.0.0/8", "private"),
        ("172.16.0.0/12", "private"),
        ("192.168.0.0/16", "private"),
        ("100.64.0.0/10", "CGNAT shared space"),
        ("169.254.0.0/16", "link-local (cloud metadata)"),
        ("168.63.129.16/32", "cloud metadata"),
        ("100.100.100.200/32", "cloud metadata"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("198.18.0.0/15", "benchmarking"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved (240/4)"),
        ("255.255.255.255/32", "broadcast"),
        ("::/128", "unspecified"),
        ("::1/128", "loopback"),
        ("fe80::/10", "link-local"),
        ("fc00::/7", "unique local (private)"),
        ("fd00:ec2::254/128", "cloud metadata"),
        ("ff00::/8", "multicast"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("2001::/32", "Teredo (embeds an obscured IPv4)"),
    ]
    .into_iter()
    .map(|(net, why)| (net.parse().expect("static range"), why))
    .collect()
});

/// Why `ip` is guarded, if it is. IPv6 forms that embed an IPv4 address (mapped, the
/// deprecated compatible form, NAT64 64:ff9b::/96, 6to4 2002::/16) are judged by that IPv4.
pub fn guarded_reason(ip: IpAddr) -> Option<&'static str> {
    if let Some(v4) = embedded_ipv4(ip) {
        return guarded_reason(IpAddr::V4(v4));
    }
    GUARDED
        .iter()
        .find(|(net, _)| net.contains(&ip))
        .map(|(_, why)| *why)
}

fn embedded_ipv4(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else { return None };
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    // ::a.b.c.d (IPv4-compatible), but not :: and ::1 themselves.
    if s[..6] == [0; 6] && u32::from(low) > 1 {
        return Some(low);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(low);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

/// An exception the chain's allow lists grant for one target (most targets have none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exception {
    /// The target is an IP literal every lease of the chain lists exactly.
    Ip(IpAddr),
    /// The target is `localhost`, listed exactly by every lease of the chain: loopback is fine.
    Localhost,
}

impl Exception {
    /// The exception `host` earns when every lease of the chain lists it exactly: an IP
    /// literal, or `localhost` (then loopback is fine). A wildcard or `*` never earns one.
    pub fn for_target<'a>(
        chain: impl IntoIterator<Item = &'a HostPolicy>,
        host: &TargetHost,
    ) -> Option<Exception> {
        let exception = match host {
            TargetHost::Ip(ip) => Exception::Ip(*ip),
            TargetHost::Name(name) if name == "localhost" => Exception::Localhost,
            TargetHost::Name(_) => return None,
        };
        let mut chain = chain.into_iter().peekable();
        chain.peek()?;
        chain
            .all(|policy| policy.allow.lists_exactly(host))
            .then_some(exception)
    }
}

/// A resolved address the guard refused, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    pub addr: SocketAddr,
    pub why: &'static str,
}

/// The result of checking resolved addresses.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    /// Addresses that may be dialled, in resolver order.
    pub dialable: Vec<UpstreamAddr>,
    /// Addresses refused (in report mode, guarded ones are also dialable: only loops are not).
    pub blocked: Vec<Blocked>,
}

/// The guard's configuration.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Operator ranges (`--allow-private`) exempt from the guarded list.
    pub allow_private: Vec<IpNet>,
    /// Socket addresses leasegate listens on; never dialled.
    pub own: Vec<SocketAddr>,
    /// Port ranges leasegate may listen on (per-lease ports) at an address; never dialled.
    pub own_ranges: Vec<(IpAddr, std::ops::RangeInclusive<u16>)>,
}

impl Guard {
    /// Whether dialling `addr` would reach one of our own listeners.
    pub fn is_loop(&self, addr: SocketAddr) -> bool {
        let ip = embedded_ipv4(addr.ip()).map_or(addr.ip(), IpAddr::V4);
        // A wildcard listener answers on every local address we can name.
        let same_host = |own: IpAddr| {
            own == ip
                || (own.is_unspecified() && (ip.is_loopback() || ip.is_unspecified()))
                || (ip.is_unspecified() && own.is_loopback())
        };
        self.own
            .iter()
            .any(|own| own.port() == addr.port() && same_host(own.ip()))
            || self
                .own_ranges
                .iter()
                .any(|(own, ports)| ports.contains(&addr.port()) && same_host(*own))
    }

    /// Sorts resolved addresses into dialable and blocked. With `enforce` false (report
    /// mode), guarded addresses are reported but stay dialable; loops never are.
    pub fn check(
        &self,
        resolved: &[SocketAddr],
        exception: Option<Exception>,
        enforce: bool,
    ) -> Checked {
        let mut out = Checked::default();
        for &addr in resolved {
            if self.is_loop(addr) {
                out.blocked.push(Blocked {
                    addr,
                    why: "one of leasegate's own listening addresses",
                });
                continue;
            }
            let why = self.why_blocked(addr.ip(), exception);
            if let Some(why) = why {
                out.blocked.push(Blocked { addr, why });
            }
            if why.is_none() || !enforce {
                out.dialable.push(UpstreamAddr(addr));
            }
        }
        out
    }

    fn why_blocked(&self, ip: IpAddr, exception: Option<Exception>) -> Option<&'static str> {
        let why = guarded_reason(ip)?;
        let plain = embedded_ipv4(ip).map_or(ip, IpAddr::V4);
        let excepted = match exception {
            None => false,
            Some(Exception::Ip(listed)) => listed == plain,
            Some(Exception::Localhost) => plain.is_loopback(),
        };
        if excepted
            || self
                .allow_private
                .iter()
                .any(|net| net.contains(&plain) || net.contains(&ip))
        {
            None
        } else {
            Some(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_guarded_list_covers_design_md() {
        for guarded in [
            "127.0.0.1",
            "0.0.0.0",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "100.64.0.1",
            "169.254.169.254",
            "168.63.129.16",
            "100.100.100.200",
            "224.0.0.1",
            "255.255.255.255",
            "240.0.0.1",
            "198.18.0.1",
            "::1",
            "::",
            "fe80::1",
            "fc00::1",
            "fd00:ec2::254",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::a00:1",
            "2002:a9fe:a9fe::1",
            "2002:7f00:1::",
            "::127.0.0.1",
        ] {
            assert!(guarded_reason(ip(guarded)).is_some(), "{guarded}");
        }
        for public in [
            "93.184.216.34",
            "2606:4700::1111",
            "64:ff9b::5db8:d822",
            "2002:5db8:d822::1",
            "1.1.1.1",
        ] {
            assert_eq!(guarded_reason(ip(public)), None, "{public}");
        }
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn exceptions_are_narrow_and_loops_are_never_dialable() {
        let guard = Guard {
            allow_private: vec!["10.9.0.0/16".parse().unwrap()],
            own: vec![addr("127.0.0.1:3128")],
            own_ranges: vec![(ip("127.0.0.1"), 40000..=40010)],
        };
        let candidates = [
            addr("127.0.0.1:8080"),
            addr("127.0.0.2:8080"),
            addr("10.9.1.1:80"),
            addr("10.8.1.1:80"),
        ];
        let checked = guard.check(&candidates, Some(Exception::Ip(ip("127.0.0.1"))), true);
        let dialable: Vec<_> = checked.dialable.iter().map(|a| a.socket_addr()).collect();
        assert_eq!(dialable, [addr("127.0.0.1:8080"), addr("10.9.1.1:80")]);
        assert_eq!(checked.blocked.len(), 2);

        let localhost = guard.check(
            &[addr("127.0.0.5:80"), addr("[::1]:80"), addr("10.0.0.1:80")],
            Some(Exception::Localhost),
            true,
        );
        assert_eq!(localhost.dialable.len(), 2);

        let everything = Guard {
            allow_private: vec!["0.0.0.0/0".parse().unwrap()],
            ..guard.clone()
        };
        for looping in [
            "127.0.0.1:3128",
            "[::ffff:127.0.0.1]:3128",
            "127.0.0.1:40005",
        ] {
            let checked = everything.check(
                &[addr(looping)],
                Some(Exception::Ip(ip("127.0.0.1"))),
                false,
            );
            assert!(checked.dialable.is_empty(), "{looping}");
        }
        let wildcard = Guard {
            own: vec![addr("0.0.0.0:3128")],
            ..Guard::default()
        };
        assert!(wildcard.is_loop(addr("127.0.0.9:3128")));
        assert!(!wildcard.is_loop(addr("127.0.0.9:3129")));
    }

    #[test]
    fn report_mode_keeps_guarded_addresses_dialable_but_reported() {
        let guard = Guard::default();
        let checked = guard.check(&[addr("169.254.169.254:80")], None, false);
        assert_eq!(checked.dialable.len(), 1);
        assert_eq!(checked.blocked[0].why, "link-local (cloud metadata)");
    }
}
