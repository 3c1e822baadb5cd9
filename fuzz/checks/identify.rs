//! Identification on arbitrary headers: never panics, and whatever it accepts names a lease id
//! of the contract's form.

use http::{HeaderMap, HeaderName, HeaderValue};
use leasegate::contract::lease::is_lease_id;
use leasegate::proxy::identify::identify;

const PORT_LEASE: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";

pub fn check(data: &[u8]) {
    // One header per line, `name: value`; the first byte picks whether a lease port applies.
    let (on_port, rest) = match data.split_first() {
        Some((first, rest)) => (first & 1 == 1, rest),
        None => (false, data),
    };
    let mut headers = HeaderMap::new();
    for line in rest.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    let port_lease = on_port.then_some(PORT_LEASE);
    if let Ok(identity) = identify(&headers, port_lease) {
        assert!(is_lease_id(&identity.lease_id), "{:?}", identity.lease_id);
        if on_port {
            assert_eq!(identity.lease_id, PORT_LEASE);
        }
    }
}
