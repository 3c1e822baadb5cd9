//! `leasegate reference <markdown|man>` (hidden): the command line's reference, made from the
//! clap definitions: Markdown by walking `clap::Command` (docs/reference/cli.md: every flag
//! with its variable, default and values, which `clap-markdown` leaves out of the variables),
//! the man pages by `clap_mangen` (docs/reference/man/: `leasegate.1` and one page per
//! subcommand, `leasegate-serve.1`, `leasegate-journal-import.1`, …), each with what its exit
//! status means.
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
    let text = match (args.format, &args.dir) {
        (ReferenceFormat::Markdown, _) => markdown(),
        (ReferenceFormat::Man, None) => man_page()?,
        (ReferenceFormat::Man, Some(dir)) => {
            std::fs::create_dir_all(dir)?;
            for (name, page) in man_pages()? {
                std::fs::write(dir.join(name), page)?;
            }
            return Ok(ExitCode::SUCCESS);
        }
    };
    std::io::stdout().lock().write_all(text.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

/// What a command's exit status means, as (status, meaning) pairs; `path` is the command as
/// typed (`leasegate run`). Every command: 2 is a usage error (clap's), and an error of its own
/// is said on stderr.
pub fn exit_status(path: &str) -> &'static [(&'static str, &'static str)] {
    match path {
        "leasegate serve" => &[
            ("0", "stopped by SIGTERM or SIGINT, after its drain"),
            ("1", "could not start (the configuration, the key, the journal, a port in use: said on stderr) or the journal failed while serving"),
            ("2", "a usage error"),
        ],
        "leasegate check" => &[
            ("0", "the request would be allowed"),
            ("1", "it would be refused (the refusal is printed), or an error"),
            ("2", "a usage error"),
        ],
        "leasegate verify" => &[
            ("0", "everything checked is valid"),
            ("1", "something is invalid (each problem is printed)"),
            ("2", "a usage or I/O error"),
        ],
        "leasegate health" => &[
            ("0", "the admin API answered 200"),
            ("1", "any other answer, or none"),
            ("2", "a usage error"),
        ],
        "leasegate run" => &[
            ("N", "the command's own exit code"),
            ("128+N", "the command was killed by signal N"),
            ("125", "`run` itself failed (the admin API, the lease not open, the trust files: said on stderr)"),
            ("126", "the command cannot be executed"),
            ("127", "the command is not found"),
            ("2", "a usage error"),
        ],
        _ => &[
            ("0", "done"),
            ("1", "an error, said on stderr (a key that verifies nothing in the journal, an admin API that refused)"),
            ("2", "a usage error, or a journal file that does not exist"),
        ],
    }
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
    let subcommands = visible_subcommands(command);
    // A command that runs (not one that only groups others) says what its exit status means.
    if subcommands.is_empty() {
        out.push_str("\nExit status:");
        for (status, meaning) in exit_status(path) {
            let _ = write!(out, " {status}, {meaning};");
        }
        out.pop();
        out.push_str(".\n");
    }
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

/// A command's subcommands as the reference lists them (hidden ones and `help` left out).
fn visible_subcommands(command: &clap::Command) -> Vec<&clap::Command> {
    command
        .get_subcommands()
        .filter(|c| !c.is_hide_set() && c.get_name() != "help")
        .collect()
}

/// docs/reference/man/leasegate.1: the top-level man page (its subcommands listed, each with
/// a page of its own in [`man_pages`]).
pub fn man_page() -> std::io::Result<String> {
    let mut root = Cli::command();
    root.build();
    render_man(&root, "leasegate")
}

/// Every man page, as (file name, roff): `leasegate.1`, then `leasegate-<command>.1` for each
/// subcommand at any depth (`leasegate-journal-import.1`).
pub fn man_pages() -> std::io::Result<Vec<(String, String)>> {
    let mut root = Cli::command();
    root.build();
    let mut pages = Vec::new();
    collect_pages(&root, "leasegate", &mut pages)?;
    Ok(pages)
}

fn collect_pages(
    command: &clap::Command,
    path: &str,
    pages: &mut Vec<(String, String)>,
) -> std::io::Result<()> {
    pages.push((
        format!("{}.1", path.replace(' ', "-")),
        render_man(command, path)?,
    ));
    for sub in visible_subcommands(command) {
        collect_pages(sub, &format!("{path} {}", sub.get_name()), pages)?;
    }
    Ok(())
}

/// One page: clap_mangen's (its title names the page `leasegate-serve`, so a parent's list of
/// subcommands points at pages that ship), then EXIT STATUS for a command that runs.
fn render_man(command: &clap::Command, path: &str) -> std::io::Result<String> {
    // clap takes a name as `&'static str` (without its `string` feature): leaked, once per
    // page of a command that prints them and exits.
    let name: &'static str = Box::leak(path.replace(' ', "-").into_boxed_str());
    let command = command.clone().name(name).bin_name(path.to_owned());
    let mut out = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut out)?;
    if visible_subcommands(&command).is_empty() {
        out.extend_from_slice(b".SH \"EXIT STATUS\"\n");
        for (status, meaning) in exit_status(path) {
            // roff: a backslash escapes, and `-` is a hyphen unless escaped as a minus.
            let meaning = meaning.replace('\\', "\\\\").replace('-', "\\-");
            let _ = write!(out, ".TP\n\\fB{status}\\fR\n{meaning}\n");
        }
    }
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

    /// Every page in docs/reference/man/ is what the definitions make, and no other is there;
    /// the top-level page names only pages that ship.
    #[test]
    fn the_man_pages_are_made_from_the_current_definitions() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/reference/man");
        let pages = man_pages().unwrap();
        let made: Vec<&str> = pages.iter().map(|(name, _)| name.as_str()).collect();
        for name in [
            "leasegate.1",
            "leasegate-serve.1",
            "leasegate-journal-import.1",
        ] {
            assert!(made.contains(&name), "{name}");
        }
        let mut shipped: Vec<String> = std::fs::read_dir(&dir)
            .map(|entries| {
                entries
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        shipped.sort();
        let mut wanted: Vec<String> = made.iter().map(|n| n.to_string()).collect();
        wanted.sort();
        let again = "cargo run -q -- reference man --dir docs/reference/man";
        assert_eq!(
            shipped, wanted,
            "make them again with\n  rm -r docs/reference/man; {again}"
        );
        for (name, page) in &pages {
            assert!(
                page.starts_with(".ie \\n(.g .ds Aq"),
                "{name}: {}",
                &page[..40]
            );
            let committed = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            assert!(
                committed == *page,
                "{name} is stale: make the pages again with\n  {again}"
            );
        }
        let top = &pages[0].1;
        for sub in ["leasegate\\-serve(1)", "leasegate\\-run(1)"] {
            assert!(top.contains(sub), "{sub} in {top}");
        }
        let run = &pages
            .iter()
            .find(|(n, _)| n == "leasegate-run.1")
            .unwrap()
            .1;
        assert!(
            run.contains(".SH \"EXIT STATUS\"") && run.contains("\\fB127\\fR"),
            "{run}"
        );
    }
}
