//! What `run`'s child sees: the proxy URL with the lease's credential, in every variable
//! clients read, and no other proxy setting.
//!
//! Invariant: the proxy's host (and, with `--proxy`, its scheme and port) is the one the
//! operator configured — `--proxy`, else the admin URL's host — never the admin API's answer,
//! which chooses only a port number (the lease's own, or the proxy's) and, without `--proxy`,
//! `http` or `https`; a credential goes only into that URL. Every inherited variable whose
//! lower-cased name is `no_proxy`, ends in `_proxy` or in `noproxy` is removed, so no client
//! of any case convention finds a way around the proxy.

use super::RunError;
use serde_json::Value;
use std::ffi::OsString;

/// The variables set to the proxy URL.
const PROXY_VARS: [&str; 6] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
];

/// The proxy URL for a lease: its own port if it has one, else the proxy's, on the host the
/// operator configured (`proxy`, else the admin URL's host), carrying the lease's credential
/// as the password: `token` if given, else the one the admin API put in its URL (only for an
/// authenticated caller), else the lease id — unless the admin API says the proxy wants
/// tokens. A lease's own port carries a credential only when it wants the token
/// (`--lease-port-credentials token`).
pub fn proxy_url(
    view: &Value,
    lease: &str,
    proxy: Option<&str>,
    admin: &url::Url,
    token: Option<&str>,
) -> Result<String, RunError> {
    let answered_text = view["proxy_url"].as_str().unwrap_or_default();
    let unreadable = |what: &str| RunError::Admin {
        url: admin.to_string(),
        status: http::StatusCode::OK,
        message: format!("unreadable answer: {what}"),
    };
    let answered = url::Url::parse(answered_text)
        .map_err(|e| unreadable(&format!("proxy_url {answered_text:?}: {e}")))?;
    let answered_scheme = match answered.scheme() {
        scheme @ ("http" | "https") => scheme,
        other => return Err(unreadable(&format!("proxy_url scheme {other:?}"))),
    };
    let own_port = match &view["port"] {
        Value::Null => None,
        port => Some(
            port.as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| unreadable(&format!("port {port}")))?,
        ),
    };
    let configured = match proxy {
        Some(proxy) => Some(
            url::Url::parse(proxy).map_err(|e| RunError::Url(proxy.to_owned(), e.to_string()))?,
        ),
        None => None,
    };
    // Scheme, host and port: the operator's, but for the port numbers the answer names.
    let mut url = configured.clone().unwrap_or_else(|| admin.clone());
    let bad = |reason: &str| RunError::Url(url_shown(proxy, admin), reason.to_owned());
    if configured.is_none() {
        url.set_scheme(answered_scheme)
            .map_err(|()| bad("cannot take the proxy's scheme"))?;
    }
    match (own_port, &configured) {
        (Some(port), _) => url.set_port(Some(port)),
        (None, None) => url.set_port(answered.port_or_known_default()),
        (None, Some(_)) => Ok(()),
    }
    .map_err(|()| bad("cannot take a port"))?;
    url.set_path("");
    url.set_query(None);
    url.set_fragment(None);
    let _ = url.set_username("");
    let _ = url.set_password(None);
    if own_port.is_some() && view["lease_port_credentials"] != "token" {
        return Ok(shown(&url));
    }
    let handed_out = answered.password().map(str::to_owned);
    let credential = match (token, handed_out) {
        (Some(token), _) => token.to_owned(),
        (None, Some(credential)) => credential,
        (None, None) if own_port.is_some() || view["credentials"] == "token" => {
            return Err(RunError::NoToken(lease.to_owned()))
        }
        (None, None) => lease.to_owned(),
    };
    url.set_username("agent")
        .and_then(|()| url.set_password(Some(&credential)))
        .map_err(|()| bad("cannot carry credentials"))?;
    Ok(shown(&url))
}

fn url_shown(proxy: Option<&str>, admin: &url::Url) -> String {
    proxy.map_or_else(|| admin.to_string(), str::to_owned)
}

fn shown(url: &url::Url) -> String {
    url.as_str().trim_end_matches('/').to_owned()
}

/// Whether an inherited variable named `name` could point a client elsewhere than the proxy
/// (or around it): `no_proxy`, `*_proxy` and `*noproxy` in any case (`No_Proxy`, `FTP_PROXY`,
/// `socks_proxy`, `npm_config_https_proxy`, `npm_config_noproxy`).
pub fn is_proxy_setting(name: &std::ffi::OsStr) -> bool {
    let name = name.to_string_lossy().to_ascii_lowercase();
    name.ends_with("_proxy") || name.ends_with("noproxy") || name == "no_proxy"
}

