//! Reading a TLS ClientHello out of a tunnel's first client bytes: the handshake message is
//! reassembled across records by hand, parsed by rustls, and its SNI read from the message.
//!
//! Invariant: pure (no I/O). [`Probe::Hello`] means a complete ClientHello of at most
//! [`MAX_HANDSHAKE`] bytes that rustls parsed, and its SNI is the `host_name` of its
//! `server_name` extension exactly as sent — an SNI that is present but unreadable is
//! [`Unverifiable`], never "no SNI". The caller's bytes are only read, never rewritten; the
//! outcome depends on the bytes alone, never on how reads split them; at most
//! [`MAX_HANDSHAKE`] handshake bytes are held. [`opening`] calls TLS every first bytes a
//! server's TLS stack would read as a record, of any content type, so that a record before
//! the ClientHello can never make a tunnel pass as plain. `fuzz/checks/hello.rs` checks all
//! of this.

/// The largest ClientHello handshake message (its 4-byte header included) we reassemble.
pub const MAX_HANDSHAKE: usize = 64 * 1024;

/// The most raw client bytes held back while reassembling: a [`MAX_HANDSHAKE`] message sent
/// one byte per record costs six bytes a byte. Zero-length records carry nothing, so this is
/// also what bounds a client that sends only those.
pub const MAX_RAW: usize = 6 * MAX_HANDSHAKE;

/// TLS record content type `handshake`: the record a ClientHello comes in.
pub const HANDSHAKE: u8 = 22;
/// The TLS record content types (RFC 8446 §5.1, RFC 6520): change_cipher_spec (20), alert
/// (21), handshake (22), application_data (23), heartbeat (24).
pub const CONTENT_TYPES: std::ops::RangeInclusive<u8> = 20..=24;
/// Record versions below `0x1000` (a first byte below this) are read on a first record: Go's
/// TLS stack takes any of them ("first record does not look like a TLS handshake" only from
/// 0x1000 up), then drops a warning alert and reads the ClientHello after it.
pub const READ_VERSION_MAJOR_BELOW: u8 = 0x10;
const CLIENT_HELLO: u8 = 1;
/// RFC 8446 §5.1: a plaintext record carries at most 2^14 bytes.
const MAX_FRAGMENT: usize = 16 * 1024;
const RECORD_HEADER: usize = 5;

/// Why the first bytes of a tunnel that began like TLS cannot be checked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unverifiable {
    #[error("a TLS record of content type {0} arrived before the ClientHello was complete")]
    NotHandshake(u8),
    #[error("a TLS record header is malformed (version or length)")]
    BadRecord,
    #[error("the first TLS handshake message is of type {0}, not a ClientHello")]
    NotClientHello(u8),
    #[error("the ClientHello is larger than {MAX_HANDSHAKE} bytes")]
    TooLarge,
    #[error("the ClientHello did not arrive within {MAX_RAW} bytes of records")]
    TooManyRecords,
    #[error("the ClientHello does not parse: {0}")]
    Malformed(String),
    #[error("the ClientHello's server_name extension names no readable host")]
    BadSni,
    #[error("no complete ClientHello within the header-read timeout")]
    Timeout,
    #[error("the tunnel's first bytes are not a TLS ClientHello (--require-sni)")]
    NotTls,
    #[error("the upstream spoke before any ClientHello (--require-sni)")]
    ServerFirst,
    #[error("the ClientHello names no host (--require-sni)")]
    NoSni,
}

/// What a tunnel's first client bytes open with, as far as TLS goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opening {
    /// Too few bytes to tell (none, or one of [`CONTENT_TYPES`] without the next).
    NeedMore,
    /// A TLS record header: the client owes a ClientHello first, read by a [`Reassembler`]
    /// (which refuses a record of any other content type before it).
    Tls,
    /// Bytes no TLS stack reads as a record.
    NotTls,
}

