//! Following the journal file as others append to it.
//!
//! Invariant: every complete line is returned exactly once per file generation; a partial last
//! line is held until its newline arrives; a truncated or replaced file (new inode, or shorter
//! than what we read) is read again from its start.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

/// Read position in one journal file.
#[derive(Debug)]
pub struct JournalTail {
    path: PathBuf,
    /// (device, inode) of the file being followed.
    identity: Option<(u64, u64)>,
    /// Bytes consumed from the current file.
    offset: u64,
    /// An unterminated last line, waiting for its newline.
    partial: Vec<u8>,
}

/// How the file changed since the last read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    Same,
    /// A new file (rotation or first read) or a truncated one: read from its start.
    Restarted,
}

impl JournalTail {
    pub fn new(path: PathBuf) -> JournalTail {
        JournalTail {
            path,
            identity: None,
            offset: 0,
            partial: Vec::new(),
        }
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Complete lines appended since the last call (without newlines). A missing file is an
    /// empty journal.
    pub fn read_new(&mut self) -> io::Result<(Generation, Vec<Vec<u8>>)> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok((Generation::Same, Vec::new()))
            }
            Err(e) => return Err(e),
        };
        let meta = file.metadata()?;
        let identity = Some((meta.dev(), meta.ino()));
        let mut generation = Generation::Same;
        if identity != self.identity || meta.len() < self.offset {
            if self.identity.is_some() {
                tracing::info!(journal = %self.path.display(), "journal replaced or truncated: reading it from the start");
            }
            self.identity = identity;
            self.offset = 0;
            self.partial.clear();
            generation = Generation::Restarted;
        }
        if meta.len() == self.offset {
            return Ok((generation, Vec::new()));
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut fresh = Vec::with_capacity((meta.len() - self.offset) as usize);
        file.read_to_end(&mut fresh)?;
        self.offset += fresh.len() as u64;
        let mut bytes = std::mem::take(&mut self.partial);
        bytes.extend_from_slice(&fresh);
        let (lines, rest) = super::journal::split_lines(&bytes);
        let lines: Vec<Vec<u8>> = lines.map(<[u8]>::to_vec).collect();
        self.partial = rest.to_vec();
        Ok((generation, lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn lines_once_partial_waits_rotation_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let mut tail = JournalTail::new(path.clone());
        assert_eq!(tail.read_new().unwrap().1.len(), 0, "missing file");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(b"one\ntw").unwrap();
        let (generation, lines) = tail.read_new().unwrap();
        assert_eq!(
            (generation, lines),
            (Generation::Restarted, vec![b"one".to_vec()])
        );
        assert!(tail.read_new().unwrap().1.is_empty(), "partial line waits");
        f.write_all(b"o\nthree\n").unwrap();
        assert_eq!(
            tail.read_new().unwrap().1,
            vec![b"two".to_vec(), b"three".to_vec()]
        );

        // Rotation: the old file moves away, a new one takes its name.
        std::fs::rename(&path, dir.path().join("j.1")).unwrap();
        std::fs::write(&path, b"fresh\n").unwrap();
        assert_eq!(
            tail.read_new().unwrap(),
            (Generation::Restarted, vec![b"fresh".to_vec()])
        );
        // Truncation in place.
        std::fs::write(&path, b"").unwrap();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        assert!(tail.read_new().unwrap().1.is_empty());
        f.write_all(b"again\n").unwrap();
        assert_eq!(tail.read_new().unwrap().1, vec![b"again".to_vec()]);
    }
}
