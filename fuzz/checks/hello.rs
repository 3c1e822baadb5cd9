//! The ClientHello reader on arbitrary client bytes: its outcome depends on the bytes only,
//! never on how they arrive (all at once, one byte a call, or in uneven chunks); it holds at
//! most `MAX_HANDSHAKE` handshake bytes; a hello is reported only once every record carrying
//! it is in, and never from a truncated stream; and the SNI it reports is the name an upstream
//! reads (rustls agrees), spelled as the host the policy judges. The tunnel's TLS-or-not
//! classification calls TLS every opening a TLS stack reads as a record, whatever its content
//! type, never changes its mind as bytes arrive, and a record of another type before the
//! ClientHello, whatever follows it, is refused.

use leasegate::policy::target::{parse_host, TargetHost};
use leasegate::proxy::hello::{
    opening, Opening, Probe, Reassembler, Unverifiable, MAX_HANDSHAKE, MAX_RAW,
};

pub fn check(data: &[u8]) {
    check_opening(data);
    // Every record type but handshake, in front of these bytes: never a hello.
    for kind in [20, 21, 23, 24] {
        for version in [[3, 3], [3, 1], [0, 0], [0x0f, 0xff]] {
            let mut prefixed = vec![kind, version[0], version[1], 0, 2, 1, 90];
            prefixed.extend_from_slice(data);
            assert_eq!(opening(&prefixed), Opening::Tls, "{prefixed:?}");
            assert_eq!(
                probe_split(&prefixed, &vec![1; prefixed.len().min(16)]),
                Probe::Unverifiable(Unverifiable::NotHandshake(kind)),
                "a type {kind} record first"
            );
        }
    }

    let whole = probe_split(data, &[data.len()]);
    let bytewise = probe_split(data, &vec![1; data.len()]);
    assert_eq!(bytewise, whole, "one byte a call");
    let uneven = probe_split(data, &chunk_sizes(data));
    assert_eq!(uneven, whole, "uneven chunks");

    match (&whole, framing(data)) {
        (Probe::NeedMore, _) => assert!(data.len() < MAX_RAW, "undecided at {}", data.len()),
        (Probe::Hello(sni), Framing::Complete { end, message }) => {
            assert!(end <= MAX_RAW && message.len() <= MAX_HANDSHAKE);
            // Complete exactly when its last record is in, never a byte before.
            assert_eq!(probe_split(&data[..end], &[end]), whole);
            assert_eq!(probe_split(&data[..end - 1], &[end - 1]), Probe::NeedMore);
            check_sni(sni.as_deref(), &message);
        }
        (Probe::Hello(_), framing) => panic!("a hello the framing calls {framing:?}"),
        (Probe::Unverifiable(why), Framing::Complete { end, message })
            if end <= MAX_RAW && message.len() <= MAX_HANDSHAKE && message[0] == 1 =>
        {
            // Well-framed, in bounds: only its content may be refused, never its records.
            assert!(
                matches!(why, Unverifiable::Malformed(_) | Unverifiable::BadSni),
                "{why:?}"
            );
        }
        (Probe::Unverifiable(_), _) => {}
    }
}

/// The opening is decided from a prefix and kept as the bytes grow, and agrees with the
/// record model: a record header (any content type) that a TLS stack would read is TLS; a
/// hello is only ever found behind a TLS opening.
fn check_opening(data: &[u8]) {
    let whole = opening(data);
    let mut decided = None;
    for end in 0..=data.len().min(8) {
        match (opening(&data[..end]), decided) {
            (Opening::NeedMore, None) => {}
            (Opening::NeedMore, Some(was)) => panic!("{was:?} at a shorter prefix, then undecided"),
            (now, None) => decided = Some(now),
            (now, Some(was)) => assert_eq!(now, was, "changed at {end} bytes"),
        }
    }
    assert_eq!(decided.unwrap_or(Opening::NeedMore), whole);
    let reads_as_record = match data {
        [22, ..] => Some(true),
        [20..=24, major, ..] => Some(*major < 0x10),
        [20..=24] | [] => None,
        _ => Some(false),
    };
    match (reads_as_record, whole) {
        (None, Opening::NeedMore) | (Some(true), Opening::Tls) | (Some(false), Opening::NotTls) => {
        }
        (model, whole) => panic!("the model says {model:?}, opening {whole:?}"),
    }
    if whole != Opening::Tls {
        assert!(
            !matches!(probe_split(data, &[data.len()]), Probe::Hello(_)),
            "a hello behind an opening called {whole:?}"
        );
    }
}