/// The environment changes that point a process at `proxy_url`: the variables to set, and
/// those of `inherited` (the names of our environment) to remove first. `admin_host`, the
/// admin API's host, is the one `NO_PROXY` names: a client's call to the admin API goes to it
/// directly instead of through the proxy (which would refuse it, and could revoke the lease).
pub fn agent_env(
    proxy_url: &str,
    lease: &str,
    admin_host: Option<&str>,
    inherited: impl IntoIterator<Item = OsString>,
) -> (Vec<(&'static str, String)>, Vec<OsString>) {
    let mut set: Vec<(&'static str, String)> = PROXY_VARS
        .iter()
        .map(|name| (*name, proxy_url.to_owned()))
        .collect();
    if let Some(host) = admin_host.map(|h| h.trim_start_matches('[').trim_end_matches(']')) {
        set.push(("NO_PROXY", host.to_owned()));
        set.push(("no_proxy", host.to_owned()));
    }
    set.push(("LEASEGATE_LEASE_ID", lease.to_owned()));
    let unset = inherited
        .into_iter()
        .filter(|name| is_proxy_setting(name) && !set.iter().any(|(s, _)| name == s))
        .collect();
    (set, unset)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";

    fn admin() -> url::Url {
        url::Url::parse("http://127.0.0.1:3129").unwrap()
    }

    #[test]
    fn a_lease_port_carries_the_token_only_when_it_wants_one() {
        let open = json!({"port": 40001, "proxy_url": "http://127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "none"});
        assert_eq!(
            proxy_url(&open, LEASE, Some("http://proxy:3128"), &admin(), Some("t")).unwrap(),
            "http://proxy:40001",
            "the lease's port on the configured proxy host, no credential"
        );
        assert_eq!(
            proxy_url(&open, LEASE, None, &admin(), Some("t")).unwrap(),
            "http://127.0.0.1:40001"
        );
        let wants = json!({"port": 40001, "proxy_url": "http://127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "token"});
        assert_eq!(
            proxy_url(&wants, LEASE, None, &admin(), Some("tok")).unwrap(),
            "http://agent:tok@127.0.0.1:40001",
        );
        assert!(matches!(
            proxy_url(&wants, LEASE, None, &admin(), None),
            Err(RunError::NoToken(_))
        ));
        let handed_out = json!({"port": 40001,
            "proxy_url": "http://agent:handed@127.0.0.1:40001",
            "credentials": "id", "lease_port_credentials": "token"});
        assert_eq!(
            proxy_url(&handed_out, LEASE, None, &admin(), None).unwrap(),
            "http://agent:handed@127.0.0.1:40001"
        );
    }

    /// The answer names a host of its own: only its port number and scheme are taken.
    #[test]
    fn the_answer_never_chooses_the_proxy_host() {
        let elsewhere = json!({"port": null,
            "proxy_url": "https://agent:handed@evil.example:8443/path?q",
            "credentials": "token", "lease_port_credentials": "none"});
        assert_eq!(
            proxy_url(&elsewhere, LEASE, None, &admin(), None).unwrap(),
            "https://agent:handed@127.0.0.1:8443"
        );
        assert_eq!(
            proxy_url(
                &elsewhere,
                LEASE,
                Some("http://proxy:3128"),
                &admin(),
                Some("t")
            )
            .unwrap(),
            "http://agent:t@proxy:3128"
        );
        let v6 = url::Url::parse("http://[::1]:3129").unwrap();
        assert_eq!(
            proxy_url(&elsewhere, LEASE, None, &v6, Some("t")).unwrap(),
            "https://agent:t@[::1]:8443"
        );
        for bad in [
            json!({"port": null, "proxy_url": "socks5://127.0.0.1:1080"}),
            json!({"port": null}),
            json!({"port": 70000, "proxy_url": "http://127.0.0.1:1"}),
            json!({"port": "40001", "proxy_url": "http://127.0.0.1:1"}),
        ] {
            assert!(
                matches!(
                    proxy_url(&bad, LEASE, None, &admin(), Some("t")),
                    Err(RunError::Admin { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn every_case_of_every_proxy_setting_is_removed() {
        let cleared = [
            "No_Proxy",
            "NO_PROXY",
            "no_proxy",
            "FTP_PROXY",
            "Socks_Proxy",
            "npm_config_https_proxy",
            "npm_config_noproxy",
        ];
        // HTTPS_PROXY is set, not cleared; the others are no proxy setting.
        let kept = ["HTTPS_PROXY", "PATH", "PROXY_HOST", "proxy"];
        let inherited = cleared.iter().chain(&kept).map(OsString::from);
        let (set, unset) = agent_env("http://127.0.0.1:3128", LEASE, None, inherited);
        assert_eq!(unset, cleared.map(OsString::from));
        let names: Vec<&str> = set.iter().map(|(n, _)| *n).collect();
        assert_eq!(names[..6], PROXY_VARS);
        assert_eq!(names[6..], ["LEASEGATE_LEASE_ID"]);
    }

    /// The inherited `NO_PROXY` goes; the one set names the admin API's host alone.
    #[test]
    fn no_proxy_names_the_admin_host_only() {
        let inherited = ["NO_PROXY", "no_proxy"].map(OsString::from);
        let (set, unset) = agent_env("http://127.0.0.1:3128", LEASE, Some("[::1]"), inherited);
        assert!(unset.is_empty(), "set again, not only removed: {unset:?}");
        let no_proxy: Vec<_> = set
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case("no_proxy"))
            .collect();
        assert_eq!(
            no_proxy,
            [
                &("NO_PROXY", "::1".to_owned()),
                &("no_proxy", "::1".to_owned())
            ]
        );
    }
}
