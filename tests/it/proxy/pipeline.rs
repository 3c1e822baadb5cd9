//! The decision pipeline without sockets, as tables of rows (smokescreen's style: how the
//! request names its lease, what it asks, the refusal code or the dialled address expected).
//! Each row runs twice: through the proxy's pipeline (a dialer that records every dial and
//! connects nowhere) and through `decide` and `resolve_and_guard` alone, as `check` calls
//! them. Then `check` against `serve` on the same targets.

use crate::support::harness::{http_origin, raw, status_of, Harness};
use http::{HeaderMap, HeaderValue};
use leasegate::commands::inspect;
use leasegate::config::{Mode, OnRefusal, ProxyConfig};
use leasegate::contract::Timestamp;
use leasegate::policy::{Code, Refusal, UpstreamAddr};
use leasegate::proxy::decision::{decide_and_guard, Ask, Asked, Decision};
use leasegate::proxy::dialer::{Dialer, Dialing};
use leasegate::proxy::exchange::Exchange;
use leasegate::proxy::{connect, identify, ClientConn, Proxy};
use leasegate::telemetry::egress::Kind;
use leasegate::telemetry::{EgressLog, Telemetry};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// linkerd's test connector: records every dial, connects nowhere.
#[derive(Default)]
struct RecordingDialer {
    dialled: Mutex<Vec<SocketAddr>>,
}

impl Dialer for RecordingDialer {
    fn connect(&self, addr: UpstreamAddr) -> Dialing<'_> {
        self.dialled.lock().unwrap().push(addr.socket_addr());
        Box::pin(async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
    }
}

/// A proxy over the harness's journal, with `dialer` in place of TCP.
async fn offline_proxy(h: &Harness, config: ProxyConfig, dialer: Arc<RecordingDialer>) -> Proxy {
    let serve = h.serve_config(config, None);
    let registry = leasegate::registry::open::open_registry(
        &serve.journal,
        serve.keyring,
        &serve.store,
        false,
    )
    .await
    .unwrap();
    let telemetry = Arc::new(Telemetry::new(
        EgressLog::disabled(),
        serve.proxy.series_grace,
        serve.proxy.series_max_leases,
    ));
    let mut proxy = Proxy::new(serve.proxy, Arc::new(registry), telemetry);
    proxy.dialer = dialer;
    proxy
}

/// How a row's request asks: a CONNECT, or a forwarded request with this method.
#[derive(Clone, Copy, Debug)]
enum Asks {
    Connect,
    Forward(&'static str),
}

/// What a row expects.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    /// Refused with this code, nothing dialled.
    Refused(Code),
    /// Allowed: this checked address (the first) is dialled.
    Dials(&'static str),
}

/// One request: the lease port it arrives on (if any), its headers, what it asks.
struct Row<'a> {
    name: &'a str,
    port_lease: Option<&'a str>,
    headers: Vec<(&'a str, &'a str)>,
    asks: Asks,
    authority: String,
    want: Want,
}

/// A CONNECT on `lease`'s own port.
fn on_port<'a>(name: &'a str, lease: &'a str, authority: &str, want: Want) -> Row<'a> {
    Row {
        name,
        port_lease: Some(lease),
        headers: vec![],
        asks: Asks::Connect,
        authority: authority.to_owned(),
        want,
    }
}

