//! The report's "CPU per operation" table and "Targets vs the floor": the proxy process's user
//! and system CPU over each load run (`cpu_r{ROUND}_{FIGURE}_{VARIANT}.json`, which run.sh
//! writes from `compare-harness cpu` before and after the run) divided by what that run did
//! (tunnels, requests, MB), medians over rounds, and leasegate's figures as ratios to the
//! floor's.
//!
//! Invariant: a figure's CPU and its operation count come from the same run (same round,
//! figure and variant); a run with no operations, or a CPU reading missing either side, is
//! left out, never counted as zero. A run's CPU is the nanosecond run time (`cpu_s`) unless it
//! falls short of the clock ticks (`user_s` + `system_s`) by more than their rounding — a
//! thread that ended during the run took its run time with it — and then the ticks; it is
//! split into user and system in the ticks' proportion. Direct has no proxy: its column is the
//! origin's CPU.

use super::{fmt_num, label};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The figures the table gives, in order: (figure, what one operation is).
const FIGURES: [(&str, &str); 3] = [
    ("connect", "CONNECT tunnel (setup loop)"),
    ("ka32", "kept-alive forwarded request"),
    ("bulk", "MB of bulk through a tunnel"),
];

/// The table's columns, in order.
const COLUMNS: [&str; 5] = [
    "direct",
    "floor",
    "leasegate-credentials",
    "leasegate-lease-port",
    "squid",
];

/// One run's CPU per operation, in µs, and the user part of it (unknown when the run was
/// shorter than a clock tick).
#[derive(Clone, Copy)]
struct Sample {
    total: f64,
    user_share: Option<f64>,
}

/// A figure's medians over rounds, in µs per operation, and how far its rounds spread.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figure {
    /// The total's user and system parts (the median user share of the rounds').
    pub user: Option<f64>,
    pub system: Option<f64>,
    pub total: f64,
    /// (max − min) ÷ median of the rounds' totals; `None` with fewer than two rounds.
    pub spread: Option<f64>,
}

/// CPU per operation by figure and variant.
#[derive(Default)]
pub struct PerOp {
    /// figure → variant → the proxy's figure (the origin's for direct).
    figures: BTreeMap<String, BTreeMap<String, Figure>>,
    /// figure → variant → the origin's figure, every variant.
    origin: BTreeMap<String, BTreeMap<String, Figure>>,
}

/// (max − min) ÷ median; `None` with fewer than two values or a zero median.
pub fn spread(values: &[f64]) -> Option<f64> {
    if values.len() < 2 {
        return None;
    }
    let max = values.iter().copied().fold(f64::MIN, f64::max);
    let min = values.iter().copied().fold(f64::MAX, f64::min);
    let median = super::median(values.to_vec())?;
    (median != 0.0).then(|| (max - min) / median)
}

/// The CPU `who` used over a run, per operation: from `{"before": {WHO: {"user_s", "system_s",
/// "cpu_s"}}, "after": {...}}`.
fn sample(cpu: &Value, who: &str, ops: f64) -> Option<Sample> {
    if ops <= 0.0 || !ops.is_finite() {
        return None;
    }
    let delta = |field: &str| {
        let after = cpu["after"][who][field].as_f64()?;
        let before = cpu["before"][who][field].as_f64()?;
        (after >= before).then_some(after - before)
    };
    let (user, system) = (delta("user_s")?, delta("system_s")?);
    let ticks = user + system;
    // Each of the four tick counts is rounded down to a tick.
    let rounding = 2.0 / cpu["after"]["clk_tck"].as_f64().unwrap_or(100.0);
    let total = match delta("cpu_s") {
        Some(precise) if precise >= ticks - rounding => precise,
        _ => ticks,
    };
    Some(Sample {
        total: total * 1e6 / ops,
        user_share: (ticks > 0.0).then(|| user / ticks),
    })
}

fn figure(samples: &[Sample]) -> Option<Figure> {
    let totals: Vec<f64> = samples.iter().map(|s| s.total).collect();
    let total = super::median(totals.clone())?;
    let share = super::median(samples.iter().filter_map(|s| s.user_share).collect());
    Some(Figure {
        user: share.map(|s| total * s),
        system: share.map(|s| total * (1.0 - s)),
        total,
        spread: spread(&totals),
    })
}

