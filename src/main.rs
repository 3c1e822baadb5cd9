//! The `leasegate` binary: parses the command line, starts logging, dispatches to
//! [`leasegate::commands`], and exits: the only place the process exits, and the only place
//! an error is printed as the last word of a failed command.
#![forbid(unsafe_code)]

use clap::Parser;
use leasegate::cli::{Cli, Command, JournalArgs, JournalCommand, LogFormat};
use leasegate::commands::{self, error_text, MissingJournal};
use std::io::IsTerminal;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let serving = matches!(
        cli.command,
        Command::Serve(_)
            | Command::Journal(JournalArgs {
                command: JournalCommand::Mirror(_)
            })
    );
    init_logging(cli.log_format, serving);
    let outcome = match cli.command {
        Command::Keygen(args) => commands::keygen::exec(args),
        Command::Issue(args) => commands::issue::exec(args),
        Command::Revoke(args) => commands::revoke::exec(args),
        Command::Verify(args) => commands::verify::exec(args),
        Command::Leases(args) => commands::leases::exec(args),
        Command::Serve(args) => commands::serve::exec(args),
        Command::Check(args) => commands::check::exec(args),
        Command::Run(args) => commands::run::exec(args),
        Command::Token(args) => commands::token::exec(args),
        Command::Health(args) => commands::health::exec(args),
        Command::Usage(args) => commands::usage::exec(args),
        Command::Suggest(args) => commands::suggest::exec(args),
        Command::Journal(args) => commands::journal::exec(args),
        Command::Approvals(args) => commands::approvals::list(args),
        Command::Approve(args) => commands::approvals::decide(args, "approve"),
        Command::Deny(args) => commands::approvals::decide(args, "deny"),
        Command::Ca(args) => commands::ca::exec(args),
        Command::Completions(args) => commands::completions::exec(args),
        Command::Reference(args) => commands::reference::exec(args),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("leasegate: {}", error_text(&e));
            if e.downcast_ref::<MissingJournal>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Logs go to stderr; RUST_LOG filters (default: info for `serve`, warn otherwise).
fn init_logging(format: LogFormat, serving: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if serving { "info" } else { "warn" })
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colour codes only for a person at a terminal, never into a file or a pipe.
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
