//! The one serialisation of an egress line, for the log file and the egress stream alike,
//! written field by field into the caller's buffer.
//!
//! Invariant: the bytes are exactly those `serde_json` writes for the event's `Serialize`
//! (member order, `null`s, members left out, string escapes, number forms); a test holds the
//! two together. Written by hand because serde's way, every address and timestamp through a
//! `Display` adapter that escapes each fragment, was a fifth of the proxy's instructions per
//! kept-alive request.

use super::egress::EgressEvent;
use crate::contract::Timestamp;
use std::fmt::Write as _;
use std::net::SocketAddr;

/// Appends `event`'s line, newline included, to `buf`.
pub fn write_line(buf: &mut Vec<u8>, event: &EgressEvent) {
    buf.extend_from_slice(b"{\"time\":");
    timestamp(buf, event.time);
    buf.extend_from_slice(b",\"ended\":");
    timestamp(buf, event.ended);
    buf.extend_from_slice(b",\"lease_id\":");
    string_or_null(buf, event.lease_id.as_deref());
    buf.extend_from_slice(b",\"label\":");
    string_or_null(buf, event.label.as_deref());
    buf.extend_from_slice(b",\"client\":");
    address(buf, event.client);
    buf.extend_from_slice(b",\"listener\":");
    address(buf, event.listener);
    buf.extend_from_slice(b",\"kind\":");
    string(buf, event.kind.as_str());
    buf.extend_from_slice(b",\"method\":");
    string(buf, event.method.as_str());
    buf.extend_from_slice(b",\"host\":");
    string_or_null(buf, event.host.as_deref());
    buf.extend_from_slice(b",\"port\":");
    number_or_null(buf, event.port);
    buf.extend_from_slice(b",\"dialed\":");
    match event.dialed {
        Some(dialed) => address(buf, dialed),
        None => buf.extend_from_slice(b"null"),
    }
    buf.extend_from_slice(b",\"verdict\":");
    string(buf, event.verdict.as_str());
    buf.extend_from_slice(b",\"code\":");
    string_or_null(buf, event.code);
    buf.extend_from_slice(b",\"rule\":");
    match &event.rule {
        Some(rule) => {
            buf.push(b'"');
            // `Rule`'s `Display` cannot fail; what it writes is escaped as it comes.
            let _ = write!(Escaping(buf), "{rule}");
            buf.push(b'"');
        }
        None => buf.extend_from_slice(b"null"),
    }
    buf.extend_from_slice(b",\"status\":");
    number_or_null(buf, event.status);
    buf.extend_from_slice(b",\"bytes_up\":");
    number(buf, event.bytes_up);
    buf.extend_from_slice(b",\"bytes_down\":");
    number(buf, event.bytes_down);
    buf.extend_from_slice(b",\"duration_ms\":");
    // serde_json's own float form (shortest round trip; null when not finite).
    let _ = serde_json::to_writer(&mut *buf, &event.duration_ms);
    if let Some(path) = &event.path {
        buf.extend_from_slice(b",\"path\":");
        string(buf, path);
    }
    if !event.secrets.is_empty() {
        buf.extend_from_slice(b",\"secrets\":[");
        for (i, secret) in event.secrets.iter().enumerate() {
            if i > 0 {
                buf.push(b',');
            }
            string(buf, secret);
        }
        buf.push(b']');
    }
    // Rare (metered calls, MCP requests) and nested: serde's own writer.
    if let Some(model) = &event.model {
        nested(buf, b",\"model\":", model);
    }
    if let Some(mcp) = &event.mcp {
        nested(buf, b",\"mcp\":", mcp);
    }
    if let Some(approval) = &event.approval {
        buf.extend_from_slice(b",\"approval\":");
        string(buf, approval);
    }
    if let Some(error) = &event.error {
        buf.extend_from_slice(b",\"error\":");
        string(buf, error);
    }
    if let Some(revoked) = event.revoked {
        buf.extend_from_slice(b",\"revoked\":");
        buf.extend_from_slice(if revoked { b"true" } else { b"false" });
    }
    buf.extend_from_slice(b"}\n");
}