/// Classifies a tunnel's first client bytes (a prefix that grows; the answer, once it is not
/// [`Opening::NeedMore`], never changes as bytes are added).
///
/// `0x16` is TLS whatever follows (the Reassembler then checks the record header); any other
/// content type is TLS when the version's first byte is one a TLS stack reads on a first
/// record (below [`READ_VERSION_MAJOR_BELOW`]: every `0x03xx`, and what Go also takes).
pub fn opening(first: &[u8]) -> Opening {
    match first {
        [] => Opening::NeedMore,
        [HANDSHAKE, ..] => Opening::Tls,
        [kind, ..] if !CONTENT_TYPES.contains(kind) => Opening::NotTls,
        [_] => Opening::NeedMore,
        [_, major, ..] if *major < READ_VERSION_MAJOR_BELOW => Opening::Tls,
        _ => Opening::NotTls,
    }
}

/// What the bytes seen so far are.
#[derive(Debug, PartialEq, Eq)]
pub enum Probe {
    NeedMore,
    /// A complete ClientHello, and its SNI if it has one.
    Hello(Option<String>),
    Unverifiable(Unverifiable),
}

/// Joins the fragments of the first handshake message across records, incrementally: each
/// call looks only at whole records it has not consumed yet.
///
/// Hand-written (about 40 lines) because rustls cannot take the records as clients send them:
/// it refuses zero-length handshake records (RFC 8446 forbids sending them, but OpenSSL
/// accepts them, so an upstream would complete the handshake), and a probe that gives up is a
/// bypass. The joined message then goes to rustls re-framed (see `parse`).
#[derive(Debug, Default)]
pub struct Reassembler {
    /// Raw bytes of whole records consumed so far.
    consumed: usize,
    /// The handshake bytes of those records, in order.
    handshake: Vec<u8>,
}

impl Reassembler {
    /// Looks at `raw`, every byte the client sent so far (the same prefix each call, grown).
    ///
    /// The outcome depends only on the bytes, never on how they were split across calls: a
    /// ClientHello must be complete within the first [`MAX_RAW`] raw bytes, and a record that
    /// would end beyond them is [`Unverifiable::TooManyRecords`] as soon as its header is in.
    pub fn probe(&mut self, raw: &[u8]) -> Probe {
        loop {
            match self.message_len() {
                Err(why) => return Probe::Unverifiable(why),
                Ok(Some(len)) if self.handshake.len() >= len => {
                    return parse(&self.handshake[..len]);
                }
                Ok(_) => {}
            }
            if self.consumed + RECORD_HEADER > MAX_RAW {
                return Probe::Unverifiable(Unverifiable::TooManyRecords);
            }
            let Some(header) = raw.get(self.consumed..self.consumed + RECORD_HEADER) else {
                return Probe::NeedMore;
            };
            if header[0] != HANDSHAKE {
                return Probe::Unverifiable(Unverifiable::NotHandshake(header[0]));
            }
            let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
            if header[1] != 3 || len > MAX_FRAGMENT {
                return Probe::Unverifiable(Unverifiable::BadRecord);
            }
            let start = self.consumed + RECORD_HEADER;
            if start + len > MAX_RAW {
                return Probe::Unverifiable(Unverifiable::TooManyRecords);
            }
            let Some(fragment) = raw.get(start..start + len) else {
                return Probe::NeedMore;
            };
            if let Err(why) = self.absorb(fragment) {
                return Probe::Unverifiable(why);
            }
            self.consumed = start + len;
        }
    }

    /// Handshake bytes held so far: never more than [`MAX_HANDSHAKE`].
    pub fn buffered(&self) -> usize {
        self.handshake.len()
    }

    /// Appends as much of `fragment` as the first message still needs, and no more: what
    /// follows the ClientHello is not ours to hold.
    fn absorb(&mut self, mut fragment: &[u8]) -> Result<(), Unverifiable> {
        while !fragment.is_empty() {
            let wanted = self.message_len()?.unwrap_or(4);
            let take = wanted
                .saturating_sub(self.handshake.len())
                .min(fragment.len());
            if take == 0 {
                break;
            }
            self.handshake.extend_from_slice(&fragment[..take]);
            fragment = &fragment[take..];
        }
        Ok(())
    }

