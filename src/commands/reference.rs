//! `leasegate reference <markdown|man>` (hidden): the command line's reference, made from the
//! clap definitions: Markdown by walking `clap::Command` (docs/reference/cli.md: every flag
//! with its variable, default and values, which `clap-markdown` leaves out of the variables),
//! the man page by `clap_mangen` (docs/reference/leasegate.1).
//!
//! Invariant: the committed files are exactly what this prints; a test fails when one is
//! stale, and says how to make it again.

use super::CliResult;
use crate::cli::{Cli, ReferenceArgs, ReferenceFormat};
use clap::CommandFactory;
use std::fmt::Write as _;
use std::io::Write;
use std::process::ExitCode;

pub fn exec(args: ReferenceArgs) -> CliResult {
    let text = match args.format {
        ReferenceFormat::Markdown => markdown(),
        ReferenceFormat::Man => man_page()?,
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

/// docs/reference/cli.md: every subcommand (hidden ones left out), its arguments, and for
/// each its variable, default and possible values.
pub fn markdown() -> String {
    let mut root = Cli::command();
    root.build();
    let mut out = String::from(
        "# leasegate command line\n\n\
         Made from the definitions in `src/cli.rs` by `leasegate reference markdown`; a test fails \
         when this file is stale. Every flag can also be set by the variable named beside it.\n",
    );
    write_command(&mut out, &root, "leasegate");
    out
}

fn write_command(out: &mut String, command: &clap::Command, path: &str) {
    let about = command.get_long_about().or(command.get_about());
    let _ = write!(out, "\n## `{path}`\n\n");
    if let Some(about) = about {
        let _ = write!(out, "{}\n\n", about.to_string().trim_end());
    }
    let usage = command.clone().render_usage().to_string();
    let usage = usage.trim_start_matches("Usage: ").replace('\n', " ");
    let _ = write!(out, "```text\n{usage}\n```\n");
    let subcommands: Vec<_> = command
        .get_subcommands()
        .filter(|c| !c.is_hide_set() && c.get_name() != "help")
        .collect();
    if !subcommands.is_empty() {
        out.push('\n');
        for sub in &subcommands {
            let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
            let _ = writeln!(out, "- `{}`: {about}", sub.get_name());
        }
    }
    let args: Vec<_> = command
        .get_arguments()
        // A global flag is listed once, under `leasegate`.
        .filter(|a| !a.is_hide_set() && (path == "leasegate" || !a.is_global_set()))
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        out.push('\n');
        for arg in args {
            write_argument(out, arg);
        }
    }
    for sub in subcommands {
        write_command(out, sub, &format!("{path} {}", sub.get_name()));
    }
}

fn write_argument(out: &mut String, arg: &clap::Arg) {
    let name = match (arg.get_long(), arg.get_value_names()) {
        (Some(long), _) if !arg.get_action().takes_values() => format!("--{long}"),
        (Some(long), Some(names)) => format!("--{long} <{}>", names[0]),
        (Some(long), None) => format!("--{long} <{}>", arg.get_id().as_str().to_uppercase()),
        (None, Some(names)) => format!("<{}>", names[0]),
        (None, None) => format!("<{}>", arg.get_id().as_str().to_uppercase()),
    };
    let help = arg.get_long_help().or(arg.get_help());
    let help = help
        .map(|h| h.to_string().replace('\n', " "))
        .unwrap_or_default();
    let _ = write!(out, "- `{name}`: {help}");
    let mut facts = Vec::new();
    if let Some(env) = arg.get_env() {
        facts.push(format!("variable `{}`", env.to_string_lossy()));
    }
    let defaults: Vec<_> = arg
        .get_default_values()
        .iter()
        .map(|v| v.to_string_lossy())
        .collect();
    if !defaults.is_empty() && arg.get_action().takes_values() {
        facts.push(format!("default `{}`", defaults.join(",")));
    }
    let values: Vec<_> = arg
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| format!("`{}`", v.get_name()))
        .collect();
    if !values.is_empty() && arg.get_action().takes_values() {
        facts.push(format!("one of {}", values.join(", ")));
    }
    if arg.is_required_set() {
        facts.push("required".to_owned());
    }
    if !facts.is_empty() {
        let _ = write!(out, " ({})", facts.join("; "));
    }
    out.push('\n');
}

/// docs/reference/leasegate.1: the top-level man page (its subcommands listed; each one's
/// flags are in cli.md and `leasegate <command> --help`).
pub fn man_page() -> std::io::Result<String> {
    let mut out = Vec::new();
    clap_mangen::Man::new(Cli::command()).render(&mut out)?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// `file` under the repository holds `made`, or the test says how to make it again.
    fn assert_current(file: &str, made: &str, format: &str) {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == made,
            "{file} is stale: the clap definitions in src/cli.rs changed. Make it again with\n  \
             cargo run -q -- reference {format} > {file}"
        );
    }

    #[test]
    fn the_cli_reference_is_made_from_the_current_definitions() {
        let made = markdown();
        for command in ["serve", "journal compact", "completions", "--allow-host"] {
            assert!(made.contains(command), "{command}");
        }
        assert_current("docs/reference/cli.md", &made, "markdown");
    }

    #[test]
    fn the_man_page_is_made_from_the_current_definitions() {
        let made = man_page().unwrap();
        assert!(
            made.starts_with(".ie \\n(.g .ds Aq"),
            "roff: {}",
            &made[..40]
        );
        assert_current("docs/reference/leasegate.1", &made, "man");
    }
}
