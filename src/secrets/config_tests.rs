//! Every problem the secrets file can have, as the operator reads it.

use super::*;

const CANARY: &str = "AKIACANARYDECOY00001";

/// A file with the canary and one secret: the good one with `replace` lines swapped in (a
/// line `key = ...` replaces the line of that key; `-key` removes it; others are added).
fn file_with(changes: &[&str]) -> String {
    let mut lines = vec![
        r#"id = "github""#.to_owned(),
        r#"hosts = ["api.github.com", "*.githubusercontent.com"]"#.to_owned(),
        r#"header = "Authorization""#.to_owned(),
        r#"format = "Bearer {value}""#.to_owned(),
        r#"env = "GITHUB_PAT""#.to_owned(),
        r#"routes = [{ method = "GET", path = "/repos/**" }, { method = "*", path = "/user" }]"#
            .to_owned(),
        r#"agents = ["coder"]"#.to_owned(),
        r#"env_name = "GITHUB_TOKEN""#.to_owned(),
    ];
    for change in changes {
        if let Some(key) = change.strip_prefix('-') {
            lines.retain(|l| !l.starts_with(&format!("{key} ")));
        } else {
            let key = change.split(' ').next().unwrap();
            match lines.iter().position(|l| l.starts_with(&format!("{key} "))) {
                Some(i) => lines[i] = (*change).to_owned(),
                None => lines.push((*change).to_owned()),
            }
        }
    }
    format!(
        "canaries = [\"{CANARY}\"]\n\n[[secret]]\n{}\n",
        lines.join("\n")
    )
}

fn problems(text: &str) -> Vec<String> {
    let found: Vec<String> = match parse(text) {
        Ok(_) => vec![],
        Err(problems) => problems.iter().map(ToString::to_string).collect(),
    };
    for p in &found {
        assert!(!p.contains(CANARY), "a problem quotes the canary: {p}");
    }
    found
}

fn one_problem(changes: &[&str]) -> String {
    let found = problems(&file_with(changes));
    assert_eq!(found.len(), 1, "{changes:?}: {found:#?}");
    found.into_iter().next().unwrap()
}

#[test]
fn the_full_example_parses_into_its_parts() {
    let file = parse(&file_with(&[])).unwrap();
    assert_eq!(file.canaries.len(), 1);
    assert_eq!(file.canaries[0].as_bytes(), CANARY.as_bytes());
    let [secret] = file.secrets.as_slice() else {
        panic!("{:?}", file.secrets)
    };
    assert_eq!(secret.id, "github");
    assert_eq!(
        secret.hosts,
        [
            HostPattern::Exact("api.github.com".into()),
            HostPattern::Subdomains("githubusercontent.com".into())
        ]
    );
    assert_eq!(
        secret.placement,
        Placement::Header(http::header::AUTHORIZATION)
    );
    assert_eq!(secret.format, ("Bearer ".into(), String::new()));
    assert_eq!(secret.source, Source::Env("GITHUB_PAT".into()));
    assert_eq!(secret.routes.len(), 2);
    assert!(secret.routes[0].matches("GET", "/repos/a/b"));
    assert!(secret.routes[1].matches("PATCH", "/user"));
    assert_eq!(secret.agents, ["coder"]);
    assert_eq!(secret.env_name, "GITHUB_TOKEN");
    // Debug of the file shows no canary.
    assert!(!format!("{file:?}").contains(CANARY));
}

#[test]
fn optional_fields_take_their_defaults() {
    let file = parse(&file_with(&[
        "-format",
        "-routes",
        "-header",
        r#"query = "api_key""#,
        "-env",
        r#"file = "/run/secrets/github""#,
    ]))
    .unwrap();
    let secret = &file.secrets[0];
    assert_eq!(secret.format, (String::new(), String::new()));
    assert!(secret.routes.is_empty());
    assert_eq!(secret.placement, Placement::Query("api_key".into()));
    assert_eq!(secret.source, Source::File("/run/secrets/github".into()));
    // A file of canaries only, and an empty file, are valid.
    assert_eq!(
        parse("canaries = [\"0123456789\"]\n")
            .unwrap()
            .secrets
            .len(),
        0
    );
    assert_eq!(parse("").unwrap().canaries.len(), 0);
}

#[test]
fn a_syntax_error_gives_its_line_and_column_and_never_the_line() {
    let text = format!("canaries = [\"{CANARY}\" \"x\"]\n");
    let found = problems(&text);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("line 1, column "), "{}", found[0]);
    let found = problems("\n[[secret]]\nid = \n");
    assert!(found[0].starts_with("line 3, column "), "{}", found[0]);
}