    /// The whole message's length once its header is in, checked against the bounds.
    fn message_len(&self) -> Result<Option<usize>, Unverifiable> {
        match self.handshake.first() {
            Some(&kind) if kind != CLIENT_HELLO => return Err(Unverifiable::NotClientHello(kind)),
            _ => {}
        }
        let Some(&[_, a, b, c]) = self.handshake.get(..4) else {
            return Ok(None);
        };
        let len = 4 + (usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c));
        if len > MAX_HANDSHAKE {
            return Err(Unverifiable::TooLarge);
        }
        Ok(Some(len))
    }
}

/// Parses one reassembled ClientHello message (header included).
fn parse(message: &[u8]) -> Probe {
    // rustls checks the whole message (lengths, extension syntax, duplicates). It is fed
    // synthetic records of at most 2^14 bytes, never empty ones, and joins them itself.
    let mut acceptor = rustls::server::Acceptor::default();
    let mut accepted = false;
    for chunk in message.chunks(MAX_FRAGMENT) {
        let mut record = Vec::with_capacity(RECORD_HEADER + chunk.len());
        record.extend_from_slice(&[HANDSHAKE, 3, 1]);
        record.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        record.extend_from_slice(chunk);
        let mut rest = record.as_slice();
        while !rest.is_empty() {
            if let Err(error) = acceptor.read_tls(&mut rest) {
                return Probe::Unverifiable(Unverifiable::Malformed(error.to_string()));
            }
        }
        match acceptor.accept() {
            Ok(Some(_)) => {
                accepted = true;
                break;
            }
            Ok(None) => {}
            Err((error, _)) => {
                return Probe::Unverifiable(Unverifiable::Malformed(error.to_string()))
            }
        }
    }
    if !accepted {
        return Probe::Unverifiable(Unverifiable::Malformed("incomplete".into()));
    }
    match sni_of(message) {
        Some(sni) => sni.map_or(Probe::Unverifiable(Unverifiable::BadSni), |sni| {
            Probe::Hello(Some(sni))
        }),
        None => Probe::Hello(None),
    }
}

/// The `host_name` of a ClientHello's `server_name` extension: `None` without one,
/// `Some(None)` when the extension is there but names no readable host.
///
/// Read by hand because rustls reports an SNI that is not a valid DNS name (an IP literal, an
/// underscore, an unknown name type) as no SNI at all, and an upstream may still route on it.
/// rustls has already checked the message's syntax, so a short read here is "no readable host".
fn sni_of(message: &[u8]) -> Option<Option<String>> {
    let mut hello = Reader(message.get(4..)?);
    hello.take(2 + 32)?; // legacy_version, random
    for prefix in [1, 2, 1] {
        // session id, cipher suites, compression methods
        let len = hello.length(prefix)?;
        hello.take(len)?;
    }
    let len = hello.length(2).unwrap_or(0);
    let mut extensions = Reader(hello.take(len)?);
    while !extensions.0.is_empty() {
        let kind = extensions.length(2)?;
        let len = extensions.length(2)?;
        let data = extensions.take(len)?;
        if kind != 0 {
            continue;
        }
        let name = (|| {
            let mut list = Reader(data);
            let len = list.length(2)?;
            let mut names = Reader(list.take(len)?);
            if names.take(1)? != [0] {
                return None;
            }
            let len = names.length(2)?;
            let name = names.take(len)?;
            std::str::from_utf8(name).ok().map(str::to_owned)
        })();
        return Some(name);
    }
    None
}

/// A cursor over length-prefixed TLS structures.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }

    /// A big-endian length of `bytes` bytes.
    fn length(&mut self, bytes: usize) -> Option<usize> {
        Some(
            self.take(bytes)?
                .iter()
                .fold(0, |len, &b| len << 8 | usize::from(b)),
        )
    }
}

#[cfg(test)]
#[path = "../../tests/it/support/tls_hello.rs"]
mod tls_hello;

#[cfg(test)]
mod tests {
    use super::tls_hello::{client_hello, reframe};
    use super::*;