impl Row<'_> {
    fn header_map(&self) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in &self.headers {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    fn method(&self) -> http::Method {
        match self.asks {
            Asks::Connect => http::Method::CONNECT,
            Asks::Forward(method) => http::Method::from_bytes(method.as_bytes()).unwrap(),
        }
    }

    fn default_port(&self) -> Option<u16> {
        match self.asks {
            Asks::Connect => None,
            Asks::Forward(_) => Some(80),
        }
    }

    /// Through the proxy's pipeline: a CONNECT through `connect::open` (clear, then dial); a
    /// forwarded request cleared the same way, then dialled. With the recording dialer an
    /// allowed row ends `upstream-unreachable`.
    async fn through_the_pipeline(&self, proxy: &Proxy) -> Result<(), Code> {
        let conn = ClientConn::detached(&proxy.telemetry, self.port_lease);
        let headers = self.header_map();
        let method = self.method();
        let kind = match self.asks {
            Asks::Connect => Kind::Connect,
            Asks::Forward(_) => Kind::Http,
        };
        let mut ex = Exchange::new(
            proxy.telemetry.clone(),
            kind,
            method.clone(),
            conn.client,
            conn.listener,
        );
        let outcome = match self.asks {
            Asks::Connect => connect::open(proxy, &conn, &headers, &self.authority, &mut ex)
                .await
                .map(drop),
            Asks::Forward(_) => {
                let asked = Asked::Forward {
                    method: &method,
                    host: headers.get(http::header::HOST),
                };
                let cleared = proxy
                    .clear(
                        &conn,
                        &headers,
                        asked,
                        &self.authority,
                        self.default_port(),
                        &mut ex,
                    )
                    .await;
                match cleared {
                    Ok(cleared) => proxy.dial(&cleared.addrs, &mut ex).await.map(drop),
                    Err(refusal) => Err(refusal),
                }
            }
        };
        outcome.map_err(|refusal| refusal.code)
    }

    /// Through `decide` and `resolve_and_guard` alone, as `check` calls them, over the proxy's
    /// registry and configuration: no connection, exchange or telemetry.
    async fn decided(&self, proxy: &Proxy) -> Result<(Decision, Vec<UpstreamAddr>), Refusal> {
        let headers = self.header_map();
        let method = self.method();
        let identity = identify::identify(&headers, self.port_lease)?;
        let asked = match self.asks {
            Asks::Connect => Asked::Tunnel,
            Asks::Forward(_) => Asked::Forward {
                method: &method,
                host: headers.get(http::header::HOST),
            },
        };
        let ask = Ask::new(asked, &self.authority, self.default_port());
        let (snapshot, now) = (proxy.registry.snapshot(), proxy.registry.now());
        decide_and_guard(snapshot, &proxy.config, &identity, ask, now).await
    }
}

