//! The loaded secrets: each secret's value read from its source, the canaries, and one
//! automaton that finds any of them in a byte slice.
//!
//! Invariant: [`Secrets`] always holds a whole set that loaded without a problem; a reload that
//! fails leaves the set in use untouched and returns why. A value is read into zeroised memory
//! that is never reallocated, and no `Debug`, `Display` or error shows one.

use super::config::{self, Canary, Place, Problem, SecretSpec, Source};
use aho_corasick::AhoCorasick;
use arc_swap::ArcSwap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zeroize::Zeroizing;

/// The largest secrets file read (it holds no values, only where they are and canaries).
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// The largest value a secret's file or variable may hold.
pub const MAX_VALUE_BYTES: usize = 16 * 1024;
/// The shortest value: a shorter one would be found by chance in ordinary traffic.
pub const MIN_VALUE_BYTES: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error("cannot read the secrets file {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("the secrets file {path} is larger than {MAX_FILE_BYTES} bytes")]
    TooLarge { path: String },
    #[error("the secrets file {path} cannot be used: {why}")]
    Refused { path: String, why: String },
    #[error("the secrets file {path} is not valid:{}", list(.problems))]
    Invalid {
        path: String,
        problems: Vec<Problem>,
    },
}

fn list(problems: &[Problem]) -> String {
    problems.iter().map(|p| format!("\n  {p}")).collect()
}

/// The secrets in use, swapped whole by [`Secrets::reload`].
pub struct Secrets {
    /// The file read at start and on every reload.
    path: PathBuf,
    current: ArcSwap<SecretSet>,
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secrets")
            .field("path", &self.path)
            .field("current", &self.current.load())
            .finish()
    }
}

/// One loaded set: secrets with their values, canaries, and the finder over all of them.
pub struct SecretSet {
    secrets: Vec<Secret>,
    canaries: Vec<Canary>,
    /// Patterns 0..secrets.len() are the values, the rest the canaries; `None`: nothing to find.
    finder: Option<AhoCorasick>,
}

impl fmt::Debug for SecretSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretSet")
            .field("secrets", &self.secrets)
            .field("canaries", &self.canaries.len())
            .finish()
    }
}

/// A secret and its value.
pub struct Secret {
    spec: SecretSpec,
    value: Zeroizing<String>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secret")
            .field("spec", &self.spec)
            .field("value", &"[redacted]")
            .finish()
    }
}

impl Secret {
    pub fn spec(&self) -> &SecretSpec {
        &self.spec
    }

    /// What the proxy puts in the request: the format with the value in its place.
    pub fn rendered(&self) -> Zeroizing<String> {
        let (before, after) = &self.spec.format;
        let mut text = Zeroizing::new(String::with_capacity(
            before.len() + self.value.len() + after.len(),
        ));
        text.push_str(before);
        text.push_str(&self.value);
        text.push_str(after);
        text
    }
}

/// What [`SecretSet::find_exact`] found: which secret's value, or which canary (by its place
/// in the file, from 1), never the bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hit {
    Secret { id: String },
    Canary { number: usize },
}

impl SecretSet {
    pub fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    pub fn get(&self, id: &str) -> Option<&Secret> {
        self.secrets.iter().find(|s| s.spec.id == id)
    }

    pub fn canary_count(&self) -> usize {
        self.canaries.len()
    }

    /// Where the leftmost value or canary in `bytes` is (start, end), exactly as
    /// [`SecretSet::find_exact`] finds it.
    pub(super) fn find_span(&self, bytes: &[u8]) -> Option<(usize, usize)> {
        let found = self.finder.as_ref()?.find(bytes)?;
        Some((found.start(), found.end()))
    }

