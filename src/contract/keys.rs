//! Signing keys, fingerprints and HMAC-SHA256 signatures.
//!
//! Invariant: key bytes never leave this module except as an HMAC; `Debug` shows only the
//! fingerprint, verification compares in constant time, and a [`Keyring`] never holds the
//! published test key unless its builder was told to allow it.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use std::fmt;
use std::path::Path;
use std::sync::Arc;

type HmacSha256 = Hmac<Sha256>;

/// Fingerprint of the contract's published TEST key (`tests/data/contract/vectors/test-key.txt`).
pub const TEST_KEY_FINGERPRINT: &str = "sha256:9d12c441941d9b5e";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read key file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("key file {path}: expected 64 hex characters (32 bytes) outside `#` comment lines")]
    Malformed { path: String },
    #[error("key file {path} holds the published TEST key ({TEST_KEY_FINGERPRINT}); it is refused unless --allow-test-key is given")]
    TestKeyRefused { path: String },
}

/// A 32-byte HMAC key.
#[derive(Clone)]
pub struct Key {
    raw: [u8; 32],
    /// Shared with every lease that names it.
    fingerprint: Arc<str>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.fingerprint)
    }
}

impl Key {
    pub fn from_bytes(raw: [u8; 32]) -> Key {
        let digest = Sha256::digest(raw);
        let fingerprint = format!("sha256:{}", &hex::encode(digest)[..16]).into();
        Key { raw, fingerprint }
    }

    /// A fresh random key from the operating system's generator.
    pub fn generate() -> Key {
        let mut raw = [0u8; 32];
        rand::fill(&mut raw);
        Key::from_bytes(raw)
    }

    /// Parses key-file text: `#` comment lines and blank lines ignored, the rest is 64 hex
    /// characters used as 32 raw bytes (never as the hex text).
    pub fn parse(text: &str) -> Option<Key> {
        let hex_text: String = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let mut raw = [0u8; 32];
        hex::decode_to_slice(hex_text.as_bytes(), &mut raw).ok()?;
        Some(Key::from_bytes(raw))
    }

    pub fn load(path: &Path) -> Result<Key, KeyError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| KeyError::Read {
            path: shown.clone(),
            error,
        })?;
        Key::parse(&text).ok_or(KeyError::Malformed { path: shown })
    }

    /// Key-file text for this key (what `keygen` writes).
    pub fn to_file_text(&self) -> String {
        format!(
            "# leasegate HMAC-SHA256 key, {}. Keep this file secret.\n{}\n",
            self.fingerprint,
            hex::encode(self.raw)
        )
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The fingerprint, shared rather than copied (a lease keeps it).
    pub fn shared_fingerprint(&self) -> Arc<str> {
        self.fingerprint.clone()
    }

    pub fn is_test_key(&self) -> bool {
        &*self.fingerprint == TEST_KEY_FINGERPRINT
    }

    /// Lower-case hex HMAC-SHA256 of `bytes`.
    pub fn sign(&self, bytes: &[u8]) -> String {
        hex::encode(self.mac(bytes).finalize().into_bytes())
    }

    /// Whether `signature_hex` is the HMAC of `bytes`, compared in constant time.
    pub fn verify(&self, bytes: &[u8], signature_hex: &str) -> bool {
        let mut expected = [0u8; 32];
        if hex::decode_to_slice(signature_hex, &mut expected).is_err() {
            return false;
        }
        self.mac(bytes).verify_slice(&expected).is_ok()
    }

    /// The raw HMAC-SHA256 of `bytes` (for derived credentials such as proxy tokens).
    pub fn hmac(&self, bytes: &[u8]) -> [u8; 32] {
        self.mac(bytes).finalize().into_bytes().into()
    }

    fn mac(&self, bytes: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.raw).expect("HMAC takes any key length");
        mac.update(bytes);
        mac
    }
}

/// Lower-case hex SHA-256 of `bytes` (declared_hash, granted_hash).
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The keys a process trusts, looked up by fingerprint (several during a rotation).
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    keys: Vec<Key>,
    allows_test_key: bool,
    /// `--require-record-signatures`: a closing record without a signature is not trusted
    /// either (a present signature is always checked).
    requires_record_signatures: bool,
}

impl Keyring {
    pub fn new(allows_test_key: bool) -> Keyring {
        Keyring {
            keys: Vec::new(),
            allows_test_key,
            requires_record_signatures: false,
        }
    }

    /// With `required`, closing records must carry a signature that verifies under their
    /// lease's key; without, only a present signature is checked.
    pub fn requiring_record_signatures(mut self, required: bool) -> Keyring {
        self.requires_record_signatures = required;
        self
    }

    /// Loads every key file; the published test key is an error unless allowed.
    pub fn load<P: AsRef<Path>>(paths: &[P], allows_test_key: bool) -> Result<Keyring, KeyError> {
        let mut ring = Keyring::new(allows_test_key);
        for path in paths {
            let key = Key::load(path.as_ref())?;
            if key.is_test_key() && !allows_test_key {
                return Err(KeyError::TestKeyRefused {
                    path: path.as_ref().display().to_string(),
                });
            }
            ring.insert(key);
        }
        Ok(ring)
    }

    /// Adds a key (a repeated fingerprint is kept once).
    pub fn insert(&mut self, key: Key) {
        if self.get(key.fingerprint()).is_none() {
            self.keys.push(key);
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.keys.iter()
    }

    pub fn get(&self, fingerprint: &str) -> Option<&Key> {
        self.keys.iter().find(|k| &*k.fingerprint == fingerprint)
    }

    pub fn allows_test_key(&self) -> bool {
        self.allows_test_key
    }

    pub fn requires_record_signatures(&self) -> bool {
        self.requires_record_signatures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_is_over_the_raw_bytes() {
        let key = Key::parse(
            "# comment\n\n 000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f\n",
        )
        .unwrap();
        let expected = format!(
            "sha256:{}",
            &sha256_hex(&(0u8..32).collect::<Vec<_>>())[..16]
        );
        assert_eq!(key.fingerprint(), expected);
        assert_eq!(format!("{key:?}"), format!("Key({expected})"));
    }

    #[test]
    fn malformed_key_text_is_refused() {
        assert!(Key::parse("abcd").is_none());
        assert!(Key::parse(&"zz".repeat(32)).is_none());
        assert!(Key::parse(&"00".repeat(33)).is_none());
    }

    #[test]
    fn signatures_verify_and_tampering_fails() {
        let key = Key::generate();
        let sig = key.sign(b"payload");
        assert!(key.verify(b"payload", &sig));
        assert!(!key.verify(b"payload!", &sig));
        assert!(!key.verify(b"payload", &sig[..62]));
        assert!(!Key::generate().verify(b"payload", &sig));
    }

    #[test]
    fn key_file_round_trips() {
        let key = Key::generate();
        assert_eq!(
            Key::parse(&key.to_file_text()).unwrap().fingerprint(),
            key.fingerprint()
        );
    }
}
