//! Placeholders: the stand-in a lease's agent holds instead of a secret's value.
//!
//! For a lease and a secret, `lgp_<secret id>_<mac>`, where `<mac>` is the first 26 characters
//! of the lower-case, unpadded RFC 4648 base32 of HMAC-SHA256(K, lease_id || 0x00 || secret_id)
//! (130 bits) and K = HMAC-SHA256(the lease's signing key, "leasegate placeholder v1").
//!
//! Invariant: a placeholder is a function of the signing key, the lease id and the secret id
//! only, so every replica with the keyring derives the same one, an agent (without the key)
//! cannot, and a placeholder verifies under its own lease only; verification compares in
//! constant time.

use crate::contract::keys::Key;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use subtle::ConstantTimeEq;

/// What every placeholder starts with, so a scan can find candidates.
pub const PREFIX: &str = "lgp_";
/// Characters of base32 kept from the HMAC (130 bits).
pub const MAC_CHARS: usize = 26;
/// The label K is derived under: a new derivation gets a new label.
const LABEL: &[u8] = b"leasegate placeholder v1";

/// The placeholder of `secret_id` under the lease `lease_id`, signed with `key`.
pub fn derive(key: &Key, lease_id: &str, secret_id: &str) -> String {
    let k = key.hmac(LABEL);
    let mut mac = Hmac::<Sha256>::new_from_slice(&k).expect("HMAC takes any key length");
    mac.update(lease_id.as_bytes());
    mac.update(&[0]);
    mac.update(secret_id.as_bytes());
    let digest = mac.finalize().into_bytes();
    let mut encoded = data_encoding::BASE32_NOPAD.encode(&digest);
    encoded.truncate(MAC_CHARS);
    encoded.make_ascii_lowercase();
    format!("{PREFIX}{secret_id}_{encoded}")
}

/// Leases whose placeholders a [`Memo`] keeps; one more starts it over.
const MEMO_LEASES: usize = 4096;
/// Placeholders a [`Memo`] keeps per lease (secrets come and go with reloads).
const MEMO_PER_LEASE: usize = 64;

/// Placeholders already derived, by lease: each request of a lease is checked for the same few
/// placeholders, and deriving one is two HMACs (about 2 µs, per secret, per request).
///
/// Invariant: what it gives is what [`derive()`] gives for the same key (by fingerprint, as the
/// keyring itself tells keys apart), lease id and secret id.
#[derive(Debug, Default)]
pub struct Memo {
    by_lease: Mutex<HashMap<String, Vec<Remembered>>>,
}

#[derive(Debug)]
struct Remembered {
    fingerprint: Arc<str>,
    secret_id: String,
    placeholder: Arc<str>,
}

impl Memo {
    /// [`derive()`], remembered.
    pub fn derive(&self, key: &Key, lease_id: &str, secret_id: &str) -> Arc<str> {
        let is_it =
            |r: &Remembered| r.secret_id == secret_id && *r.fingerprint == *key.fingerprint();
        {
            let memo = self.by_lease.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(found) = memo.get(lease_id).and_then(|l| l.iter().find(|r| is_it(r))) {
                return found.placeholder.clone();
            }
        }
        let placeholder: Arc<str> = derive(key, lease_id, secret_id).into();
        let mut memo = self.by_lease.lock().unwrap_or_else(|e| e.into_inner());
        if memo.len() >= MEMO_LEASES && !memo.contains_key(lease_id) {
            memo.clear();
        }
        let list = memo.entry(lease_id.to_owned()).or_default();
        if list.len() < MEMO_PER_LEASE && !list.iter().any(is_it) {
            list.push(Remembered {
                fingerprint: key.shared_fingerprint(),
                secret_id: secret_id.to_owned(),
                placeholder: placeholder.clone(),
            });
        }
        placeholder
    }
}

/// Whether `candidate` is the placeholder of `secret_id` under `lease_id`, compared in
/// constant time (its length aside, which every placeholder of the secret shares).
pub fn verify(key: &Key, lease_id: &str, secret_id: &str, candidate: &[u8]) -> bool {
    derive(key, lease_id, secret_id)
        .as_bytes()
        .ct_eq(candidate)
        .into()
}