impl PerOp {
    /// From the CPU readings by (figure, variant, round) and the operations each run did.
    pub fn collect(
        cpu: &BTreeMap<(String, String, u32), Value>,
        ops: &BTreeMap<(String, String, u32), f64>,
    ) -> PerOp {
        type Samples = BTreeMap<(String, String), Vec<Sample>>;
        let (mut proxy, mut origin): (Samples, Samples) = Default::default();
        for (key @ (fig, variant, _), reading) in cpu {
            let Some(&n) = ops.get(key) else {
                continue;
            };
            let who = if variant == "direct" {
                "origin"
            } else {
                "proxy"
            };
            let id = (fig.clone(), variant.clone());
            if let Some(s) = sample(reading, who, n) {
                proxy.entry(id.clone()).or_default().push(s);
            }
            if let Some(s) = sample(reading, "origin", n) {
                origin.entry(id).or_default().push(s);
            }
        }
        let fold = |samples: Samples| {
            let mut out: BTreeMap<String, BTreeMap<String, Figure>> = BTreeMap::new();
            for ((fig, variant), s) in samples {
                if let Some(f) = figure(&s) {
                    out.entry(fig).or_default().insert(variant, f);
                }
            }
            out
        };
        PerOp {
            figures: fold(proxy),
            origin: fold(origin),
        }
    }

    pub fn get(&self, figure: &str, variant: &str) -> Option<Figure> {
        self.figures.get(figure)?.get(variant).copied()
    }

    /// `variant`'s total over `reference`'s for `figure`.
    pub fn ratio(&self, figure: &str, variant: &str, reference: &str) -> Option<f64> {
        let r = self.get(figure, reference)?.total;
        (r > 0.0).then(|| self.get(figure, variant).map(|f| f.total / r))?
    }

    /// The largest spread of rounds among `figure`'s columns.
    pub fn spread(&self, figure: &str) -> Option<f64> {
        let by_variant = self.figures.get(figure)?;
        COLUMNS
            .iter()
            .filter_map(|v| by_variant.get(*v)?.spread)
            .reduce(f64::max)
    }

    pub fn is_empty(&self) -> bool {
        self.figures.is_empty()
    }

    /// The markdown section: heading, table and its notes.
    pub fn table(&self, conc: &str) -> Result<String, std::fmt::Error> {
        let mut md = String::new();
        writeln!(md, "\n## CPU per operation\n")?;
        writeln!(
            md,
            "User + system CPU of the proxy process (and its child processes) per operation, in µs: \
             read before and after each load run (the threads' run time from \
             `/proc/PID/task/*/schedstat`, split into user and system as `/proc/PID/stat`'s utime \
             and stime are), divided by the tunnels, requests or MB the run completed; medians over rounds. **`× floor`** (the headline) is the ratio \
             to the floor, a proxy doing the same socket work and nothing else; `× sq` to Squid.\n"
        )?;
        write!(md, "| CPU per |")?;
        for v in COLUMNS {
            write!(
                md,
                " {}{} |",
                label(v),
                if v == "direct" { " ⁶" } else { "" }
            )?;
        }
        writeln!(md, " spread of rounds ⁵ |")?;
        writeln!(md, "|---|{}---:|", "---:|".repeat(COLUMNS.len()))?;
        for (fig, what) in FIGURES {
            let name = match fig {
                "connect" => format!("{what}, {conc} concurrent"),
                "ka32" => format!("{what}, {conc} conns"),
                _ => what.to_owned(),
            };
            write!(md, "| {name} |")?;
            for v in COLUMNS {
                let Some(f) = self.get(fig, v) else {
                    write!(md, " – |")?;
                    continue;
                };
                let mut cell = match (f.user, f.system) {
                    (Some(user), Some(system)) => format!(
                        "{} + {} = {} µs",
                        fmt_num(user, 1),
                        fmt_num(system, 1),
                        fmt_num(f.total, 1)
                    ),
                    _ => format!("{} µs", fmt_num(f.total, 1)),
                };
                let mut ratios = Vec::new();
                if v.starts_with("leasegate") {
                    if let Some(r) = self.ratio(fig, v, "floor") {
                        ratios.push(format!("**{r:.2}× floor**"));
                    }
                } else if v == "squid" {
                    if let Some(r) = self.ratio(fig, v, "floor") {
                        ratios.push(format!("{r:.2}× floor"));
                    }
                }
                if v != "direct" && v != "squid" {
                    if let Some(r) = self.ratio(fig, v, "squid") {
                        ratios.push(format!("{r:.2}× sq"));
                    }
                }
                if !ratios.is_empty() {
                    write!(cell, " ({})", ratios.join(", "))?;
                }
                write!(md, " {cell} |")?;
            }
            writeln!(md, " {} |", percent(self.spread(fig)))?;
        }
        writeln!(md)?;
        writeln!(
            md,
            "6. Direct has no proxy: its column is the origin's own CPU for the same operation served \
             directly (a plain connect and close for the tunnel row), for scale."
        )?;
        Ok(md)
    }