    /// Whether `bytes` holds any secret's value or any canary, exactly (byte for byte, no
    /// decoding): the first found, leftmost.
    pub fn find_exact(&self, bytes: &[u8]) -> Option<Hit> {
        let found = self.finder.as_ref()?.find(bytes)?;
        let index = found.pattern().as_usize();
        Some(match self.secrets.get(index) {
            Some(secret) => Hit::Secret {
                id: secret.spec.id.clone(),
            },
            None => Hit::Canary {
                number: index - self.secrets.len() + 1,
            },
        })
    }
}

#[cfg(test)]
impl SecretSet {
    /// The set a secrets file of `text` loads, every value it names being `value`.
    pub(crate) fn for_tests(text: &str, value: &str) -> Arc<SecretSet> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secrets.toml");
        std::fs::write(&path, text).unwrap();
        Secrets::load_with(&path, &|_| Some(value.to_owned()))
            .unwrap()
            .current()
    }
}

impl Secrets {
    /// Reads `path` and every value it names (environment variables of this process, files).
    pub fn load(path: &Path) -> Result<Secrets, SecretsError> {
        Secrets::load_with(path, &|name| std::env::var(name).ok())
    }

    /// [`Secrets::load`] with `env` in place of the process's environment.
    pub fn load_with(
        path: &Path,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Secrets, SecretsError> {
        Ok(Secrets {
            path: path.to_owned(),
            current: ArcSwap::from_pointee(read_set(path, env)?),
        })
    }

    /// Reads the file and its values again and swaps the new set in whole; on any problem the
    /// set in use stays and the error says why (SIGHUP).
    pub fn reload(&self) -> Result<(), SecretsError> {
        self.reload_with(&|name| std::env::var(name).ok())
    }

    pub fn reload_with(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), SecretsError> {
        self.reload_checked(env, &|_| Ok(()))
    }

    /// [`Secrets::reload_with`], swapping the new set in only if `accept` takes it.
    pub fn reload_checked(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
        accept: &dyn Fn(&SecretSet) -> Result<(), String>,
    ) -> Result<(), SecretsError> {
        let set = read_set(&self.path, env)?;
        accept(&set).map_err(|why| SecretsError::Refused {
            path: self.path.display().to_string(),
            why,
        })?;
        self.current.store(Arc::new(set));
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The set in use now (a reload after this call does not change it).
    pub fn current(&self) -> Arc<SecretSet> {
        self.current.load_full()
    }

    /// [`SecretSet::find_exact`] on the set in use.
    pub fn find_exact(&self, bytes: &[u8]) -> Option<Hit> {
        self.current.load().find_exact(bytes)
    }
}

fn read_set(path: &Path, env: &dyn Fn(&str) -> Option<String>) -> Result<SecretSet, SecretsError> {
    let shown = path.display().to_string();
    let text = read_file_text(path).map_err(|e| match e {
        Bounded::Io(error) => SecretsError::Read {
            path: shown.clone(),
            error,
        },
        Bounded::TooLarge => SecretsError::TooLarge {
            path: shown.clone(),
        },
    })?;
    let invalid = |problems| SecretsError::Invalid {
        path: shown.clone(),
        problems,
    };
    let file = config::parse(&text).map_err(invalid)?;
    let mut problems = Vec::new();
    let mut secrets = Vec::with_capacity(file.secrets.len());
    for (index, spec) in file.secrets.into_iter().enumerate() {
        match read_value(&spec.source, env) {
            Ok(value) => secrets.push(Secret { spec, value }),
            Err(why) => {
                let field = match spec.source {
                    Source::Env(_) => "env",
                    Source::File(_) => "file",
                };
                problems.push(Problem::of_secret(&spec, index + 1, field, why));
            }
        }
    }
    for (index, canary) in file.canaries.iter().enumerate() {
        if let Some(secret) = secrets
            .iter()
            .find(|s| s.value.as_bytes() == canary.as_bytes())
        {
            problems.push(Problem {
                place: Place::Top {
                    field: "canaries".into(),
                    item: Some(index + 1),
                },
                why: format!(
                    "is the value of secret {:?}: a canary is a decoy, never a real value",
                    secret.spec.id
                ),
            });
        }
    }
    if !problems.is_empty() {
        return Err(invalid(problems));
    }
    let patterns: Vec<&[u8]> = secrets
        .iter()
        .map(|s| s.value.as_bytes())
        .chain(file.canaries.iter().map(Canary::as_bytes))
        .collect();
    let finder = match patterns.is_empty() {
        true => None,
        false => Some(AhoCorasick::new(&patterns).map_err(|e| {
            invalid(vec![Problem {
                place: Place::Top {
                    field: "(file)".into(),
                    item: None,
                },
                why: format!("the values and canaries are too many to search at once: {e}"),
            }])
        })?),
    };
    Ok(SecretSet {
        secrets,
        canaries: file.canaries,
        finder,
    })
}

enum Bounded {
    Io(std::io::Error),
    TooLarge,
}

/// The secrets file's text, in zeroised memory (it holds the canaries).
fn read_file_text(path: &Path) -> Result<Zeroizing<String>, Bounded> {
    let file = std::fs::File::open(path).map_err(Bounded::Io)?;
    let mut bytes = Zeroizing::new(Vec::new());
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(Bounded::Io)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(Bounded::TooLarge);
    }
    let text = String::from_utf8(std::mem::take(&mut *bytes)).map_err(|e| {
        let _wiped = Zeroizing::new(e.into_bytes());
        Bounded::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "the file is not UTF-8",
        ))
    })?;
    Ok(Zeroizing::new(text))
}

