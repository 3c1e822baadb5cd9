//! What makes an egress stream message count: a MAC under the shared key over its subject,
//! nonce and payload, checked by [`verify`] before any reader counts its line.
//!
//! Invariants: a line counts only when its MAC verifies and its `lease_id` is its subject's
//! lease; the `Nats-Msg-Id` is derived from the MAC, so nobody without the key can predict an
//! id (and plant a message under it first), and a message sent again keeps its id.

use super::key::EgressKey;
use super::EGRESS_SUBJECTS;
use crate::contract::Timestamp;
use crate::nats::subject_token;
use crate::telemetry::egress::{LoggedLine, ReadLine};
use async_nats::HeaderMap;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;

/// `<publisher>-<n>`: the publisher's id (a UUID, hex) and a count, unique per message.
pub const NONCE_HEADER: &str = "Leasegate-Nonce";
/// HMAC-SHA256(key, subject || 0 || nonce || 0 || payload), lowercase hex.
pub const MAC_HEADER: &str = "Leasegate-Mac";
/// The MAC's hex digits that make the `Nats-Msg-Id` (128 bits).
const ID_HEX_DIGITS: usize = 32;

/// A message's MAC and the headers that carry it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub nonce: String,
    /// Hex.
    pub mac: String,
}

impl Sealed {
    /// The `Nats-Msg-Id`: the MAC's first 32 hex digits (128 bits).
    pub fn id(&self) -> &str {
        &self.mac[..ID_HEX_DIGITS]
    }

    /// The nonce, the MAC and the `Nats-Msg-Id`.
    pub fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(NONCE_HEADER, self.nonce.as_str());
        headers.insert(MAC_HEADER, self.mac.as_str());
        headers.insert(async_nats::header::NATS_MESSAGE_ID, self.id());
        headers
    }
}

fn mac(key: &EgressKey, subject: &str, nonce: &str, payload: &[u8]) -> Hmac<Sha256> {
    // Any key length is accepted by HMAC; `EgressKey` holds at least 32 bytes.
    let mut mac =
        <Hmac<Sha256> as Mac>::new_from_slice(key.bytes()).expect("HMAC takes a key of any length");
    mac.update(subject.as_bytes());
    mac.update(&[0]);
    mac.update(nonce.as_bytes());
    mac.update(&[0]);
    mac.update(payload);
    mac
}

/// Seals `payload` for `subject` under `nonce`.
pub fn seal(key: &EgressKey, subject: &str, nonce: String, payload: &[u8]) -> Sealed {
    let mac = hex::encode(mac(key, subject, &nonce, payload).finalize().into_bytes());
    Sealed { nonce, mac }
}

/// A line that counts.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The publisher's id, from the nonce (`EgressStream::publisher_id` of the replica).
    pub publisher: String,
    pub time: Timestamp,
    pub line: LoggedLine,
}

/// Why a message does not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rejected {
    /// Empty or whitespace.
    Blank,
    /// No nonce or no MAC header: not written by a replica that holds the key.
    Unsigned,
    /// A MAC that does not verify: another key, or a changed subject, nonce or payload.
    BadMac,
    /// Verified, but not an egress line.
    Unreadable,
    /// Verified, but the line's lease is not its subject's.
    LeaseMismatch,
}

impl Rejected {
    /// The reason as `usage` prints it.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejected::Blank => "blank",
            Rejected::Unsigned => "unsigned",
            Rejected::BadMac => "bad-mac",
            Rejected::Unreadable => "unreadable",
            Rejected::LeaseMismatch => "lease-mismatch",
        }
    }
}

/// Checks one message of the egress stream: the one test every reader applies.
pub fn verify(
    key: &EgressKey,
    subject: &str,
    headers: Option<&HeaderMap>,
    payload: &[u8],
) -> Result<Verified, Rejected> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Err(Rejected::Blank);
    }
    let header = |name| headers.and_then(|h| h.get(name)).map(|v| v.as_str());
    let (Some(nonce), Some(claimed)) = (header(NONCE_HEADER), header(MAC_HEADER)) else {
        return Err(Rejected::Unsigned);
    };
    let claimed = hex::decode(claimed).map_err(|_| Rejected::BadMac)?;
    mac(key, subject, nonce, payload)
        .verify_slice(&claimed)
        .map_err(|_| Rejected::BadMac)?;
    let ReadLine::Line(time, line) = LoggedLine::read(payload) else {
        return Err(Rejected::Unreadable);
    };
    let token = subject
        .strip_prefix(EGRESS_SUBJECTS)
        .and_then(|rest| rest.strip_prefix('.'));
    if token != Some(subject_token(line.lease_id.as_deref())) {
        return Err(Rejected::LeaseMismatch);
    }
    let publisher = nonce.rsplit_once('-').map_or(nonce, |(p, _)| p);
    Ok(Verified {
        publisher: publisher.to_owned(),
        time,
        line: *line,
    })
}

/// Messages that did not count, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SetAside {
    pub blank: u64,
    pub unreadable: u64,
    pub unsigned: u64,
    pub bad_mac: u64,
    pub lease_mismatch: u64,
}

impl SetAside {
    pub fn count(&mut self, reason: Rejected) {
        let counter = match reason {
            Rejected::Blank => &mut self.blank,
            Rejected::Unsigned => &mut self.unsigned,
            Rejected::BadMac => &mut self.bad_mac,
            Rejected::Unreadable => &mut self.unreadable,
            Rejected::LeaseMismatch => &mut self.lease_mismatch,
        };
        *counter += 1;
    }

    pub fn total(&self) -> u64 {
        self.blank + self.unreadable + self.unsigned + self.bad_mac + self.lease_mismatch
    }