/// The secret id a well-formed placeholder names (`lgp_<id>_<26 base32 characters>`), without
/// saying whether it verifies.
pub fn secret_id_of(candidate: &str) -> Option<&str> {
    let rest = candidate.strip_prefix(PREFIX)?;
    let (id, mac) = rest.rsplit_once('_')?;
    let is_base32 = |b: u8| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b);
    (!id.is_empty() && mac.len() == MAC_CHARS && mac.bytes().all(is_base32)).then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> Key {
        Key::from_bytes([byte; 32])
    }

    #[test]
    fn the_format_is_prefix_id_and_26_base32_characters() {
        let p = derive(&key(1), "lease-a", "github");
        assert_eq!(p.len(), "lgp_github_".len() + MAC_CHARS, "{p}");
        assert!(p.starts_with("lgp_github_"), "{p}");
        assert_eq!(secret_id_of(&p), Some("github"));
        assert_eq!(secret_id_of("lgp_github_short"), None);
        assert_eq!(secret_id_of("xyz_github_aaaaaaaaaaaaaaaaaaaaaaaaaa"), None);
        assert_eq!(secret_id_of("lgp_github_AAAAAAAAAAAAAAAAAAAAAAAAAA"), None);
        assert_eq!(
            secret_id_of("lgp_my-api_aaaaaaaaaaaaaaaaaaaaaaaaaa"),
            Some("my-api")
        );
    }

    #[test]
    fn a_known_vector_stays_the_same() {
        // Replicas and later versions must derive the same placeholder: pin one.
        assert_eq!(
            derive(&key(7), "0190f3c2-lease", "github"),
            "lgp_github_ucx4hwve42vm6ec43dh4afwobh"
        );
        assert_eq!(
            derive(&key(0), "lease", "s"),
            "lgp_s_".to_owned() + &expected_mac(&[0; 32], b"lease\0s")
        );
    }

    /// The derivation spelled out a second way, with the HMAC crate directly.
    fn expected_mac(raw_key: &[u8; 32], message: &[u8]) -> String {
        let mut outer = Hmac::<Sha256>::new_from_slice(raw_key).unwrap();
        outer.update(b"leasegate placeholder v1");
        let k = outer.finalize().into_bytes();
        let mut inner = Hmac::<Sha256>::new_from_slice(&k).unwrap();
        inner.update(message);
        let text = data_encoding::BASE32_NOPAD.encode(&inner.finalize().into_bytes());
        text[..MAC_CHARS].to_ascii_lowercase()
    }

    #[test]
    fn a_memo_gives_what_derive_gives_and_stays_bounded() {
        let memo = Memo::default();
        let (a, b) = (key(1), key(2));
        // Derived the first time, remembered the second: the same either way, and a lease id
        // signed with another key gets that key's placeholder.
        for _ in 0..2 {
            for k in [&a, &b] {
                for lease in ["lease-a", "lease-b"] {
                    for secret in ["github", "gitlab"] {
                        assert_eq!(&*memo.derive(k, lease, secret), derive(k, lease, secret));
                    }
                }
            }
        }
        for i in 0..=MEMO_LEASES {
            memo.derive(&a, &format!("lease-{i}"), "s");
        }
        assert!(memo.by_lease.lock().unwrap().len() <= MEMO_LEASES);
        assert_eq!(
            &*memo.derive(&b, "lease-a", "github"),
            derive(&b, "lease-a", "github")
        );
    }

    #[test]
    fn two_leases_get_different_placeholders() {
        let k = key(1);
        assert_ne!(
            derive(&k, "lease-a", "github"),
            derive(&k, "lease-b", "github")
        );
        assert_ne!(
            derive(&k, "lease-a", "github"),
            derive(&k, "lease-a", "gitlab")
        );
        // The separator keeps (lease, secret) pairs apart that concatenate alike.
        assert_ne!(derive(&k, "ab", "c"), derive(&k, "a", "bc"));
        assert_ne!(
            derive(&key(1), "lease-a", "github"),
            derive(&key(2), "lease-a", "github")
        );
    }

    #[test]
    fn a_placeholder_verifies_under_its_own_lease_only() {
        let k = key(3);
        let p = derive(&k, "lease-a", "github");
        assert!(verify(&k, "lease-a", "github", p.as_bytes()));
        assert!(!verify(&k, "lease-b", "github", p.as_bytes()));
        assert!(!verify(&k, "lease-a", "gitlab", p.as_bytes()));
        assert!(!verify(&key(4), "lease-a", "github", p.as_bytes()));
        assert!(!verify(
            &k,
            "lease-a",
            "github",
            &p.as_bytes()[..p.len() - 1]
        ));
        assert!(!verify(&k, "lease-a", "github", b""));
    }
}
