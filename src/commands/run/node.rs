//! Node's way to the proxy under `run`: a preload (`proxy_preload.cjs`) named in
//! `NODE_OPTIONS`, after what the child inherited there, that makes Node's own `fetch` and its
//! `http` and `https` agents tunnel through the proxy on every Node version (Node 20 reads no
//! proxy variable; 22 and 24 only with `NODE_USE_ENV_PROXY`, and then print an experimental
//! warning in every process).
//!
//! Invariant: the preload holds no credential (it reads the proxy variables the child is
//! given) and lives in a directory of this user's alone, removed when `run` ends.

use std::ffi::{OsStr, OsString};
use std::io::Write;
use std::path::PathBuf;

/// The preload's text. JavaScript, so that it runs inside the child's own Node.
const PRELOAD: &str = include_str!("proxy_preload.cjs");

/// The variable Node reads its extra command-line options from.
pub const NODE_OPTIONS: &str = "NODE_OPTIONS";

/// The preload written out, for as long as this is held.
pub struct NodePreload {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl NodePreload {
    /// Writes the preload into a new directory (mode 0700).
    pub fn write() -> std::io::Result<NodePreload> {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::Builder::new()
            .prefix("leasegate-node-")
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()?;
        let path = dir.path().join("proxy_preload.cjs");
        let mut file = std::fs::File::create(&path)?;
        file.write_all(PRELOAD.as_bytes())?;
        Ok(NodePreload { _dir: dir, path })
    }

    /// `NODE_OPTIONS` for the child: `inherited`, then `--require "<the preload>"`.
    pub fn node_options(&self, inherited: Option<&OsStr>) -> OsString {
        let mut options = OsString::new();
        if let Some(held) = inherited.filter(|held| !held.is_empty()) {
            options.push(held);
            options.push(" ");
        }
        options.push("--require ");
        options.push(quoted(self.path.as_os_str()));
        options
    }
}

/// `path` as one word of `NODE_OPTIONS`, which Node splits at spaces outside double quotes
/// and unescapes `\"` and `\\` inside them.
fn quoted(path: &OsStr) -> OsString {
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let mut bytes = vec![b'"'];
    for &byte in path.as_bytes() {
        if byte == b'"' || byte == b'\\' {
            bytes.push(b'\\');
        }
        bytes.push(byte);
    }
    bytes.push(b'"');
    OsString::from_vec(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preload_follows_what_the_child_inherited_and_is_quoted() {
        let preload = NodePreload::write().unwrap();
        assert_eq!(std::fs::read_to_string(&preload.path).unwrap(), PRELOAD);
        let shown = preload.path.display();
        assert_eq!(
            preload.node_options(None),
            OsString::from(format!("--require \"{shown}\""))
        );
        assert_eq!(
            preload.node_options(Some(OsStr::new("--max-old-space-size=512"))),
            OsString::from(format!("--max-old-space-size=512 --require \"{shown}\""))
        );
        assert_eq!(quoted(OsStr::new(r#"/a b/"c"\d"#)), r#""/a b/\"c\"\\d""#);
    }

    #[test]
    fn the_directory_is_this_users_alone_and_goes_with_the_preload() {
        use std::os::unix::fs::PermissionsExt;
        let preload = NodePreload::write().unwrap();
        let dir = preload.path.parent().unwrap().to_owned();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(preload);
        assert!(!dir.exists());
    }
}
