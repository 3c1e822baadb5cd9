//! `leasegate keygen`: a new random key, written to a file (mode 0600) or printed.

use super::{dev, CliResult};
use crate::cli::KeygenArgs;
use crate::contract::Key;
use std::process::ExitCode;

pub fn exec(args: KeygenArgs) -> CliResult {
    let key = Key::generate();
    match &args.out {
        Some(path) => {
            dev::write_key_file(path, &key)?;
            println!("{}", key.fingerprint());
        }
        None => {
            print!("{}", key.to_file_text());
            eprintln!("{}", key.fingerprint());
        }
    }
    Ok(ExitCode::SUCCESS)
}
