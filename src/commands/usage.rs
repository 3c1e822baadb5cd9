//! `leasegate usage`: calls, refusals, bytes and top hosts per lease, from egress lines: an
//! egress log file, or the egress stream every replica publishes to (`serve --egress-stream`).
//!
//! Invariant: both sources feed the same [`Tally`] one line at a time, so a file and a stream
//! holding the same lines give the same report; a stream's message counts only when
//! [`egress_stream::verify`] accepts it under the replicas' key. A line that does not count
//! (not an egress line; from the stream: blank, unsigned, a bad MAC, filed under another
//! lease's subject) is counted by reason and reported, never fatal.

use super::{block_on, load_ledger, require_journal, CliResult};
use crate::cli::{UsageArgs, UsageFormat};
use crate::contract::Timestamp;
use crate::nats::{subject_token, NatsError, NatsOptions, NatsStream};
use crate::registry::store::NatsLocation;
use crate::registry::{JournalLocation, StoreOptions};
use crate::telemetry::egress::{LoggedLine, LoggedModel, ReadLine};
use crate::telemetry::egress_stream::{self, EgressKey, Rejected, SetAside, EGRESS_SUBJECTS};
use anyhow::Context;
use async_nats::jetstream::consumer;
use futures_util::StreamExt;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::io::{self, BufRead};
use std::process::ExitCode;
use std::time::Duration;

/// Hosts listed per lease.
pub const TOP_HOSTS: usize = 5;
/// Routes of terminated hosts listed per lease.
pub const TOP_ROUTES: usize = 10;

/// The `--lease` value that selects lines without a lease.
pub const NO_LEASE: &str = "_";

/// How long the stream may stay silent, while it still holds lines for us, before the read
/// fails.
const STREAM_SILENCE: Duration = Duration::from_secs(10);

/// Which lines count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only this lease ([`NO_LEASE`]: lines without one).
    pub lease: Option<String>,
    /// Only lines logged at or after this instant.
    pub since: Option<Timestamp>,
}

impl Filter {
    /// Reads one egress line and keeps it (with its time) if it passes; a line that is not an egress line is
    /// counted in `unreadable` (a blank one is skipped silently).
    pub fn take(&self, line: &[u8], unreadable: &mut u64) -> Option<(Timestamp, LoggedLine)> {
        match LoggedLine::read(line) {
            ReadLine::Blank => None,
            ReadLine::Unreadable => {
                *unreadable += 1;
                None
            }
            ReadLine::Line(time, line) => self
                .admits(line.lease_id.as_deref(), time)
                .then_some((time, *line)),
        }
    }

    /// Whether a line of this lease, logged at `time`, passes.
    pub fn admits(&self, lease_id: Option<&str>, time: Timestamp) -> bool {
        let lease_ok = match (self.lease.as_deref(), lease_id) {
            (None, _) => true,
            (Some(NO_LEASE), None) => true,
            (Some(wanted), Some(id)) => wanted == id,
            (Some(_), None) => false,
        };
        lease_ok && self.since.is_none_or(|since| time >= since)
    }
}

/// One lease's usage, as printed (a JSON line with `--json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeaseUsage {
    /// `null`: lines whose client presented no lease (or none that could be read).
    pub lease_id: Option<String>,
    /// Requests and tunnels, whatever their verdict.
    pub calls: u64,
    /// Calls refused.
    pub refused: u64,
    /// 407 answers asking for credentials not sent yet (`lease-missing`): not refusals.
    pub challenges: u64,
    /// Refused calls by refusal code.
    pub refusals: BTreeMap<String, u64>,
    /// Bytes from client to upstream, and back.
    pub bytes_up: u64,
    pub bytes_down: u64,
    /// The most called hosts, most calls first (ties by name), at most [`TOP_HOSTS`].
    pub top_hosts: Vec<HostCalls>,
    /// Calls inside terminated tunnels by route (`METHOD host/path`, query left out), most
    /// first, at most [`TOP_ROUTES`].
    pub top_routes: Vec<RouteCalls>,
    /// The first and last line's time.
    pub first: Timestamp,
    pub last: Timestamp,
    /// Its model calls (lines with a `model` object); absent when it made none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelUsage>,
    /// Its MCP `tools/call`s that went out (each a step of `budget.steps`; lines with an
    /// `mcp` object); absent when it made none.
    #[serde(skip_serializing_if = "is_zero")]
    pub tool_calls: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One lease's model calls: what their egress lines' `model` objects add up to.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ModelUsage {
    /// Lines with a `model` object, metered or not.
    pub calls: u64,
    /// Sums over the metered calls.
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    /// Input plus output: what the budget's `tokens` counts.
    pub tokens: u64,
    /// The sum over the priced calls; `null` when none was priced.
    pub cost_usd: Option<f64>,
    /// Calls whose usage could not be read (their tokens are unknown, not zero).
    pub unmetered: u64,
    /// Metered calls of a model the price table lacks (their cost is unknown).
    pub unpriced: u64,
}

