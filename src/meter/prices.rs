//! The price table (`serve --prices FILE`): TOML, validated against
//! `schemas/prices.schema.json`, that gives each model's price per million tokens.
//!
//! Invariant: a [`Prices`] exists only for a file that passed the schema and the checks a
//! schema cannot make (no name twice, finite prices); a model matches its exact name first,
//! else the longest `prefix*` pattern, so the order of the entries never matters; a model that
//! matches nothing has no cost (`None`, "unpriced"), never a cost of zero.

use super::Usage;
use jsonschema::error::ValidationErrorKind;
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

const SCHEMA: &str = include_str!("../../schemas/prices.schema.json");

// Compiled here rather than in `contract::schema`: the price table is the meter's own file, not
// part of the lease contract.
static VALIDATOR: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
    let schema: Value = serde_json::from_str(SCHEMA).expect("embedded schema is JSON");
    jsonschema::draft7::new(&schema).expect("embedded schema compiles")
});

/// One model's prices, in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input: f64,
    pub output: f64,
    /// Input tokens read from the cache (the input price when the file gives none).
    pub cached_input: f64,
}

impl Price {
    /// What `usage` costs at these prices, in US dollars.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let uncached = usage.input.saturating_sub(usage.cached) as f64;
        (uncached * self.input
            + usage.cached as f64 * self.cached_input
            + usage.output as f64 * self.output)
            / 1e6
    }
}

/// The loaded table.
#[derive(Debug, Clone, Default)]
pub struct Prices {
    exact: HashMap<String, Price>,
    /// `prefix*` patterns, longest prefix first.
    prefixes: Vec<(String, Price)>,
}

/// One thing wrong with the file: where, and why in words.
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
    /// The file as a whole, or a top-level field.
    Top { field: String },
    /// A field of a `[[model]]` entry: its 1-based number, and its name when it has one.
    Model {
        number: usize,
        name: Option<String>,
        field: String,
    },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.place {
            Place::Syntax { line, column } => write!(f, "line {line}, column {column}: "),
            Place::Top { field } => write!(f, "{field}: "),
            Place::Model {
                number,
                name: Some(name),
                field,
            } => write!(f, "model #{number} ({name:?}), field {field}: "),
            Place::Model {
                number,
                name: None,
                field,
            } => write!(f, "model #{number}, field {field}: "),
        }?;
        f.write_str(&self.why)
    }
}

/// Why a price table was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum PricesError {
    #[error("cannot read the price table {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the price table {} is not valid:{}", path.display(), list(problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

fn list(problems: &[Problem]) -> String {
    problems.iter().map(|p| format!("\n  {p}")).collect()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    model: Vec<RawModel>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    input_per_million: f64,
    output_per_million: f64,
    cached_input_per_million: Option<f64>,
}

impl Prices {
    /// Reads and checks the file at `path`.
    pub fn load(path: &Path) -> Result<Prices, PricesError> {
        let text = std::fs::read_to_string(path).map_err(|source| PricesError::Read {
            path: path.to_owned(),
            source,
        })?;
        Prices::parse(&text).map_err(|problems| PricesError::Invalid {
            path: path.to_owned(),
            problems,
        })
    }

    /// Reads a table from its text: TOML, then the schema, then the checks; every problem of
    /// the first stage that fails is returned.
    pub fn parse(text: &str) -> Result<Prices, Vec<Problem>> {
        let table: toml::Table = toml::from_str(text).map_err(|e| vec![syntax(text, &e)])?;
        let top = |why: String| {
            vec![Problem {
                place: Place::Top {
                    field: "(file)".into(),
                },
                why,
            }]
        };
        let json = serde_json::to_value(&table)
            .map_err(|e| top(format!("not representable as JSON: {e}")))?;
        schema_problems(&json)?;
        let raw: RawFile = serde_json::from_value(json)
            // The schema admits only what these structs read; a difference is a bug, told in words.
            .map_err(|e| top(format!("does not match the expected structure: {e}")))?;
        check(raw)
    }

    /// The prices of `model`: its exact entry, else the longest matching pattern.
    pub fn price(&self, model: &str) -> Option<&Price> {
        self.exact.get(model).or_else(|| {
            self.prefixes
                .iter()
                .find(|(prefix, _)| model.starts_with(prefix.as_str()))
                .map(|(_, price)| price)
        })
    }

    /// What `usage` cost in US dollars; `None` ("unpriced") when its model is not known or not
    /// in the table.
    pub fn cost(&self, usage: &Usage) -> Option<f64> {
        let model = usage.model.as_deref()?;
        self.price(model).map(|price| price.cost(usage))
    }