    fn probe_growing(raw: &[u8]) -> Probe {
        // Byte by byte, as the slowest client would deliver it.
        let mut reassembler = Reassembler::default();
        for end in 1..=raw.len() {
            match reassembler.probe(&raw[..end]) {
                Probe::NeedMore => {}
                done => return done,
            }
        }
        Probe::NeedMore
    }

    #[test]
    fn a_plain_hello_names_its_sni() {
        let hello = client_hello("secure.test", vec![]);
        assert_eq!(
            Reassembler::default().probe(&hello),
            Probe::Hello(Some("secure.test".into()))
        );
        assert_eq!(
            probe_growing(&hello),
            Probe::Hello(Some("secure.test".into()))
        );
    }

    #[test]
    fn zero_length_and_one_byte_records_are_reassembled() {
        let hello = client_hello("denied.test", vec![]);
        let mut raw = vec![22, 3, 1, 0, 0];
        raw.extend_from_slice(&hello);
        assert_eq!(
            Reassembler::default().probe(&raw),
            Probe::Hello(Some("denied.test".into()))
        );
        let tiny = reframe(&hello, 1);
        assert_eq!(
            probe_growing(&tiny),
            Probe::Hello(Some("denied.test".into()))
        );
    }

    #[test]
    fn hellos_beyond_one_record_are_read_up_to_the_bound() {
        // 80 ALPN names of 250 bytes: a ~20 KB hello, two records as rustls sends it.
        let hello = client_hello("denied.test", vec![vec![b'a'; 250]; 80]);
        assert!(hello.len() > 20_000);
        assert_eq!(
            Reassembler::default().probe(&hello),
            Probe::Hello(Some("denied.test".into()))
        );
        // Close to the bound (rustls itself takes handshake messages up to 0xffff).
        let big = client_hello("denied.test", vec![vec![b'a'; 250]; 250]);
        assert!(
            big.len() > 60_000 && big.len() < MAX_HANDSHAKE,
            "{}",
            big.len()
        );
        assert_eq!(
            Reassembler::default().probe(&reframe(&big, 1000)),
            Probe::Hello(Some("denied.test".into()))
        );
    }

    #[test]
    fn whatever_is_not_a_complete_hello_is_unverifiable() {
        let hello = client_hello("secure.test", vec![]);
        let unverifiable = |raw: &[u8]| match Reassembler::default().probe(raw) {
            Probe::Unverifiable(why) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            unverifiable(b"\x16garbage, not a record"),
            Unverifiable::BadRecord
        );
        // An alert record between two fragments of the hello.
        let mut split = reframe(&hello, 100);
        split.splice(105..105, [21, 3, 1, 0, 2, 1, 0]);
        assert_eq!(unverifiable(&split), Unverifiable::NotHandshake(21));
        // A ServerHello-typed message.
        assert_eq!(
            unverifiable(&[22, 3, 1, 0, 4, 2, 0, 0, 0]),
            Unverifiable::NotClientHello(2)
        );
        // A hello claiming more than the bound.
        assert_eq!(
            unverifiable(&[22, 3, 1, 0, 4, 1, 1, 0, 0]),
            Unverifiable::TooLarge
        );
        // A hello whose body is junk.
        assert!(matches!(
            unverifiable(&[22, 3, 1, 0, 8, 1, 0, 0, 4, 3, 3, 0, 0]),
            Unverifiable::Malformed(_)
        ));
        // Endless zero-length records.
        let empties: Vec<u8> = [22, 3, 1, 0, 0].repeat(MAX_RAW / 5 + 1);
        assert_eq!(unverifiable(&empties), Unverifiable::TooManyRecords);
    }