impl ModelUsage {
    fn add(&mut self, model: &LoggedModel) {
        self.calls += 1;
        let Some((input, output)) = model.tokens() else {
            self.unmetered += 1;
            return;
        };
        self.input_tokens = self.input_tokens.saturating_add(input);
        self.output_tokens = self.output_tokens.saturating_add(output);
        self.cached_tokens = self
            .cached_tokens
            .saturating_add(model.cached_tokens.unwrap_or(0));
        self.tokens = self.input_tokens.saturating_add(self.output_tokens);
        match model.cost() {
            Some(cost) => self.cost_usd = Some(self.cost_usd.unwrap_or(0.0) + cost),
            None => self.unpriced += 1,
        }
    }

    /// Calls whose tokens were read.
    pub fn metered(&self) -> u64 {
        self.calls - self.unmetered
    }

    /// The sum of `usages` (a lease and its descendants).
    pub fn sum<'a>(usages: impl IntoIterator<Item = &'a ModelUsage>) -> ModelUsage {
        usages
            .into_iter()
            .fold(ModelUsage::default(), |mut sum, u| {
                sum.calls += u.calls;
                sum.input_tokens = sum.input_tokens.saturating_add(u.input_tokens);
                sum.output_tokens = sum.output_tokens.saturating_add(u.output_tokens);
                sum.cached_tokens = sum.cached_tokens.saturating_add(u.cached_tokens);
                sum.tokens = sum.tokens.saturating_add(u.tokens);
                sum.cost_usd = match (sum.cost_usd, u.cost_usd) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
                };
                sum.unmetered += u.unmetered;
                sum.unpriced += u.unpriced;
                sum
            })
    }

    /// The contract's `usage` object (lease-record `definitions.usage`), where an absent
    /// member is unmeasured, not zero: `tokens` once a call was metered, `cost_usd` only when
    /// every metered call was priced; the call counts beside them say how complete they are.
    pub fn record(&self) -> UsageRecord {
        let metered = self.metered() > 0;
        UsageRecord {
            tokens: metered.then_some(self.tokens),
            cost_usd: (metered && self.unpriced == 0)
                .then(|| rounded(self.cost_usd.unwrap_or(0.0))),
            model_calls: self.calls,
            unmetered_calls: self.unmetered,
            unpriced_calls: self.unpriced,
        }
    }
}

/// The `usage` object as printed: the contract's members first, then the call counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageRecord {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    pub model_calls: u64,
    pub unmetered_calls: u64,
    pub unpriced_calls: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HostCalls {
    pub host: String,
    pub calls: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouteCalls {
    pub route: String,
    pub calls: u64,
}

/// The whole report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Most calls first; ties by lease id, lines without a lease last.
    pub leases: Vec<LeaseUsage>,
    /// Lines that did not count, by reason.
    pub set_aside: SetAside,
}

/// Counts as lines come in.
#[derive(Debug, Default)]
pub struct Tally {
    filter: Filter,
    leases: HashMap<Option<String>, Counts>,
    set_aside: SetAside,
}

#[derive(Debug)]
struct Counts {
    calls: u64,
    challenges: u64,
    refusals: BTreeMap<String, u64>,
    bytes_up: u64,
    bytes_down: u64,
    hosts: HashMap<String, u64>,
    routes: HashMap<String, u64>,
    first: Timestamp,
    last: Timestamp,
    model: Option<ModelUsage>,
    tool_calls: u64,
}

impl Tally {
    pub fn new(filter: Filter) -> Tally {
        Tally {
            filter,
            ..Tally::default()
        }
    }

    /// Counts one egress line (without its newline; an empty line is skipped silently).
    pub fn add(&mut self, line: &[u8]) {
        if let Some((time, line)) = self.filter.take(line, &mut self.set_aside.unreadable) {
            self.count(time, line);
        }
    }

    /// Counts a line read and verified already, if it passes the filter.
    pub fn add_read(&mut self, time: Timestamp, line: LoggedLine) {
        if self.filter.admits(line.lease_id.as_deref(), time) {
            self.count(time, line);
        }
    }

    /// Counts a message that was set aside.
    pub fn set_aside(&mut self, reason: Rejected) {
        self.set_aside.count(reason);
    }

