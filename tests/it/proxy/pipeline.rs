//! The decision pipeline without sockets (a dialer that records every dial and connects
//! nowhere), and `check` against `serve` on the same targets.

use crate::support::harness::{http_origin, raw, status_of, Harness};
use http::{HeaderMap, HeaderValue};
use leasegate::config::{Mode, OnRefusal, ProxyConfig};
use leasegate::contract::Timestamp;
use leasegate::inspect;
use leasegate::policy::{Code, UpstreamAddr};
use leasegate::proxy::dialer::{Dialer, Dialing};
use leasegate::proxy::exchange::Exchange;
use leasegate::proxy::{connect, ClientConn, Proxy};
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

/// One request through the pipeline: a CONNECT goes through `connect::open` (decide, then
/// dial); a forwarded request's kind is decided the same way, then dialled.
async fn ask(
    proxy: &Proxy,
    port_lease: Option<&str>,
    headers: &[(&str, &str)],
    kind: Kind,
    method: &str,
    authority: &str,
) -> Result<(), Code> {
    let conn = ClientConn::detached(proxy, port_lease);
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.append(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        kind,
        http::Method::from_bytes(method.as_bytes()).unwrap(),
        conn.client,
        conn.listener,
    );
    let outcome = match kind {
        Kind::Connect => connect::open(proxy, &conn, &map, authority, &mut ex)
            .await
            .map(drop),
        Kind::Http => match proxy
            .decide(&conn, &map, authority, Some(80), &mut ex)
            .await
        {
            Ok(decision) => proxy.dial(&decision.addrs, &mut ex).await.map(drop),
            Err(refusal) => Err(refusal),
        },
    };
    outcome.map_err(|refusal| refusal.code)
}

/// The detail of the refusal phases 1–5 give a CONNECT on `lease`'s own port.
async fn refusal_detail(proxy: &Proxy, lease: &str, authority: &str) -> String {
    let conn = ClientConn::detached(proxy, Some(lease));
    let mut ex = Exchange::new(
        proxy.telemetry.clone(),
        Kind::Connect,
        http::Method::CONNECT,
        conn.client,
        conn.listener,
    );
    match proxy
        .decide(&conn, &HeaderMap::new(), authority, None, &mut ex)
        .await
    {
        Ok(_) => panic!("{authority} was allowed"),
        Err(refusal) => refusal.detail,
    }
}

