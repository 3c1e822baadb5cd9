//! Loading values, reloading whole or not at all, finding values and canaries.

use super::*;
use std::collections::HashMap;

const VALUE: &str = "ghp_realvalue0123456789";
const CANARY: &str = "AKIACANARYDECOY00001";

struct Dir {
    dir: tempfile::TempDir,
}

impl Dir {
    fn new() -> Dir {
        Dir {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A secrets file with one env secret (GITHUB_PAT) and one file secret (`value-file`).
    fn secrets_file(&self) -> PathBuf {
        let file = self.path("value-file");
        self.write(
            "secrets.toml",
            &format!(
                r#"canaries = ["{CANARY}"]

[[secret]]
id = "github"
hosts = ["api.github.com"]
header = "Authorization"
format = "Bearer {{value}}"
env = "GITHUB_PAT"
agents = ["coder"]
env_name = "GITHUB_TOKEN"

[[secret]]
id = "search"
hosts = ["search.test"]
query = "key"
file = "{}"
agents = ["coder"]
env_name = "SEARCH_KEY"
"#,
                file.display()
            ),
        )
    }
}

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    move |name| map.get(name).cloned()
}

/// The load's error as the operator reads it, checked to show no value.
fn load_error(path: &Path, vars: &[(&str, &str)]) -> String {
    let text = Secrets::load_with(path, &env(vars))
        .unwrap_err()
        .to_string();
    for (_, value) in vars.iter().filter(|(_, v)| !v.is_empty()) {
        assert!(!text.contains(value), "{text}");
    }
    text
}

#[test]
fn values_load_from_env_and_file_and_render_in_their_format() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    dir.write("value-file", "search-key-0123456789\r\n");
    let secrets = Secrets::load_with(&path, &env(&[("GITHUB_PAT", VALUE)])).unwrap();
    let set = secrets.current();
    assert_eq!(set.secrets().len(), 2);
    assert_eq!(set.canary_count(), 1);
    assert_eq!(
        *set.get("github").unwrap().rendered(),
        format!("Bearer {VALUE}")
    );
    // One trailing newline (CRLF too) is not part of a file's value.
    assert_eq!(
        *set.get("search").unwrap().rendered(),
        "search-key-0123456789"
    );
    let shown = format!("{secrets:?}");
    assert!(!shown.contains(VALUE), "{shown}");
    assert!(!shown.contains("search-key"), "{shown}");
    assert!(!shown.contains(CANARY), "{shown}");
    assert!(shown.contains("[redacted]"), "{shown}");
}

#[test]
fn find_exact_names_the_secret_or_the_canary_and_nothing_else() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    dir.write("value-file", "search-key-0123456789");
    let secrets = Secrets::load_with(&path, &env(&[("GITHUB_PAT", VALUE)])).unwrap();
    let head = format!("GET / HTTP/1.1\r\nAuthorization: token {VALUE}\r\n\r\n");
    assert_eq!(
        secrets.find_exact(head.as_bytes()),
        Some(Hit::Secret {
            id: "github".into()
        })
    );
    assert_eq!(
        secrets.find_exact(b"?q=1&key=search-key-0123456789"),
        Some(Hit::Secret {
            id: "search".into()
        })
    );
    assert_eq!(
        secrets.find_exact(format!("{{\"k\":\"{CANARY}\"}}").as_bytes()),
        Some(Hit::Canary { number: 1 })
    );
    // Exact bytes only: a part, another case or an encoding is not found.
    assert_eq!(secrets.find_exact(&VALUE.as_bytes()[1..]), None);
    assert_eq!(secrets.find_exact(VALUE.to_uppercase().as_bytes()), None);
    assert_eq!(secrets.find_exact(b""), None);
}

#[test]
fn a_missing_or_bad_value_names_the_secret_and_its_source() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    let file = dir.path("value-file");
    let shown = path.display();
    assert_eq!(
        load_error(&path, &[]),
        format!(
            "the secrets file {shown} is not valid:\n  secret \"github\", field env: the environment variable GITHUB_PAT is not set (or is not UTF-8) in the proxy's environment\n  secret \"search\", field file: cannot read {}: No such file or directory (os error 2)",
            file.display()
        )
    );
    dir.write("value-file", "search-key-0123456789");
    let cases = [
        ("", "the value is empty"),
        ("x7q2k9", "the value is shorter than 8 bytes: that short, it would be found by chance in ordinary traffic"),
        ("has a space in it", "the value holds a space, control or non-ASCII byte (at byte 4): it must be printable ASCII"),
        ("tab\tseparated-value", "the value holds a space, control or non-ASCII byte (at byte 4): it must be printable ASCII"),
    ];
    for (value, why) in cases {
        assert_eq!(
            load_error(&path, &[("GITHUB_PAT", value)]),
            format!(
                "the secrets file {shown} is not valid:\n  secret \"github\", field env: {why}"
            ),
            "{value:?}"
        );
    }
    dir.write("value-file", &"x".repeat(MAX_VALUE_BYTES + 1));
    assert_eq!(
        load_error(&path, &[("GITHUB_PAT", VALUE)]),
        format!(
            "the secrets file {shown} is not valid:\n  secret \"search\", field file: {} is larger than 16384 bytes",
            file.display()
        )
    );
    dir.write("value-file", "\n");
    assert!(load_error(&path, &[("GITHUB_PAT", VALUE)])
        .ends_with("secret \"search\", field file: the value is empty"));
}