    fn count(&mut self, time: Timestamp, line: LoggedLine) {
        let challenge = line.is_challenge();
        let route = line.route();
        let counts = self.leases.entry(line.lease_id).or_insert(Counts {
            calls: 0,
            challenges: 0,
            refusals: BTreeMap::new(),
            bytes_up: 0,
            bytes_down: 0,
            hosts: HashMap::new(),
            routes: HashMap::new(),
            first: time,
            last: time,
            model: None,
            tool_calls: 0,
        });
        counts.calls += 1;
        if let Some(model) = &line.model {
            counts.model.get_or_insert_default().add(model);
        }
        if let Some(steps) = line.mcp.as_ref().and_then(|m| m.steps) {
            counts.tool_calls = counts.tool_calls.saturating_add(steps);
        }
        if challenge {
            counts.challenges += 1;
        } else if line.verdict == "refuse" {
            let code = line.code.unwrap_or_else(|| "-".to_owned());
            *counts.refusals.entry(code).or_default() += 1;
        }
        counts.bytes_up = counts.bytes_up.saturating_add(line.bytes_up);
        counts.bytes_down = counts.bytes_down.saturating_add(line.bytes_down);
        if let Some(route) = route {
            *counts.routes.entry(route).or_default() += 1;
        }
        if let Some(host) = line.host {
            *counts.hosts.entry(host).or_default() += 1;
        }
        counts.first = counts.first.min(time);
        counts.last = counts.last.max(time);
    }

    pub fn finish(self) -> Report {
        let mut leases: Vec<LeaseUsage> = self
            .leases
            .into_iter()
            .map(|(lease_id, c)| {
                let hosts = top(c.hosts, TOP_HOSTS, |host, calls| HostCalls { host, calls });
                let routes = top(c.routes, TOP_ROUTES, |route, calls| RouteCalls {
                    route,
                    calls,
                });
                LeaseUsage {
                    lease_id,
                    calls: c.calls,
                    refused: c.refusals.values().sum(),
                    challenges: c.challenges,
                    refusals: c.refusals,
                    bytes_up: c.bytes_up,
                    bytes_down: c.bytes_down,
                    top_hosts: hosts,
                    top_routes: routes,
                    first: c.first,
                    last: c.last,
                    model: c.model.map(|mut m| {
                        m.cost_usd = m.cost_usd.map(rounded);
                        m
                    }),
                    tool_calls: c.tool_calls,
                }
            })
            .collect();
        leases.sort_by(|a, b| {
            b.calls
                .cmp(&a.calls)
                .then_with(|| a.lease_id.is_none().cmp(&b.lease_id.is_none()))
                .then_with(|| a.lease_id.cmp(&b.lease_id))
        });
        Report {
            leases,
            set_aside: self.set_aside,
        }
    }
}

/// The `n` most called of `calls`, most first, ties by name.
fn top<T>(calls: HashMap<String, u64>, n: usize, make: impl Fn(String, u64) -> T) -> Vec<T> {
    let mut sorted: Vec<(String, u64)> = calls.into_iter().collect();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    sorted.truncate(n);
    sorted
        .into_iter()
        .map(|(name, calls)| make(name, calls))
        .collect()
}

/// The report of `lines` under `filter`: the one aggregation both sources use.
pub fn aggregate<'a>(lines: impl IntoIterator<Item = &'a [u8]>, filter: Filter) -> Report {
    let mut tally = Tally::new(filter);
    for line in lines {
        tally.add(line);
    }
    tally.finish()
}

/// Feeds every line of an egress log (a file, stdin) to `tally`.
pub fn read_lines(input: impl BufRead, tally: &mut Tally) -> io::Result<()> {
    for_each_line(input, |line| tally.add(line))
}

/// Calls `each` with every line of `input`, without its newline (the last line may lack one).
pub fn for_each_line(mut input: impl BufRead, mut each: impl FnMut(&[u8])) -> io::Result<()> {
    let mut line = Vec::with_capacity(1024);
    loop {
        line.clear();
        if input.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        if line.last() == Some(&b'\n') {
            line.pop();
        }
        each(&line);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("reading {location}: {reason}")]
    Stream { location: String, reason: String },
}

/// Feeds `tally` the egress stream's lines that can pass its filter: only the filtered
/// lease's subject, and only messages stored since `--since` (a line is stored after it is
/// logged, so none that passes is left out; the line's own time decides in
/// [`Tally::add_read`]). Each message is verified under `key` first; what fails is set aside.
/// A stream that does not exist is an error (it is not created).
pub async fn read_stream(
    location: &NatsLocation,
    options: &NatsOptions,
    key: &EgressKey,
    tally: &mut Tally,
) -> Result<(), UsageError> {
    let stream_error = |reason: String| UsageError::Stream {
        location: location.to_string(),
        reason,
    };
    let stream = NatsStream::connect_existing(
        location,
        options,
        &egress_stream::spec(egress_stream::DEFAULT_MAX_AGE),
    )
    .await?;
    let head = stream
        .last_sequence()
        .await
        .map_err(|e| stream_error(e.to_string()))?;
    if head == 0 {
        return Ok(());
    }
    let filter_subject = match tally.filter.lease.as_deref() {
        Some(lease) => format!("{EGRESS_SUBJECTS}.{}", subject_token(Some(lease))),
        None => format!("{EGRESS_SUBJECTS}.>"),
    };
    let deliver_policy = match tally.filter.since {
        Some(since) => consumer::DeliverPolicy::ByStartTime {
            start_time: egress_stream::start_time(since)
                .ok_or_else(|| stream_error("--since: out of range".into()))?,
        },
        None => consumer::DeliverPolicy::All,
    };
    let consumer = stream
        .stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: stream.client.new_inbox(),
            filter_subject,
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| stream_error(e.to_string()))?;
    if consumer.cached_info().num_pending == 0 {
        return Ok(());
    }
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| stream_error(e.to_string()))?;
    loop {
        let next = tokio::time::timeout(STREAM_SILENCE, messages.next())
            .await
            .map_err(|_| stream_error(format!("no message for {STREAM_SILENCE:?}")))?;
        let message = match next {
            Some(Ok(message)) => message,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "egress stream reader");
                continue;
            }
            None => return Err(stream_error("the stream's consumer ended".into())),
        };
        let verified = egress_stream::verify(
            key,
            message.subject.as_str(),
            message.headers.as_ref(),
            &message.payload,
        );
        match verified {
            Ok(v) => tally.add_read(v.time, v.line),
            Err(reason) => tally.set_aside(reason),
        }
        let info = message.info().map_err(|e| stream_error(e.to_string()))?;
        // Done at the head as it was when we began, or when the filter has nothing left.
        if info.pending == 0 || info.stream_sequence >= head {
            return Ok(());
        }
    }
}

