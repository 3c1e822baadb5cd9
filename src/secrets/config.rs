//! The secrets file: TOML read into typed structs, validated against
//! `schemas/secrets.schema.json` and then checked for what a schema cannot say.
//!
//! Invariant: a [`SecretsFile`] exists only for text that passed the schema and every semantic
//! check; every [`Problem`] names the secret (by id, or by its place when the id is itself
//! wrong) and the field, and never quotes a canary.

use super::route::Route;
use crate::contract::schema::Schema;
use crate::policy::pattern::HostPattern;
use jsonschema::error::ValidationErrorKind;
use serde::Deserialize;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use zeroize::Zeroizing;

/// The parsed file: the secrets (without their values) and the canaries.
#[derive(Debug)]
pub struct SecretsFile {
    pub secrets: Vec<SecretSpec>,
    pub canaries: Vec<Canary>,
}

/// One secret as configured; its value is loaded by [`super::store`].
#[derive(Debug, Clone)]
pub struct SecretSpec {
    /// A lower-case slug; part of every placeholder of the secret.
    pub id: String,
    /// The hosts it is for (never `*`), in the grammar of `allow.hosts`.
    pub hosts: Vec<HostPattern>,
    pub placement: Placement,
    /// What is sent: `before`, the value, `after` (`format` split at `{value}`).
    pub format: (String, String),
    pub source: Source,
    /// Requests that get it; empty: every request to its hosts.
    pub routes: Vec<Route>,
    /// Manifest `agent.name` values whose leases may use it.
    pub agents: Vec<String>,
    /// The variable `leasegate run` sets to the placeholder.
    pub env_name: String,
    /// Its hosts are a model API whose calls are metered against lease budgets.
    pub meter: Option<crate::meter::Api>,
}

/// Where the value goes in a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    Header(http::HeaderName),
    Query(String),
}

/// Where the value comes from, read at start and on reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// An environment variable of the proxy.
    Env(String),
    /// A file (an absolute path).
    File(PathBuf),
}

/// A decoy value: held zeroised, never shown.
pub struct Canary(Zeroizing<String>);

impl Canary {
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for Canary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Canary([redacted])")
    }
}

/// One thing wrong with the file, where it is and why, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub place: Place,
    pub why: String,
}

/// Where a [`Problem`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// The TOML does not parse (1-based line and column).
    Syntax { line: usize, column: usize },
    /// A top-level field (`canaries`, `secret`, or an unknown one); `item` is 1-based.
    Top { field: String, item: Option<usize> },
    /// A field of a secret: `id` when the secret's id is valid, else its 1-based number.
    Secret {
        number: usize,
        id: Option<String>,
        field: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.place {
            Place::Syntax { line, column } => write!(f, "line {line}, column {column}: "),
            Place::Top { field, item: None } => write!(f, "{field}: "),
            Place::Top {
                field,
                item: Some(n),
            } => write!(f, "{field} (item {n}): "),
            Place::Secret {
                id: Some(id),
                field,
                ..
            } => write!(f, "secret {id:?}, field {field}: "),
            Place::Secret {
                number,
                id: None,
                field,
            } => write!(f, "secret #{number}, field {field}: "),
        }?;
        f.write_str(&self.why)
    }
}

impl Problem {
    pub(crate) fn of_secret(spec: &SecretSpec, number: usize, field: &str, why: String) -> Problem {
        Problem {
            place: Place::Secret {
                number,
                id: Some(spec.id.clone()),
                field: field.to_owned(),
            },
            why,
        }
    }
}

/// Headers the proxy owns (framing, routing, its own credentials): a secret never replaces them.
const RESERVED_HEADERS: [&str; 12] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
    "proxy-authenticate",
    "x-lease-id",
];