/// A CONNECT on `lease`'s own port.
async fn connect_on_port(proxy: &Proxy, lease: &str, authority: &str) -> Result<(), Code> {
    ask(proxy, Some(lease), &[], Kind::Connect, "CONNECT", authority).await
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
        leasegate::issue::revoke(&h.journal, &h.key, id, "test", Timestamp::now()).unwrap();
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

    struct Case<'a> {
        name: &'a str,
        port_lease: Option<&'a str>,
        headers: Vec<(&'a str, &'a str)>,
        kind: Kind,
        method: &'a str,
        authority: String,
        want: Code,
    }
    let connect = |name, port_lease, authority: &str, want| Case {
        name,
        port_lease,
        headers: vec![],
        kind: Kind::Connect,
        method: "CONNECT",
        authority: authority.to_owned(),
        want,
    };
    let mut cases = vec![
        Case {
            headers: vec![],
            ..connect(
                "no lease named",
                None,
                "allowed.test:443",
                Code::LeaseMissing,
            )
        },
        Case {
            headers: vec![("x-lease-id", &unknown)],
            ..connect(
                "unknown lease",
                None,
                "allowed.test:443",
                Code::LeaseUnknown,
            )
        },
        Case {
            headers: vec![("x-lease-id", &narrow)],
            ..connect(
                "two leases",
                Some(&lease),
                "allowed.test:443",
                Code::LeaseConflict,
            )
        },
        connect("no port", Some(&lease), "allowed.test", Code::BadTarget),
        connect(
            "userinfo",
            Some(&lease),
            "a@allowed.test:443",
            Code::BadTarget,
        ),
        connect(
            "not yet valid",
            Some(&later),
            "allowed.test:443",
            Code::LeaseNotYetValid,
        ),
        connect(
            "expired",
            Some(&expired),
            "allowed.test:443",
            Code::LeaseExpired,
        ),
        connect(
            "revoked",
            Some(&revoked),
            "allowed.test:443",
            Code::LeaseRevoked,
        ),
        connect(
            "parent revoked",
            Some(&child),
            "allowed.test:443",
            Code::AncestorClosed,
        ),
        connect("denied", Some(&lease), "denied.test:443", Code::HostDenied),
        connect(
            "not listed",
            Some(&narrow),
            "elsewhere.test:443",
            Code::HostNotAllowed,
        ),
        connect(
            "name resolving to metadata",
            Some(&lease),
            "metadata.test:80",
            Code::AddressNotAllowed,
        ),
        connect(
            "name resolving to a private address",
            Some(&lease),
            "private.test:80",
            Code::AddressNotAllowed,
        ),
        connect(
            "no such name",
            Some(&lease),
            "nowhere.test:443",
            Code::DnsFailed,
        ),
        Case {
            kind: Kind::Http,
            method: "TRACE",
            ..connect(
                "TRACE",
                Some(&lease),
                "allowed.test",
                Code::MethodNotAllowed,
            )
        },
        Case {
            kind: Kind::Http,
            method: "GET",
            headers: vec![("host", "other.test")],
            ..connect(
                "Host names another host",
                Some(&narrow),
                "allowed.test",
                Code::HostMismatch,
            )
        },
    ];
    let guarded: Vec<String> = GUARDED.iter().map(|a| format!("{a}:80")).collect();
    for authority in &guarded {
        cases.push(connect(
            "guarded literal",
            Some(&lease),
            authority,
            Code::AddressNotAllowed,
        ));
    }
    for case in &cases {
        let outcome = ask(
            &proxy,
            case.port_lease,
            &case.headers,
            case.kind,
            case.method,
            &case.authority,
        )
        .await;
        assert_eq!(outcome, Err(case.want), "{}: {}", case.name, case.authority);
        let dialled = std::mem::take(&mut *dialer.dialled.lock().unwrap());
        assert_eq!(
            dialled,
            Vec::<SocketAddr>::new(),
            "{} ({}) dialled",
            case.name,
            case.authority
        );
    }

    // The control: an allowed target is dialled, at the address that was checked.
    let outcome = connect_on_port(&proxy, &lease, "allowed.test:443").await;
    assert_eq!(outcome, Err(Code::UpstreamUnreachable));
    assert_eq!(
        *dialer.dialled.lock().unwrap(),
        ["93.184.216.34:443".parse::<SocketAddr>().unwrap()]
    );
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
    for authority in &guarded {
        let outcome = connect_on_port(&proxy, &lease, authority).await;
        assert_eq!(outcome, Err(Code::AddressNotAllowed), "{authority}");
        let dialled = std::mem::take(&mut *dialer.dialled.lock().unwrap());
        assert_eq!(dialled, Vec::<SocketAddr>::new(), "{authority} dialled");
    }
    // Host policy is what report mode relaxes: a host the lease does not list is dialled.
    let outcome = connect_on_port(&proxy, &narrow, "elsewhere.test:443").await;
    assert_eq!(outcome, Err(Code::UpstreamUnreachable));
    assert_eq!(
        *dialer.dialled.lock().unwrap(),
        ["93.184.216.35:443".parse::<SocketAddr>().unwrap()]
    );
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
        for (kind, method, authority) in [
            (Kind::Connect, "CONNECT", "allowed.test:22"),
            (Kind::Connect, "CONNECT", "allowed.test:80"),
            (Kind::Connect, "CONNECT", "93.184.216.34:8443"),
            (Kind::Http, "GET", "allowed.test:8080"),
            (Kind::Http, "GET", "allowed.test:443"),
        ] {
            let outcome = ask(&proxy, Some(&lease), &[], kind, method, authority).await;
            assert_eq!(outcome, Err(Code::PortNotAllowed), "{mode:?} {authority}");
            assert!(dialer.dialled.lock().unwrap().is_empty(), "{authority}");
        }
        let said = refusal_detail(&proxy, &lease, "allowed.test:22").await;
        assert_eq!(said, "port 22 is not open to tunnels (--connect-ports 443)");
        // The host verdict comes first: a denied host on any port is host-denied.
        if mode == Mode::Enforce {
            let outcome = connect_on_port(&proxy, &lease, "denied.test:22").await;
            assert_eq!(outcome, Err(Code::HostDenied));
        }
        // The defaults themselves are dialled (the recording dialer connects nowhere).
        let outcome = connect_on_port(&proxy, &lease, "allowed.test:443").await;
        assert_eq!(outcome, Err(Code::UpstreamUnreachable));
        let outcome = ask(&proxy, Some(&lease), &[], Kind::Http, "GET", "allowed.test").await;
        assert_eq!(outcome, Err(Code::UpstreamUnreachable));
        assert_eq!(
            std::mem::take(&mut *dialer.dialled.lock().unwrap()),
            [
                "93.184.216.34:443".parse::<SocketAddr>().unwrap(),
                "93.184.216.34:80".parse().unwrap()
            ]
        );
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
        ("allowed.test:80", Some(Code::PortNotAllowed)),
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
    let outcome = connect_on_port(&proxy, &lease, "allowed.test:443").await;
    assert_eq!(outcome, Err(Code::TooManyConnections));
    assert!(dialer.dialled.lock().unwrap().is_empty());
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
    for (lease, target) in [
        (&sneaky, "sneaky.test:443"),
        (&nat64, "nat64.test:443"),
        (&mixed, "mixed.test:443"),
        (&child, "parents.test:443"),
    ] {
        let outcome = connect_on_port(&proxy, lease, target).await;
        assert_eq!(outcome, Err(Code::HostDenied), "{target}");
        assert!(
            dialer.dialled.lock().unwrap().is_empty(),
            "{target} was dialled"
        );
    }
    // The refusal names the address and the lease whose deny list holds it.
    let said = refusal_detail(&proxy, &nat64, "nat64.test:443").await;
    assert_eq!(
        said,
        format!("nat64.test resolves to 64:ff9b::cb00:7107 (embedding 203.0.113.7), denied by 203.0.113.7 in lease {nat64}")
    );
    let said = refusal_detail(&proxy, &child, "parents.test:443").await;
    assert!(said.contains(&format!("in lease {parent}")), "{said}");

    // The control: an address the deny list does not name is dialled.
    let other = h.lease(&["*"], &["203.0.113.7"]);
    let proxy = offline_proxy(&h, config.clone(), dialer.clone()).await;
    let outcome = connect_on_port(&proxy, &other, "fine.test:443").await;
    assert_eq!(outcome, Err(Code::UpstreamUnreachable));
    assert_eq!(
        std::mem::take(&mut *dialer.dialled.lock().unwrap()),
        ["203.0.113.8:443".parse::<SocketAddr>().unwrap()]
    );

    // Report mode only reports: the denied address is dialled, nothing is revoked.
    config.mode = leasegate::proxy::Mode::Report;
    let proxy = offline_proxy(&h, config, dialer.clone()).await;
    let outcome = connect_on_port(&proxy, &other, "sneaky.test:443").await;
    assert_eq!(outcome, Err(Code::UpstreamUnreachable));
    assert_eq!(
        *dialer.dialled.lock().unwrap(),
        ["203.0.113.7:443".parse::<SocketAddr>().unwrap()]
    );
}