/// A fixed-width table, one row per lease.
pub fn render_table(leases: &[LeaseUsage]) -> String {
    let header = [
        "LEASE",
        "CALLS",
        "REFUSED",
        "CHALLENGES",
        "BYTES_UP",
        "BYTES_DOWN",
        "TOP_HOSTS",
        "REFUSALS",
    ];
    let cells: Vec<[String; 8]> = leases
        .iter()
        .map(|u| {
            let join = |items: Vec<String>| match items.is_empty() {
                true => "-".to_owned(),
                false => items.join(","),
            };
            [
                u.lease_id.clone().unwrap_or_else(|| "-".into()),
                u.calls.to_string(),
                u.refused.to_string(),
                u.challenges.to_string(),
                u.bytes_up.to_string(),
                u.bytes_down.to_string(),
                join(
                    u.top_hosts
                        .iter()
                        .map(|h| format!("{}({})", h.host, h.calls))
                        .collect(),
                ),
                join(
                    u.refusals
                        .iter()
                        .map(|(code, n)| format!("{code}({n})"))
                        .collect(),
                ),
            ]
        })
        .collect();
    if leases.iter().all(|u| u.model.is_none()) {
        return crate::table::render(header, &cells);
    }
    with_model_columns(header, cells, leases)
}

/// Columns shown after the others once any lease made model calls.
const MODEL_HEADER: [&str; 8] = [
    "MODEL_CALLS",
    "TOKENS_IN",
    "TOKENS_OUT",
    "CACHED",
    "TOKENS",
    "COST_USD",
    "UNMETERED",
    "UNPRICED",
];

/// The usage table with [`MODEL_HEADER`]'s columns appended (`-` for a lease without model
/// calls, and for the cost of one whose calls were never priced).
fn with_model_columns(header: [&str; 8], cells: Vec<[String; 8]>, leases: &[LeaseUsage]) -> String {
    let header: [&str; 16] = std::array::from_fn(|i| match i {
        0..8 => header[i],
        _ => MODEL_HEADER[i - 8],
    });
    let rows: Vec<[String; 16]> = cells
        .into_iter()
        .zip(leases)
        .map(|(cells, u)| {
            let model: [String; 8] = match &u.model {
                None => std::array::from_fn(|_| "-".to_owned()),
                Some(m) => [
                    m.calls.to_string(),
                    m.input_tokens.to_string(),
                    m.output_tokens.to_string(),
                    m.cached_tokens.to_string(),
                    m.tokens.to_string(),
                    m.cost_usd.map_or_else(|| "-".to_owned(), |c| c.to_string()),
                    m.unmetered.to_string(),
                    m.unpriced.to_string(),
                ],
            };
            let mut both = cells.into_iter().chain(model);
            std::array::from_fn(|_| both.next().unwrap_or_default())
        })
        .collect();
    crate::table::render(header, &rows)
}

/// `cost` to the nano-dollar: sums of prices print without float noise.
fn rounded(cost: f64) -> f64 {
    (cost * 1e9).round() / 1e9
}

/// Calls per route of terminated hosts, a row per lease and route; `None` when no lease has
/// any.
pub fn render_routes(leases: &[LeaseUsage]) -> Option<String> {
    let rows: Vec<[String; 3]> = leases
        .iter()
        .flat_map(|u| {
            u.top_routes.iter().map(|r| {
                [
                    u.lease_id.clone().unwrap_or_else(|| "-".into()),
                    r.route.clone(),
                    r.calls.to_string(),
                ]
            })
        })
        .collect();
    (!rows.is_empty()).then(|| crate::table::render(["LEASE", "ROUTE", "CALLS"], &rows))
}