    /// `bad-mac 1, unsigned 2`: the reasons that occurred, with their counts.
    pub fn describe(&self) -> String {
        [
            (Rejected::Blank, self.blank),
            (Rejected::Unreadable, self.unreadable),
            (Rejected::Unsigned, self.unsigned),
            (Rejected::BadMac, self.bad_mac),
            (Rejected::LeaseMismatch, self.lease_mismatch),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(reason, n)| format!("{} {n}", reason.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: &str = "00000001-0000-4000-8000-000000000000";

    fn key(byte: u8) -> EgressKey {
        EgressKey::from_bytes(&[byte; 32]).unwrap()
    }

    fn line(lease: Option<&str>) -> Vec<u8> {
        serde_json::json!({
            "time": "2026-01-01T10:00:00.000Z", "lease_id": lease, "host": "a.test",
            "verdict": "allow", "code": null, "bytes_up": 1, "bytes_down": 2,
        })
        .to_string()
        .into_bytes()
    }

    fn subject(lease: Option<&str>) -> String {
        format!("{EGRESS_SUBJECTS}.{}", subject_token(lease))
    }

    #[test]
    fn a_sealed_line_verifies_on_its_own_subject_only() {
        let payload = line(Some(LEASE));
        let subject = subject(Some(LEASE));
        let sealed = seal(&key(1), &subject, "0123abcd-7".into(), &payload);
        let headers = sealed.headers();
        let verified = verify(&key(1), &subject, Some(&headers), &payload).unwrap();
        assert_eq!(verified.publisher, "0123abcd");
        assert_eq!(verified.line.lease_id.as_deref(), Some(LEASE));
        // The id: the MAC's first 32 hex digits, the same every time.
        assert_eq!(sealed.id(), &sealed.mac[..32]);
        assert_eq!(sealed.mac.len(), 64);
        assert_eq!(
            seal(&key(1), &subject, "0123abcd-7".into(), &payload),
            sealed
        );
        assert_ne!(
            seal(&key(1), &subject, "0123abcd-8".into(), &payload).id(),
            sealed.id()
        );
        assert_eq!(
            headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str()),
            Some(sealed.id())
        );

        // Another key, subject, nonce or payload: the MAC fails.
        assert_eq!(
            verify(&key(2), &subject, Some(&headers), &payload),
            Err(Rejected::BadMac)
        );
        let other = subject_for_other();
        assert_eq!(
            verify(&key(1), &other, Some(&headers), &payload),
            Err(Rejected::BadMac)
        );
        let mut changed = payload.clone();
        changed[10] ^= 1;
        assert_eq!(
            verify(&key(1), &subject, Some(&headers), &changed),
            Err(Rejected::BadMac)
        );
        let mut renonced = headers.clone();
        renonced.insert(NONCE_HEADER, "0123abcd-8");
        assert_eq!(
            verify(&key(1), &subject, Some(&renonced), &payload),
            Err(Rejected::BadMac)
        );
        let mut garbled = headers.clone();
        garbled.insert(MAC_HEADER, "zz");
        assert_eq!(
            verify(&key(1), &subject, Some(&garbled), &payload),
            Err(Rejected::BadMac)
        );
    }

    fn subject_for_other() -> String {
        subject(Some("00000002-0000-4000-8000-000000000000"))
    }

    #[test]
    fn blank_unsigned_unreadable_and_misfiled_messages_are_told_apart() {
        let k = key(1);
        assert_eq!(
            verify(&k, &subject(None), None, b" \t"),
            Err(Rejected::Blank)
        );
        assert_eq!(verify(&k, &subject(None), None, b""), Err(Rejected::Blank));
        let payload = line(Some(LEASE));
        assert_eq!(
            verify(&k, &subject(Some(LEASE)), None, &payload),
            Err(Rejected::Unsigned)
        );
        let mut only_nonce = HeaderMap::new();
        only_nonce.insert(NONCE_HEADER, "p-1");
        assert_eq!(
            verify(&k, &subject(Some(LEASE)), Some(&only_nonce), &payload),
            Err(Rejected::Unsigned)
        );
        // Signed with the key, but not an egress line, or filed under another lease.
        let junk = b"{\"time\": \"yesterday\"}";
        let sealed = seal(&k, &subject(None), "p-1".into(), junk);
        assert_eq!(
            verify(&k, &subject(None), Some(&sealed.headers()), junk),
            Err(Rejected::Unreadable)
        );
        let misfiled = seal(&k, &subject_for_other(), "p-2".into(), &payload);
        assert_eq!(
            verify(
                &k,
                &subject_for_other(),
                Some(&misfiled.headers()),
                &payload
            ),
            Err(Rejected::LeaseMismatch)
        );
        // A line without a lease belongs on `leasegate.egress._`.
        let none = line(None);
        let sealed = seal(&k, &subject(None), "p-3".into(), &none);
        assert!(verify(&k, &subject(None), Some(&sealed.headers()), &none).is_ok());
        let sealed = seal(&k, &subject(Some(LEASE)), "p-4".into(), &none);
        assert_eq!(
            verify(&k, &subject(Some(LEASE)), Some(&sealed.headers()), &none),
            Err(Rejected::LeaseMismatch)
        );

        let mut set_aside = SetAside::default();
        for reason in [
            Rejected::BadMac,
            Rejected::Unsigned,
            Rejected::Unsigned,
            Rejected::Blank,
        ] {
            set_aside.count(reason);
        }
        assert_eq!(set_aside.total(), 4);
        assert_eq!(set_aside.describe(), "blank 1, unsigned 2, bad-mac 1");
    }
}
