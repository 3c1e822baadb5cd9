//! `leasegate keygen`: a new random key, written to a file (mode 0600) or printed.

use super::{dev, CliResult};
use crate::cli::KeygenArgs;
use crate::contract::Key;
use crate::telemetry::egress_stream::EgressKey;
use std::process::ExitCode;

pub fn exec(args: KeygenArgs) -> CliResult {
    if args.egress_stream {
        return egress_stream_key(args.out.as_deref());
    }
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

/// `keygen --egress-stream`: a key for `--egress-stream-key`, to a new file or printed.
fn egress_stream_key(out: Option<&std::path::Path>) -> CliResult {
    match out {
        Some(path) => {
            EgressKey::write_new(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => print!("{}", *EgressKey::generate_text()),
    }
    Ok(ExitCode::SUCCESS)
}