/// A secret's value from its source, checked; the error says why in words, never the value.
fn read_value(
    source: &Source,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Zeroizing<String>, String> {
    let value = match source {
        Source::Env(name) => match env(name) {
            Some(value) => Zeroizing::new(value),
            None => {
                return Err(format!(
                    "the environment variable {name} is not set (or is not UTF-8) in the proxy's environment"
                ))
            }
        },
        Source::File(path) => read_value_file(path)?,
    };
    check_value(&value)?;
    Ok(value)
}

/// A value file: at most [`MAX_VALUE_BYTES`] into a buffer allocated once (never copied by a
/// reallocation), one trailing newline dropped.
fn read_value_file(path: &Path) -> Result<Zeroizing<String>, String> {
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read {shown}: {e}"))?;
    let mut bytes = Zeroizing::new(Vec::with_capacity(MAX_VALUE_BYTES + 1));
    file.take(MAX_VALUE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {shown}: {e}"))?;
    if bytes.len() > MAX_VALUE_BYTES {
        return Err(format!("{shown} is larger than {MAX_VALUE_BYTES} bytes"));
    }
    if bytes.ends_with(b"\n") {
        bytes.pop();
        if bytes.ends_with(b"\r") {
            bytes.pop();
        }
    }
    match String::from_utf8(std::mem::take(&mut *bytes)) {
        Ok(text) => Ok(Zeroizing::new(text)),
        Err(e) => {
            let _wiped = Zeroizing::new(e.into_bytes());
            Err(format!("{shown} is not UTF-8"))
        }
    }
}

/// A value goes into a header or a query as it is: printable ASCII without spaces, of a
/// length that is not found by chance.
fn check_value(value: &str) -> Result<(), String> {
    if value.is_empty() {
        return Err("the value is empty".into());
    }
    if value.len() > MAX_VALUE_BYTES {
        return Err(format!("the value is longer than {MAX_VALUE_BYTES} bytes"));
    }
    if value.len() < MIN_VALUE_BYTES {
        return Err(format!(
            "the value is shorter than {MIN_VALUE_BYTES} bytes: that short, it would be found by chance in ordinary traffic"
        ));
    }
    if let Some(at) = value.bytes().position(|b| !(0x21..0x7f).contains(&b)) {
        return Err(format!(
            "the value holds a space, control or non-ASCII byte (at byte {}): it must be printable ASCII",
            at + 1
        ));
    }
    Ok(())
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
