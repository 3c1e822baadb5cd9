//! A Java trust store in the JKS format: trusted-certificate entries only, sealed with the
//! store's keyed SHA-1 digest.
//!
//! Invariant: the bytes hold public certificates and nothing else (no key entry is ever
//! written), so the store's password guards integrity, not secrecy.
//!
//! Written by hand rather than with a crate: the format for trusted certificates is a few
//! fixed fields, every JDK reads it, and it needs no cipher; the PKCS#12 crates bring a
//! cipher suite along and mark trusted entries in ways not every JDK accepts.

use sha1::{Digest, Sha1};

/// The JKS magic number and the version every JDK since 1.2 writes.
const MAGIC: u32 = 0xFEED_FEED;
const VERSION: u32 = 2;
/// Entry tag of a trusted certificate (1 is a private key, never written here).
const TRUSTED_CERT: u32 = 2;
/// The salt the JDK's `JavaKeyStore` mixes into the store's digest, after the password.
const WHITENER: &[u8] = b"Mighty Aphrodite";

/// A trusted-certificate entry: its alias (ASCII, unique without case, as the JDK lower-cases
/// aliases) and its DER.
pub struct Entry<'a> {
    pub alias: String,
    pub der: &'a [u8],
}

/// The store's bytes: `entries` in order, each created at `created_ms` (milliseconds since
/// the epoch), sealed with `password`.
///
/// An alias longer than a u16 length can say, or not ASCII, is an error: the JDK writes
/// aliases in modified UTF-8, which is ASCII's bytes for ASCII.
pub fn trust_store(entries: &[Entry], password: &str, created_ms: u64) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&VERSION.to_be_bytes());
    let count = u32::try_from(entries.len()).map_err(|_| "too many certificates".to_owned())?;
    out.extend_from_slice(&count.to_be_bytes());
    for entry in entries {
        let alias = entry.alias.as_bytes();
        let alias_len = u16::try_from(alias.len())
            .ok()
            .filter(|_| entry.alias.is_ascii() && !alias.is_empty())
            .ok_or_else(|| format!("alias {:?}: not 1 to 65535 ASCII bytes", entry.alias))?;
        let der_len = u32::try_from(entry.der.len())
            .map_err(|_| format!("{}: certificate too long", entry.alias))?;
        out.extend_from_slice(&TRUSTED_CERT.to_be_bytes());
        out.extend_from_slice(&alias_len.to_be_bytes());
        out.extend_from_slice(alias);
        out.extend_from_slice(&created_ms.to_be_bytes());
        write_utf(&mut out, "X.509");
        out.extend_from_slice(&der_len.to_be_bytes());
        out.extend_from_slice(entry.der);
    }
    let digest = seal(password, &out);
    out.extend_from_slice(&digest);
    Ok(out)
}

/// The store's trailing digest: SHA-1 over the password (UTF-16 big-endian), the whitener
/// and the store's bytes.
fn seal(password: &str, store: &[u8]) -> [u8; 20] {
    let mut sha = Sha1::new();
    for unit in password.encode_utf16() {
        sha.update(unit.to_be_bytes());
    }
    sha.update(WHITENER);
    sha.update(store);
    sha.finalize().into()
}

/// A short ASCII string as `DataOutputStream.writeUTF` writes it.
fn write_utf(out: &mut Vec<u8>, text: &'static str) {
    out.extend_from_slice(&(text.len() as u16).to_be_bytes());
    out.extend_from_slice(text.as_bytes());
}

#[cfg(test)]
/// A store read back: (alias, created, DER) per entry; panics on anything a JDK would
/// refuse (wrong magic, version or tag, a digest that does not match `password`).
pub(super) fn read_back(bytes: &[u8], password: &str) -> Vec<(String, u64, Vec<u8>)> {
    let (body, digest) = bytes.split_at(bytes.len() - 20);
    assert_eq!(seal(password, body), digest, "the digest seals the store");
    let mut at = 0;
    let mut take = |n: usize| {
        let part = &body[at..at + n];
        at += n;
        part
    };
    let u16_of = |b: &[u8]| u16::from_be_bytes(b.try_into().unwrap()) as usize;
    let u32_of = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
    assert_eq!(u32_of(take(4)), MAGIC);
    assert_eq!(u32_of(take(4)), VERSION);
    let count = u32_of(take(4));
    let mut entries = Vec::new();
    for _ in 0..count {
        assert_eq!(u32_of(take(4)), TRUSTED_CERT);
        let len = u16_of(take(2));
        let alias = String::from_utf8(take(len).to_vec()).unwrap();
        let created = u64::from_be_bytes(take(8).try_into().unwrap());
        let len = u16_of(take(2));
        assert_eq!(take(len), b"X.509");
        let len = u32_of(take(4)) as usize;
        entries.push((alias, created, take(len).to_vec()));
    }
    assert_eq!(at, body.len(), "nothing after the last entry");
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::pki_types::{pem::PemObject, CertificateDer};

    /// A fixed CA (made once with `openssl req -x509`) for the fixed vector.
    const FIXED_CA: &str = include_str!("../../../tests/data/run/fixed-ca.pem");

    /// The store of [`FIXED_CA`] under alias `leasegate-ca`, created at 1 700 000 000 000 ms
    /// with "changeit" (read by `keytool -list -storetype JKS -storepass changeit` when it was
    /// made): a change to the bytes written is a change a JDK has not seen.
    const FIXED_SHA256: &str = "19c33390174a862ca9feb3ffa980b0e7b1bff6a28cd9d312ea87c487e4f0421b";

    #[test]
    fn the_fixed_store_is_the_one_keytool_read() {
        let der = CertificateDer::from_pem_slice(FIXED_CA.as_bytes()).unwrap();
        let entry = Entry {
            alias: "leasegate-ca".into(),
            der: &der,
        };
        let store = trust_store(&[entry], "changeit", 1_700_000_000_000).unwrap();
        use sha2::Digest as _;
        assert_eq!(hex::encode(sha2::Sha256::digest(&store)), FIXED_SHA256);
        let read = read_back(&store, "changeit");
        assert_eq!(
            read,
            [("leasegate-ca".to_owned(), 1_700_000_000_000, der.to_vec())]
        );
    }

    #[test]
    fn every_certificate_is_listed_and_a_bad_alias_is_refused() {
        let ders: Vec<Vec<u8>> = (0..3).map(|n| vec![0x30, n, 1, 2, 3]).collect();
        let entries: Vec<Entry> = ders
            .iter()
            .enumerate()
            .map(|(n, der)| Entry {
                alias: format!("root-{n}"),
                der,
            })
            .collect();
        let store = trust_store(&entries, "changeit", 7).unwrap();
        let read = read_back(&store, "changeit");
        assert_eq!(read.len(), 3);
        for (n, (alias, created, der)) in read.into_iter().enumerate() {
            assert_eq!(
                (alias, created, der),
                (format!("root-{n}"), 7, ders[n].clone())
            );
        }
        let empty = trust_store(&[], "changeit", 7).unwrap();
        assert_eq!(read_back(&empty, "changeit"), []);
        for alias in ["", "ünïcode", &"a".repeat(70_000)] {
            let entry = Entry {
                alias: alias.to_owned(),
                der: &ders[0],
            };
            assert!(trust_store(&[entry], "changeit", 7).is_err(), "{alias:?}");
        }
    }
}