/// Variables `leasegate run` sets itself (the proxy, the CA, the lease): a placeholder never
/// takes their place. Compared without case; `LEASEGATE_*` too.
const RESERVED_ENV: [&str; 14] = [
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "FTP_PROXY",
    "NODE_OPTIONS",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "GIT_SSL_CAINFO",
    "CURL_CA_BUNDLE",
    "JAVA_TOOL_OPTIONS",
    "PATH",
];

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    canaries: Vec<String>,
    #[serde(default)]
    secret: Vec<RawSecret>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSecret {
    id: String,
    hosts: Vec<String>,
    header: Option<String>,
    query: Option<String>,
    format: Option<String>,
    env: Option<String>,
    file: Option<String>,
    routes: Option<Vec<RawRoute>>,
    agents: Vec<String>,
    env_name: String,
    meter: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoute {
    method: String,
    path: String,
}

/// Reads the file's text: TOML, then the schema, then the semantic checks. Every problem found
/// at the first stage that fails is returned (none is ever printed with a canary in it).
pub fn parse(text: &str) -> Result<SecretsFile, Vec<Problem>> {
    let table: toml::Table = toml::from_str(text).map_err(|e| vec![syntax(text, &e)])?;
    let json = serde_json::to_value(&table).map_err(|e| {
        vec![Problem {
            place: Place::Top {
                field: "(file)".into(),
                item: None,
            },
            why: format!("not representable as JSON: {e}"),
        }]
    })?;
    drop(table);
    schema_problems(&json)?;
    let raw: RawFile = serde_json::from_value(json).map_err(|e| {
        // The schema admits only what these structs read; a difference is a bug, told in words.
        vec![Problem {
            place: Place::Top {
                field: "(file)".into(),
                item: None,
            },
            why: format!("does not match the expected structure: {e}"),
        }]
    })?;
    check(raw)
}

/// A TOML syntax error at its line and column, with the parser's words and without the quoted
/// source line (which may hold a canary).
fn syntax(text: &str, error: &toml::de::Error) -> Problem {
    let (line, column) = line_column(text, error);
    Problem {
        place: Place::Syntax { line, column },
        why: error.message().trim_end().to_owned(),
    }
}

/// Where in `text` a TOML error is: its 1-based line and column (in characters). Also the
/// price table's.
pub(crate) fn line_column(text: &str, error: &toml::de::Error) -> (usize, usize) {
    let at = error.span().map_or(0, |span| span.start).min(text.len());
    let before = &text.as_bytes()[..at];
    let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let column = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, column)
}

fn schema_problems(json: &Value) -> Result<(), Vec<Problem>> {
    let validator = Schema::Secrets.validator();
    if validator.is_valid(json) {
        return Ok(());
    }
    Err(validator
        .iter_errors(json)
        .map(|e| {
            let pointer = e.instance_path().to_string();
            let parts: Vec<&str> = pointer.split('/').skip(1).collect();
            let schema_path = e.schema_path().to_string();
            let (field, why) = words(&parts, e.kind(), &schema_path, || e.to_string());
            let place = match parts.as_slice() {
                ["secret", index, ..] if index.parse::<usize>().is_ok() => {
                    let index: usize = index.parse().unwrap_or_default();
                    Place::Secret {
                        number: index + 1,
                        id: json["secret"][index]["id"]
                            .as_str()
                            .filter(|id| is_slug(id))
                            .map(str::to_owned),
                        field,
                    }
                }
                [top, rest @ ..] => Place::Top {
                    field: (*top).to_owned(),
                    item: rest
                        .first()
                        .and_then(|i| i.parse::<usize>().ok())
                        .map(|i| i + 1),
                },
                [] => Place::Top { field, item: None },
            };
            Problem { place, why }
        })
        .collect())
}

