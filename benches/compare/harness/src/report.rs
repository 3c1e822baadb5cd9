//! `compare-harness report`: folds the per-run files that run.sh leaves in a directory into
//! RESULTS.md (one table, ratios to the floor, to direct and to Squid, the CPU per operation,
//! the targets) and results.json.
//!
//! Files read from `--runs DIR`:
//! - `r{ROUND}_{FIGURE}_{VARIANT}.json`: one run; FIGURE is ka1, ka32, close32 (load tool output:
//!   oha `--output-format json`, or the wrk script's JSON), connect (connect-rate) or bulk (bulk).
//! - `cpu_r{ROUND}_{FIGURE}_{VARIANT}.json`: `{"before": CPU, "after": CPU}` around that run,
//!   CPU being `compare-harness cpu --pids proxy=PID,origin=PID` (no proxy for direct).
//! - `rss_{VARIANT}.json`: `{"vmhwm_kib": N, "vmrss_kib": N}` after every round.
//! - `idle_{VARIANT}.json`: idle-tunnels output.

use crate::{Opts, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

mod per_op;

const VARIANTS: [&str; 6] = [
    "direct",
    "floor",
    "leasegate-credentials",
    "leasegate-lease-port",
    "squid",
    "tinyproxy",
];

fn label(variant: &str) -> &'static str {
    match variant {
        "direct" => "direct",
        "floor" => "floor",
        "leasegate-credentials" => "leasegate (credentials)",
        "leasegate-lease-port" => "leasegate (lease port)",
        "squid" => "Squid",
        "tinyproxy" => "tinyproxy",
        _ => "?",
    }
}

/// One measured quantity of one run.
#[derive(Default, Clone)]
struct Run {
    values: BTreeMap<&'static str, f64>,
    ok: f64,
    bad: f64,
    first_error: Option<String>,
    /// What the run did, for CPU per operation: tunnels, requests or MB (10^6 bytes).
    ops: f64,
}

/// Normalises a load-tool run (oha JSON or the wrk script's JSON).
fn load_run(v: &Value) -> Run {
    let mut run = Run::default();
    if v.get("summary").is_some() {
        // oha
        let total = v["summary"]["total"].as_f64().unwrap_or(0.0);
        let mut ok = 0.0;
        let mut bad = 0.0;
        if let Some(codes) = v["statusCodeDistribution"].as_object() {
            for (code, n) in codes {
                let n = n.as_f64().unwrap_or(0.0);
                if code == "200" {
                    ok += n;
                } else {
                    bad += n;
                    run.first_error
                        .get_or_insert_with(|| format!("status {code}"));
                }
            }
        }
        if let Some(errors) = v["errorDistribution"].as_object() {
            for (msg, n) in errors {
                // Requests still in flight when the duration ends are cut off by design.
                if msg.contains("aborted due to deadline") {
                    continue;
                }
                bad += n.as_f64().unwrap_or(0.0);
                run.first_error.get_or_insert_with(|| msg.clone());
            }
        }
        run.ok = ok;
        run.bad = bad;
        run.ops = ok;
        if total > 0.0 {
            run.values.insert("rps", ok / total);
        }
        let pct = &v["latencyPercentiles"];
        if let Some(p50) = pct["p50"].as_f64() {
            run.values.insert("p50_us", p50 * 1e6);
        }
        if let Some(p99) = pct["p99"].as_f64() {
            run.values.insert("p99_us", p99 * 1e6);
        }
    } else {
        // wrk script: {"tool":"wrk","seconds":..,"requests":..,"errors":..,"non2xx":..,"p50_us":..,"p99_us":..}
        let secs = v["seconds"].as_f64().unwrap_or(0.0);
        let requests = v["requests"].as_f64().unwrap_or(0.0);
        let non2xx = v["non2xx"].as_f64().unwrap_or(0.0);
        let errors = v["errors"].as_f64().unwrap_or(0.0);
        run.ok = requests - non2xx;
        run.bad = non2xx + errors;
        run.ops = run.ok;
        if run.bad > 0.0 {
            run.first_error = Some(format!("{non2xx} non-2xx, {errors} socket errors"));
        }
        if secs > 0.0 {
            run.values.insert("rps", run.ok / secs);
        }
        for k in ["p50_us", "p99_us"] {
            if let Some(x) = v[k].as_f64() {
                run.values.insert(k, x);
            }
        }
    }
    run
}

