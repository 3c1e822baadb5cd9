//! The JSON Schemas leasegate validates against (the contract's, and the secrets file's),
//! embedded in the binary and compiled once.
//!
//! Invariant: a value is schema-valid only if the compiled validator says so; the schemas are
//! ours (`schemas/`), with the published contract's constraints.

use serde_json::Value;
use std::sync::LazyLock;

/// One schema violation: where in the instance, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct SchemaIssue {
    /// JSON Pointer into the validated value ("" for the root).
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for SchemaIssue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.path.is_empty() {
            "/"
        } else {
            &self.path
        };
        write!(f, "{path}: {}", self.message)
    }
}

/// The schemas we validate against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    Lease,
    Manifest,
    Record,
    EgressEvent,
    /// The secrets file (`serve --secrets`), parsed from TOML.
    Secrets,
}

const LEASE: &str = include_str!("../../schemas/agent-lease.schema.json");
const MANIFEST: &str = include_str!("../../schemas/agent-lease-manifest.schema.json");
const RECORD: &str = include_str!("../../schemas/lease-record.schema.json");
const EGRESS: &str = include_str!("../../schemas/egress-event.schema.json");
const SECRETS: &str = include_str!("../../schemas/secrets.schema.json");

fn compile(text: &str) -> jsonschema::Validator {
    let schema: Value = serde_json::from_str(text).expect("embedded schema is JSON");
    jsonschema::draft7::new(&schema).expect("embedded schema compiles")
}

static VALIDATORS: LazyLock<[jsonschema::Validator; 5]> = LazyLock::new(|| {
    [
        compile(LEASE),
        compile(MANIFEST),
        compile(RECORD),
        compile(EGRESS),
        compile(SECRETS),
    ]
});

impl Schema {
    /// The compiled validator, for a caller that words its own messages from the error kinds.
    pub fn validator(self) -> &'static jsonschema::Validator {
        &VALIDATORS[self as usize]
    }

    pub fn is_valid(self, instance: &Value) -> bool {
        self.validator().is_valid(instance)
    }

    /// Every violation, or `Ok` if there is none.
    pub fn validate(self, instance: &Value) -> Result<(), Vec<SchemaIssue>> {
        let validator = self.validator();
        if validator.is_valid(instance) {
            return Ok(());
        }
        Err(validator
            .iter_errors(instance)
            .map(|e| {
                let path = e.instance_path().to_string();
                let message = match e.kind() {
                    jsonschema::error::ValidationErrorKind::Pattern { .. } => {
                        pattern_words(&path, e.instance())
                    }
                    _ => e.to_string(),
                };
                SchemaIssue { path, message }
            })
            .collect())
    }
}

/// A pattern violation in words: a regular expression tells a user nothing.
fn pattern_words(path: &str, instance: &Value) -> String {
    let text = match instance.as_str() {
        Some(text) => text,
        None => return "not in the expected form".to_owned(),
    };
    if path.contains("/hosts/") {
        let why = match crate::policy::pattern::HostPattern::parse(text) {
            Err(bad) => bad.why,
            Ok(_) => "a host pattern is written in lower case".to_owned(),
        };
        return format!("{text:?} is not a host pattern: {why}");
    }
    format!("{text:?} is not in the expected form")
}

/// Major version of a `schema_version` string ("1.2" → 1).
pub fn major_version(value: &Value) -> Option<u64> {
    value
        .get("schema_version")?
        .as_str()?
        .split_once('.')?
        .0
        .parse()
        .ok()
}

/// The schema-set major version this reader knows.
pub const KNOWN_MAJOR: u64 = 1;
/// The schema-set version we write.
pub const WRITTEN_VERSION: &str = "1.2";