#[test]
fn a_canary_that_is_a_real_value_is_refused() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    dir.write("value-file", CANARY);
    assert_eq!(
        load_error(&path, &[("GITHUB_PAT", VALUE)]),
        format!(
            "the secrets file {} is not valid:\n  canaries (item 1): is the value of secret \"search\": a canary is a decoy, never a real value",
            path.display()
        )
    );
}

#[test]
fn the_file_itself_missing_or_unparsable_says_so() {
    let dir = Dir::new();
    let missing = dir.path("nope.toml");
    assert_eq!(
        load_error(&missing, &[]),
        format!(
            "cannot read the secrets file {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
    let bad = dir.write("bad.toml", "[[secret]\n");
    assert!(load_error(&bad, &[]).starts_with(&format!(
        "the secrets file {} is not valid:\n  line 1, column ",
        bad.display()
    )));
}

#[test]
fn a_reload_swaps_the_whole_set_or_keeps_the_old_one() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    dir.write("value-file", "search-key-0123456789");
    let secrets = Secrets::load_with(&path, &env(&[("GITHUB_PAT", VALUE)])).unwrap();
    let before = secrets.current();

    // A new value in the file: the new set is in use, the old one unchanged for its holders.
    dir.write("value-file", "search-key-rotated-000");
    secrets.reload_with(&env(&[("GITHUB_PAT", VALUE)])).unwrap();
    assert_eq!(
        *secrets.current().get("search").unwrap().rendered(),
        "search-key-rotated-000"
    );
    assert_eq!(
        *before.get("search").unwrap().rendered(),
        "search-key-0123456789"
    );
    assert_eq!(secrets.find_exact(b"search-key-0123456789"), None);

    // A reload that fails (one value missing) changes nothing: no half-loaded set.
    std::fs::remove_file(dir.path("value-file")).unwrap();
    let error = secrets.reload_with(&env(&[("GITHUB_PAT", VALUE)]));
    assert!(
        matches!(error, Err(SecretsError::Invalid { .. })),
        "{error:?}"
    );
    assert_eq!(
        *secrets.current().get("search").unwrap().rendered(),
        "search-key-rotated-000"
    );
    assert_eq!(
        secrets.find_exact(VALUE.as_bytes()),
        Some(Hit::Secret {
            id: "github".into()
        })
    );
    // An unparsable file too.
    dir.write("secrets.toml", "[[secret]]\nid = ");
    assert!(secrets.reload_with(&env(&[("GITHUB_PAT", VALUE)])).is_err());
    assert_eq!(secrets.current().secrets().len(), 2);
}

#[test]
fn a_reload_the_check_refuses_keeps_the_old_set() {
    let dir = Dir::new();
    let path = dir.secrets_file();
    dir.write("value-file", "search-key-0123456789");
    let secrets = Secrets::load_with(&path, &env(&[("GITHUB_PAT", VALUE)])).unwrap();

    // A file that reads well (a new value, a new host) but that the check turns down, as the
    // CA's coverage check does on SIGHUP for a host the CA does not cover.
    dir.write("value-file", "search-key-rotated-000");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("search.test", "uncovered.test");
    std::fs::write(&path, text).unwrap();
    let seen = std::cell::Cell::new(0);
    let refuse = |set: &SecretSet| {
        seen.set(set.secrets().len());
        Err("host uncovered.test is outside the CA".to_owned())
    };
    let error = secrets
        .reload_checked(&env(&[("GITHUB_PAT", VALUE)]), &refuse)
        .unwrap_err();
    assert_eq!(seen.get(), 2, "the check saw the whole new set");
    match &error {
        SecretsError::Refused { path: named, why } => {
            assert_eq!(named, &path.display().to_string());
            assert_eq!(why, "host uncovered.test is outside the CA");
        }
        other => panic!("{other:?}"),
    }
    assert!(!error.to_string().contains("search-key"), "{error}");
    let hosts: Vec<String> = (secrets.current().get("search").unwrap().spec().hosts)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(hosts, ["search.test"]);
    assert_eq!(
        *secrets.current().get("search").unwrap().rendered(),
        "search-key-0123456789"
    );
    assert_eq!(secrets.find_exact(b"search-key-rotated-000"), None);

    // The same file, accepted, is swapped in.
    secrets
        .reload_checked(&env(&[("GITHUB_PAT", VALUE)]), &|_| Ok(()))
        .unwrap();
    assert_eq!(
        *secrets.current().get("search").unwrap().rendered(),
        "search-key-rotated-000"
    );
}
