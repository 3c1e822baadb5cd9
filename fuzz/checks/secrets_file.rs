//! The secrets file parser on arbitrary text: never panics; a file it accepts keeps the
//! invariants the store relies on (unique ids and env names, no secret for every host, a format
//! with one place for the value); a file it refuses says at least one thing, in words.

use leasegate::policy::pattern::HostPattern;
use leasegate::secrets::config::parse;

pub fn check(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match parse(text) {
        Ok(file) => {
            let mut ids = std::collections::HashSet::new();
            let mut env_names = std::collections::HashSet::new();
            for secret in &file.secrets {
                assert!(ids.insert(secret.id.clone()), "{text:?}: id twice");
                assert!(
                    env_names.insert(secret.env_name.to_ascii_uppercase()),
                    "{text:?}: env_name twice"
                );
                assert!(!secret.hosts.is_empty(), "{text:?}");
                assert!(!secret.hosts.contains(&HostPattern::Any), "{text:?}");
                assert!(!secret.agents.is_empty(), "{text:?}");
                let (before, after) = &secret.format;
                assert!(!before.contains("{value}") && !after.contains("{value}"));
            }
        }
        Err(problems) => {
            assert!(!problems.is_empty(), "{text:?}: refused without a reason");
            for problem in problems {
                assert!(!problem.to_string().is_empty());
            }
        }
    }
}