#[test]
fn schema_problems_name_the_field_in_words() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["tokens = \"x\""],
            "secret \"github\", field tokens: is not a known field (a misspelling?)",
        ),
        (&["-agents"], "secret \"github\", field agents: is required"),
        (&["-hosts"], "secret \"github\", field hosts: is required"),
        (&["-env_name"], "secret \"github\", field env_name: is required"),
        (
            &[r#"query = "key""#],
            "secret \"github\", field header/query: give exactly one of `header` or `query` (where the value goes)",
        ),
        (
            &["-header"],
            "secret \"github\", field header/query: give exactly one of `header` or `query` (where the value goes)",
        ),
        (
            &[r#"file = "/run/x""#],
            "secret \"github\", field env/file: give exactly one of `env` or `file` (where the value comes from)",
        ),
        (
            &["-env"],
            "secret \"github\", field env/file: give exactly one of `env` or `file` (where the value comes from)",
        ),
        (
            &[r#"id = "GitHub""#],
            "secret #1, field id: must be a lower-case slug: letters, digits and single hyphens, e.g. \"github\"",
        ),
        (
            &[r#"env = """#],
            "secret \"github\", field env: must be an environment variable name: letters, digits and _, not starting with a digit",
        ),
        (
            &[r#"env_name = "1TOKEN""#],
            "secret \"github\", field env_name: must be an environment variable name: letters, digits and _, not starting with a digit",
        ),
        (
            &["-env", r#"file = "secrets/github""#],
            "secret \"github\", field file: must be an absolute path",
        ),
        (
            &["-header", r#"query = "api key""#],
            "secret \"github\", field query: must be a parameter name: letters, digits and . _ ~ -",
        ),
        (
            &[r#"routes = [{ method = "get", path = "/" }]"#],
            "secret \"github\", field routes: must be an upper-case method such as GET, or *",
        ),
        (
            &[r#"routes = [{ method = "GET", path = "repos" }]"#],
            "secret \"github\", field routes: must start with /",
        ),
        (
            &[r#"routes = [{ method = "GET" }]"#],
            "secret \"github\", field routes: path is required",
        ),
        (
            &[r#"routes = [{ method = "GET", path = "/", query = "a" }]"#],
            "secret \"github\", field routes: query is not a known field (a misspelling?)",
        ),
        (
            &["agents = []"],
            "secret \"github\", field agents: [] has less than 1 item",
        ),
        (
            &["hosts = \"api.github.com\""],
            "secret \"github\", field hosts: \"api.github.com\" is not of type \"array\"",
        ),
    ];
    for (changes, expected) in cases {
        assert_eq!(one_problem(changes), *expected, "{changes:?}");
    }
}

#[test]
fn top_level_problems_never_quote_a_canary() {
    assert_eq!(
        problems("leases = 1\n"),
        ["leases: is not a top-level field: only `canaries` and [[secret]] tables"]
    );
    assert_eq!(
        problems("canaries = [\"decoy\"]\n"),
        ["canaries (item 1): is shorter than 8 characters: a decoy that short would be found by chance"]
    );
    assert_eq!(
        problems("canaries = \"AKIACANARYDECOY00001\"\n"),
        ["canaries: must be a list of strings"]
    );
    assert_eq!(
        problems("canaries = [\"AKIACANARYDECOY00001\", 7]\n"),
        ["canaries (item 2): must be a list of strings"]
    );
}

#[test]
fn semantic_problems_name_the_secret_and_the_field() {
    let cases: &[(&[&str], &str)] = &[
        (
            &[r#"hosts = ["*"]"#],
            "secret \"github\", field hosts: '*' would send the secret to every host: list the hosts it is for",
        ),
        (
            &[r#"hosts = ["*x.example.com"]"#],
            "secret \"github\", field hosts: '*x.example.com': a wildcard is only a whole leading label: '*' alone, or '*.' and a domain, e.g. '*.example.com'",
        ),
        (
            &[r#"header = "Host""#],
            "secret \"github\", field header: \"Host\" is a header the proxy sets or reads itself",
        ),
        (
            &[r#"header = "Proxy-Authorization""#],
            "secret \"github\", field header: \"Proxy-Authorization\" is a header the proxy sets or reads itself",
        ),
        (
            &[r#"header = "X Token""#],
            "secret \"github\", field header: \"X Token\" is not a header name (letters, digits and -, no spaces)",
        ),
        (
            &[r#"format = "Bearer value""#],
            "secret \"github\", field format: \"Bearer value\" must contain {value} exactly once (it has 0)",
        ),
        (
            &[r#"format = "{value}:{value}""#],
            "secret \"github\", field format: \"{value}:{value}\" must contain {value} exactly once (it has 2)",
        ),
        (
            &[r#"format = "Bearer\t{value}""#],
            "secret \"github\", field format: holds a character that is not printable ASCII: a header value could not carry it",
        ),
        (
            &[r#"routes = [{ method = "GET", path = "/a/**/b" }]"#],
            "secret \"github\", field routes: path \"/a/**/b\": ** stands for the rest of the path, so only as the last segment",
        ),
        (
            &[r#"env_name = "HTTPS_PROXY""#],
            "secret \"github\", field env_name: HTTPS_PROXY is a variable `leasegate run` sets itself (the proxy, the CA or the lease)",
        ),
        (
            &[r#"env_name = "leasegate_lease_id""#],
            "secret \"github\", field env_name: leasegate_lease_id is a variable `leasegate run` sets itself (the proxy, the CA or the lease)",
        ),
    ];
    for (changes, expected) in cases {
        assert_eq!(one_problem(changes), *expected, "{changes:?}");
    }
}

#[test]
fn ids_and_env_names_are_unique_across_secrets() {
    let base = file_with(&[]);
    let second = base.split_once("[[secret]]").unwrap().1;
    let text = format!(
        "{base}\n[[secret]]{}",
        second.replace("GITHUB_TOKEN", "github_token")
    );
    assert_eq!(
        problems(&text),
        [
            "secret \"github\", field id: is the id of an earlier secret too: ids are unique",
            "secret \"github\", field env_name: github_token is also the env_name of secret \"github\"",
        ]
    );
}
