//! `leasegate run`'s reading of an admin API answer it cannot vouch for (`GET /leases/{id}`):
//! never panic; a proxy URL it builds is on the host the operator configured (`--proxy`, else
//! the admin URL's), with `--proxy`'s scheme and port when given, else http or https; it has
//! no path, query or fragment; and a minted token, when given, is its only credential.

use leasegate::commands::run::proxy_url;

const LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
const TOKEN: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c.minted";

pub fn check(data: &[u8]) {
    // The first byte picks --proxy, the admin URL and a minted token; the rest is the answer.
    let (pick, rest) = match data.split_first() {
        Some((first, rest)) => (*first, rest),
        None => (0, data),
    };
    let proxy = [
        None,
        Some("http://proxy.test:3128"),
        Some("https://[::1]:8443"),
    ][usize::from(pick % 3)];
    let admin = [
        "http://127.0.0.1:3129",
        "https://admin.test",
        "http://[::1]:3129",
    ][usize::from(pick / 3 % 3)];
    let admin = url::Url::parse(admin).unwrap();
    let token = (pick & 0x80 != 0).then_some(TOKEN);
    let view = serde_json::from_slice(rest)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(rest).into()));
    let Ok(built) = proxy_url(&view, LEASE, proxy, &admin, token) else {
        return;
    };
    let url = url::Url::parse(&built).expect("a proxy URL that parses");
    let configured = proxy.map(|p| url::Url::parse(p).unwrap());
    let host_of = |u: &url::Url| u.host_str().map(str::to_owned);
    match &configured {
        Some(proxy) => {
            assert_eq!(host_of(&url), host_of(proxy), "{built}");
            assert_eq!(url.scheme(), proxy.scheme(), "{built}");
            if view["port"].is_null() {
                assert_eq!(url.port_or_known_default(), proxy.port_or_known_default());
            }
        }
        None => {
            assert_eq!(host_of(&url), host_of(&admin), "{built}");
            assert!(matches!(url.scheme(), "http" | "https"), "{built}");
        }
    }
    assert!(matches!(url.path(), "" | "/"), "{built}");
    assert!(url.query().is_none() && url.fragment().is_none(), "{built}");
    if let (Some(token), Some(password)) = (token, url.password()) {
        assert_eq!(password, token, "{built}");
    }
}
