//! The price table: loading, its errors, matching, and the cost.

use super::{Place, Prices, PricesError};
use crate::meter::Usage;

const GOOD: &str = r#"
# Prices in US dollars per million tokens.
[[model]]
name = "gpt-4o-mini*"
input_per_million = 0.15
output_per_million = 0.60
cached_input_per_million = 0.075

[[model]]
name = "gpt-4o*"
input_per_million = 2.5
output_per_million = 10

[[model]]
name = "gpt-4o-mini-2024-07-18"
input_per_million = 1
output_per_million = 2
cached_input_per_million = 0
"#;

fn usage(model: Option<&str>, input: u64, output: u64, cached: u64) -> Usage {
    Usage {
        model: model.map(str::to_owned),
        input,
        output,
        cached,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn a_good_table_prices_by_exact_name_then_longest_prefix() {
    let prices = Prices::parse(GOOD).unwrap();
    assert_eq!(prices.len(), 3);
    // Exact beats every pattern.
    assert_eq!(prices.price("gpt-4o-mini-2024-07-18").unwrap().input, 1.0);
    // The longest prefix wins, though `gpt-4o*` matches too and would come first in the file
    // were the order reversed.
    assert_eq!(prices.price("gpt-4o-mini").unwrap().input, 0.15);
    assert_eq!(prices.price("gpt-4o-2024-08-06").unwrap().input, 2.5);
    assert!(prices.price("gpt-4").is_none());
    assert!(prices.price("claude-opus-4").is_none());

    // (1000 - 200) * 0.15 + 200 * 0.075 + 500 * 0.6 = 120 + 15 + 300 = 435 per million.
    let cost = prices
        .cost(&usage(Some("gpt-4o-mini"), 1000, 500, 200))
        .unwrap();
    assert!(close(cost, 435e-6), "{cost}");
    // No cached price: cached input at the input price. 1000 * 2.5 + 10 * 10 = 2600.
    let cost = prices.cost(&usage(Some("gpt-4o"), 1000, 10, 400)).unwrap();
    assert!(close(cost, 2600e-6), "{cost}");
    // Unknown or missing model: unpriced, never zero.
    assert_eq!(prices.cost(&usage(Some("o3"), 1000, 10, 0)), None);
    assert_eq!(prices.cost(&usage(None, 1000, 10, 0)), None);
}

#[test]
fn the_order_of_entries_does_not_matter() {
    let entries: Vec<&str> = GOOD.split("[[model]]").skip(1).collect();
    let reversed: String = entries
        .iter()
        .rev()
        .map(|e| format!("[[model]]{e}"))
        .collect();
    let prices = Prices::parse(&reversed).unwrap();
    for name in ["gpt-4o-mini-2024-07-18", "gpt-4o-mini-x", "gpt-4o-x"] {
        assert_eq!(
            prices.price(name),
            Prices::parse(GOOD).unwrap().price(name),
            "{name}"
        );
    }
    // `*` alone is the fallback for everything else.
    let text =
        format!("{GOOD}\n[[model]]\nname = \"*\"\ninput_per_million = 9\noutput_per_million = 9\n");
    let prices = Prices::parse(&text).unwrap();
    assert_eq!(prices.price("claude-opus-4").unwrap().input, 9.0);
    assert_eq!(prices.price("gpt-4o-mini").unwrap().input, 0.15);
}

fn problems(text: &str) -> Vec<String> {
    Prices::parse(text)
        .unwrap_err()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn bad_tables_name_the_entry_and_the_field() {
    let one = |body: &str| {
        format!("[[model]]\nname = \"a\"\ninput_per_million = 1\noutput_per_million = 1\n\n[[model]]\n{body}\n")
    };
    for (text, want) in [
        (
            one("name = \"b\"\ninput_per_million = -1\noutput_per_million = 1"),
            "model #2 (\"b\"), field input_per_million: must not be negative",
        ),
        (
            one("name = \"b\"\ninput_per_million = \"1\"\noutput_per_million = 1"),
            "model #2 (\"b\"), field input_per_million: has the wrong type",
        ),
        (
            one("name = \"b\"\ninput_per_million = 1"),
            "model #2 (\"b\"), field output_per_million: is required",
        ),
        (
            one("name = \"b\"\ninput_per_million = 1\noutput_per_million = 1\ncached_per_million = 1"),
            "model #2 (\"b\"), field cached_per_million: is not a known field",
        ),
        (
            one("name = \"b*c*\"\ninput_per_million = 1\noutput_per_million = 1"),
            "model #2 (\"b*c*\"), field name: may hold `*` only once, at its end",
        ),
        (
            one("name = \"a\"\ninput_per_million = 1\noutput_per_million = 1"),
            "model #2 (\"a\"), field name: is also the name of model #1",
        ),
        (
            one("name = \"b\"\ninput_per_million = nan\noutput_per_million = 1"),
            "model #2 (\"b\"), field input_per_million: has the wrong type",
        ),
        (
            "[[models]]\nname = \"a\"\n".to_owned(),
            "models: is not a known field",
        ),
        (
            "[[model]]\nname = \"a\"\ninput_per_million = 1\noutput_per_million = ".to_owned(),
            "line 4, column 22: ",
        ),
    ] {
        let found = problems(&text);
        assert!(
            found.iter().any(|p| p.starts_with(want)),
            "{want:?} not in {found:?}"
        );
    }
    let error =
        Prices::parse("[[model]]\ninput_per_million = 1\noutput_per_million = 1\n").unwrap_err();
    assert_eq!(
        error[0].place,
        Place::Model {
            number: 1,
            name: None,
            field: "name".into()
        }
    );
}

#[test]
fn load_reads_a_file_and_says_which_on_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("prices.toml");
    std::fs::write(&path, GOOD).unwrap();
    assert_eq!(Prices::load(&path).unwrap().len(), 3);
    std::fs::write(&path, "[[model]]\nname = \"\"\n").unwrap();
    let error = Prices::load(&path).unwrap_err();
    assert!(matches!(error, PricesError::Invalid { .. }));
    let text = error.to_string();
    assert!(text.contains("prices.toml is not valid"), "{text}");
    assert!(
        text.contains("\n  model #1 (\"\"), field name: must not be empty"),
        "{text}"
    );
    let missing = dir.path().join("none.toml");
    let error = Prices::load(&missing).unwrap_err();
    assert!(matches!(error, PricesError::Read { .. }), "{error}");
    // An empty table is valid: every model is unpriced.
    std::fs::write(&path, "# nothing priced yet\n").unwrap();
    assert!(Prices::load(&path).unwrap().is_empty());
}