    /// How many entries the table has.
    pub fn len(&self) -> usize {
        self.exact.len() + self.prefixes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A TOML syntax error at its line and column, with the parser's words.
fn syntax(text: &str, error: &toml::de::Error) -> Problem {
    let (line, column) = crate::secrets::config::line_column(text, error);
    Problem {
        place: Place::Syntax { line, column },
        why: error.message().trim_end().to_owned(),
    }
}

fn schema_problems(json: &Value) -> Result<(), Vec<Problem>> {
    if VALIDATOR.is_valid(json) {
        return Ok(());
    }
    Err(VALIDATOR
        .iter_errors(json)
        .map(|e| {
            let pointer = e.instance_path().to_string();
            let parts: Vec<&str> = pointer.split('/').skip(1).collect();
            let (named, why) = words(e.kind(), || e.to_string());
            let place = match parts.as_slice() {
                ["model", index, rest @ ..] if index.parse::<usize>().is_ok() => {
                    let index: usize = index.parse().unwrap_or_default();
                    Place::Model {
                        number: index + 1,
                        name: json["model"][index]["name"]
                            .as_str()
                            .map(|name| name.chars().take(256).collect()),
                        field: named
                            .unwrap_or_else(|| rest.first().map_or("(entry)", |f| *f).to_owned()),
                    }
                }
                [field, ..] => Place::Top {
                    field: (*field).to_owned(),
                },
                [] => Place::Top {
                    field: named.unwrap_or_else(|| "(file)".to_owned()),
                },
            };
            Problem { place, why }
        })
        .collect())
}

/// The field a schema error names (a missing or unknown one), and why, in words.
fn words(
    kind: &ValidationErrorKind,
    fallback: impl FnOnce() -> String,
) -> (Option<String>, String) {
    match kind {
        ValidationErrorKind::Required { property } => (
            Some(property.as_str().unwrap_or("?").to_owned()),
            "is required".to_owned(),
        ),
        ValidationErrorKind::AdditionalProperties { unexpected } => (
            Some(unexpected.join(", ")),
            "is not a known field (a misspelling?); a table has `name`, `input_per_million`, \
             `output_per_million` and `cached_input_per_million`, the file only [[model]] tables"
                .to_owned(),
        ),
        ValidationErrorKind::Minimum { .. } => (None, "must not be negative".to_owned()),
        ValidationErrorKind::Maximum { limit } => (None, format!("must be at most {limit}")),
        ValidationErrorKind::Pattern { .. } => (
            None,
            "may hold `*` only once, at its end (`gpt-4o-mini*`)".to_owned(),
        ),
        ValidationErrorKind::MinLength { .. } => (None, "must not be empty".to_owned()),
        ValidationErrorKind::MaxLength { limit } => {
            (None, format!("is longer than {limit} characters"))
        }
        ValidationErrorKind::Type { .. } => (None, format!("has the wrong type: {}", fallback())),
        _ => (None, fallback()),
    }
}

/// The checks a schema cannot make: a name given twice, and prices that are not finite.
fn check(raw: RawFile) -> Result<Prices, Vec<Problem>> {
    let mut problems = Vec::new();
    let mut prices = Prices::default();
    let mut first: HashMap<String, usize> = HashMap::new();
    for (index, model) in raw.model.into_iter().enumerate() {
        let number = index + 1;
        let mut problem = |field: &str, why: String| {
            problems.push(Problem {
                place: Place::Model {
                    number,
                    name: Some(model.name.clone()),
                    field: field.to_owned(),
                },
                why,
            })
        };
        let price = Price {
            input: model.input_per_million,
            output: model.output_per_million,
            cached_input: model
                .cached_input_per_million
                .unwrap_or(model.input_per_million),
        };
        for (field, value) in [
            ("input_per_million", price.input),
            ("output_per_million", price.output),
            ("cached_input_per_million", price.cached_input),
        ] {
            if !value.is_finite() || value < 0.0 {
                problem(field, "must be a finite number, at least 0".to_owned());
            }
        }
        if let Some(earlier) = first.get(&model.name) {
            problem("name", format!("is also the name of model #{earlier}"));
            continue;
        }
        first.insert(model.name.clone(), number);
        match model.name.strip_suffix('*') {
            Some(prefix) => prices.prefixes.push((prefix.to_owned(), price)),
            None => {
                prices.exact.insert(model.name, price);
            }
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    prices
        .prefixes
        .sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
    Ok(prices)
}

#[cfg(test)]
#[path = "prices_tests.rs"]
mod tests;
