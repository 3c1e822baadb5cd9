//! The per-lease port assignments on disk: `<data-dir>/lease-ports`, JSON Lines, one
//! `{"lease_id": ..., "port": ..., "expires_at": ...}` per assignment.
//!
//! Invariant: an assignment is appended (fsynced) before its port opens, so every port this
//! process has served is in the file and a restart restores it rather than deriving it again;
//! the file is rewritten atomically ([`crate::durable`]) once most of its lines are
//! assignments that ended. Reading skips what does not parse (a torn last write, a foreign
//! line) and counts it; of two lines for one lease or one port the first stands (see
//! [`super::assignment::Assignments::restore`]).

use super::assignment::Held;
use crate::contract::lease::is_lease_id;
use crate::contract::Timestamp;
use crate::durable;
use std::io;
use std::path::{Path, PathBuf};

/// The file's name under `--data-dir`.
pub const FILE_NAME: &str = "lease-ports";

/// Below this many lines the file is never rewritten: a rewrite costs more than the lines.
const REWRITE_FLOOR: usize = 64;

/// One line.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Line<'a> {
    lease_id: std::borrow::Cow<'a, str>,
    port: u16,
    expires_at: std::borrow::Cow<'a, str>,
}

/// The file, and how many lines it holds.
#[derive(Debug)]
pub struct Persisted {
    path: PathBuf,
    lines: usize,
}

/// What a read of the file found.
#[derive(Debug, Default, PartialEq)]
pub struct Read {
    /// The assignments, in file order.
    pub entries: Vec<(String, Held)>,
    /// Lines that do not parse (a torn last line among them).
    pub skipped: usize,
}

