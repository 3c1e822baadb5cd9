//! `leasegate completions <shell>`: a completion script for the shell, made by `clap_complete`
//! from the same definitions the parser uses, so it never names a flag the binary lacks.

use super::CliResult;
use crate::cli::{Cli, CompletionsArgs};
use clap::CommandFactory;
use std::process::ExitCode;

pub fn exec(args: CompletionsArgs) -> CliResult {
    let mut command = Cli::command();
    let name = command.get_name().to_owned();
    clap_complete::generate(
        args.shell,
        &mut command,
        name,
        &mut std::io::stdout().lock(),
    );
    Ok(ExitCode::SUCCESS)
}