/// MCP tool calls and steps (tool calls and model calls: what `budget.steps` counts) per
/// lease; `None` when no lease made a tool call.
pub fn render_tools(leases: &[LeaseUsage]) -> Option<String> {
    let rows: Vec<[String; 3]> = leases
        .iter()
        .filter(|u| u.tool_calls > 0)
        .map(|u| {
            let model_calls = u.model.as_ref().map_or(0, |m| m.calls);
            [
                u.lease_id.clone().unwrap_or_else(|| "-".into()),
                u.tool_calls.to_string(),
                u.tool_calls.saturating_add(model_calls).to_string(),
            ]
        })
        .collect();
    (!rows.is_empty()).then(|| crate::table::render(["LEASE", "TOOL_CALLS", "STEPS"], &rows))
}

/// The ids of `--lease` and every lease below it in `--journal` (signatures verified).
fn subtree(args: &UsageArgs) -> anyhow::Result<HashSet<String>> {
    let (Some(root), Some(ledger)) = (
        args.lease.as_deref(),
        args.lease_journal.ledger(&args.store),
    ) else {
        anyhow::bail!("--subtree needs --lease and --journal");
    };
    if root == NO_LEASE {
        anyhow::bail!("--subtree needs a lease id as --lease, not {NO_LEASE}");
    }
    require_journal(&ledger.journal)?;
    let ledger = load_ledger(&ledger)?;
    let mut ids: HashSet<String> = ledger
        .leases()
        .filter(|lease| ledger.ancestors(&lease.id).any(|a| a.id == root))
        .map(|lease| lease.id.clone())
        .collect();
    ids.insert(root.to_owned());
    Ok(ids)
}