    /// Everything, for results.json: figure → variant → {proxy, origin}.
    pub fn to_json(&self) -> Value {
        let one = |f: &Figure| json!({"user_us": f.user, "system_us": f.system, "total_us": f.total, "spread": f.spread});
        // (`user_us`/`system_us` are null where every round was shorter than a clock tick.)
        let mut out = Map::new();
        for (fig, by_variant) in &self.origin {
            let mut row = Map::new();
            for (variant, origin) in by_variant {
                let proxy = self.get(fig, variant).filter(|_| variant != "direct");
                row.insert(
                    variant.clone(),
                    json!({"proxy": proxy.as_ref().map(one), "origin": one(origin)}),
                );
            }
            out.insert(fig.clone(), Value::Object(row));
        }
        Value::Object(out)
    }
}

/// A spread as a percentage, or "one round".
pub fn percent(spread: Option<f64>) -> String {
    match spread {
        Some(s) => format!("{:.1} %", s * 100.0),
        None => "one round".into(),
    }
}

/// A throughput of one variant, and its spread of rounds, as the main table has them.
pub struct Throughput<'a> {
    pub value: &'a dyn Fn(&str, &str) -> Option<f64>,
    pub spread: &'a dyn Fn(&str) -> Option<f64>,
}

/// "Targets vs the floor": leasegate (credentials) judged, the lease port and Squid shown;
/// each verdict says when its margin is within the noise its figures showed.
pub fn floor_targets(per_op: &PerOp, thr: &Throughput) -> Vec<(String, Option<bool>)> {
    let lg = "leasegate-credentials";
    let lp = "leasegate-lease-port";
    let mut out = Vec::new();
    let nan = |x: Option<f64>| x.unwrap_or(f64::NAN);
    for (fig, what, bound) in [
        ("connect", "CPU per CONNECT tunnel", 1.2),
        ("ka32", "CPU per kept-alive request", 1.5),
    ] {
        let r = per_op.ratio(fig, lg, "floor");
        let ok = r.map(|r| r <= bound);
        out.push((
            format!(
                "{what} ≤ {bound}× floor: {} — {:.2}× floor ({} vs {} µs; lease port {:.2}×; Squid {:.2}×){}",
                mark(ok),
                nan(r),
                fmt_num(nan(per_op.get(fig, lg).map(|f| f.total)), 1),
                fmt_num(nan(per_op.get(fig, "floor").map(|f| f.total)), 1),
                nan(per_op.ratio(fig, lp, "floor")),
                nan(per_op.ratio(fig, "squid", "floor")),
                noise_note(r, bound, per_op.spread(fig)),
            ),
            ok,
        ));
    }
    {
        let mbs = |v| (thr.value)("bulk.mb_per_s", v);
        let r_of = |v| Some(mbs(v)? / mbs("floor").filter(|f| *f > 0.0)?);
        let r = r_of(lg);
        let ok = r.map(|r| r >= 0.95);
        out.push((
            format!(
                "Bulk MB/s ≥ 0.95× floor: {} — {:.2}× floor ({} vs {} MB/s; lease port {:.2}×; Squid {:.2}×; CPU per MB {:.2}× floor){}",
                mark(ok),
                nan(r),
                fmt_num(nan(mbs(lg)), 0),
                fmt_num(nan(mbs("floor")), 0),
                nan(r_of(lp)),
                nan(r_of("squid")),
                nan(per_op.ratio("bulk", lg, "floor")),
                noise_note(r, 0.95, (thr.spread)("bulk.mb_per_s")),
            ),
            ok,
        ));
    }
    {
        // CPU no more than 5 % above, throughput no more than 5 % below the main listener's.
        let mut parts = Vec::new();
        let mut verdicts = Vec::new();
        for (fig, what) in [
            ("connect", "per tunnel"),
            ("ka32", "per request"),
            ("bulk", "per MB"),
        ] {
            let r = per_op.ratio(fig, lp, lg);
            verdicts.push(r.map(|r| r <= 1.05));
            parts.push(format!("CPU {what} {:.2}×", nan(r)));
        }
        for (key, what) in [
            ("connect.per_s", "tunnels/s"),
            ("ka32.rps", "requests/s"),
            ("bulk.mb_per_s", "MB/s"),
        ] {
            let r = (thr.value)(key, lp)
                .zip((thr.value)(key, lg).filter(|x| *x > 0.0))
                .map(|(a, b)| a / b);
            verdicts.push(r.map(|r| r >= 0.95));
            parts.push(format!("{what} {:.2}×", nan(r)));
        }
        let ok = verdicts.iter().try_fold(true, |all, v| v.map(|v| all && v));
        out.push((
            format!(
                "Lease-port figures within 5 % of the main listener's (CPU at most 1.05×, throughput at least 0.95×): {} — {}",
                mark(ok),
                parts.join(", ")
            ),
            ok,
        ));
    }
    out
}