/// Runs every row both ways and checks what each is refused with and what it dials.
async fn run(proxy: &Proxy, dialer: &RecordingDialer, rows: &[Row<'_>]) {
    for row in rows {
        let what = format!("{} ({})", row.name, row.authority);
        let outcome = row.through_the_pipeline(proxy).await;
        let dialled = std::mem::take(&mut *dialer.dialled.lock().unwrap());
        match row.want {
            Want::Refused(code) => {
                assert_eq!(outcome, Err(code), "{what}: the pipeline");
                assert_eq!(dialled, Vec::<SocketAddr>::new(), "{what} dialled");
            }
            Want::Dials(addr) => {
                assert_eq!(
                    outcome,
                    Err(Code::UpstreamUnreachable),
                    "{what}: the pipeline"
                );
                assert_eq!(dialled, [addr.parse::<SocketAddr>().unwrap()], "{what}");
            }
        }
        // The connection limit is the handler's (it ties the connection), not the decision's.
        if row.want == Want::Refused(Code::TooManyConnections) {
            continue;
        }
        let decided = row.decided(proxy).await.map(|(_, addrs)| addrs);
        match row.want {
            Want::Refused(code) => {
                assert_eq!(decided.map_err(|r| r.code), Err(code), "{what}: decide")
            }
            Want::Dials(addr) => {
                let addrs = decided.unwrap_or_else(|r| panic!("{what}: decide: {r:?}"));
                let first = addrs.first().map(|a| a.socket_addr());
                assert_eq!(first, Some(addr.parse().unwrap()), "{what}: decide");
            }
        }
    }
}

/// The detail of the refusal `decide` and `resolve_and_guard` give a CONNECT on `lease`'s own
/// port.
async fn refusal_detail(proxy: &Proxy, lease: &str, authority: &str) -> String {
    let row = on_port("detail", lease, authority, Want::Refused(Code::BadTarget));
    match row.decided(proxy).await {
        Ok(_) => panic!("{authority} was allowed"),
        Err(refusal) => refusal.detail,
    }
}

/// Addresses of every kind the guard refuses by default, IPv4 and IPv6 and embedded forms.
const GUARDED: [&str; 38] = [
    "0.0.0.1",
    "127.0.0.1",
    "10.0.0.1",
    "172.16.0.1",
    "192.168.0.1",
    "100.64.0.1",
    "169.254.169.254",
    "168.63.129.16",
    "100.100.100.200",
    "192.0.0.8",
    "198.18.0.1",
    "224.0.0.1",
    "240.0.0.1",
    "255.255.255.255",
    "[::]",
    "[::1]",
    "[fe80::1]",
    "[fc00::1]",
    "[fd00:ec2::254]",
    "[ff02::1]",
    "[64:ff9b:1::1]",
    "[2001::1]",
    "[::ffff:169.254.169.254]",
    "[64:ff9b::a9fe:a9fe]",
    "[2002:a9fe:a9fe::1]",
    "[::10.0.0.1]",
    // Special-purpose registry rows the guard once missed.
    "192.0.2.1",
    "198.51.100.1",
    "203.0.113.1",
    "192.88.99.1",
    "[fec0::1]",
    "[::ffff:0:5db8:d822]",
    "[100::1]",
    "[2001:db8::1]",
    "[3fff::1]",
    "[5f00::1]",
    "[2001:2::1]",
    "[2002:c000:201::1]",
];

#[tokio::test]
async fn every_refusal_code_of_the_pipeline_dials_nothing() {
    let h = Harness::new();
    let lease = h.lease(&["*"], &["denied.test"]);
    let narrow = h.lease(&["allowed.test", "other.test"], &[]);
    let later = h.lease_with(
        &["*"],
        &[],
        None,
        Timestamp::now().saturating_add_millis(3_600_000),
        Duration::from_secs(60),
    );
    let expired = h.lease_with(
        &["*"],
        &[],
        None,
        Timestamp::now().saturating_add_millis(-120_000),
        Duration::from_secs(60),
    );
    let parent = h.lease(&["*"], &[]);
    let child = h.lease_with(
        &["*"],
        &[],
        Some(&parent),
        Timestamp::now(),
        Duration::from_secs(600),
    );
    let revoked = h.lease(&["*"], &[]);
    for id in [&parent, &revoked] {
        leasegate::commands::issue::revoke(&h.journal, &h.key, id, "test", Timestamp::now())
            .unwrap();
    }
    let unknown = crate::support::id(7);
    let mut config = h.config(&[
        ("allowed.test", "93.184.216.34"),
        ("metadata.test", "169.254.169.254"),
        ("private.test", "10.1.2.3"),
    ]);
    config.guard.allow_private.clear();
    let dialer = Arc::new(RecordingDialer::default());
    let proxy = offline_proxy(&h, config, dialer.clone()).await;

    use Want::{Dials, Refused};
    let named_by = |name, headers, port_lease, authority: &str, want| Row {
        headers,
        port_lease,
        ..on_port(name, "", authority, want)
    };
    let forward = |name, method, headers, lease, authority: &str, want| Row {
        asks: Asks::Forward(method),
        headers,
        ..on_port(name, lease, authority, want)
    };
    #[rustfmt::skip]
    let mut rows = vec![
        named_by("no lease named", vec![], None, "allowed.test:443", Refused(Code::LeaseMissing)),
        named_by("unknown lease", vec![("x-lease-id", &unknown)], None, "allowed.test:443", Refused(Code::LeaseUnknown)),
        named_by("two leases", vec![("x-lease-id", &narrow)], Some(&lease), "allowed.test:443", Refused(Code::LeaseConflict)),
        on_port("no port", &lease, "allowed.test", Refused(Code::BadTarget)),
        on_port("userinfo", &lease, "a@allowed.test:443", Refused(Code::BadTarget)),
        on_port("not yet valid", &later, "allowed.test:443", Refused(Code::LeaseNotYetValid)),
        on_port("expired", &expired, "allowed.test:443", Refused(Code::LeaseExpired)),
        on_port("revoked", &revoked, "allowed.test:443", Refused(Code::LeaseRevoked)),
        on_port("parent revoked", &child, "allowed.test:443", Refused(Code::AncestorClosed)),
        on_port("denied", &lease, "denied.test:443", Refused(Code::HostDenied)),
        on_port("not listed", &narrow, "elsewhere.test:443", Refused(Code::HostNotAllowed)),
        on_port("name resolving to metadata", &lease, "metadata.test:80", Refused(Code::AddressNotAllowed)),
        on_port("name resolving to a private address", &lease, "private.test:80", Refused(Code::AddressNotAllowed)),
        on_port("no such name", &lease, "nowhere.test:443", Refused(Code::DnsFailed)),
        forward("TRACE", "TRACE", vec![], &lease, "allowed.test", Refused(Code::MethodNotAllowed)),
        forward("Host names another host", "GET", vec![("host", "other.test")], &narrow, "allowed.test", Refused(Code::HostMismatch)),
        // The control: an allowed target is dialled, at the address that was checked.
        on_port("allowed", &lease, "allowed.test:443", Dials("93.184.216.34:443")),
    ];
    let guarded: Vec<String> = GUARDED.iter().map(|a| format!("{a}:80")).collect();
    for authority in &guarded {
        rows.push(on_port(
            "guarded literal",
            &lease,
            authority,
            Refused(Code::AddressNotAllowed),
        ));
    }
    run(&proxy, &dialer, &rows).await;
}

#[tokio::test]
async fn report_mode_relaxes_host_policy_but_never_the_guard() {
    let h = Harness::new();
    let lease = h.lease(&["*"], &[]);
    let narrow = h.lease(&["allowed.test"], &[]);
    let mut config = h.config(&[
        ("allowed.test", "93.184.216.34"),
        ("elsewhere.test", "93.184.216.35"),
        ("metadata.test", "169.254.169.254"),
        ("private.test", "10.1.2.3"),
    ]);
    config.guard.allow_private.clear();
    config.mode = leasegate::proxy::Mode::Report;
    let dialer = Arc::new(RecordingDialer::default());
    let proxy = offline_proxy(&h, config, dialer.clone()).await;
    let mut guarded: Vec<String> = GUARDED.iter().map(|a| format!("{a}:443")).collect();
    guarded.extend(["metadata.test:80".into(), "private.test:443".into()]);
    let mut rows: Vec<Row> = guarded
        .iter()
        .map(|authority| {
            on_port(
                "guarded",
                &lease,
                authority,
                Want::Refused(Code::AddressNotAllowed),
            )
        })
        .collect();
    // Host policy is what report mode relaxes: a host the lease does not list is dialled.
    let relaxed = on_port(
        "not listed",
        &narrow,
        "elsewhere.test:443",
        Want::Dials("93.184.216.35:443"),
    );
    // ... and the decision says what enforce mode would have refused.
    let (decision, _) = relaxed.decided(&proxy).await.unwrap();
    let reported: Vec<Code> = decision.reported.iter().map(|r| r.code).collect();
    assert_eq!(reported, [Code::HostNotAllowed]);
    rows.push(relaxed);
    run(&proxy, &dialer, &rows).await;
}

#[tokio::test]
async fn ports_outside_the_lists_are_refused_before_any_dial_in_every_mode() {
    let h = Harness::new();
    let lease = h.lease(&["*"], &["denied.test"]);
    let mut config = h.config(&[
        ("allowed.test", "93.184.216.34"),
        ("denied.test", "93.184.216.35"),
    ]);
    // The defaults: tunnels to 443, forwarded requests to 80.
    config.connect_ports = ProxyConfig::default().connect_ports;
    config.forward_ports = ProxyConfig::default().forward_ports;
    for mode in [Mode::Enforce, Mode::Report] {
        config.mode = mode;
        let dialer = Arc::new(RecordingDialer::default());
        let proxy = offline_proxy(&h, config.clone(), dialer.clone()).await;
        let get = |authority: &str, want| Row {
            asks: Asks::Forward("GET"),
            ..on_port("GET", &lease, authority, want)
        };
        let closed = Want::Refused(Code::PortNotAllowed);
        let mut rows = vec![
            on_port("CONNECT", &lease, "allowed.test:22", closed),
            on_port("CONNECT", &lease, "allowed.test:80", closed),
            on_port("CONNECT", &lease, "93.184.216.34:8443", closed),
            get("allowed.test:8080", closed),
            get("allowed.test:443", closed),
            // The defaults themselves are dialled (the recording dialer connects nowhere).
            on_port(
                "CONNECT",
                &lease,
                "allowed.test:443",
                Want::Dials("93.184.216.34:443"),
            ),
            get("allowed.test", Want::Dials("93.184.216.34:80")),
        ];
        // The host verdict comes first: a denied host on any port is host-denied.
        if mode == Mode::Enforce {
            rows.push(on_port(
                "denied",
                &lease,
                "denied.test:22",
                Want::Refused(Code::HostDenied),
            ));
        }
        run(&proxy, &dialer, &rows).await;
        let said = refusal_detail(&proxy, &lease, "allowed.test:22").await;
        assert_eq!(said, "port 22 is not open to tunnels (--connect-ports 443)");
    }

    // `check` asks an http:// URL as a forwarded request and anything else as a CONNECT.
    config.mode = Mode::Enforce;
    config.resolve_names = false;
    let keyring = {
        let serve = h.serve_config(config.clone(), None);
        serve.keyring
    };
    for (target, want) in [
        ("allowed.test", None),
        ("https://allowed.test/x", None),
        ("http://allowed.test/x", None),
        // A CONNECT to a port open to forwarded requests only is served as one.
        ("allowed.test:80", None),
        ("allowed.test:22", Some(Code::PortNotAllowed)),
        ("http://allowed.test:8080/", Some(Code::PortNotAllowed)),
        ("https://allowed.test:8443/", Some(Code::PortNotAllowed)),
    ] {
        let explained = inspect::check(
            &leasegate::registry::JournalLocation::File(h.journal.clone()),
            &Default::default(),
            keyring.clone(),
            config.clone(),
            &lease,
            target,
        )
        .await
        .unwrap();
        assert_eq!(explained.refusal.map(|r| r.code), want, "{target}");
    }
}

#[tokio::test]
async fn the_per_lease_connection_limit_refuses_before_any_dial() {
    let h = Harness::new();
    let lease = h.lease(&["*"], &[]);
    let mut config = h.config(&[("allowed.test", "93.184.216.34")]);
    config.max_connections_per_lease = 0;
    let dialer = Arc::new(RecordingDialer::default());
    let proxy = offline_proxy(&h, config, dialer.clone()).await;
    let rows = [on_port(
        "over the lease's connections",
        &lease,
        "allowed.test:443",
        Want::Refused(Code::TooManyConnections),
    )];
    run(&proxy, &dialer, &rows).await;
}

/// The refusal code of a raw proxy answer (`None` for 200).
fn answer_code(answer: &str) -> Option<String> {
    if status_of(answer) == 200 {
        return None;
    }
    answer.lines().find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("x-leasegate-refusal")
            .then(|| value.trim().to_owned())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_and_serve_decide_alike() {
    let h = Harness::new();
    let origin = http_origin().await;
    let lease = h.lease(&["*.test", "127.0.0.1", "localhost"], &["denied.test"]);
    let mut config = h.config(&[
        ("origin.test", "127.0.0.1"),
        ("metadata.test", "169.254.169.254"),
        ("loop.test", "127.0.0.2"),
    ]);
    config.on_refusal = OnRefusal::Log;
    let server = h.start(config.clone()).await;
    let port = origin.addr.port();
    let targets = [
        format!("origin.test:{port}"),
        format!("127.0.0.1:{port}"),
        "denied.test:443".to_owned(),
        "elsewhere.example:443".to_owned(),
        "metadata.test:80".to_owned(),
        "loop.test:80".to_owned(),
        "169.254.169.254:80".to_owned(),
        "10.0.0.1:443".to_owned(),
        "[::ffff:a9fe:a9fe]:80".to_owned(),
        "nowhere.test:443".to_owned(),
        "origin..test:443".to_owned(),
        "origin.test:0".to_owned(),
    ];
    let mut compared = 0;
    for target in &targets {
        let answer = raw(
            server.addr,
            format!("CONNECT {target} HTTP/1.1\r\nX-Lease-Id: {lease}\r\n\r\n").as_bytes(),
        )
        .await;
        let served = answer_code(&answer);
        let checked = inspect::check(
            &leasegate::registry::JournalLocation::File(h.journal.clone()),
            &Default::default(),
            server
                .proxy
                .registry
                .snapshot()
                .ledger
                .keyring()
                .unwrap()
                .clone(),
            config.clone(),
            &lease,
            target,
        )
        .await
        .unwrap();
        let checked = checked.refusal.map(|r| r.code.as_str().to_owned());
        assert_eq!(checked, served, "{target}: check vs serve ({answer})");
        compared += 1;
    }
    assert_eq!(compared, targets.len());
    assert!(
        h.revocations().await.is_empty(),
        "on-refusal log: nothing revoked"
    );
}

#[tokio::test]
async fn a_denied_ip_literal_refuses_names_resolving_to_it_before_any_dial() {
    let h = Harness::new();
    let denying = || h.lease(&["*"], &["203.0.113.7"]);
    let (sneaky, nat64, mixed) = (denying(), denying(), denying());
    let parent = h.lease(&["*"], &["198.51.100.9"]);
    let child = h.lease_with(
        &["*"],
        &[],
        Some(&parent),
        Timestamp::now(),
        Duration::from_secs(600),
    );
    let resolve = [
        ("sneaky.test", "203.0.113.7"),
        ("nat64.test", "64:ff9b::cb00:7107"),
        ("mixed.test", "93.184.216.34"),
        ("mixed.test", "203.0.113.7"),
        ("parents.test", "198.51.100.9"),
        ("fine.test", "203.0.113.8"),
    ];
    let mut config = h.config(&resolve);
    // The documentation ranges are guarded; exempt them so only the deny list can refuse.
    config.guard.allow_private = vec![
        "203.0.113.0/24".parse().unwrap(),
        "198.51.100.0/24".parse().unwrap(),
    ];
    let dialer = Arc::new(RecordingDialer::default());
    let proxy = offline_proxy(&h, config.clone(), dialer.clone()).await;
    let denied = Want::Refused(Code::HostDenied);
    let rows = [
        on_port("a name", &sneaky, "sneaky.test:443", denied),
        on_port("NAT64", &nat64, "nat64.test:443", denied),
        on_port("one of two", &mixed, "mixed.test:443", denied),
        on_port("the parent's deny", &child, "parents.test:443", denied),
    ];
    run(&proxy, &dialer, &rows).await;
    // The refusal names the address and the lease whose deny list holds it.
    let said = refusal_detail(&proxy, &nat64, "nat64.test:443").await;
    assert_eq!(
        said,
        format!("nat64.test resolves to 64:ff9b::cb00:7107 (embedding 203.0.113.7), denied by 203.0.113.7 in lease {nat64}")
    );
    // The child carries its parent's denials (deny lists are united at issue).
    let said = refusal_detail(&proxy, &child, "parents.test:443").await;
    assert!(said.contains(&format!("in lease {child}")), "{said}");

    // The control: an address the deny list does not name is dialled; in report mode, which
    // only reports, the denied one too.
    let other = h.lease(&["*"], &["203.0.113.7"]);
    for (mode, authority, dials) in [
        (Mode::Enforce, "fine.test:443", "203.0.113.8:443"),
        (Mode::Report, "sneaky.test:443", "203.0.113.7:443"),
    ] {
        config.mode = mode;
        let proxy = offline_proxy(&h, config.clone(), dialer.clone()).await;
        let row = on_port("not denied", &other, authority, Want::Dials(dials));
        run(&proxy, &dialer, &[row]).await;
    }
}