fn harness_run(figure: &str, v: &Value) -> Run {
    let mut run = Run::default();
    match figure {
        "connect" => {
            run.ok = v["tunnels"].as_f64().unwrap_or(0.0);
            run.bad = v["errors"].as_f64().unwrap_or(0.0);
            run.first_error = v["first_error"].as_str().map(str::to_owned);
            run.ops = run.ok;
            run.values
                .insert("per_s", v["per_s"].as_f64().unwrap_or(0.0));
            run.values
                .insert("p50_us", v["p50_us"].as_f64().unwrap_or(0.0));
            run.values
                .insert("p99_us", v["p99_us"].as_f64().unwrap_or(0.0));
        }
        "bulk" => {
            run.ok = v["repeat"].as_f64().unwrap_or(0.0);
            run.ops = run.ok * v["bytes"].as_f64().unwrap_or(0.0) / 1e6;
            run.values
                .insert("mb_per_s", v["mb_per_s"].as_f64().unwrap_or(0.0));
        }
        _ => {}
    }
    run
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// A row of the table: how to get each variant's value.
struct Row {
    name: String,
    key: &'static str,
    unit: &'static str,
    decimals: usize,
}

fn fmt_num(x: f64, decimals: usize) -> String {
    let s = format!("{x:.decimals$}");
    // Thousands separators on the integer part.
    let (int, frac) = match s.find('.') {
        Some(i) => (&s[..i], &s[i..]),
        None => (&s[..], ""),
    };
    let (sign, digits) = match int.strip_prefix('-') {
        Some(d) => ("-", d),
        None => ("", int),
    };
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    format!("{sign}{out}{frac}")
}

fn ratio(x: f64, reference: Option<f64>) -> Option<f64> {
    match reference {
        Some(r) if r != 0.0 => Some(x / r),
        _ => None,
    }
}

pub fn report(opts: &Opts) -> Result<()> {
    let dir = Path::new(opts.req("runs")?);
    let out_md = opts.req("out-md")?;
    let out_json = opts.req("out-json")?;

    // figure → variant → runs
    let mut runs: BTreeMap<String, BTreeMap<String, Vec<Run>>> = BTreeMap::new();
    let mut raw_runs: Vec<Value> = Vec::new();
    let mut rss: BTreeMap<String, Value> = BTreeMap::new();
    let mut idle: BTreeMap<String, Value> = BTreeMap::new();
    // (figure, variant, round) → the CPU reading around the run, and what the run did.
    let mut cpu: BTreeMap<(String, String, u32), Value> = BTreeMap::new();
    let mut ops: BTreeMap<(String, String, u32), f64> = BTreeMap::new();
    // figure.key → variant → the rounds' values (for their spread).
    let mut rounds: BTreeMap<String, BTreeMap<&str, Vec<f64>>> = BTreeMap::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    names.sort();
    for name in names {
        let text = std::fs::read_to_string(dir.join(&name))?;
        let stem = name.trim_end_matches(".json");
        let value: Value = match serde_json::from_str(&text) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("report: {name}: not JSON ({e}); skipped");
                continue;
            }
        };
        if let Some(variant) = stem.strip_prefix("rss_") {
            rss.insert(variant.to_owned(), value);
            continue;
        }
        if let Some(variant) = stem.strip_prefix("idle_") {
            idle.insert(variant.to_owned(), value);
            continue;
        }
        let (stem, is_cpu) = match stem.strip_prefix("cpu_") {
            Some(run) => (run, true),
            None => (stem, false),
        };
        let mut parts = stem.splitn(3, '_');
        let (Some(round), Some(figure), Some(variant)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let Some(round) = round.strip_prefix('r').and_then(|r| r.parse::<u32>().ok()) else {
            continue;
        };
        if is_cpu {
            cpu.insert((figure.to_owned(), variant.to_owned(), round), value);
            continue;
        }
        let run = match figure {
            "ka1" | "ka32" | "close32" => load_run(&value),
            _ => harness_run(figure, &value),
        };
        raw_runs.push(json!({
            "round": round, "figure": figure, "variant": variant,
            "values": run.values.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<Map<_, _>>(),
            "ok": run.ok, "bad": run.bad, "first_error": run.first_error,
        }));
        ops.insert((figure.to_owned(), variant.to_owned(), round), run.ops);
        runs.entry(figure.to_owned())
            .or_default()
            .entry(variant.to_owned())
            .or_default()
            .push(run);
    }

    // Medians: figure.key → variant → value.
    let mut med: BTreeMap<String, BTreeMap<&str, f64>> = BTreeMap::new();
    let mut errors: BTreeMap<&str, (f64, f64, Option<String>)> = BTreeMap::new();
    for (figure, by_variant) in &runs {
        for variant in VARIANTS {
            let Some(rs) = by_variant.get(variant) else {
                continue;
            };
            let keys: Vec<&'static str> = rs
                .iter()
                .flat_map(|r| r.values.keys().copied())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            for key in keys {
                let vals: Vec<f64> = rs
                    .iter()
                    .filter_map(|r| r.values.get(key).copied())
                    .collect();
                rounds
                    .entry(format!("{figure}.{key}"))
                    .or_default()
                    .insert(variant, vals.clone());
                if let Some(m) = median(vals) {
                    med.entry(format!("{figure}.{key}"))
                        .or_default()
                        .insert(variant, m);
                }
            }
            let e = errors.entry(variant).or_default();
            for r in rs {
                e.0 += r.ok;
                e.1 += r.bad;
                if e.2.is_none() {
                    e.2 = r.first_error.as_ref().map(|m| format!("{figure}: {m}"));
                }
            }
        }
    }
    // How far a row's rounds spread: the largest (max − min) ÷ median among its variants.
    let spread_of = |key: &str| -> Option<f64> {
        rounds
            .get(key)?
            .values()
            .filter_map(|vals| per_op::spread(vals))
            .reduce(f64::max)
    };
    let per_op = per_op::PerOp::collect(&cpu, &ops);
    // Added p50 latency at 1 connection, over direct.
    if let Some(p50) = med.get("ka1.p50_us").cloned() {
        if let Some(&d) = p50.get("direct") {
            let added: BTreeMap<&str, f64> = p50.iter().map(|(v, x)| (*v, x - d)).collect();
            med.insert("ka1.p50_added_us".into(), added);
        }
    }
    for (variant, v) in &rss {
        if let Some(variant) = VARIANTS.iter().find(|x| **x == variant.as_str()) {
            if let Some(h) = v["vmhwm_kib"].as_f64() {
                med.entry("rss.peak_mib".into())
                    .or_default()
                    .insert(variant, h / 1024.0);
            }
        }
    }
    let mut idle_count = None;
    for (variant, v) in &idle {
        if let Some(variant) = VARIANTS.iter().find(|x| **x == variant.as_str()) {
            idle_count = v["opened"].as_u64().or(idle_count);
            if let Some(r) = v["rss_after_kib"].as_f64() {
                med.entry("idle.rss_mib".into())
                    .or_default()
                    .insert(variant, r / 1024.0);
            }
            if let Some(b) = v["bytes_per_tunnel"].as_f64() {
                med.entry("idle.kib_per_tunnel".into())
                    .or_default()
                    .insert(variant, b / 1024.0);
            }
        }
    }

    let conc: String = opts.opt("concurrency").unwrap_or("32").to_owned();
    let bulk_mib = opts
        .opt("bulk-bytes")
        .and_then(|b| b.parse::<f64>().ok())
        .map(|b| b / (1024.0 * 1024.0))
        .unwrap_or(100.0);
    let idle_n = idle_count
        .map(|n| fmt_num(n as f64, 0))
        .unwrap_or_else(|| "N".into());
    let rows = vec![
        Row {
            name: "HTTP keep-alive, 1 conn: requests/s".into(),
            key: "ka1.rps",
            unit: "",
            decimals: 0,
        },
        Row {
            name: "HTTP keep-alive, 1 conn: p50 latency".into(),
            key: "ka1.p50_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: "HTTP keep-alive, 1 conn: p99 latency".into(),
            key: "ka1.p99_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: "HTTP keep-alive, 1 conn: p50 added over direct".into(),
            key: "ka1.p50_added_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: format!("HTTP keep-alive, {conc} conns: requests/s"),
            key: "ka32.rps",
            unit: "",
            decimals: 0,
        },
        Row {
            name: format!("HTTP keep-alive, {conc} conns: p50 latency"),
            key: "ka32.p50_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: format!("HTTP keep-alive, {conc} conns: p99 latency"),
            key: "ka32.p99_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: format!("HTTP new connection per request, {conc} conns: requests/s"),
            key: "close32.rps",
            unit: "",
            decimals: 0,
        },
        Row {
            name: format!("CONNECT setup, {conc} concurrent: tunnels/s ¹"),
            key: "connect.per_s",
            unit: "",
            decimals: 0,
        },
        Row {
            name: "CONNECT setup: p50".into(),
            key: "connect.p50_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: "CONNECT setup: p99".into(),
            key: "connect.p99_us",
            unit: " µs",
            decimals: 0,
        },
        Row {
            name: format!(
                "CONNECT bulk, {} MiB plain HTTP in the tunnel: MB/s ²",
                fmt_num(bulk_mib, 0)
            ),
            key: "bulk.mb_per_s",
            unit: "",
            decimals: 0,
        },
        Row {
            name: "peak RSS (VmHWM) after the rounds ³".into(),
            key: "rss.peak_mib",
            unit: " MiB",
            decimals: 1,
        },
        Row {
            name: format!("RSS with {idle_n} idle tunnels"),
            key: "idle.rss_mib",
            unit: " MiB",
            decimals: 1,
        },
        Row {
            name: "RSS per idle tunnel".into(),
            key: "idle.kib_per_tunnel",
            unit: " KiB",
            decimals: 1,
        },
    ];

    // Pinned runs (`--proxy-cores K`): every proxy had K cores of its own; throughputs are
    // also given per core.
    let proxy_cores: Option<f64> = opts.opt("proxy-cores").and_then(|k| k.parse().ok());
    let per_core = |key: &str| {
        matches!(
            key,
            "ka1.rps" | "ka32.rps" | "close32.rps" | "connect.per_s" | "bulk.mb_per_s"
        )
    };
    // The CONNECT setup figures measure the proxies only if the harness can go much faster.
    let harness_bound = med.get("connect.per_s").and_then(|m| {
        let direct = *m.get("direct")?;
        let fastest = m
            .iter()
            .filter(|(v, _)| **v != "direct")
            .map(|(_, x)| *x)
            .fold(0.0, f64::max);
        (fastest > 0.0 && direct < 3.0 * fastest).then_some((direct, fastest))
    });
    if let Some((direct, fastest)) = harness_bound {
        eprintln!(
            "report: WARNING: direct connect-and-close ({direct:.0}/s) is under 3× the fastest proxy's tunnels/s ({fastest:.0}/s): the CONNECT setup figures may measure the harness, not the proxies"
        );
    }

    let mut md = String::new();
    let meta = |k: &str| opts.opt(k).unwrap_or("?").to_owned();
    let machine = machine_info();
    writeln!(md, "# leasegate end-to-end comparison\n")?;
    writeln!(
        md,
        "Generated by `benches/compare/run.sh` — do not edit by hand; see `benches/compare/README.md`.\n"
    )?;
    writeln!(
        md,
        "- **Date**: {} (run took {})",
        meta("date"),
        meta("elapsed")
    )?;
    writeln!(
        md,
        "- **Machine**: {} cores, {}, {} memory, Linux {}, TCP congestion control {}",
        machine["nproc"],
        machine["cpu"].as_str().unwrap_or("?"),
        machine["memory"].as_str().unwrap_or("?"),
        machine["kernel"].as_str().unwrap_or("?"),
        machine["tcp_congestion_control"].as_str().unwrap_or("?")
    )?;
    match opts.opt("leasegate-bin").filter(|b| !b.is_empty()) {
        Some(bin) => writeln!(
            md,
            "- **leasegate**: the prebuilt binary `{bin}` (this checkout: git {})",
            meta("leasegate-rev")
        )?,
        None => writeln!(
            md,
            "- **leasegate**: git {} (`{}` build)",
            meta("leasegate-rev"),
            meta("leasegate-profile")
        )?,
    }
    writeln!(md, "- **Squid**: {}", meta("squid-version"))?;
    writeln!(md, "- **tinyproxy**: {}", meta("tinyproxy-version"))?;
    writeln!(
        md,
        "- **Load tool**: {} (same for every variant)",
        meta("load-tool")
    )?;
    writeln!(
        md,
        "- **Settings**: {} round(s), {} s per load run, {} connections for the concurrent figures, alternating variants within each figure, medians over rounds{}",
        meta("rounds"),
        meta("duration"),
        conc,
        if opts.opt("quick") == Some("1") { " — **QUICK=1 smoke run: short runs, numbers are indicative only**" } else { "" }
    )?;
    writeln!(md, "- **CPUs**: {}", meta("pinning"))?;
    writeln!(md, "- **Reproduce**: `{}`\n", meta("command"))?;

    // The table.
    write!(md, "| figure |")?;
    for v in VARIANTS {
        write!(md, " {} |", label(v))?;
    }
    writeln!(md, " spread of rounds ⁵ |")?;
    write!(md, "|---|")?;
    for _ in VARIANTS {
        write!(md, "---:|")?;
    }
    writeln!(md, "---:|")?;
    for row in &rows {
        let Some(vals) = med.get(row.key) else {
            continue;
        };
        write!(md, "| {} |", row.name)?;
        let direct = if row.key == "ka1.p50_added_us" {
            None
        } else {
            vals.get("direct").copied()
        };
        let squid = vals.get("squid").copied();
        let floor = vals.get("floor").copied();
        for v in VARIANTS {
            match vals.get(v) {
                None => write!(md, " – |")?,
                Some(&x) => {
                    let mut cell = format!("{}{}", fmt_num(x, row.decimals), row.unit);
                    let mut ratios = Vec::new();
                    // Throughputs: the ratio to the floor first, the headline.
                    if v != "direct" && v != "floor" && per_core(row.key) {
                        if let Some(r) = ratio(x, floor) {
                            ratios.push(format!("{r:.2}× fl"));
                        }
                    }
                    if v != "direct" {
                        if let Some(r) = ratio(x, direct) {
                            ratios.push(format!("{r:.2}× d"));
                        }
                    }
                    if v != "squid" && row.key != "ka1.p50_added_us" {
                        if let Some(r) = ratio(x, squid) {
                            ratios.push(format!("{r:.2}× sq"));
                        }
                    }
                    if let Some(cores) = proxy_cores.filter(|_| v != "direct" && per_core(row.key))
                    {
                        ratios.push(format!("{}/core", fmt_num(x / cores, row.decimals)));
                    }
                    if !ratios.is_empty() {
                        write!(cell, " ({})", ratios.join(", "))?;
                    }
                    write!(md, " {cell} |")?;
                }
            }
        }
        let spread = match row.key {
            "ka1.p50_added_us" => "–".to_owned(),
            key if key.starts_with("rss.") || key.starts_with("idle.") => "–".to_owned(),
            key => per_op::percent(spread_of(key)),
        };
        writeln!(md, " {spread} |")?;
    }
    // Errors row.
    write!(md, "| failed requests / tunnels, all runs ⁴ |")?;
    for v in VARIANTS {
        match errors.get(v) {
            Some((ok, bad, _)) => {
                write!(md, " {} of {} |", fmt_num(*bad, 0), fmt_num(ok + bad, 0))?
            }
            None => write!(md, " – |")?,
        }
    }
    writeln!(md, " – |")?;
    writeln!(md)?;
    writeln!(
        md,
        "`× fl` = ratio to the floor (throughput rows), `× d` = ratio to direct, `× sq` = ratio to Squid (value ÷ reference, so for latencies and memory lower is better). \
Latencies are the load tool's (oha) or the harness's, end to end from the client. \
The floor (`compare-harness floor`) is the cheapest proxy doing leasegate's socket work and nothing else: \
the same runtime layout (a current-thread runtime per core), socket options, hyper 1 server and client, splice(2) relay and per-worker upstream pool, \
with no identification, policy, address guard, logging, metrics or timeouts; what leasegate costs beyond it is what `× fl` and `× floor` measure."
    )?;
    writeln!(md)?;
    writeln!(
        md,
        "1. direct: a plain TCP connect + close to the origin (no proxy, no CONNECT), for scale. Every proxy dials the origin before answering 200.{}",
        match harness_bound {
            Some((direct, fastest)) => format!(
                " **Warning: direct ({}/s) is under 3× the fastest proxy ({}/s), so these rows may measure the harness (client or origin), not the proxies.**",
                fmt_num(direct, 0),
                fmt_num(fastest, 0)
            ),
            None => String::new(),
        }
    )?;
    writeln!(
        md,
        "2. The tunnel carries plain HTTP (`GET /big` to the origin's HTTP port) so TLS cost stays out of the proxy comparison; direct = the same request over plain TCP. Median of {} downloads per round, each on a fresh tunnel.",
        meta("bulk-repeat")
    )?;
    writeln!(
        md,
        "3. VmHWM from /proc/PID/status after every load round and before the idle-tunnel test; direct has no proxy process. leasegate's two columns are the same process."
    )?;
    writeln!(
        md,
        "4. Non-200 answers and transport errors seen by the load tool and the harness (oha's requests cut off at the end of the duration are not counted). First error per variant: {}.",
        {
            let list: Vec<String> = VARIANTS
                .iter()
                .filter_map(|v| {
                    errors
                        .get(v)
                        .and_then(|e| e.2.as_ref())
                        .map(|m| format!("{}: `{}`", label(v), m.replace('`', "'")))
                })
                .collect();
            if list.is_empty() { "none".to_owned() } else { list.join("; ") }
        }
    )?;
    writeln!(
        md,
        "5. How far a row's rounds spread: the largest (max − min) ÷ median of the per-round values among its columns (\"one round\" when each figure ran once). A ratio nearer 1 than this is a tie."
    )?;
    if let Some(note) = opts.opt("notes") {
        if !note.is_empty() {
            writeln!(md)?;
            writeln!(md, "{note}")?;
        }
    }

    if !per_op.is_empty() {
        md.push_str(&per_op.table(&conc)?);
    }

    // Targets (leasegate by credentials; lease port in parentheses).
    writeln!(md, "\n## Targets\n")?;
    let get = |k: &str, v: &str| med.get(k).and_then(|m| m.get(v)).copied();
    let mut targets = Vec::new();
    let lg = "leasegate-credentials";
    let lp = "leasegate-lease-port";
    let mark = |ok: Option<bool>| match ok {
        Some(true) => "**met**",
        Some(false) => "**missed**",
        None => "not measured",
    };
    {
        let r_sq = |v| Some(get("ka32.rps", v)? / get("ka32.rps", "squid")?);
        let r_d = |v| Some(get("ka32.rps", v)? / get("ka32.rps", "direct")?);
        // The target (docs/performance.md) is the Squid ratio; the ratio to direct is shown, not judged.
        let ok = r_sq(lg).map(|a| a >= 2.5);
        let line = format!(
            "Plain-HTTP keep-alive requests/s ≥ 2.5× Squid ({conc} conns): {} — {:.2}× Squid, {:.2}× direct (lease port: {:.2}× Squid, {:.2}× direct; at 1 conn: {:.2}× Squid, {:.2}× direct)",
            mark(ok),
            r_sq(lg).unwrap_or(f64::NAN), r_d(lg).unwrap_or(f64::NAN),
            r_sq(lp).unwrap_or(f64::NAN), r_d(lp).unwrap_or(f64::NAN),
            get("ka1.rps", lg).zip(get("ka1.rps", "squid")).map(|(a, b)| a / b).unwrap_or(f64::NAN),
            get("ka1.rps", lg).zip(get("ka1.rps", "direct")).map(|(a, b)| a / b).unwrap_or(f64::NAN),
        );
        targets.push((line, ok));
    }
    {
        let r = |v| Some(get("bulk.mb_per_s", v)? / get("bulk.mb_per_s", "direct")?);
        let ok = r(lg).map(|x| x >= 0.9);
        targets.push((
            format!(
                "CONNECT bulk throughput ≥ 0.9× direct: {} — {:.2}× direct ({} vs {} MB/s; lease port {:.2}×)",
                mark(ok),
                r(lg).unwrap_or(f64::NAN),
                fmt_num(get("bulk.mb_per_s", lg).unwrap_or(f64::NAN), 0),
                fmt_num(get("bulk.mb_per_s", "direct").unwrap_or(f64::NAN), 0),
                r(lp).unwrap_or(f64::NAN),
            ),
            ok,
        ));
    }
    {
        let r = |v| Some(get("connect.per_s", v)? / get("connect.per_s", "squid")?);
        let ok = r(lg).map(|x| x >= 2.0);
        targets.push((
            format!(
                "New CONNECT tunnels/s ≥ 2× Squid: {} — {:.2}× Squid ({} vs {} tunnels/s; lease port {:.2}×)",
                mark(ok),
                r(lg).unwrap_or(f64::NAN),
                fmt_num(get("connect.per_s", lg).unwrap_or(f64::NAN), 0),
                fmt_num(get("connect.per_s", "squid").unwrap_or(f64::NAN), 0),
                r(lp).unwrap_or(f64::NAN),
            ),
            ok,
        ));
    }
    {
        let a = get("ka1.p50_added_us", lg);
        let ok = a.map(|x| x <= 150.0);
        targets.push((
            format!(
                "p50 added latency at 1 connection ≤ 150 µs over direct: {} — {} µs (lease port {} µs; direct p50 {} µs)",
                mark(ok),
                fmt_num(a.unwrap_or(f64::NAN), 0),
                fmt_num(get("ka1.p50_added_us", lp).unwrap_or(f64::NAN), 0),
                fmt_num(get("ka1.p50_us", "direct").unwrap_or(f64::NAN), 0),
            ),
            ok,
        ));
    }
    {
        let k = get("idle.kib_per_tunnel", lg);
        let ok = k.map(|x| x <= 64.0);
        targets.push((
            format!(
                "≤ 64 KiB per idle tunnel: {} — {:.1} KiB per tunnel over {idle_n} tunnels{}",
                mark(ok),
                k.unwrap_or(f64::NAN),
                get("idle.kib_per_tunnel", "squid")
                    .map(|s| format!(" (Squid: {s:.1} KiB)"))
                    .unwrap_or_default()
            ),
            ok,
        ));
    }
    for (line, _) in &targets {
        writeln!(md, "- {line}")?;
    }

    // Targets vs the floor (leasegate by credentials judged; lease port and Squid shown).
    let value = |key: &str, v: &str| get(key, v);
    let throughput = per_op::Throughput {
        value: &value,
        spread: &spread_of,
    };
    let floor_targets = per_op::floor_targets(&per_op, &throughput);
    writeln!(md, "\n## Targets vs the floor\n")?;
    for (line, _) in &floor_targets {
        writeln!(md, "- {line}")?;
    }
    writeln!(
        md,
        "- Noise (spread of rounds, footnote 5): CPU per tunnel {}, per request {}, per MB {}; tunnels/s {}, requests/s {}, MB/s {}.",
        per_op::percent(per_op.spread("connect")),
        per_op::percent(per_op.spread("ka32")),
        per_op::percent(per_op.spread("bulk")),
        per_op::percent(spread_of("connect.per_s")),
        per_op::percent(spread_of("ka32.rps")),
        per_op::percent(spread_of("bulk.mb_per_s")),
    )?;
    std::fs::write(out_md, &md)?;

    let medians: Map<String, Value> = med
        .iter()
        .map(|(k, m)| {
            (
                k.clone(),
                Value::Object(m.iter().map(|(v, x)| (v.to_string(), json!(x))).collect()),
            )
        })
        .collect();
    let out = json!({
        "meta": {
            "date": meta("date"), "elapsed": meta("elapsed"), "leasegate_rev": meta("leasegate-rev"), "leasegate_profile": meta("leasegate-profile"),
            "leasegate_bin": opts.opt("leasegate-bin").filter(|b| !b.is_empty()),
            "squid": meta("squid-version"), "tinyproxy": meta("tinyproxy-version"),
            "load_tool": meta("load-tool"), "rounds": meta("rounds"), "duration_s": meta("duration"),
            "concurrency": conc, "quick": opts.opt("quick") == Some("1"), "command": meta("command"),
            "pinning": meta("pinning"), "proxy_cores": proxy_cores, "harness_bound": harness_bound.is_some(),
            "machine": machine,
        },
        "medians": medians,
        "errors": errors.iter().map(|(v, (ok, bad, first))| (v.to_string(), json!({"ok": ok, "failed": bad, "first": first}))).collect::<Map<_, _>>(),
        "targets": targets.iter().map(|(l, ok)| json!({"target": l, "met": ok})).collect::<Vec<_>>(),
        "floor_targets": floor_targets.iter().map(|(l, ok)| json!({"target": l, "met": ok})).collect::<Vec<_>>(),
        "cpu_per_op": per_op.to_json(),
        "spread": rounds.keys().map(|k| (k.clone(), json!(spread_of(k)))).collect::<Map<_, _>>(),
        "rss": rss,
        "idle_tunnels": idle,
        "runs": raw_runs,
    });
    std::fs::write(out_json, serde_json::to_string_pretty(&out)? + "\n")?;
    print!("{md}");
    Ok(())
}