impl Persisted {
    /// Opens `<data_dir>/lease-ports`, creating the directory and the file if missing (so an
    /// unwritable place fails here, at start, not at the first grant), and reads it. Blocking.
    pub fn open(data_dir: &Path) -> io::Result<(Persisted, Read)> {
        std::fs::create_dir_all(data_dir)?;
        let path = data_dir.join(FILE_NAME);
        create(&path)?;
        let read = parse(&std::fs::read(&path)?);
        let lines = read.entries.len() + read.skipped;
        Ok((Persisted { path, lines }, read))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `entries` in one write, fsynced. Blocking.
    pub fn append<'a>(
        &mut self,
        entries: impl IntoIterator<Item = (&'a str, Held)>,
    ) -> io::Result<()> {
        let lines: Vec<Vec<u8>> = entries.into_iter().map(line).collect();
        durable::append_lines(&self.path, lines.iter().map(Vec::as_slice))?;
        self.lines += lines.len();
        Ok(())
    }

    /// Whether the file holds many more lines than the `live` assignments (those of leases
    /// retired since were appended once and linger): worth a rewrite.
    pub fn is_worth_rewriting(&self, live: usize) -> bool {
        self.lines > REWRITE_FLOOR.max(live.saturating_mul(2))
    }

    /// Replaces the file by one holding `entries`, atomically. Blocking.
    pub fn rewrite<'a>(
        &mut self,
        entries: impl IntoIterator<Item = (&'a str, Held)>,
    ) -> io::Result<()> {
        let lines: Vec<Vec<u8>> = entries.into_iter().map(line).collect();
        durable::rewrite(&self.path, lines.iter().map(Vec::as_slice))?;
        // No lines removes the file: it stays, empty, so that it exists while we run.
        if lines.is_empty() {
            create(&self.path)?;
        }
        self.lines = lines.len();
        Ok(())
    }
}

/// Makes the file if it is missing (an existing one is left as it is).
fn create(path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map(drop)
}

fn line((lease_id, held): (&str, Held)) -> Vec<u8> {
    let expires_at = held.expires_at.to_string();
    serde_json::to_vec(&Line {
        lease_id: lease_id.into(),
        port: held.port,
        expires_at: expires_at.as_str().into(),
    })
    .expect("a struct of strings and a number serializes")
}

/// The assignments in `bytes`, in order; a line that is not one (a torn last write, a lease id
/// not of the contract's form, port 0, an unreadable time) is skipped and counted.
pub fn parse(bytes: &[u8]) -> Read {
    let mut read = Read::default();
    for text in bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let entry = serde_json::from_slice::<Line>(text).ok().and_then(|line| {
            let expires_at = Timestamp::parse(&line.expires_at).ok()?;
            let valid = is_lease_id(&line.lease_id) && line.port != 0;
            valid.then(|| {
                let held = Held {
                    port: line.port,
                    expires_at,
                };
                (line.lease_id.into_owned(), held)
            })
        });
        match entry {
            Some(entry) => read.entries.push(entry),
            None => read.skipped += 1,
        }
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "3e7a9c5d-1b2f-4a8e-9c6d-5b4a3f2e1d0c";
    const B: &str = "0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c";

    fn held(port: u16) -> Held {
        Held {
            port,
            expires_at: Timestamp::from_millis(1_767_225_600_000),
        }
    }

    #[test]
    fn assignments_survive_a_reopen_and_a_torn_last_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let (mut file, read) = Persisted::open(&data).unwrap();
        assert_eq!(read, Read::default());
        assert!(
            file.path().exists(),
            "made at open, so a bad place fails at start"
        );
        file.append([(A, held(40001)), (B, held(40002))]).unwrap();
        let text = std::fs::read_to_string(file.path()).unwrap();
        assert_eq!(
            text.lines().next().unwrap(),
            format!(r#"{{"lease_id":"{A}","port":40001,"expires_at":"2026-01-01T00:00:00.000Z"}}"#)
        );
        // A write cut short by a crash: the last line is torn.
        std::fs::write(file.path(), format!("{text}{{\"lease_id\":\"{A}\",\"po")).unwrap();
        let (file, read) = Persisted::open(&data).unwrap();
        assert_eq!(
            read.entries,
            [(A.to_owned(), held(40001)), (B.to_owned(), held(40002))]
        );
        assert_eq!(read.skipped, 1);
        assert_eq!(file.lines, 3);
    }

    #[test]
    fn lines_that_are_not_assignments_are_counted_not_taken() {
        let good =
            format!(r#"{{"lease_id":"{A}","port":7,"expires_at":"2026-01-01T00:00:00.000Z"}}"#);
        let bad = [
            r#"{"lease_id":"not-a-lease","port":7,"expires_at":"2026-01-01T00:00:00.000Z"}"#
                .to_owned(),
            format!(r#"{{"lease_id":"{B}","port":0,"expires_at":"2026-01-01T00:00:00.000Z"}}"#),
            format!(r#"{{"lease_id":"{B}","port":70000,"expires_at":"2026-01-01T00:00:00.000Z"}}"#),
            format!(r#"{{"lease_id":"{B}","port":7,"expires_at":"yesterday"}}"#),
            "\u{0}\u{ff}".to_owned(),
        ];
        let text = format!("{good}\n\n{}\n", bad.join("\n"));
        let read = parse(text.as_bytes());
        assert_eq!(read.entries.len(), 1);
        assert_eq!(read.entries[0].0, A);
        assert_eq!(read.entries[0].1.port, 7);
        assert_eq!(read.skipped, bad.len());
    }

    #[test]
    fn a_rewrite_keeps_only_what_is_given_and_the_file_stays() {
        let dir = tempfile::tempdir().unwrap();
        let (mut file, _) = Persisted::open(dir.path()).unwrap();
        let many: Vec<(String, Held)> = (0..100u16)
            .map(|i| (format!("00000000-0000-4000-8000-{i:012x}"), held(1000 + i)))
            .collect();
        file.append(many.iter().map(|(id, h)| (id.as_str(), *h)))
            .unwrap();
        assert!(!file.is_worth_rewriting(60), "most lines still live");
        assert!(file.is_worth_rewriting(10));
        file.rewrite([(A, held(5))]).unwrap();
        let (file, read) = Persisted::open(dir.path()).unwrap();
        assert_eq!(read.entries, [(A.to_owned(), held(5))]);
        assert_eq!(file.lines, 1);
        let (mut file, _) = Persisted::open(dir.path()).unwrap();
        file.rewrite([]).unwrap();
        assert!(file.path().exists());
        file.append([(B, held(6))]).unwrap();
        assert_eq!(
            Persisted::open(dir.path()).unwrap().1.entries,
            [(B.to_owned(), held(6))]
        );
    }
}
