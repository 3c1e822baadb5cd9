//! What `run`'s child could reach besides what it is given: `run`'s own process, the
//! descriptors `run` inherited, and operator credentials named in the environment.
//!
//! Invariant: before the child starts, `run` is not dumpable (so a child of the same user can
//! neither read `/proc/<run>/environ`, `mem` or `fd/` nor ptrace it: the kernel then treats
//! `run` as another user's), every descriptor above stderr is close-on-exec (the child gets
//! stdin, stdout and stderr only), and no operator credential that the environment names —
//! the signing key, the admin token, the egress stream key, NATS credentials, a TLS or CA
//! private key — is readable by this user: if one is, the child would be too, and `run`
//! refuses to start it. The `LEASEGATE_*` variables themselves never reach the child.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

/// The variables naming an operator's credential files (some hold lists, comma-separated)
/// and, for `LEASEGATE_CA_DIR`, a directory holding one (`ca-key.pem`).
const CREDENTIAL_VARS: [(&str, Holds); 6] = [
    ("LEASEGATE_KEY_FILE", Holds::Files),
    ("LEASEGATE_ADMIN_TOKEN_FILE", Holds::Files),
    ("LEASEGATE_EGRESS_STREAM_KEY", Holds::Files),
    ("LEASEGATE_NATS_CREDS", Holds::Files),
    ("LEASEGATE_TLS_KEY", Holds::Files),
    ("LEASEGATE_CA_DIR", Holds::CaDir),
];

#[derive(Debug, Clone, Copy)]
enum Holds {
    Files,
    CaDir,
}

/// An operator credential the child could read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readable {
    pub var: &'static str,
    pub path: PathBuf,
}

/// The operator credentials `vars` (name, value) name that this process can read; the child,
/// the same user, could read them too.
pub fn readable_credentials(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<Readable> {
    let mut found = Vec::new();
    for (name, value) in vars {
        let Some(&(var, holds)) = CREDENTIAL_VARS.iter().find(|(var, _)| name == *var) else {
            continue;
        };
        let value = value.to_string_lossy().into_owned();
        for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let path = match holds {
                Holds::Files => PathBuf::from(part),
                Holds::CaDir => Path::new(part).join("ca-key.pem"),
            };
            if std::fs::File::open(&path).is_ok() {
                found.push(Readable { var, path });
            }
        }
    }
    found
}

/// Whether an inherited variable is one of leasegate's own settings (never passed on).
pub fn is_leasegate_setting(name: &OsStr) -> bool {
    name.to_string_lossy().starts_with("LEASEGATE_")
}

/// Closes `run` off from its child: not dumpable, and every descriptor above stderr
/// close-on-exec (set by the `close_fds` crate, then checked in `/proc/self/fdinfo`). An error
/// here stops the start: the child would reach more than it may.
pub fn seal_off() -> std::io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(std::io::Error::from)?;
    close_fds::set_fds_cloexec_threadsafe(3, &[]);
    match inheritable_descriptors()?.first() {
        None => Ok(()),
        Some(fd) => Err(std::io::Error::other(format!(
            "descriptor {fd} would be inherited by the child and cannot be made close-on-exec"
        ))),
    }
}

/// The descriptors above stderr that a child would inherit (not close-on-exec), as
/// `/proc/self/fdinfo` lists them.
pub fn inheritable_descriptors() -> std::io::Result<Vec<i32>> {
    /// `O_CLOEXEC` as fdinfo's octal `flags` shows it (Linux).
    const O_CLOEXEC: u32 = 0o2000000;
    let mut open = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fdinfo")? {
        let entry = entry?;
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if fd <= 2 {
            continue;
        }
        // The directory's own descriptor is gone by the time it is read: not inherited.
        let Ok(info) = std::fs::read_to_string(entry.path()) else {
            continue;
        };
        let flags = info
            .lines()
            .find_map(|line| line.strip_prefix("flags:"))
            .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok());
        match flags {
            Some(flags) if flags & O_CLOEXEC != 0 => {}
            _ => open.push(fd),
        }
    }
    Ok(open)
}