fn machine_info() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("model name")?
                    .split_once(':')
                    .map(|x| x.1.trim().to_owned())
            })
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                let kib: f64 = l
                    .strip_prefix("MemTotal:")?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()?;
                Some(format!("{:.1} GiB", kib / 1024.0 / 1024.0))
            })
        })
        .unwrap_or_else(|| "?".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    // The bulk figure depends on it: BBR (a common default) paces every TCP sender with a
    // timer when no fq qdisc does; direct has one such hop, a tunnel two (leasegate's own
    // loopback sockets use reno, ARCHITECTURE.md, "Loopback is unpaced").
    let congestion = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    json!({"nproc": nproc, "cpu": cpu, "memory": memory, "kernel": kernel,
           "tcp_congestion_control": congestion})
}

#[cfg(test)]
mod tests {
    use super::report;
    use crate::Opts;
    use serde_json::json;

    /// A report from run files and CPU readings: the floor's column, `× fl` on throughputs,
    /// the spread of rounds, the CPU table and the targets against the floor.
    #[test]
    fn the_report_measures_every_variant_against_the_floor() {
        let dir = std::env::temp_dir().join(format!("compare-report-{}", std::process::id()));
        let runs = dir.join("runs");
        std::fs::create_dir_all(&runs).unwrap();
        let write = |name: &str, v: serde_json::Value| {
            std::fs::write(runs.join(name), v.to_string()).unwrap();
        };
        // Two rounds of CONNECT setup; the floor 10,000 and 12,000 tunnels/s.
        for (variant, per_s, cpu_s) in [
            ("direct", [40_000.0, 40_000.0], 0.5),
            ("floor", [10_000.0, 12_000.0], 1.0),
            ("leasegate-credentials", [9_000.0, 9_000.0], 1.1),
            ("leasegate-lease-port", [9_000.0, 9_000.0], 1.1),
            ("squid", [5_000.0, 5_000.0], 2.0),
        ] {
            for (round, per_s) in per_s.iter().enumerate() {
                let r = round + 1;
                write(
                    &format!("r{r}_connect_{variant}.json"),
                    json!({"tunnels": 20_000, "errors": 0, "per_s": per_s, "p50_us": 100, "p99_us": 900}),
                );
                let side = |s: f64| json!({"user_s": s / 2.0, "system_s": s / 2.0, "cpu_s": s});
                let who = if variant == "direct" {
                    "origin"
                } else {
                    "proxy"
                };
                write(
                    &format!("cpu_r{r}_connect_{variant}.json"),
                    json!({"before": {"clk_tck": 100, who: side(0.0), "origin": side(0.0)},
                           "after": {"clk_tck": 100, who: side(cpu_s), "origin": side(0.2)}}),
                );
            }
        }
        let (md, js) = (dir.join("out.md"), dir.join("out.json"));
        let opts = Opts(
            [
                ("runs", runs.to_str().unwrap()),
                ("out-md", md.to_str().unwrap()),
                ("out-json", js.to_str().unwrap()),
                ("concurrency", "32"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        );
        report(&opts).unwrap();
        let md = std::fs::read_to_string(&md).unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&js).unwrap()).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(
            md.contains("| figure | direct | floor | leasegate (credentials) | leasegate (lease port) | Squid | tinyproxy | spread of rounds ⁵ |"),
            "{md}"
        );
        // 9,000 over the floor's median 11,000; the floor's rounds spread 2,000 / 11,000.
        assert!(
            md.contains("| 9,000 (0.82× fl, 0.23× d, 1.80× sq) |"),
            "{md}"
        );
        assert!(md.contains("| 18.2 % |"), "{md}");
        // 1.1 s over 20,000 tunnels = 55 µs against the floor's 50 µs.
        assert!(
            md.contains("| 27.5 + 27.5 = 55.0 µs (**1.10× floor**, 0.55× sq) |"),
            "{md}"
        );
        assert!(
            md.contains("- CPU per CONNECT tunnel ≤ 1.2× floor: **met** — 1.10× floor (55.0 vs 50.0 µs; lease port 1.10×; Squid 2.00×)"),
            "{md}"
        );
        assert_eq!(json["floor_targets"][0]["met"], json!(true));
        assert_eq!(
            json["cpu_per_op"]["connect"]["leasegate-credentials"]["proxy"]["total_us"],
            json!(55.0)
        );
        assert_eq!(json["medians"]["connect.per_s"]["floor"], json!(11_000.0));
    }
}