/// `usage`: one report from an egress stream or an egress log file.
pub fn exec(args: UsageArgs) -> CliResult {
    let since = args.since.map(super::ago);
    let format = match (args.format, args.json) {
        (Some(format), _) => format,
        (None, true) => UsageFormat::Json,
        (None, false) => UsageFormat::Table,
    };
    if format == UsageFormat::Record && args.lease.as_deref() == Some(NO_LEASE) {
        anyhow::bail!("--format record needs a lease id as --lease, not {NO_LEASE}");
    }
    let subtree = match args.subtree {
        true => Some(subtree(&args)?),
        false => None,
    };
    // A subtree's lines are read whole and kept to its leases once counted.
    let mut tally = Tally::new(Filter {
        lease: args.lease.clone().filter(|_| subtree.is_none()),
        since,
    });
    match &args.from {
        JournalLocation::File(path) if path.as_os_str() == "-" => {
            read_lines(std::io::stdin().lock(), &mut tally).context("reading stdin")?
        }
        JournalLocation::File(path) => std::fs::File::open(path)
            .and_then(|file| read_lines(std::io::BufReader::new(file), &mut tally))
            .with_context(|| format!("reading {}", path.display()))?,
        JournalLocation::Nats(nats) => {
            // Fail closed: without the key, forged lines could not be told from real ones.
            let path = args.egress_stream_key.as_deref().ok_or_else(|| {
                anyhow::anyhow!(
                    "--from {}: a stream needs --egress-stream-key FILE, the replicas' key; \
                     only lines sealed with it count",
                    args.from
                )
            })?;
            let key = EgressKey::load(path)?;
            block_on(read_stream(
                nats,
                &StoreOptions::from(&args.store).nats,
                &key,
                &mut tally,
            ))?
        }
    }
    let mut report = tally.finish();
    if let Some(subtree) = &subtree {
        report
            .leases
            .retain(|u| u.lease_id.as_ref().is_some_and(|id| subtree.contains(id)));
    }
    let mut out = std::io::stdout().lock();
    let set_aside = report.set_aside;
    if format == UsageFormat::Record {
        let usage = ModelUsage::sum(report.leases.iter().filter_map(|u| u.model.as_ref()));
        serde_json::to_writer(&mut out, &usage.record())?;
        writeln!(out)?;
    } else if format == UsageFormat::Json {
        for lease in &report.leases {
            serde_json::to_writer(&mut out, lease)?;
            writeln!(out)?;
        }
        if set_aside.total() > 0 {
            serde_json::to_writer(&mut out, &serde_json::json!({ "set_aside": set_aside }))?;
            writeln!(out)?;
        }
    } else {
        out.write_all(render_table(&report.leases).as_bytes())?;
        if let Some(routes) = render_routes(&report.leases) {
            writeln!(out)?;
            out.write_all(routes.as_bytes())?;
        }
        if let Some(tools) = render_tools(&report.leases) {
            writeln!(out)?;
            out.write_all(tools.as_bytes())?;
        }
        if let Some(line) = set_aside_line(&set_aside) {
            writeln!(out)?;
            writeln!(out, "{line}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The text report's last line when lines did not count: how many, and why.
pub fn set_aside_line(set_aside: &SetAside) -> Option<String> {
    let total = set_aside.total();
    (total > 0).then(|| {
        format!(
            "set aside: {total} line(s) not counted ({})",
            set_aside.describe()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "00000001-0000-4000-8000-000000000000";
    const B: &str = "00000002-0000-4000-8000-000000000000";

    fn line(time: &str, lease: Option<&str>, host: Option<&str>, code: Option<&str>) -> String {
        serde_json::json!({
            "time": time,
            "lease_id": lease,
            "label": null,
            "client": "127.0.0.1:5000",
            "listener": "127.0.0.1:3128",
            "kind": "http",
            "method": "GET",
            "host": host,
            "port": 80,
            "dialed": null,
            "verdict": if code.is_some() { "refuse" } else { "allow" },
            "code": code,
            "status": if code.is_some() { 403 } else { 200 },
            "bytes_up": if code.is_some() { 0 } else { 10 },
            "bytes_down": if code.is_some() { 0 } else { 100 },
            "duration_ms": 1.5,
        })
        .to_string()
    }

    fn sample() -> Vec<String> {
        vec![
            line("2026-01-01T10:00:00.000Z", Some(A), Some("a.test"), None),
            line("2026-01-01T10:00:01.000Z", Some(A), Some("b.test"), None),
            line("2026-01-01T10:00:02.000Z", Some(A), Some("a.test"), None),
            line(
                "2026-01-01T10:00:03.000Z",
                Some(A),
                Some("evil.test"),
                Some("host-not-allowed"),
            ),
            line(
                "2026-01-01T10:00:04.000Z",
                Some(A),
                Some("a.test"),
                Some("lease-revoked"),
            ),
            line("2026-01-01T11:00:00.000Z", Some(B), Some("c.test"), None),
            line(
                "2026-01-01T11:00:01.000Z",
                None,
                None,
                Some("lease-missing"),
            ),
            "not json".to_owned(),
            "{\"time\": \"yesterday\"}".to_owned(),
            String::new(),
        ]
    }

    fn report(filter: Filter) -> Report {
        let lines = sample();
        aggregate(lines.iter().map(|l| l.as_bytes()), filter)
    }

    fn t(text: &str) -> Timestamp {
        Timestamp::parse(text).unwrap()
    }

    #[test]
    fn lines_sum_per_lease_with_refusals_by_code_and_top_hosts() {
        let report = report(Filter::default());
        assert_eq!(report.set_aside.unreadable, 2);
        assert_eq!(report.set_aside.total(), 2);
        assert_eq!(
            set_aside_line(&report.set_aside).as_deref(),
            Some("set aside: 2 line(s) not counted (unreadable 2)")
        );
        assert_eq!(set_aside_line(&SetAside::default()), None);
        assert_eq!(
            report.leases,
            vec![
                LeaseUsage {
                    lease_id: Some(A.into()),
                    calls: 5,
                    refused: 2,
                    challenges: 0,
                    refusals: BTreeMap::from([
                        ("host-not-allowed".into(), 1),
                        ("lease-revoked".into(), 1)
                    ]),
                    bytes_up: 30,
                    bytes_down: 300,
                    top_hosts: vec![
                        HostCalls {
                            host: "a.test".into(),
                            calls: 3
                        },
                        HostCalls {
                            host: "b.test".into(),
                            calls: 1
                        },
                        HostCalls {
                            host: "evil.test".into(),
                            calls: 1
                        },
                    ],
                    top_routes: vec![],
                    first: t("2026-01-01T10:00:00.000Z"),
                    last: t("2026-01-01T10:00:04.000Z"),
                    model: None,
                    tool_calls: 0,
                },
                LeaseUsage {
                    lease_id: Some(B.into()),
                    calls: 1,
                    refused: 0,
                    challenges: 0,
                    refusals: BTreeMap::new(),
                    bytes_up: 10,
                    bytes_down: 100,
                    top_hosts: vec![HostCalls {
                        host: "c.test".into(),
                        calls: 1
                    }],
                    top_routes: vec![],
                    first: t("2026-01-01T11:00:00.000Z"),
                    last: t("2026-01-01T11:00:00.000Z"),
                    model: None,
                    tool_calls: 0,
                },
                LeaseUsage {
                    lease_id: None,
                    calls: 1,
                    refused: 0,
                    challenges: 1,
                    refusals: BTreeMap::new(),
                    bytes_up: 0,
                    bytes_down: 0,
                    top_hosts: vec![],
                    top_routes: vec![],
                    first: t("2026-01-01T11:00:01.000Z"),
                    last: t("2026-01-01T11:00:01.000Z"),
                    model: None,
                    tool_calls: 0,
                },
            ]
        );
    }

    #[test]
    fn the_filter_selects_a_lease_lines_without_one_and_a_start() {
        let only_b = report(Filter {
            lease: Some(B.into()),
            since: None,
        });
        assert_eq!(only_b.leases.len(), 1);
        assert_eq!(only_b.leases[0].lease_id.as_deref(), Some(B));
        let none = report(Filter {
            lease: Some(NO_LEASE.into()),
            since: None,
        });
        assert_eq!(none.leases.len(), 1);
        assert_eq!(none.leases[0].lease_id, None);
        let recent = report(Filter {
            lease: None,
            since: Some(t("2026-01-01T10:00:02.000Z")),
        });
        let calls: Vec<(Option<&str>, u64)> = recent
            .leases
            .iter()
            .map(|u| (u.lease_id.as_deref(), u.calls))
            .collect();
        assert_eq!(calls, [(Some(A), 3), (Some(B), 1), (None, 1)]);
        assert_eq!(recent.leases[0].bytes_down, 100);
    }

    #[test]
    fn at_most_five_hosts_are_listed() {
        let lines: Vec<String> = (0..7)
            .flat_map(|i| {
                let host = format!("h{i}.test");
                (0..=i)
                    .map(|_| line("2026-01-01T10:00:00.000Z", Some(A), Some(&host), None))
                    .collect::<Vec<_>>()
            })
            .collect();
        let report = aggregate(lines.iter().map(|l| l.as_bytes()), Filter::default());
        let hosts: Vec<(&str, u64)> = report.leases[0]
            .top_hosts
            .iter()
            .map(|h| (h.host.as_str(), h.calls))
            .collect();
        assert_eq!(
            hosts,
            [
                ("h6.test", 7),
                ("h5.test", 6),
                ("h4.test", 5),
                ("h3.test", 4),
                ("h2.test", 3)
            ]
        );
    }

    #[test]
    fn a_file_reads_line_by_line_with_or_without_a_last_newline() {
        let text = sample().join("\n");
        let mut with = Tally::new(Filter::default());
        read_lines(format!("{text}\n").as_bytes(), &mut with).unwrap();
        let mut without = Tally::new(Filter::default());
        read_lines(text.as_bytes(), &mut without).unwrap();
        assert_eq!(with.finish(), report(Filter::default()));
        assert_eq!(without.finish(), report(Filter::default()));
    }

    #[test]
    fn the_table_has_a_row_per_lease() {
        let table = render_table(&report(Filter::default()).leases);
        let rows: Vec<&str> = table.lines().collect();
        assert_eq!(rows.len(), 4);
        assert_eq!(
            rows[0],
            "LEASE                                 CALLS  REFUSED  CHALLENGES  BYTES_UP  BYTES_DOWN  TOP_HOSTS                         REFUSALS"
        );
        assert_eq!(
            rows[1],
            format!("{A}  5      2        0           30        300         a.test(3),b.test(1),evil.test(1)  host-not-allowed(1),lease-revoked(1)")
        );
        assert_eq!(
            rows[3],
            "-                                     1      0        1           0         0           -                                 -"
        );
    }

    #[test]
    fn terminated_requests_are_counted_per_route_without_their_query() {
        let https = |method: &str, path: &str| {
            format!(
                r#"{{"time":"2026-12-01T10:00:00.000Z","lease_id":"L","host":"api.test","verdict":"allow","code":null,"bytes_up":1,"bytes_down":2,"kind":"https","method":"{method}","path":"{path}"}}"#
            )
        };
        let lines = [
            https("GET", "/repos/a?page=[redacted]"),
            https("GET", "/repos/a"),
            https("POST", "/issues"),
            line("2026-12-01T10:00:01Z", Some("L"), Some("api.test"), None),
        ];
        let report = aggregate(lines.iter().map(|l| l.as_bytes()), Filter::default());
        let routes: Vec<(&str, u64)> = report.leases[0]
            .top_routes
            .iter()
            .map(|r| (r.route.as_str(), r.calls))
            .collect();
        assert_eq!(
            routes,
            [("GET api.test/repos/a", 2), ("POST api.test/issues", 1)]
        );
        assert_eq!(
            render_routes(&report.leases).unwrap(),
            "LEASE  ROUTE                 CALLS\nL      GET api.test/repos/a  2\nL      POST api.test/issues  1\n"
        );
        assert_eq!(render_routes(&[]), None);
    }

    #[test]
    fn tool_calls_are_summed_from_mcp_objects_and_shown_as_steps() {
        let mcp = |lease: &str, steps: u64| {
            serde_json::json!({
                "time": "2026-12-01T10:00:00.000Z", "lease_id": lease, "host": "mcp.test",
                "verdict": "allow", "code": null, "bytes_up": 1, "bytes_down": 2,
                "kind": "forward", "method": "POST",
                "mcp": {"server": "notes", "steps": steps, "messages": []},
            })
            .to_string()
        };
        let lines = [mcp("L", 1), mcp("L", 3), mcp("M", 0)];
        let report = aggregate(lines.iter().map(|l| l.as_bytes()), Filter::default());
        let of = |id: &str| {
            report
                .leases
                .iter()
                .find(|u| u.lease_id.as_deref() == Some(id))
                .unwrap()
                .clone()
        };
        assert_eq!(of("L").tool_calls, 4);
        let json = serde_json::to_value(of("M")).unwrap();
        assert!(json.get("tool_calls").is_none(), "{json}");
        assert_eq!(
            render_tools(&report.leases).unwrap(),
            "LEASE  TOOL_CALLS  STEPS\nL      4           4\n"
        );
        assert_eq!(render_tools(&[]), None);
    }

    /// A model call's line for lease `lease` with this `model` object.
    fn model_line(lease: &str, model: serde_json::Value) -> String {
        serde_json::json!({
            "time": "2026-12-01T10:00:00.000Z", "lease_id": lease, "host": "api.test",
            "verdict": "allow", "code": null, "bytes_up": 1, "bytes_down": 2,
            "kind": "https", "method": "POST", "path": "/v1/chat/completions", "model": model,
        })
        .to_string()
    }

    fn model_report() -> Report {
        let lines = [
            model_line(
                A,
                serde_json::json!({"api": "openai", "name": "gpt-4o-mini", "input_tokens": 12, "output_tokens": 30, "cached_tokens": 4, "cost_usd": 0.000123}),
            ),
            model_line(
                A,
                serde_json::json!({"api": "openai", "name": "gpt-4o-mini", "input_tokens": 100, "output_tokens": 1, "cached_tokens": 0, "cost_usd": 0.000246}),
            ),
            model_line(
                A,
                serde_json::json!({"api": "openai", "name": "mystery", "input_tokens": 5, "output_tokens": 5, "cached_tokens": 0, "cost_usd": null, "unpriced": true}),
            ),
            model_line(
                A,
                serde_json::json!({"api": "openai", "name": null, "unmetered": "no usage in the response"}),
            ),
            // Present but not a model object: a call whose usage is unknown, not a lost line.
            model_line(A, serde_json::json!({"input_tokens": -3})),
            line("2026-12-01T10:00:01.000Z", Some(B), Some("c.test"), None),
        ];
        aggregate(lines.iter().map(|l| l.as_bytes()), Filter::default())
    }

    #[test]
    fn model_calls_sum_tokens_and_priced_cost_and_count_the_rest() {
        let report = model_report();
        assert_eq!(report.set_aside.unreadable, 0);
        assert_eq!(report.leases[0].calls, 5);
        assert_eq!(
            report.leases[0].model,
            Some(ModelUsage {
                calls: 5,
                input_tokens: 117,
                output_tokens: 36,
                cached_tokens: 4,
                tokens: 153,
                cost_usd: Some(0.000369),
                unmetered: 2,
                unpriced: 1,
            })
        );
        assert_eq!(report.leases[1].model, None);
        let json = serde_json::to_value(&report.leases[0]).unwrap();
        assert_eq!(json["model"]["tokens"], 153);
        assert_eq!(json["model"]["cost_usd"], 0.000369);
        let plain = serde_json::to_value(&report.leases[1]).unwrap();
        assert!(plain.get("model").is_none(), "{plain}");
    }

    #[test]
    fn the_record_leaves_out_what_was_not_measured() {
        let report = model_report();
        let usage = report.leases[0].model.clone().unwrap();
        // One metered call was not priced: its cost is unknown, so the sum is no cost.
        assert_eq!(
            serde_json::to_value(usage.record()).unwrap(),
            serde_json::json!({"tokens": 153, "model_calls": 5, "unmetered_calls": 2, "unpriced_calls": 1})
        );
        let priced = ModelUsage {
            unpriced: 0,
            ..usage.clone()
        };
        assert_eq!(priced.record().cost_usd, Some(0.000369));
        let unmetered = ModelUsage {
            calls: 1,
            unmetered: 1,
            ..ModelUsage::default()
        };
        assert_eq!(
            serde_json::to_value(unmetered.record()).unwrap(),
            serde_json::json!({"model_calls": 1, "unmetered_calls": 1, "unpriced_calls": 0})
        );
        let both = ModelUsage::sum([&usage, &unmetered]);
        assert_eq!((both.calls, both.tokens, both.unmetered), (6, 153, 3));
    }

    #[test]
    fn model_columns_appear_only_when_a_lease_made_model_calls() {
        let plain = render_table(&report(Filter::default()).leases);
        assert!(!plain.contains("MODEL_CALLS"), "{plain}");
        let table = render_table(&model_report().leases);
        let rows: Vec<&str> = table.lines().collect();
        assert!(
            rows[0].ends_with("REFUSALS  MODEL_CALLS  TOKENS_IN  TOKENS_OUT  CACHED  TOKENS  COST_USD  UNMETERED  UNPRICED"),
            "{}",
            rows[0]
        );
        assert!(
            rows[1].ends_with(
                "5            117        36          4       153     0.000369  2          1"
            ),
            "{}",
            rows[1]
        );
        assert!(
            rows[2].ends_with(
                "-            -          -           -       -       -         -          -"
            ),
            "{}",
            rows[2]
        );
    }
}