/// The field a schema error is about and why, in words. `parts` is the instance path;
/// `fallback` is the validator's own message, used only where it cannot quote a canary.
fn words(
    parts: &[&str],
    kind: &ValidationErrorKind,
    schema_path: &str,
    fallback: impl FnOnce() -> String,
) -> (String, String) {
    // The field the error is inside: the one under a secret, or the top-level one.
    let inside = match parts {
        ["secret", _, field, ..] => Some(*field),
        ["secret", _] | [] => None,
        [field, ..] => Some(*field),
    };
    let in_secret = matches!(parts, ["secret", _, ..]);
    // Errors about an object name a field of it (missing, unexpected, one of two).
    let about: Option<(String, String)> = match kind {
        ValidationErrorKind::Required { property } => Some((
            property.as_str().unwrap_or("?").to_owned(),
            "is required".to_owned(),
        )),
        ValidationErrorKind::AdditionalProperties { unexpected } => Some((
            unexpected.join(", "),
            match in_secret || inside.is_some() {
                true => "is not a known field (a misspelling?)".to_owned(),
                false => {
                    "is not a top-level field: only `canaries` and [[secret]] tables".to_owned()
                }
            },
        )),
        ValidationErrorKind::OneOfNotValid { .. }
        | ValidationErrorKind::OneOfMultipleValid { .. }
            if schema_path.contains("allOf/0") =>
        {
            Some((
                "header/query".to_owned(),
                "give exactly one of `header` or `query` (where the value goes)".to_owned(),
            ))
        }
        ValidationErrorKind::OneOfNotValid { .. }
        | ValidationErrorKind::OneOfMultipleValid { .. } => Some((
            "env/file".to_owned(),
            "give exactly one of `env` or `file` (where the value comes from)".to_owned(),
        )),
        _ => None,
    };
    match (about, inside) {
        (Some((field, why)), None) => (field, why),
        (Some((sub, why)), Some(field)) => (field.to_owned(), format!("{sub} {why}")),
        (None, field) => {
            let why = match kind {
                ValidationErrorKind::Pattern { .. } => pattern_words(parts),
                _ if parts.first() == Some(&"canaries") => canary_words(kind),
                _ => fallback(),
            };
            (field.unwrap_or("(file)").to_owned(), why)
        }
    }
}

/// A pattern violation in words: a regular expression tells an operator nothing.
fn pattern_words(parts: &[&str]) -> String {
    match parts {
        ["secret", _, "id"] => {
            "must be a lower-case slug: letters, digits and single hyphens, e.g. \"github\"".into()
        }
        ["secret", _, "env" | "env_name"] => {
            "must be an environment variable name: letters, digits and _, not starting with a digit"
                .into()
        }
        ["secret", _, "file"] => "must be an absolute path".into(),
        ["secret", _, "query"] => "must be a parameter name: letters, digits and . _ ~ -".into(),
        ["secret", _, "routes", _, "method"] => {
            "must be an upper-case method such as GET, or *".into()
        }
        ["secret", _, "routes", _, "path"] => "must start with /".into(),
        _ => "is not in the expected form".into(),
    }
}

/// A canary's schema error, never quoting it.
fn canary_words(kind: &ValidationErrorKind) -> String {
    match kind {
        ValidationErrorKind::MinLength { limit } => format!(
            "is shorter than {limit} characters: a decoy that short would be found by chance"
        ),
        ValidationErrorKind::MaxLength { limit } => format!("is longer than {limit} characters"),
        ValidationErrorKind::MaxItems { limit } => format!("has more than {limit} canaries"),
        ValidationErrorKind::Type { .. } => "must be a list of strings".into(),
        _ => "is not valid".into(),
    }
}

fn is_slug(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 64
        && text.split('-').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        })
}

