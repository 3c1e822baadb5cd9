//! Target normalisation on arbitrary authorities: never panics, and a normalised target parses
//! back to itself (one spelling per host).

use leasegate::policy::target::{parse_authority, parse_host};

pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for default_port in [None, Some(443)] {
        if let Ok(target) = parse_authority(text, default_port) {
            let again = parse_authority(&target.to_string(), None);
            assert_eq!(again.as_ref(), Ok(&target), "{text:?} -> {target}");
        }
    }
    if let Ok(host) = parse_host(text) {
        let spelled = match host.as_text() {
            v6 if v6.contains(':') => format!("[{v6}]"),
            other => other,
        };
        assert_eq!(parse_host(&spelled).as_ref(), Ok(&host), "{text:?}");
    }
}