/// `member` and `value` as serde writes it (`null` should it fail).
fn nested(buf: &mut Vec<u8>, member: &[u8], value: &impl serde::Serialize) {
    buf.extend_from_slice(member);
    let start = buf.len();
    if serde_json::to_writer(&mut *buf, value).is_err() {
        buf.truncate(start);
        buf.extend_from_slice(b"null");
    }
}

fn timestamp(buf: &mut Vec<u8>, time: Timestamp) {
    buf.push(b'"');
    match time.contract_form() {
        Some(form) => buf.extend_from_slice(&form),
        // Outside four-digit years: `Display`'s own spelling (digits and signs only).
        None => {
            let _ = write!(Escaping(buf), "{time}");
        }
    }
    buf.push(b'"');
}

fn number(buf: &mut Vec<u8>, n: impl itoa::Integer) {
    buf.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

fn number_or_null(buf: &mut Vec<u8>, n: Option<u16>) {
    match n {
        Some(n) => number(buf, n),
        None => buf.extend_from_slice(b"null"),
    }
}

/// `"a.b.c.d:port"`, or an IPv6 address as `Display` writes it (no byte needs escaping).
fn address(buf: &mut Vec<u8>, address: SocketAddr) {
    buf.push(b'"');
    match address {
        SocketAddr::V4(v4) => {
            for (i, octet) in v4.ip().octets().into_iter().enumerate() {
                if i > 0 {
                    buf.push(b'.');
                }
                number(buf, octet);
            }
            buf.push(b':');
            number(buf, v4.port());
        }
        SocketAddr::V6(v6) => {
            let _ = write!(Escaping(buf), "{v6}");
        }
    }
    buf.push(b'"');
}

fn string_or_null(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => string(buf, s),
        None => buf.extend_from_slice(b"null"),
    }
}

fn string(buf: &mut Vec<u8>, s: &str) {
    buf.push(b'"');
    escape_into(buf, s);
    buf.push(b'"');
}

/// What serde_json escapes: `"`, `\` and the control bytes below 0x20 (the short forms where
/// JSON has them, `\u00xx` in lower-case hex for the rest); everything else as it is. By hand
/// because serde_json's escaper is not public for pieces of a string, and `Display` values
/// (rules, IPv6 addresses) arrive in pieces through [`Escaping`]: one escaper for both.
fn escape_into(buf: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    // Nearly every string has nothing to escape: one pass without early exit (which the
    // compiler can vectorise) says so, and the bytes go in at once.
    let plain = bytes.iter().fold(true, |plain, &b| {
        plain & (b >= 0x20) & (b != b'"') & (b != b'\\')
    });
    if plain {
        buf.extend_from_slice(bytes);
        return;
    }
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x08 => b'b',
            0x0c => b'f',
            0x00..=0x1f => b'u',
            _ => continue,
        };
        buf.extend_from_slice(&bytes[start..i]);
        buf.push(b'\\');
        buf.push(short);
        if short == b'u' {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            buf.extend_from_slice(&[
                b'0',
                b'0',
                HEX[usize::from(b >> 4)],
                HEX[usize::from(b & 15)],
            ]);
        }
        start = i + 1;
    }
    buf.extend_from_slice(&bytes[start..]);
}

