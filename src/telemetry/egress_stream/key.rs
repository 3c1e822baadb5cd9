//! The key the replicas and `usage` share (`--egress-stream-key FILE`): every egress stream
//! message carries a MAC under it, so only its holders can write lines that count.
//!
//! Invariants: the key is at least [`MIN_KEY_BYTES`] random bytes, lives in memory that is
//! zeroised when dropped, and is never printed; a key file others could read is refused.

use std::path::Path;
use std::sync::Arc;
use zeroize::Zeroizing;

/// The shortest key taken: an HMAC-SHA256 key of less would be weaker than the MAC.
pub const MIN_KEY_BYTES: usize = 32;

/// The bytes [`EgressKey::generate_text`] writes.
const NEW_KEY_BYTES: usize = 32;

/// A key file is one line; anything longer is not one.
const MAX_FILE_BYTES: u64 = 4096;

/// How to make a key, for error messages and help.
pub const HOW_TO_MAKE: &str =
    "make one with `leasegate keygen --egress-stream --out FILE` and give every replica and `usage` the same file";

/// The shared key (cheap to clone; zeroised when the last clone drops).
#[derive(Clone)]
pub struct EgressKey(Arc<Zeroizing<Vec<u8>>>);

impl std::fmt::Debug for EgressKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EgressKey([redacted])")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("--egress-stream-key {path}: {error}")]
    Io { path: String, error: std::io::Error },
    #[error(
        "--egress-stream-key {path}: readable by group or others (mode {mode:o}); \
         `chmod 600 {path}`, and make a new key if others may have read it"
    )]
    Exposed { path: String, mode: u32 },
    #[error(
        "--egress-stream-key {path}: expected one line of hex or base64 text \
         holding at least {MIN_KEY_BYTES} random bytes; {HOW_TO_MAKE}"
    )]
    Malformed { path: String },
}

impl EgressKey {
    /// A key from its bytes; `None` when shorter than [`MIN_KEY_BYTES`].
    pub fn from_bytes(bytes: &[u8]) -> Option<EgressKey> {
        (bytes.len() >= MIN_KEY_BYTES).then(|| EgressKey(Arc::new(Zeroizing::new(bytes.to_vec()))))
    }

    /// Reads a key file: one line of hex (an even number of hex digits) or of base64
    /// (standard alphabet, padded or not); refused when group or others may read it.
    pub fn load(path: &Path) -> Result<EgressKey, KeyFileError> {
        use std::io::Read;
        use std::os::unix::fs::PermissionsExt;
        let shown = || path.display().to_string();
        let io = |error| KeyFileError::Io {
            path: shown(),
            error,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let mode = file.metadata().map_err(io)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(KeyFileError::Exposed {
                path: shown(),
                mode: mode & 0o777,
            });
        }
        let mut text = Zeroizing::new(Vec::new());
        file.take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut text)
            .map_err(io)?;
        let malformed = || KeyFileError::Malformed { path: shown() };
        if text.len() as u64 > MAX_FILE_BYTES {
            return Err(malformed());
        }
        let bytes = decode(text.trim_ascii()).ok_or_else(malformed)?;
        EgressKey::from_bytes(&bytes).ok_or_else(malformed)
    }

    /// A new key file's text: 32 random bytes as hex, and a newline.
    pub fn generate_text() -> Zeroizing<String> {
        let mut bytes = Zeroizing::new([0u8; NEW_KEY_BYTES]);
        rand::fill(&mut bytes[..]);
        let mut text = Zeroizing::new(hex::encode(&bytes[..]));
        text.push('\n');
        text
    }

    /// Writes a new key file (mode 0600); refuses to overwrite one.
    pub fn write_new(path: &Path) -> std::io::Result<()> {
        crate::durable::create_new(path, 0o600, EgressKey::generate_text().as_bytes())
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

/// Hex when every character is a hex digit and there is an even number of them, base64
/// otherwise; `None` for anything else (a second line included).
fn decode(text: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    use base64::Engine;
    if text.len() % 2 == 0 && text.iter().all(u8::is_ascii_hexdigit) {
        return hex::decode(text).ok().map(Zeroizing::new);
    }
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    engine.decode(text).ok().map(Zeroizing::new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(dir: &Path, name: &str, text: &str, mode: u32) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path
    }

    #[test]
    fn a_key_file_is_hex_or_base64_of_32_bytes_or_more_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let hex32 = "ab".repeat(32);
        let key = EgressKey::load(&file(dir.path(), "hex", &format!("{hex32}\n"), 0o600)).unwrap();
        assert_eq!(key.bytes(), [0xab; 32]);
        let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 40]);
        let key = EgressKey::load(&file(dir.path(), "b64", &b64, 0o400)).unwrap();
        assert_eq!(key.bytes(), [7; 40]);
        let unpadded = b64.trim_end_matches('=');
        assert_eq!(
            EgressKey::load(&file(dir.path(), "b64u", unpadded, 0o600))
                .unwrap()
                .bytes(),
            [7; 40]
        );

        let short = file(dir.path(), "short", &"ab".repeat(31), 0o600);
        let two_lines = file(dir.path(), "two", &format!("{hex32}\n{hex32}\n"), 0o600);
        let garbage = file(dir.path(), "garbage", "not a key at all!", 0o600);
        let empty = file(dir.path(), "empty", "", 0o600);
        for path in [short, two_lines, garbage, empty] {
            let error = EgressKey::load(&path).unwrap_err();
            assert!(matches!(error, KeyFileError::Malformed { .. }), "{error}");
            assert!(error
                .to_string()
                .contains("leasegate keygen --egress-stream"));
        }
        let exposed = file(dir.path(), "exposed", &hex32, 0o640);
        let error = EgressKey::load(&exposed).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("readable by group or others (mode 640)"),
            "{error}"
        );
        let error = EgressKey::load(&dir.path().join("missing")).unwrap_err();
        assert!(matches!(error, KeyFileError::Io { .. }), "{error}");
    }

    #[test]
    fn a_new_key_file_is_private_and_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("egress.key");
        EgressKey::write_new(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(EgressKey::load(&path).unwrap().bytes().len(), 32);
        assert!(EgressKey::write_new(&path).is_err(), "overwrote a key");
        assert_ne!(*EgressKey::generate_text(), *EgressKey::generate_text());
        assert_eq!(
            format!("{:?}", EgressKey::load(&path).unwrap()),
            "EgressKey([redacted])"
        );
    }
}
