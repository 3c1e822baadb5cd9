//! The address guard (SSRF and DNS rebinding): which resolved addresses may be dialled.
//!
//! Invariant: an [`UpstreamAddr`] can only be built here, by [`Guard::check`], so nothing can
//! dial an address the guard has not seen; the guard is the same in every mode (report mode
//! relaxes host policy only); and no exception ever yields a socket address leasegate itself
//! listens on.

use super::target::TargetHost;
use super::verdict::HostPolicy;
use arc_swap::ArcSwap;
use ipnet::IpNet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, LazyLock};

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

/// Ranges no request reaches by default, with the reason shown in refusals: every entry of
/// the IANA IPv4 and IPv6 Special-Purpose Address Registries whose "Globally Reachable" is
/// False or N/A (checked row by row against both registries as of 2025, including
/// 100:0:0:1::/64 of RFC 9780, 3fff::/20 of RFC 9637 and 5f00::/16 of RFC 9602), named as the
/// registry names it, plus multicast, deprecated site-local, SIIT
/// and the cloud-metadata addresses. The most specific range gives the reason.
///
/// Strict, on purpose: a globally reachable exception *inside* a guarded block (192.0.0.9/32
/// and 192.0.0.10/32 in 192.0.0.0/24; 2001:1::1-3/128, 2001:3::/32, 2001:4:112::/48,
/// 2001:20::/28 and 2001:30::/28 in 2001::/23) stays guarded with its block: no agent needs
/// anycast PCP, TURN or AMT relays through an egress proxy, and `--allow-private` exempts one.
/// Transition forms that embed an IPv4 address (::ffff:0:0/96 IPv4-mapped, 64:ff9b::/96,
/// 6to4 2002::/16, ::a.b.c.d) are judged by that IPv4 address instead (see
/// [`guarded_reason`]): the registry's rows for them never reach this table.
const GUARDED_TABLE: &[(&str, &str)] = &[
    // IANA IPv4 Special-Purpose Address Registry.
    ("0.0.0.0/8", "\"This network\""),
    ("0.0.0.0/32", "\"This host on this network\""),
    ("10.0.0.0/8", "Private-Use"),
    ("100.64.0.0/10", "Shared Address Space (CGNAT)"),
    ("127.0.0.0/8", "Loopback"),
    ("169.254.0.0/16", "Link Local (cloud metadata)"),
    ("172.16.0.0/12", "Private-Use"),
    ("192.0.0.0/24", "IETF Protocol Assignments"),
    ("192.0.0.0/29", "IPv4 Service Continuity Prefix"),
    ("192.0.0.8/32", "IPv4 dummy address"),
    ("192.0.0.170/32", "NAT64/DNS64 Discovery"),
    ("192.0.0.171/32", "NAT64/DNS64 Discovery"),
    ("192.0.2.0/24", "Documentation (TEST-NET-1)"),
    ("192.88.99.0/24", "Deprecated (6to4 Relay Anycast)"),
    ("192.168.0.0/16", "Private-Use"),
    ("198.18.0.0/15", "Benchmarking"),
    ("198.51.100.0/24", "Documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "Documentation (TEST-NET-3)"),
    ("240.0.0.0/4", "Reserved"),
    ("255.255.255.255/32", "Limited Broadcast"),
    // Not special-purpose, but never a unicast upstream.
    ("224.0.0.0/4", "Multicast"),
    // Cloud metadata services (Azure wire server, Alibaba Cloud; AWS's IPv6 one below).
    ("168.63.129.16/32", "cloud metadata"),
    ("100.100.100.200/32", "cloud metadata"),
    // IANA IPv6 Special-Purpose Address Registry.
    ("::1/128", "Loopback Address"),
    ("::/128", "Unspecified Address"),
    ("64:ff9b:1::/48", "IPv4-IPv6 Translat. (local-use NAT64)"),
    ("100::/64", "Discard-Only Address Block"),
    ("100:0:0:1::/64", "Dummy IPv6 Prefix"),
    ("2001::/23", "IETF Protocol Assignments"),
    ("2001::/32", "TEREDO (embeds an obscured IPv4)"),
    ("2001:2::/48", "Benchmarking"),
    ("2001:10::/28", "Deprecated (previously ORCHID)"),
    ("2001:db8::/32", "Documentation"),
    ("3fff::/20", "Documentation"),
    ("5f00::/16", "Segment Routing (SRv6) SIDs"),
    ("fc00::/7", "Unique-Local"),
    ("fe80::/10", "Link-Local Unicast"),
    // Not in the registry: deprecated site-local (RFC 3879), SIIT's IPv4-translated form
    // (RFC 2765: reaches an IPv4 host through a translator the guard cannot see), multicast.
    ("fec0::/10", "Site-Local (deprecated)"),
    ("::ffff:0:0:0/96", "IPv4-translated (SIIT)"),
    ("ff00::/8", "Multicast"),
    ("fd00:ec2::254/128", "cloud metadata"),
];

/// [`GUARDED_TABLE`] parsed, most specific range first.
static GUARDED: LazyLock<Vec<(IpNet, &'static str)>> = LazyLock::new(|| {
    let mut table: Vec<(IpNet, &'static str)> = GUARDED_TABLE
        .iter()
        .map(|(net, why)| (net.parse().expect("static range"), *why))
        .collect();
    table.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
    table
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

pub(crate) fn embedded_ipv4(ip: IpAddr) -> Option<Ipv4Addr> {
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

/// Why an address of leasegate's own is blocked (no flag exempts it).
const OWN_LISTENER: &str = "one of leasegate's own listening addresses";

/// Special-use domains for testing (RFC 2606, RFC 6761): names only `--resolve` or a local
/// resolver gives an address.
const TEST_DOMAINS: &[&str] = &["test", "example", "invalid", "localhost"];

impl Blocked {
    /// The refusal's words when every address of `host` is blocked and this one is named:
    /// "resolves to" only for a name, and the flag that would let it through —
    /// `--allow-private` with this one address (the narrowest range), and `--resolve` for a
    /// test name. One line, bounded by the host's length.
    pub fn explain(&self, host: &TargetHost) -> String {
        let ip = self.addr.ip();
        let subject = match host {
            TargetHost::Ip(_) => format!("{ip} is"),
            TargetHost::Name(name) => format!("{name} resolves to {ip},"),
        };
        if self.why == OWN_LISTENER {
            return format!(
                "{subject} {OWN_LISTENER} (port {}), never dialled",
                self.addr.port()
            );
        }
        // The guard exempts an embedded IPv4 address by the IPv4 range: name that one.
        let range = IpNet::from(embedded_ipv4(ip).map_or(ip, IpAddr::V4));
        let mut text = format!(
            "{subject} a guarded address ({}): --allow-private {range} allows it",
            self.why
        );
        if let TargetHost::Name(name) = host {
            let tld = name.rsplit('.').next().unwrap_or_default();
            if name.contains('.') && TEST_DOMAINS.contains(&tld) {
                text.push_str(&format!(
                    ", or --resolve {name}=ADDR gives the test name another address"
                ));
            }
        }
        text
    }
}

/// The result of checking resolved addresses.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    /// Addresses that may be dialled, in resolver order.
    pub dialable: Vec<UpstreamAddr>,
    /// Addresses refused, and why.
    pub blocked: Vec<Blocked>,
}

/// The host's own interface addresses, as the server last read them: a wildcard listener
/// answers on every one of them. Shared, so the server can refresh it while requests read it.
pub type LocalAddrs = Arc<ArcSwap<Vec<IpAddr>>>;

/// The guard's configuration.
#[derive(Debug, Clone, Default)]
pub struct Guard {
    /// Operator ranges (`--allow-private`) exempt from the guarded list.
    pub allow_private: Vec<IpNet>,
    /// Socket addresses leasegate listens on; never dialled.
    pub own: Vec<SocketAddr>,
    /// Port ranges leasegate may listen on (per-lease ports) at an address; never dialled.
    pub own_ranges: Vec<(IpAddr, std::ops::RangeInclusive<u16>)>,
    /// Every interface address of this host (refreshed by the server), so that a wildcard
    /// listener's non-loopback addresses count as ours too.
    pub local: LocalAddrs,
}

impl Guard {
    /// Whether dialling `addr` would reach one of our own listeners.
    pub fn is_loop(&self, addr: SocketAddr) -> bool {
        let ip = embedded_ipv4(addr.ip()).map_or(addr.ip(), IpAddr::V4);
        let local = self.local.load();
        // A wildcard listener answers on every local address: loopback, unspecified, and each
        // interface's (an `--allow-private` range may hold the host's own LAN address).
        let same_host = |own: IpAddr| {
            own == ip
                || (own.is_unspecified()
                    && (ip.is_loopback() || ip.is_unspecified() || local.contains(&ip)))
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

    /// Sorts resolved addresses into dialable and blocked, in every mode alike.
    pub fn check(&self, resolved: &[SocketAddr], exception: Option<Exception>) -> Checked {
        let mut out = Checked::default();
        for &addr in resolved {
            if self.is_loop(addr) {
                out.blocked.push(Blocked {
                    addr,
                    why: OWN_LISTENER,
                });
                continue;
            }
            match self.why_blocked(addr.ip(), exception) {
                Some(why) => out.blocked.push(Blocked { addr, why }),
                None => out.dialable.push(UpstreamAddr(addr)),
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

    /// "resolves to" for names only, and the flags that would let the address through.
    #[test]
    fn a_blocked_address_is_explained_with_the_way_forward() {
        let name = |n: &str| TargetHost::Name(n.to_owned());
        let blocked = |a: &str| {
            let addr = addr(a);
            Blocked {
                addr,
                why: guarded_reason(addr.ip()).unwrap_or(OWN_LISTENER),
            }
        };
        for (host, at, said) in [
            (
                TargetHost::Ip(ip("127.0.0.1")),
                "127.0.0.1:80",
                "127.0.0.1 is a guarded address (Loopback): --allow-private 127.0.0.1/32 \
                 allows it",
            ),
            (
                name("localhost"),
                "127.0.0.1:80",
                "localhost resolves to 127.0.0.1, a guarded address (Loopback): \
                 --allow-private 127.0.0.1/32 allows it",
            ),
            (
                name("origin.test"),
                "10.1.2.3:443",
                "origin.test resolves to 10.1.2.3, a guarded address (Private-Use): \
                 --allow-private 10.1.2.3/32 allows it, or --resolve origin.test=ADDR gives \
                 the test name another address",
            ),
            (
                TargetHost::Ip(ip("::ffff:169.254.169.254")),
                "[::ffff:169.254.169.254]:80",
                "::ffff:169.254.169.254 is a guarded address (Link Local (cloud metadata)): \
                 --allow-private 169.254.169.254/32 allows it",
            ),
            (
                TargetHost::Ip(ip("fe80::1")),
                "[fe80::1]:443",
                "fe80::1 is a guarded address (Link-Local Unicast): --allow-private \
                 fe80::1/128 allows it",
            ),
        ] {
            assert_eq!(blocked(at).explain(&host), said);
        }
        let own = Blocked {
            addr: addr("93.184.216.34:3128"),
            why: OWN_LISTENER,
        };
        assert_eq!(
            own.explain(&name("proxy.example.com")),
            "proxy.example.com resolves to 93.184.216.34, one of leasegate's own listening \
             addresses (port 3128), never dialled"
        );
    }

    #[test]
    fn exceptions_are_narrow_and_loops_are_never_dialable() {
        let guard = Guard {
            allow_private: vec!["10.9.0.0/16".parse().unwrap()],
            own: vec![addr("127.0.0.1:3128")],
            own_ranges: vec![(ip("127.0.0.1"), 40000..=40010)],
            ..Guard::default()
        };
        let candidates = [
            addr("127.0.0.1:8080"),
            addr("127.0.0.2:8080"),
            addr("10.9.1.1:80"),
            addr("10.8.1.1:80"),
        ];
        let checked = guard.check(&candidates, Some(Exception::Ip(ip("127.0.0.1"))));
        let dialable: Vec<_> = checked.dialable.iter().map(|a| a.socket_addr()).collect();
        assert_eq!(dialable, [addr("127.0.0.1:8080"), addr("10.9.1.1:80")]);
        assert_eq!(checked.blocked.len(), 2);

        let localhost = guard.check(
            &[addr("127.0.0.5:80"), addr("[::1]:80"), addr("10.0.0.1:80")],
            Some(Exception::Localhost),
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
            let checked = everything.check(&[addr(looping)], Some(Exception::Ip(ip("127.0.0.1"))));
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
    fn guarded_addresses_are_never_dialable() {
        let guard = Guard::default();
        let checked = guard.check(
            &[addr("169.254.169.254:80"), addr("93.184.216.34:80")],
            None,
        );
        let dialable: Vec<_> = checked.dialable.iter().map(|a| a.socket_addr()).collect();
        assert_eq!(dialable, [addr("93.184.216.34:80")]);
        assert_eq!(checked.blocked.len(), 1);
        assert_eq!(checked.blocked[0].why, "Link Local (cloud metadata)");
    }

    /// One address per row of the IANA Special-Purpose Address Registries (IPv4 and IPv6),
    /// with the reason the guard gives, or `None` where the row is globally reachable and
    /// lies outside every guarded block.
    #[test]
    fn one_row_per_special_purpose_registry_entry() {
        let rows: &[(&str, Option<&str>)] = &[
            // IPv4 registry.
            ("0.1.2.3", Some("\"This network\"")),
            ("0.0.0.0", Some("\"This host on this network\"")),
            ("10.20.30.40", Some("Private-Use")),
            ("100.64.1.1", Some("Shared Address Space (CGNAT)")),
            ("127.0.0.53", Some("Loopback")),
            ("169.254.169.254", Some("Link Local (cloud metadata)")),
            ("172.31.255.1", Some("Private-Use")),
            ("192.0.0.100", Some("IETF Protocol Assignments")),
            ("192.0.0.5", Some("IPv4 Service Continuity Prefix")),
            ("192.0.0.8", Some("IPv4 dummy address")),
            // Globally reachable, but inside 192.0.0.0/24: guarded with it (strict).
            ("192.0.0.9", Some("IETF Protocol Assignments")),
            ("192.0.0.10", Some("IETF Protocol Assignments")),
            ("192.0.0.170", Some("NAT64/DNS64 Discovery")),
            ("192.0.0.171", Some("NAT64/DNS64 Discovery")),
            ("192.0.2.7", Some("Documentation (TEST-NET-1)")),
            ("192.31.196.1", None),
            ("192.52.193.1", None),
            ("192.88.99.1", Some("Deprecated (6to4 Relay Anycast)")),
            ("192.168.1.1", Some("Private-Use")),
            ("192.175.48.1", None),
            ("198.19.255.254", Some("Benchmarking")),
            ("198.51.100.7", Some("Documentation (TEST-NET-2)")),
            ("203.0.113.7", Some("Documentation (TEST-NET-3)")),
            ("250.1.2.3", Some("Reserved")),
            ("255.255.255.255", Some("Limited Broadcast")),
            // Kept beside the registry.
            ("239.255.255.250", Some("Multicast")),
            ("168.63.129.16", Some("cloud metadata")),
            ("100.100.100.200", Some("cloud metadata")),
            // IPv6 registry.
            ("::1", Some("Loopback Address")),
            ("::", Some("Unspecified Address")),
            // IPv4-mapped: judged by the IPv4 address it embeds.
            ("::ffff:192.168.0.1", Some("Private-Use")),
            ("::ffff:93.184.216.34", None),
            // 64:ff9b::/96 is globally reachable: judged by the embedded IPv4 address.
            ("64:ff9b::a00:1", Some("Private-Use")),
            ("64:ff9b::5db8:d822", None),
            (
                "64:ff9b:1::5db8:d822",
                Some("IPv4-IPv6 Translat. (local-use NAT64)"),
            ),
            ("100::1", Some("Discard-Only Address Block")),
            ("100:0:0:1::1", Some("Dummy IPv6 Prefix")),
            (
                "2001:0:4136:e378::1",
                Some("TEREDO (embeds an obscured IPv4)"),
            ),
            ("2001:1ff::1", Some("IETF Protocol Assignments")),
            // Globally reachable rows inside 2001::/23: guarded with it (strict).
            ("2001:1::1", Some("IETF Protocol Assignments")),
            ("2001:1::2", Some("IETF Protocol Assignments")),
            ("2001:1::3", Some("IETF Protocol Assignments")),
            ("2001:3::1", Some("IETF Protocol Assignments")),
            ("2001:4:112::1", Some("IETF Protocol Assignments")),
            ("2001:20::1", Some("IETF Protocol Assignments")),
            ("2001:30::1", Some("IETF Protocol Assignments")),
            ("2001:2::1", Some("Benchmarking")),
            ("2001:10::1", Some("Deprecated (previously ORCHID)")),
            ("2001:db8::1", Some("Documentation")),
            // 6to4 (N/A): judged by the embedded IPv4 address.
            ("2002:c000:0207::1", Some("Documentation (TEST-NET-1)")),
            ("2002:5db8:d822::1", None),
            ("2620:4f:8000::1", None),
            ("3fff:fff::1", Some("Documentation")),
            ("5f00::1", Some("Segment Routing (SRv6) SIDs")),
            ("fd12:3456::1", Some("Unique-Local")),
            ("fe80::1", Some("Link-Local Unicast")),
            // Kept beside the registry.
            ("fec0::1", Some("Site-Local (deprecated)")),
            ("::ffff:0:5db8:d822", Some("IPv4-translated (SIIT)")),
            ("ff02::1", Some("Multicast")),
            ("fd00:ec2::254", Some("cloud metadata")),
        ];
        for (addr, want) in rows {
            assert_eq!(guarded_reason(ip(addr)), *want, "{addr}");
        }
    }

    #[test]
    fn a_wildcard_listener_loops_on_every_local_interface_address() {
        let guard = Guard {
            own: vec![addr("0.0.0.0:3128"), addr("0.0.0.0:3129")],
            own_ranges: vec![(ip("::"), 40000..=40010)],
            ..Guard::default()
        };
        assert!(!guard.is_loop(addr("10.1.2.3:3129")), "not ours yet");
        guard
            .local
            .store(Arc::new(vec![ip("10.1.2.3"), ip("fd12::5")]));
        assert!(guard.is_loop(addr("10.1.2.3:3129")));
        assert!(guard.is_loop(addr("[::ffff:10.1.2.3]:3128")));
        assert!(guard.is_loop(addr("[fd12::5]:40003")));
        assert!(!guard.is_loop(addr("10.1.2.3:8080")), "another port");
        assert!(!guard.is_loop(addr("10.1.2.4:3129")), "another host");
        // Even when an operator range exempts the host's LAN, it is never dialable.
        let exempt = Guard {
            allow_private: vec!["10.0.0.0/8".parse().unwrap()],
            ..guard.clone()
        };
        let checked = exempt.check(&[addr("10.1.2.3:3129")], None);
        assert!(checked.dialable.is_empty());
        // A listener on one address is not reachable through another.
        let specific = Guard {
            own: vec![addr("127.0.0.1:3129")],
            ..guard.clone()
        };
        assert!(!specific.is_loop(addr("10.1.2.3:3129")));
    }
}
