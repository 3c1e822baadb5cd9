//! Proxy tokens (`--credentials token`): `<lease-id>.<tag>`, where tag is base64url (no
//! padding) of the first 16 bytes of HMAC-SHA256(lease key, "leasegate-proxy-token\n" + id).
//!
//! Invariant: pure, and a tag is only ever compared in constant time; a tag that is not
//! exactly 16 bytes of base64url never verifies.

use super::Key;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use subtle::ConstantTimeEq;

/// What the MAC is taken over, before the lease id: a fixed context so that a proxy token
/// can never be mistaken for (or replayed as) any other HMAC made with the lease key.
const CONTEXT: &str = "leasegate-proxy-token\n";

/// Bytes of the MAC kept in a tag: 128 bits.
const TAG_BYTES: usize = 16;

/// The separator between lease id and tag (never part of a lease id, a UUID).
pub const SEPARATOR: char = '.';

fn tag_bytes(key: &Key, lease_id: &str) -> [u8; TAG_BYTES] {
    let mac = key.hmac(format!("{CONTEXT}{lease_id}").as_bytes());
    let mut tag = [0u8; TAG_BYTES];
    tag.copy_from_slice(&mac[..TAG_BYTES]);
    tag
}

/// The token for `lease_id` under its lease's key: `<lease-id>.<tag>`.
pub fn mint(key: &Key, lease_id: &str) -> String {
    format!(
        "{lease_id}{SEPARATOR}{}",
        URL_SAFE_NO_PAD.encode(tag_bytes(key, lease_id))
    )
}

/// Whether `tag` is the tag of `lease_id` under `key` (constant time).
pub fn verify(key: &Key, lease_id: &str, tag: &str) -> bool {
    let mut given = [0u8; TAG_BYTES];
    match URL_SAFE_NO_PAD.decode_slice(tag.as_bytes(), &mut given) {
        Ok(TAG_BYTES) => bool::from(given.ct_eq(&tag_bytes(key, lease_id))),
        _ => false,
    }
}

/// Splits a credential into lease id and tag (`None`: a bare lease id).
pub fn split(credential: &str) -> (&str, Option<&str>) {
    match credential.split_once(SEPARATOR) {
        Some((id, tag)) => (id, Some(tag)),
        None => (credential, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";

    #[test]
    fn minted_tokens_verify_under_their_key_only() {
        let key = Key::generate();
        let token = mint(&key, A);
        let (id, tag) = split(&token);
        assert_eq!(id, A);
        let tag = tag.unwrap();
        assert_eq!(tag.len(), 22, "16 bytes of base64url without padding");
        assert!(verify(&key, A, tag));
        assert!(!verify(&Key::generate(), A, tag), "another key");
        assert!(!verify(&key, "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c", tag));
        assert!(!verify(&key, A, &tag[..21]), "truncated");
        assert!(!verify(&key, A, &format!("{tag}A")), "extended");
        assert!(!verify(&key, A, ""));
        let mut flipped = tag.to_owned().into_bytes();
        flipped[0] = if flipped[0] == b'A' { b'B' } else { b'A' };
        assert!(!verify(&key, A, std::str::from_utf8(&flipped).unwrap()));
    }

    #[test]
    fn the_tag_is_the_documented_hmac() {
        // Fixed key and id: the first 16 bytes of HMAC-SHA256(key, context + id), base64url.
        let key = Key::parse(&"00".repeat(32)).unwrap();
        let mac = key.hmac(format!("leasegate-proxy-token\n{A}").as_bytes());
        let expected = URL_SAFE_NO_PAD.encode(&mac[..16]);
        assert_eq!(mint(&key, A), format!("{A}.{expected}"));
        assert_eq!(split(A), (A, None));
    }
}
