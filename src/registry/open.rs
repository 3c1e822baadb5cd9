//! Opening a journal wherever `--journal` puts it (a file or a NATS stream): followed, for the
//! proxy; read once and folded, for the commands that only report.
//!
//! Invariant: both kinds of journal go through the same fold ([`journal::apply_lines`]) and
//! the same [`Registry`]; only where the lines come from differs.

use super::journal::{self, LineProblem};
use super::ledger::Ledger;
use super::live::Registry;
use super::pending::Pending;
use super::store::location::JournalLocation;
use super::store::nats::NatsStore;
use super::store::whole::{self, Prefer};
use crate::contract::Keyring;
use crate::nats::{IfMissing, NatsError, NatsOptions, NatsStream, StreamSpec};
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// How to reach a journal that is not a file, where its local state lives, and how long the
/// fold keeps a closed lease whole.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub nats: NatsOptions,
    /// `--data-dir`: where a stream journal's queue of pending revocations is kept.
    pub data_dir: PathBuf,
    /// `--closed-lease-retention` (`serve`): a lease closed or expired longer ago than this is
    /// retired (see [`super::Retired`]); `None`: every lease is kept whole.
    pub closed_lease_retention: Option<Duration>,
    /// `--max-journal-line`: a longer line is skipped (`too-long`) by the fold, and by a store
    /// following the journal without ever holding it.
    pub max_line: usize,
    /// `--max-lease-lifetime`: a lease lives at most this long after its `issued_at`; `None`:
    /// as long as its `expires_at` says.
    pub max_lease_lifetime: Option<Duration>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            nats: NatsOptions::default(),
            data_dir: PathBuf::from(".leasegate"),
            closed_lease_retention: None,
            max_line: journal::MAX_LINE,
            max_lease_lifetime: None,
        }
    }
}

impl StoreOptions {
    /// The empty ledger a fold under these options starts from.
    pub fn ledger(&self, keyring: Keyring) -> Ledger {
        let mut ledger = Ledger::new(keyring).limiting_lines(self.max_line);
        if let Some(max) = self.max_lease_lifetime {
            ledger = ledger.capping_lifetime(max);
        }
        match self.closed_lease_retention {
            Some(retention) => ledger.retaining_closed(retention),
            None => ledger,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "the journal {journal}: its directory {dir} does not exist (give --create-journal to \
         create it)"
    )]
    NoDirectory { journal: String, dir: String },
    #[error("creating the journal {journal}: {error}")]
    Create { journal: String, error: io::Error },
    #[error("reading the journal {location}: {error}")]
    Io { location: String, error: io::Error },
    #[error(transparent)]
    Nats(#[from] NatsError),
}

impl OpenError {
    fn io(location: &JournalLocation) -> impl FnOnce(io::Error) -> OpenError + '_ {
        move |error| OpenError::Io {
            location: location.to_string(),
            error,
        }
    }
}

/// The queue file of pending revocations for a stream journal: `<data-dir>/<stream>.pending`.
pub fn stream_pending_path(options: &StoreOptions, stream: &str) -> PathBuf {
    options.data_dir.join(format!("{stream}.pending"))
}

/// Where a proxy following `location` writes its clock's latest time down (see
/// [`super::Clock`]): beside a file journal (`<journal>.clock`, as its queue), under
/// `--data-dir` for a stream (`<data-dir>/<stream>.clock`).
pub fn clock_path(location: &JournalLocation, options: &StoreOptions) -> PathBuf {
    beside(location, options, "clock")
}

/// Where a proxy following `location` keeps what its model calls reserved and spent (see
/// [`crate::budget::log`]): `<journal>.spent`, or `<data-dir>/<stream>.spent`.
pub fn spent_path(location: &JournalLocation, options: &StoreOptions) -> PathBuf {
    beside(location, options, "spent")
}

/// The approvals file of a file journal (`<journal>.approvals`), shared by its replicas.
pub fn approvals_path(location: &JournalLocation, options: &StoreOptions) -> PathBuf {
    beside(location, options, "approvals")
}

/// A proxy's own file for `location`: beside a file journal, under `--data-dir` for a stream.
fn beside(location: &JournalLocation, options: &StoreOptions, suffix: &str) -> PathBuf {
    match location {
        JournalLocation::File(path) => {
            let mut name = path.as_os_str().to_owned();
            name.push(".");
            name.push(suffix);
            PathBuf::from(name)
        }
        JournalLocation::Nats(nats) => options.data_dir.join(format!("{}.{suffix}", nats.stream)),
    }
}