/// Feeds `data` to one reader in growing prefixes, `sizes` bytes more each call (the rest in
/// one last call), and returns the first outcome that is not `NeedMore`.
fn probe_split(data: &[u8], sizes: &[usize]) -> Probe {
    let mut reader = Reassembler::default();
    let mut end = 0;
    for size in sizes.iter().copied().chain([data.len()]) {
        end = (end + size).min(data.len());
        let outcome = reader.probe(&data[..end]);
        assert!(reader.buffered() <= MAX_HANDSHAKE, "{}", reader.buffered());
        if outcome != Probe::NeedMore {
            return outcome;
        }
    }
    Probe::NeedMore
}

/// Chunk sizes from 1 to 64 drawn from the data itself, so each input has its own split.
fn chunk_sizes(data: &[u8]) -> Vec<usize> {
    let mut state = data.len() as u64 ^ 0x9e37_79b9_7f4a_7c15;
    for &b in data.iter().take(64) {
        state = (state ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    let mut sizes = Vec::new();
    let mut total = 0;
    while total < data.len() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let size = 1 + (state % 64) as usize;
        sizes.push(size);
        total += size;
    }
    sizes
}

/// The stream as a plain reading of RFC 8446 §5.1 frames it, written apart from the reader.
#[derive(Debug)]
enum Framing {
    /// The first handshake message, complete once the record ending at `end` is in.
    Complete { end: usize, message: Vec<u8> },
    /// A record before that is not a well-formed handshake record.
    Broken,
    /// Well-formed so far, but the message is not complete yet.
    Short,
}

fn framing(data: &[u8]) -> Framing {
    let mut joined = Vec::new();
    let mut at = 0;
    loop {
        if joined.len() >= 4 {
            let len = 4
                + (usize::from(joined[1]) << 16
                    | usize::from(joined[2]) << 8
                    | usize::from(joined[3]));
            if joined.len() >= len {
                joined.truncate(len);
                return Framing::Complete {
                    end: at,
                    message: joined,
                };
            }
        }
        let Some(header) = data.get(at..at + 5) else {
            return Framing::Short;
        };
        let len = usize::from(header[3]) << 8 | usize::from(header[4]);
        if header[0] != 22 || header[1] != 3 || len > 1 << 14 {
            return Framing::Broken;
        }
        let Some(fragment) = data.get(at + 5..at + 5 + len) else {
            return Framing::Short;
        };
        joined.extend_from_slice(fragment);
        at += 5 + len;
    }
}

/// The reported SNI is what rustls reads from the same message, and is spelled as the host it
/// is judged as: no escapes, no Unicode, nothing a parser would turn into another name.
fn check_sni(sni: Option<&str>, message: &[u8]) {
    let accepted = rustls_server_name(message);
    let Some(sni) = sni else {
        assert_eq!(accepted, None, "rustls reads an SNI the reader does not");
        return;
    };
    if let Some(name) = &accepted {
        assert!(
            name.eq_ignore_ascii_case(sni),
            "rustls {name:?}, reader {sni:?}"
        );
    }
    assert!(
        !sni.is_empty()
            && sni
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.'),
        "{sni:?}"
    );
    if let Ok(TargetHost::Name(name)) = parse_host(sni) {
        let spelled = sni.strip_suffix('.').unwrap_or(sni).to_ascii_lowercase();
        assert_eq!(name, spelled, "the SNI {sni:?} is judged as another name");
    }
}

/// The DNS name rustls's own ClientHello parser reads from `message`, if any.
fn rustls_server_name(message: &[u8]) -> Option<String> {
    let mut acceptor = rustls::server::Acceptor::default();
    for chunk in message.chunks(1 << 14) {
        let mut record = vec![22, 3, 1];
        record.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
        record.extend_from_slice(chunk);
        let mut rest = record.as_slice();
        while !rest.is_empty() {
            acceptor
                .read_tls(&mut rest)
                .expect("the reader accepted it");
        }
        if let Some(accepted) = acceptor.accept().map_err(|(e, _)| e).expect("accepted") {
            return accepted.client_hello().server_name().map(str::to_owned);
        }
    }
    panic!("the reader accepted a hello rustls finds incomplete");
}