/// The checks a schema cannot express: host patterns, header names, formats, routes, and
/// uniqueness across secrets.
fn check(raw: RawFile) -> Result<SecretsFile, Vec<Problem>> {
    let mut problems = Vec::new();
    let mut secrets = Vec::with_capacity(raw.secret.len());
    let mut ids: HashSet<String> = HashSet::new();
    let mut env_names: HashMap<String, String> = HashMap::new();
    for (index, secret) in raw.secret.into_iter().enumerate() {
        let number = index + 1;
        let mut problem = |field: &str, why: String| {
            problems.push(Problem {
                place: Place::Secret {
                    number,
                    id: Some(secret.id.clone()),
                    field: field.to_owned(),
                },
                why,
            })
        };
        if !ids.insert(secret.id.clone()) {
            problem(
                "id",
                "is the id of an earlier secret too: ids are unique".into(),
            );
        }
        let env_key = secret.env_name.to_ascii_uppercase();
        if let Some(other) = env_names.insert(env_key.clone(), secret.id.clone()) {
            problem(
                "env_name",
                format!(
                    "{} is also the env_name of secret {other:?}",
                    secret.env_name
                ),
            );
        }
        if RESERVED_ENV.contains(&env_key.as_str()) || env_key.starts_with("LEASEGATE_") {
            problem(
                "env_name",
                format!(
                    "{} is a variable `leasegate run` sets itself (the proxy, the CA or the lease)",
                    secret.env_name
                ),
            );
        }
        let mut hosts = Vec::with_capacity(secret.hosts.len());
        for text in &secret.hosts {
            match HostPattern::parse(text) {
                Ok(HostPattern::Any) => problem(
                    "hosts",
                    "'*' would send the secret to every host: list the hosts it is for".into(),
                ),
                Ok(pattern) => hosts.push(pattern),
                Err(bad) => problem("hosts", format!("{bad}")),
            }
        }
        let placement = match (&secret.header, &secret.query) {
            (Some(name), None) => match http::HeaderName::from_bytes(name.as_bytes()) {
                Ok(header) if RESERVED_HEADERS.contains(&header.as_str()) => {
                    problem(
                        "header",
                        format!("{name:?} is a header the proxy sets or reads itself"),
                    );
                    None
                }
                Ok(header) => Some(Placement::Header(header)),
                Err(_) => {
                    problem(
                        "header",
                        format!("{name:?} is not a header name (letters, digits and -, no spaces)"),
                    );
                    None
                }
            },
            (None, Some(param)) => Some(Placement::Query(param.clone())),
            // The schema's oneOf refuses both and neither.
            _ => None,
        };
        let format_text = secret.format.as_deref().unwrap_or("{value}");
        let format = match format_text.split("{value}").collect::<Vec<_>>().as_slice() {
            [before, after] if format_text.bytes().all(|b| (0x20..0x7f).contains(&b)) => {
                Some(((*before).to_owned(), (*after).to_owned()))
            }
            [_, _] => {
                problem(
                    "format",
                    "holds a character that is not printable ASCII: a header value could not carry it"
                        .into(),
                );
                None
            }
            parts => {
                problem(
                    "format",
                    format!(
                        "{format_text:?} must contain {{value}} exactly once (it has {})",
                        parts.len() - 1
                    ),
                );
                None
            }
        };
        let source = match (&secret.env, &secret.file) {
            (Some(name), None) => Some(Source::Env(name.clone())),
            (None, Some(path)) => Some(Source::File(path.into())),
            _ => None,
        };
        let mut routes = Vec::new();
        for rule in secret.routes.iter().flatten() {
            match Route::parse(&rule.method, &rule.path) {
                Ok(route) => routes.push(route),
                Err(why) => problem("routes", why),
            }
        }
        // The schema holds `meter` to the names this parse knows.
        let meter = secret.meter.as_deref().and_then(|name| name.parse().ok());
        if let (Some(placement), Some(format), Some(source)) = (placement, format, source) {
            secrets.push(SecretSpec {
                id: secret.id,
                hosts,
                placement,
                format,
                source,
                routes,
                agents: secret.agents,
                env_name: secret.env_name,
                meter,
            });
        }
    }
    match problems.is_empty() {
        true => Ok(SecretsFile {
            secrets,
            canaries: raw
                .canaries
                .into_iter()
                .map(|c| Canary(Zeroizing::new(c)))
                .collect(),
        }),
        false => Err(problems),
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