/// Opens the registry a proxy follows. A file journal keeps its queue beside it; a stream's
/// queue is under `--data-dir` (made if missing). With `durable` false (`check`), nothing is
/// ever appended, so the queue is only in memory, and a missing stream is an error, not made.
pub async fn open_registry(
    location: &JournalLocation,
    keyring: Keyring,
    options: &StoreOptions,
    durable: bool,
) -> Result<Registry, OpenError> {
    let ledger = options.ledger(keyring.clone());
    match location {
        JournalLocation::File(path) => Registry::load(path.clone(), ledger, durable)
            .await
            .map_err(OpenError::io(location)),
        JournalLocation::Nats(nats) => {
            // `check` only reads: it does not create a missing stream.
            let missing = match durable {
                true => IfMissing::Create,
                false => IfMissing::Refuse,
            };
            let store =
                NatsStore::open(nats, &options.nats, &keyring, options.max_line, missing).await?;
            let pending = match durable {
                true => {
                    let dir = options.data_dir.clone();
                    let path = stream_pending_path(options, &nats.stream);
                    tokio::task::spawn_blocking(move || {
                        std::fs::create_dir_all(&dir)?;
                        Pending::open(path)
                    })
                    .await
                    .map_err(io::Error::other)
                    .and_then(|r| r)
                    .map_err(OpenError::io(location))?
                }
                false => Pending::in_memory(),
            };
            Registry::open_with(Box::new(store), ledger, pending)
                .await
                .map_err(OpenError::io(location))
        }
    }
}

/// `serve` on a journal file that is not there yet: creates the file, and its directory when
/// `create_dir` (otherwise a missing directory is most likely a mistyped path).
pub async fn create_journal_file(
    path: &std::path::Path,
    create_dir: bool,
) -> Result<(), OpenError> {
    let journal = path.display().to_string();
    let create = |error| OpenError::Create {
        journal: journal.clone(),
        error,
    };
    if tokio::fs::try_exists(path).await.map_err(create)? {
        return Ok(());
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    };
    if !tokio::fs::try_exists(dir).await.map_err(create)? {
        if !create_dir {
            return Err(OpenError::NoDirectory {
                journal,
                dir: dir.display().to_string(),
            });
        }
        tokio::fs::create_dir_all(dir).await.map_err(create)?;
    }
    tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
        .map(drop)
        .map_err(create)
}

/// Every line of the journal now, without their newlines: a stream's messages, or once it is
/// purged, its snapshot's lines (verified under `keyring`) and the messages after them. A missing
/// stream is an error (it is not created).
pub async fn read_lines(
    location: &JournalLocation,
    options: &StoreOptions,
    keyring: Option<&Keyring>,
) -> Result<Vec<Vec<u8>>, OpenError> {
    match location {
        JournalLocation::File(path) => {
            let path = path.clone();
            let bytes = tokio::task::spawn_blocking(move || std::fs::read(path))
                .await
                .map_err(io::Error::other)
                .and_then(|r| r)
                .map_err(OpenError::io(location))?;
            let (lines, rest) = journal::split_lines(&bytes);
            let mut lines: Vec<Vec<u8>> = lines.map(<[u8]>::to_vec).collect();
            if !rest.is_empty() {
                lines.push(rest.to_vec());
            }
            Ok(lines)
        }
        JournalLocation::Nats(nats) => {
            let stream =
                NatsStream::connect_existing(nats, &options.nats, &StreamSpec::JOURNAL).await?;
            let start = whole::start(&stream, keyring, Prefer::Stream)
                .await
                .map_err(|e| OpenError::io(location)(io::Error::other(e)))?;
            let messages = stream
                .read_all_from(start.next)
                .await
                .map_err(OpenError::io(location))?;
            let snapshot = start.snapshot.map(|(_, lines)| lines).unwrap_or_default();
            Ok(snapshot
                .into_iter()
                .chain(messages.into_iter().map(|(_, m)| m.to_vec()))
                .collect())
        }
    }
}

/// Reads the whole journal and folds it into `ledger`. A missing file is an empty journal.
pub async fn fold(
    location: &JournalLocation,
    mut ledger: Ledger,
    options: &StoreOptions,
) -> Result<(Ledger, Vec<LineProblem>), OpenError> {
    if let JournalLocation::File(path) = location {
        let path = path.clone();
        let (ledger, problems) = tokio::task::spawn_blocking(move || journal::load(&path, ledger))
            .await
            .map_err(io::Error::other)
            .and_then(|r| r)
            .map_err(OpenError::io(location))?;
        journal::warn_skipped(&problems);
        return Ok((ledger, problems));
    }
    let keyring = ledger.keyring().cloned();
    let lines = read_lines(location, options, keyring.as_ref()).await?;
    let problems = journal::apply_lines(&mut ledger, lines.iter().map(Vec::as_slice));
    journal::warn_skipped(&problems);
    Ok((ledger, problems))
}