    #[test]
    fn a_record_of_any_type_opens_tls_and_only_a_handshake_may_come_first() {
        let hello = client_hello("denied.test", vec![]);
        // A warning alert first: Go's TLS stack drops it and reads the hello after it.
        for (kind, version) in [
            (21, [3, 3]),
            (21, [0, 0]),
            (20, [3, 1]),
            (23, [3, 3]),
            (24, [3, 0]),
        ] {
            let mut raw = vec![kind, version[0], version[1], 0, 2, 1, 90];
            raw.extend_from_slice(&hello);
            assert_eq!(opening(&raw[..1]), Opening::NeedMore, "{kind}");
            assert_eq!(opening(&raw), Opening::Tls, "{kind} {version:?}");
            assert_eq!(
                probe_growing(&raw),
                Probe::Unverifiable(Unverifiable::NotHandshake(kind))
            );
        }
        assert_eq!(opening(&hello), Opening::Tls);
        assert_eq!(opening(&[22]), Opening::Tls);
        assert_eq!(opening(&[]), Opening::NeedMore);
        // Plain protocols stay plain, even one whose first byte is a content type.
        for plain in [
            &b"SSH-2.0-OpenSSH_9.6\r\n"[..],
            b"GET / HTTP/1.1\r\n",
            b"\x00\x00\x00\x08\x04\xd2\x16\x2f",
            b"\x15A line",
            b"\x17\x10",
        ] {
            assert_eq!(opening(plain), Opening::NotTls, "{plain:?}");
        }
    }

    #[test]
    fn an_ip_literal_sni_is_reported_not_hidden() {
        // rustls calls a hello whose SNI is an IP literal SNI-less; this one is rewritten in
        // place to a same-length IP literal, so every length field stays right.
        let mut hello = client_hello("abcdefgh.test", vec![]);
        let at = hello
            .windows(13)
            .position(|w| w == b"abcdefgh.test")
            .unwrap();
        hello[at..at + 13].copy_from_slice(b"192.168.10.10");
        assert_eq!(
            Reassembler::default().probe(&hello),
            Probe::Hello(Some("192.168.10.10".into()))
        );
    }

    #[test]
    fn the_outcome_does_not_depend_on_how_the_bytes_arrive() {
        // The `hello` fuzz check's split property, past MAX_RAW: a hello whose last record ended there was
        // accepted when it arrived in one read and refused when it arrived in two.
        let hello = client_hello("secure.test", vec![]);
        let mut raw = [22, 3, 1, 0, 0].repeat((MAX_RAW - hello.len()) / 5 + 1);
        raw.extend_from_slice(&hello);
        assert!(raw.len() > MAX_RAW);
        let whole = Reassembler::default().probe(&raw);
        assert_eq!(whole, Probe::Unverifiable(Unverifiable::TooManyRecords));
        let empties = raw.len() - hello.len();
        let mut reassembler = Reassembler::default();
        assert_eq!(reassembler.probe(&raw[..empties]), Probe::NeedMore);
        assert_eq!(reassembler.probe(&raw), whole);
        // Decided as soon as the hello's first record header says it would end past the bound.
        assert_eq!(Reassembler::default().probe(&raw[..empties + 5]), whole);
    }

    #[test]
    fn no_more_than_the_hello_is_held() {
        // A ~63 KB hello whose last record also carries 16 KB of what follows it: held whole,
        // it was ~79 KB.
        let big = client_hello("denied.test", vec![vec![b'a'; 250]; 250]);
        let mut handshake = Vec::new();
        let mut at = 0;
        while at < big.len() {
            let len = usize::from(u16::from_be_bytes([big[at + 3], big[at + 4]]));
            handshake.extend_from_slice(&big[at + 5..at + 5 + len]);
            at += 5 + len;
        }
        // The hello's last byte opens a full record of what follows it.
        let last = handshake.pop().unwrap();
        let mut records: Vec<Vec<u8>> =
            handshake.chunks(MAX_FRAGMENT).map(<[u8]>::to_vec).collect();
        records.push([vec![last], vec![0; MAX_FRAGMENT - 1]].concat());
        let mut raw = Vec::new();
        for record in records {
            raw.extend_from_slice(&[22, 3, 1]);
            raw.extend_from_slice(&(record.len() as u16).to_be_bytes());
            raw.extend_from_slice(&record);
        }
        let mut reassembler = Reassembler::default();
        assert_eq!(
            reassembler.probe(&raw),
            Probe::Hello(Some("denied.test".into()))
        );
        assert!(
            reassembler.buffered() <= MAX_HANDSHAKE,
            "{}",
            reassembler.buffered()
        );
    }
}
