//! One module per subcommand (cargo's `src/bin/cargo/commands/`), and the code only commands
//! use: the development issuer, `serve --dev`'s set-up, the journal bridges, the reports.
//!
//! Invariant: nothing outside `commands` (and `main`) imports from it, except tests.

pub mod dev;
pub mod health;
pub mod inspect;
pub mod issue;
pub mod journal;
pub mod run;
pub mod suggest;
pub mod usage;
