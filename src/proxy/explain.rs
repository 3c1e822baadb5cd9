//! `check`'s question, asked of the decision the proxy makes: the verdict a lease would get
//! for a target, explained, from `leasegate check` (over a journal it reads) or the running
//! proxy's `GET /check` (over its own state and configuration).
//!
//! Invariant: it decides through [`decide_and_guard`], never a copy of it; nothing is
//! dialled, nothing is written, and names are resolved only with `config.resolve_names`.

use super::decision::{decide_and_guard, Ask, Asked};
use super::identify;
use crate::config::ProxyConfig;
use crate::policy::codes::{Code, Refusal};
use crate::policy::{HostVerdict, TargetHost};
use crate::registry::Registry;
use http::HeaderMap;

/// What a check found: the refusal, if any, what decided the verdict, and what phase 5 saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Explanation {
    pub refusal: Option<Refusal>,
    /// Which pattern of which lease decided (or why nothing could be decided).
    pub reason: String,
    /// Further lines: the addresses that may be dialled, what report mode would refuse.
    pub notes: Vec<String>,
}

/// Whether `check`'s target is a URL a client fetches through the proxy as a forwarded
/// request (`http://`, `ws://`) rather than through a CONNECT tunnel.
fn is_forwarded(target: &str) -> bool {
    target.contains("://")
        && url::Url::parse(target).is_ok_and(|url| matches!(url.scheme(), "http" | "ws"))
}

/// `check`'s target as the authority a CONNECT would name: `HOST[:PORT]` as given, or a URL's
/// host and port (its scheme's default when it has none: 80 for `http://`, 443 for `https://`).
pub fn target_authority(target: &str) -> Result<String, String> {
    if !target.contains("://") {
        return Ok(target.to_owned());
    }
    let url = url::Url::parse(target).map_err(|e| format!("{target}: not a URL: {e}"))?;
    let port = url.port_or_known_default().ok_or_else(|| {
        format!(
            "{target}: no port, and {}:// has no default: give HOST:PORT",
            url.scheme()
        )
    })?;
    match url.host() {
        Some(url::Host::Domain(name)) => Ok(format!("{name}:{port}")),
        Some(url::Host::Ipv4(ip)) => Ok(format!("{ip}:{port}")),
        Some(url::Host::Ipv6(ip)) => Ok(format!("[{ip}]:{port}")),
        None => Err(format!("{target}: the URL names no host")),
    }
}

/// Explains the decision for `lease_id` and `target` (port 443 if absent) by running the
/// proxy's own [`decide_and_guard`] over `registry` with `config`'s guard, exceptions and
/// resolver, as if the request arrived on the lease's own port.
pub async fn explain(
    registry: &Registry,
    config: &ProxyConfig,
    lease_id: &str,
    target: &str,
) -> Explanation {
    let authority = match target_authority(target) {
        Ok(authority) => authority,
        Err(why) => {
            return Explanation {
                reason: why.clone(),
                refusal: Some(Refusal::new(Code::BadTarget, why)),
                notes: Vec::new(),
            }
        }
    };
    // What a client sends for it: a forwarded GET for an `http://` (or `ws://`) URL, judged
    // against `--forward-ports`; a CONNECT for anything else. Asked on the lease's own port.
    // A CONNECT to a port open to forwarded requests only is read as one, as the proxy does.
    let forwarded = is_forwarded(target) || super::plain_tunnel::applies(config, &authority);
    let asked = match forwarded {
        true => Asked::Forward {
            method: &http::Method::GET,
            host: None,
        },
        false => Asked::Tunnel,
    };
    let ask = Ask::new(asked, &authority, Some(443));
    let (snapshot, now) = (registry.snapshot(), registry.now());
    let guarded = match identify::identify(&HeaderMap::new(), Some(lease_id)) {
        Ok(identity) => decide_and_guard(snapshot, config, &identity, ask, now).await,
        Err(refusal) => Err(refusal),
    };
    let (decision, addrs) = match guarded {
        Ok(guarded) => guarded,
        Err(refusal) => {
            return Explanation {
                reason: refusal.detail.clone(),
                refusal: Some(refusal),
                notes: Vec::new(),
            }
        }
    };
    let host = &decision.target.host;
    let reason = match decision.verdict(host) {
        HostVerdict::Allowed(by) => format!(
            "{} is allowed by {} in lease {} (and by every ancestor)",
            decision.target,
            by.pattern(host).map(|p| p.to_string()).unwrap_or_default(),
            by.lease_id
        ),
        _ => format!("{} is let through by report mode", decision.target),
    };
    let mut notes = Vec::new();
    if let Some(reported) = decision.reported.first() {
        notes.push(format!(
            "report mode: enforce mode would refuse it ({})",
            reported.code
        ));
    }
    match (&decision.target.host, addrs.is_empty()) {
        (TargetHost::Name(_), true) => {
            notes.push("names not resolved: pass --resolve-names to check the addresses".into())
        }
        _ => {
            let addrs: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            notes.push(format!("may dial {}", addrs.join(", ")));
        }
    }
    Explanation {
        refusal: None,
        reason,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::target_authority;

    #[test]
    fn a_url_names_its_host_and_its_schemes_port() {
        for (given, want) in [
            ("https://api.github.com/x", "api.github.com:443"),
            ("http://api.github.com/x?y", "api.github.com:80"),
            (
                "https://Agent:pw@API.github.com:8443/",
                "api.github.com:8443",
            ),
            ("http://[::1]/", "[::1]:80"),
            ("wss://10.0.0.1/socket", "10.0.0.1:443"),
            ("api.github.com:8080", "api.github.com:8080"),
            ("api.github.com", "api.github.com"),
        ] {
            assert_eq!(target_authority(given).as_deref(), Ok(want), "{given}");
        }
        assert_eq!(
            target_authority("ftp2://example.com/"),
            Err("ftp2://example.com/: no port, and ftp2:// has no default: give HOST:PORT".into())
        );
    }
}
