//! Which target ports a request may reach: `--connect-ports` for CONNECT tunnels (443 by
//! default), `--forward-ports` for forwarded requests, WebSocket upgrades included (80), as
//! Squid's `SSL_ports` and `Safe_ports` do.
//!
//! Invariant: pure; a [`Ports`] that exists is a non-empty list of ranges within 1–65535,
//! and it is shown as it was written (normalised: no spaces).

use std::ops::RangeInclusive;
use std::str::FromStr;

/// A set of TCP ports, as `443,8443,9000-9100`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ports(Vec<RangeInclusive<u16>>);

impl Ports {
    /// One port.
    pub fn only(port: u16) -> Ports {
        Ports(vec![port..=port])
    }

    /// Every port, 1–65535.
    pub fn all() -> Ports {
        Ports(vec![1..=u16::MAX])
    }

    pub fn contains(&self, port: u16) -> bool {
        self.0.iter().any(|range| range.contains(&port))
    }
}

/// Why a port list does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortsError {
    #[error("no ports: expected a list such as 443,8443,9000-9100")]
    Empty,
    #[error("{0:?} is not a port (1-65535) or a range A-B")]
    NotAPort(String),
    #[error("{0:?}: a range runs from its lower port to its higher one")]
    Backwards(String),
}

impl FromStr for Ports {
    type Err = PortsError;

    fn from_str(text: &str) -> Result<Ports, PortsError> {
        if text.trim().is_empty() {
            return Err(PortsError::Empty);
        }
        let port = |item: &str, text: &str| match item.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(PortsError::NotAPort(text.to_owned())),
            Ok(port) => Ok(port),
        };
        text.split(',')
            .map(|item| match item.split_once('-') {
                None => port(item, item).map(|p| p..=p),
                Some((low, high)) => {
                    let (low, high) = (port(low, item)?, port(high, item)?);
                    match low <= high {
                        true => Ok(low..=high),
                        false => Err(PortsError::Backwards(item.to_owned())),
                    }
                }
            })
            .collect::<Result<_, _>>()
            .map(Ports)
    }
}

impl std::fmt::Display for Ports {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, range) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match range.start() == range.end() {
                true => write!(f, "{}", range.start())?,
                false => write!(f, "{}-{}", range.start(), range.end())?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges_parse_and_show_as_written() {
        let ports: Ports = "443, 8443,9000-9100".parse().unwrap();
        assert_eq!(ports.to_string(), "443,8443,9000-9100");
        for open in [443, 8443, 9000, 9050, 9100] {
            assert!(ports.contains(open), "{open}");
        }
        for closed in [22, 80, 442, 444, 8999, 9101, 65535] {
            assert!(!ports.contains(closed), "{closed}");
        }
        assert!(Ports::all().contains(1) && Ports::all().contains(65535));
        assert_eq!(Ports::all().to_string(), "1-65535");
        assert_eq!(Ports::only(80).to_string(), "80");
        assert_eq!("7-7".parse::<Ports>().unwrap(), Ports::only(7));
    }

    #[test]
    fn bad_lists_say_what_is_wrong() {
        for (text, want) in [
            ("", PortsError::Empty),
            (" ", PortsError::Empty),
            ("0", PortsError::NotAPort("0".into())),
            ("65536", PortsError::NotAPort("65536".into())),
            ("https", PortsError::NotAPort("https".into())),
            ("443,", PortsError::NotAPort("".into())),
            ("443,,80", PortsError::NotAPort("".into())),
            ("-5", PortsError::NotAPort("-5".into())),
            ("1-", PortsError::NotAPort("1-".into())),
            ("1-2-3", PortsError::NotAPort("1-2-3".into())),
            ("0-80", PortsError::NotAPort("0-80".into())),
            ("9100-9000", PortsError::Backwards("9100-9000".into())),
        ] {
            assert_eq!(text.parse::<Ports>(), Err(want), "{text:?}");
        }
        assert_eq!(
            "9100-9000".parse::<Ports>().unwrap_err().to_string(),
            "\"9100-9000\": a range runs from its lower port to its higher one"
        );
    }
}