/// " (within this run's noise of N %)" when `ratio` is nearer `bound` than the noise.
fn noise_note(ratio: Option<f64>, bound: f64, noise: Option<f64>) -> String {
    match (ratio, noise) {
        (Some(r), Some(n)) if ((r - bound) / bound).abs() <= n => {
            format!(" (within this run's noise of {:.1} %)", n * 100.0)
        }
        _ => String::new(),
    }
}

fn mark(ok: Option<bool>) -> &'static str {
    match ok {
        Some(true) => "**met**",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(before: (f64, f64), after: (f64, f64), origin: (f64, f64)) -> Value {
        json!({
            "before": {"proxy": {"user_s": before.0, "system_s": before.1},
                       "origin": {"user_s": 0.0, "system_s": 0.0}},
            "after": {"proxy": {"user_s": after.0, "system_s": after.1},
                      "origin": {"user_s": origin.0, "system_s": origin.1}},
        })
    }

    /// Two rounds of CONNECT: per-tunnel CPU, its median, spread and ratio; a run without
    /// operations is left out; direct's column is the origin's.
    #[test]
    fn cpu_per_operation_is_the_runs_cpu_over_its_operations() {
        let mut cpu = BTreeMap::new();
        let mut ops = BTreeMap::new();
        let k = |v: &str, r| ("connect".to_string(), v.to_string(), r);
        // floor: 0.4 s + 0.6 s over 20,000 tunnels = 50 µs; then 0.5 + 0.7 = 60 µs.
        cpu.insert(k("floor", 1), reading((1.0, 2.0), (1.4, 2.6), (0.2, 0.2)));
        ops.insert(k("floor", 1), 20_000.0);
        cpu.insert(k("floor", 2), reading((1.4, 2.6), (1.9, 3.3), (0.2, 0.2)));
        ops.insert(k("floor", 2), 20_000.0);
        // leasegate: 0.6 + 0.6 = 1.2 s over 20,000 = 60 µs (one round).
        cpu.insert(
            k("leasegate-credentials", 1),
            reading((0.0, 0.0), (0.6, 0.6), (0.2, 0.2)),
        );
        ops.insert(k("leasegate-credentials", 1), 20_000.0);
        // A run that did nothing: left out, not a zero or an infinity.
        cpu.insert(k("squid", 1), reading((0.0, 0.0), (0.5, 0.5), (0.0, 0.0)));
        ops.insert(k("squid", 1), 0.0);
        // direct: the origin's 0.1 + 0.3 s over 40,000 = 10 µs.
        cpu.insert(
            k("direct", 1),
            json!({"before": {"origin": {"user_s": 0.0, "system_s": 0.0}},
                   "after": {"origin": {"user_s": 0.1, "system_s": 0.3}}}),
        );
        ops.insert(k("direct", 1), 40_000.0);
        let per_op = PerOp::collect(&cpu, &ops);

        let floor = per_op.get("connect", "floor").unwrap();
        assert!((floor.total - 55.0).abs() < 1e-9, "{floor:?}");
        // The user share: median of 0.4 and 5/12.
        assert!(
            (floor.user.unwrap() - 55.0 * (0.4 + 5.0 / 12.0) / 2.0).abs() < 1e-9,
            "{floor:?}"
        );
        assert!((floor.spread.unwrap() - 10.0 / 55.0).abs() < 1e-9);
        let lg = per_op.get("connect", "leasegate-credentials").unwrap();
        assert!((lg.total - 60.0).abs() < 1e-9);
        assert_eq!(lg.spread, None);
        assert!(
            (per_op
                .ratio("connect", "leasegate-credentials", "floor")
                .unwrap()
                - 60.0 / 55.0)
                .abs()
                < 1e-9
        );
        assert!(per_op.get("connect", "squid").is_none());
        assert!((per_op.get("connect", "direct").unwrap().total - 10.0).abs() < 1e-9);

        let md = per_op.table("32").unwrap();
        assert!(
            md.contains("| CONNECT tunnel (setup loop), 32 concurrent | 2.5 + 7.5 = 10.0 µs | 22.5 + 32.5 = 55.0 µs | 30.0 + 30.0 = 60.0 µs (**1.09× floor**) | – | – | 18.2 % |"),
            "{md}"
        );
    }

    /// The nanosecond run time is used where it agrees with the ticks; where a thread that
    /// ended took its run time along, the ticks; under a tick, the total alone.
    #[test]
    fn the_run_time_counts_unless_an_ended_thread_took_it_along() {
        let reading = |ticks: (f64, f64), cpu_s: f64| {
            json!({"before": {"clk_tck": 100.0, "proxy": {"user_s": 1.0, "system_s": 1.0, "cpu_s": 10.0}},
                   "after": {"clk_tck": 100.0, "proxy": {"user_s": 1.0 + ticks.0, "system_s": 1.0 + ticks.1, "cpu_s": 10.0 + cpu_s}}})
        };
        let one = |r: Value| {
            let key = ("bulk".to_string(), "floor".to_string(), 1);
            let per_op = PerOp::collect(&[(key.clone(), r)].into(), &[(key, 100.0)].into());
            per_op.get("bulk", "floor").unwrap()
        };
        // 23.4 ms of run time over 100 MB, between 2 and 3 ticks: 234 µs per MB, split 1 : 1.
        let f = one(reading((0.01, 0.01), 0.0234));
        assert!((f.total - 234.0).abs() < 1e-6, "{f:?}");
        assert!((f.user.unwrap() - 117.0).abs() < 1e-6, "{f:?}");
        // 5 ticks but 10 ms of run time: a thread ended; the ticks count.
        let f = one(reading((0.03, 0.02), 0.01));
        assert!((f.total - 500.0).abs() < 1e-6, "{f:?}");
        // Under a tick: the total, no split.
        let f = one(reading((0.0, 0.0), 0.004));
        assert!((f.total - 40.0).abs() < 1e-6, "{f:?}");
        assert_eq!((f.user, f.system), (None, None));
    }

    #[test]
    fn floor_targets_judge_leasegate_and_say_when_noise_decides() {
        let mut cpu = BTreeMap::new();
        let mut ops = BTreeMap::new();
        for (v, fig, secs) in [
            ("floor", "connect", 1.0),
            ("leasegate-credentials", "connect", 1.3),
            ("leasegate-lease-port", "connect", 1.3),
            ("floor", "ka32", 1.0),
            ("leasegate-credentials", "ka32", 1.4),
            ("leasegate-lease-port", "ka32", 1.4),
            ("floor", "bulk", 1.0),
            ("leasegate-credentials", "bulk", 1.0),
            ("leasegate-lease-port", "bulk", 1.0),
        ] {
            let key = (fig.to_string(), v.to_string(), 1);
            cpu.insert(key.clone(), reading((0.0, 0.0), (secs, 0.0), (0.0, 0.0)));
            ops.insert(key, 1000.0);
        }
        let per_op = PerOp::collect(&cpu, &ops);
        let value = |key: &str, v: &str| match (key, v) {
            ("bulk.mb_per_s", "floor") => Some(1000.0),
            ("bulk.mb_per_s", _) => Some(960.0),
            (_, "leasegate-lease-port") => Some(900.0),
            _ => Some(1000.0),
        };
        let spread = |key: &str| (key == "bulk.mb_per_s").then_some(0.02);
        let lines = floor_targets(
            &per_op,
            &Throughput {
                value: &value,
                spread: &spread,
            },
        );
        let verdicts: Vec<Option<bool>> = lines.iter().map(|(_, ok)| *ok).collect();
        assert_eq!(
            verdicts,
            vec![Some(false), Some(true), Some(true), Some(false)]
        );
        assert!(
            lines[0].0.contains("1.30× floor (1,300.0 vs 1,000.0 µs"),
            "{}",
            lines[0].0
        );
        assert!(
            lines[2].0.contains("(within this run's noise of 2.0 %)"),
            "{}",
            lines[2].0
        );
        assert!(!lines[1].0.contains("noise"), "{}", lines[1].0);
        assert!(lines[3].0.contains("tunnels/s 0.90×"), "{}", lines[3].0);
    }
}