/// A `fmt::Write` that escapes what it is given into a JSON string's body.
struct Escaping<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for Escaping<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        escape_into(self.0, s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{HostPattern, Rule};
    use crate::telemetry::egress::{Kind, LoggedVerdict, ModelCall};
    use proptest::prelude::*;

    fn serde_line(event: &EgressEvent) -> Vec<u8> {
        let mut line = serde_json::to_vec(event).unwrap();
        line.push(b'\n');
        line
    }

    fn hand_line(event: &EgressEvent) -> Vec<u8> {
        let mut line = Vec::new();
        write_line(&mut line, event);
        line
    }

    fn plain() -> EgressEvent {
        EgressEvent {
            time: Timestamp::from_millis(1_789_466_400_123),
            ended: Timestamp::from_millis(1_789_466_400_456),
            lease_id: Some("7d3c3a52-0c5e-4c1e-9a55-0b0d6cfb1a2e".into()),
            label: Some("agent".into()),
            client: "127.0.0.1:50312".parse().unwrap(),
            listener: "[::1]:3128".parse().unwrap(),
            kind: Kind::Http,
            method: http::Method::GET,
            host: Some("api.example.test".into()),
            port: Some(443),
            dialed: Some("[2001:db8::1]:443".parse().unwrap()),
            verdict: LoggedVerdict::Allow,
            code: None,
            rule: Some(Rule::Allow(HostPattern::Subdomains("example.test".into()))),
            status: Some(200),
            bytes_up: 0,
            bytes_down: u64::MAX,
            duration_ms: 0.25,
            path: None,
            secrets: Vec::new(),
            model: None,
            mcp: None,
            approval: None,
            error: None,
            revoked: None,
        }
    }

    #[test]
    fn a_plain_line_is_serdes_line() {
        let event = plain();
        assert_eq!(
            String::from_utf8(hand_line(&event)).unwrap(),
            String::from_utf8(serde_line(&event)).unwrap()
        );
    }

    #[test]
    fn every_optional_member_is_serdes_too() {
        let mut event = plain();
        event.lease_id = None;
        event.label = None;
        event.host = None;
        event.port = None;
        event.dialed = None;
        event.rule = None;
        event.status = None;
        event.verdict = LoggedVerdict::Refuse;
        event.code = Some("host-not-allowed");
        event.kind = Kind::Https;
        event.method = http::Method::from_bytes(b"PROPFIND").unwrap();
        event.duration_ms = f64::NAN;
        event.path = Some("/v1/chat?key=[redacted]".into());
        event.secrets = vec!["openai".into(), "gh".into()];
        event.model = Some(Box::new(ModelCall {
            api: "openai",
            name: Some("gpt-4o-mini".into()),
            input_tokens: Some(12),
            output_tokens: Some(2_000),
            cached_tokens: Some(0),
            cost_usd: Some(None),
            unpriced: Some(true),
            unmetered: None,
            charged_tokens: None,
            charged_cost_usd: None,
        }));
        event.error = Some("upstream: \"reset\"\n\tby peer \u{1}\u{7f}".into());
        event.revoked = Some(true);
        assert_eq!(
            String::from_utf8(hand_line(&event)).unwrap(),
            String::from_utf8(serde_line(&event)).unwrap()
        );
    }

    #[test]
    fn a_year_outside_four_digits_is_serdes_too() {
        let mut event = plain();
        event.time = Timestamp::from_millis(-62_198_755_200_000);
        event.ended = Timestamp::from_millis(253_402_300_800_000);
        assert_eq!(hand_line(&event), serde_line(&event));
    }

    proptest! {
        #[test]
        fn any_line_is_serdes_line(
            lease in proptest::option::of(".{0,40}"),
            label in proptest::option::of("\\PC{0,20}|[\\x00-\\x1f\"\\\\]{0,8}"),
            host in proptest::option::of(".{0,60}"),
            error in proptest::option::of("(.|\\n|\\x00|\\x7f){0,40}"),
            secrets in proptest::collection::vec(".{0,10}", 0..3),
            client in any::<SocketAddr>(),
            dialed in proptest::option::of(any::<SocketAddr>()),
            port in proptest::option::of(any::<u16>()),
            status in proptest::option::of(any::<u16>()),
            up in any::<u64>(),
            down in any::<u64>(),
            duration in any::<f64>(),
            time in -1_000_000_000_000_000i64..1_000_000_000_000_000,
            revoked in proptest::option::of(any::<bool>()),
        ) {
            let mut event = plain();
            event.lease_id = lease;
            event.label = label;
            event.host = host.clone();
            event.error = error;
            event.secrets = secrets;
            event.client = client;
            event.dialed = dialed;
            event.port = port;
            event.status = status;
            event.bytes_up = up;
            event.bytes_down = down;
            event.duration_ms = duration;
            event.time = Timestamp::from_millis(time);
            event.revoked = revoked;
            event.rule = host.map(|h| Rule::Deny(HostPattern::Exact(h)));
            prop_assert_eq!(hand_line(&event), serde_line(&event));
        }
    }
}
