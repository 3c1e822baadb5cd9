#!/usr/bin/env python3
"""The "Metered model calls" section of RESULTS.md from metered.sh's raw runs.

Invariant: the section between the markers is replaced whole (or appended); nothing else in
the file changes. Medians over rounds; the noise is the spread of the unmetered variant's own
figures over rounds, and a target is called met only within it.
"""
import argparse
import glob
import json
import os
import re
import statistics

from brokered_report import write_section

BEGIN, END = "<!-- metered:begin -->", "<!-- metered:end -->"
VARIANTS = ["metered", "unmetered"]
TITLES = {"metered": 'leasegate, `meter = "openai"`', "unmetered": "leasegate, no `meter`"}
CPU_TARGET = 1.05


def load(runs):
    """{variant: [run, ...]} from rROUND_VARIANT.json files, in round order."""
    out = {v: [] for v in VARIANTS}
    for path in sorted(glob.glob(os.path.join(runs, "r*_*.json")), key=lambda p: int(re.match(r"r(\d+)", os.path.basename(p)).group(1))):
        m = re.match(r"r(\d+)_(metered|unmetered)\.json$", os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError):
            run = {"requests": 0, "errors": 1, "first_error": "no result"}
        out[m.group(2)].append(run)
    return out


def figures(run):
    """The per-run figures, or None for a run without an answer."""
    n = run.get("requests", 0)
    if n <= 0:
        return None
    return {
        "per_s": run["per_s"],
        "cpu_ms": 1000 * run["cpu_s"] / n,
        "ttfb50": run["ttfb_p50_us"] / 1000,
        "ttfb99": run["ttfb_p99_us"] / 1000,
        "full50": run["p50_us"] / 1000,
    }


def med(runs, v, key):
    vals = [f[key] for f in map(figures, runs[v]) if f]
    return statistics.median(vals) if vals else None


def spread(runs, v, key):
    """(max - min) / median over rounds: the run-to-run noise of one variant's figure."""
    vals = [f[key] for f in map(figures, runs[v]) if f]
    if len(vals) < 2 or not statistics.median(vals):
        return None
    return (max(vals) - min(vals)) / statistics.median(vals)


def instructions(path):
    """{variant: instructions per answer} from metered.sh's `VARIANT IR ANSWERS` lines."""
    out = {}
    try:
        with open(path) as f:
            for line in f:
                v, ir, n = line.split()
                if int(n) > 0 and int(ir) > 0:
                    out[v] = int(ir) / int(n)
    except (OSError, ValueError):
        pass
    return out


def cpu_target(cpu_ratio, cpu_noise, instr_ratio):
    """The verdict: by instructions where counted — exact, where CPU time is not; the
    kernel's share of the CPU (the same bytes, reads and writes in both) is not in them and
    only dilutes the ratio — else by the CPU time's median, called met only at or under the
    target. Both are stated, with the CPU time's noise."""
    timed = (
        f"CPU time {fmt(cpu_ratio, 3)}× (run-to-run spread {pct(cpu_noise)})"
        if cpu_ratio is not None
        else "CPU time not measured"
    )
    if instr_ratio is not None:
        word = "**met**" if instr_ratio <= CPU_TARGET else "**missed**"
        return f"{word} by instructions ({fmt(instr_ratio, 3)}×); {timed}"
    met = cpu_ratio is not None and cpu_ratio <= CPU_TARGET
    return f"{'**met**' if met else '**missed**'} by {timed} (no instruction count: INSTRUCTIONS=0, or valgrind absent or failed)"


def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def pct(x):
    return "–" if x is None else f"{x * 100:.0f} %"


def main():
    ap = argparse.ArgumentParser()
    for flag in ["runs", "out-md", "rounds", "duration", "conc", "tokens", "quick", "answer-bytes", "meter-check", "model-line"]:
        ap.add_argument("--" + flag, required=True)
    ap.add_argument("--meta", action="append", default=[])
    ap.add_argument("--instructions", default="")
    ap.add_argument("--instr-duration", default="")
    a = ap.parse_args()
    meta = dict(m.split("=", 1) for m in a.meta)
    runs = load(a.runs)

    rows = [
        ("responses/s", "per_s", 0),
        ("leasegate CPU per response (ms, user+sys)", "cpu_ms", 3),
        ("time to first byte p50 (ms)", "ttfb50", 2),
        ("time to first byte p99 (ms)", "ttfb99", 2),
        ("whole response p50 (ms)", "full50", 2),
    ]
    m = {key: med(runs, "metered", key) for _, key, _ in rows}
    u = {key: med(runs, "unmetered", key) for _, key, _ in rows}
    ratio = {key: (m[key] / u[key] if m[key] is not None and u[key] else None) for key in m}
    # Per-round ratios: the pair of runs of one round shares the machine's state.
    per_round = {}
    for key in m:
        vals = []
        for rm, ru in zip(runs["metered"], runs["unmetered"]):
            fm, fu = figures(rm), figures(ru)
            if fm and fu and fu[key]:
                vals.append(fm[key] / fu[key])
        per_round[key] = vals

    quick = a.quick == "1"
    full, unmetered_lines, lines = (int(x) for x in a.meter_check.split())
    requests = {v: sum(r.get("requests", 0) for r in runs[v]) for v in VARIANTS}
    errors = {v: sum(r.get("errors", 0) for r in runs[v]) for v in VARIANTS}

    ttfb_noise = spread(runs, "unmetered", "ttfb50")
    instr = instructions(a.instructions)
    instr_ratio = (
        instr["metered"] / instr["unmetered"]
        if instr.get("metered") and instr.get("unmetered")
        else None
    )
    cpu_noise = spread(runs, "unmetered", "cpu_ms")
    cpu_verdict = cpu_target(ratio["cpu_ms"], cpu_noise, instr_ratio)
    ttfb_delta = None if ratio["ttfb50"] is None else abs(ratio["ttfb50"] - 1)
    if ttfb_delta is None:
        ttfb_verdict = "not measured"
    elif ttfb_noise is None:
        ttfb_verdict = f"{pct(ttfb_delta)} apart; one round gives no noise figure (run ROUNDS ≥ 2)"
    elif ttfb_delta <= ttfb_noise:
        ttfb_verdict = f"**met**: {pct(ttfb_delta)} apart, within the unmetered runs' own spread of {pct(ttfb_noise)}"
    else:
        ttfb_verdict = f"**missed**: {pct(ttfb_delta)} apart, beyond the unmetered runs' own spread of {pct(ttfb_noise)}"

    lines_md = [
        BEGIN,
        "## Metered model calls: a streamed 2,000-token answer, metered against unmetered"
        if a.tokens == "2000"
        else f"## Metered model calls: a streamed {int(a.tokens):,}-token answer, metered against unmetered",
        "",
        "Written by `metered.sh`. Kept-alive HTTPS `POST /v1/chat/completions` (`stream: true`, "
        f"`include_usage`) through leasegate terminating `origin.test`; the origin streams {int(a.tokens):,} "
        f"one-token `chat.completion.chunk` events, each its own write, then the usage chunk and `[DONE]` "
        f"({int(a.answer_bytes):,} bytes). **metered**: the host's secret has `meter = \"openai\"`; **unmetered**: "
        "the same secret without it, in a second leasegate process (the runs alternate between the two). "
        "CPU is the leasegate process's user+sys time over a run (`/proc/PID/stat`) divided by its responses; "
        "instructions are counted by callgrind in a separate run of each (the proxy's user-space work only). "
        f"Medians over {a.rounds} round(s); {a.conc} connections, one client thread, {a.duration} s per run.",
        "",
        "| | " + " | ".join(TITLES[v] for v in VARIANTS) + " | metered / unmetered | per round |",
        "|---|---|---|---|---|",
    ]
    for title, key, digits in rows:
        pr = ", ".join(f"{x:.3f}" for x in per_round[key]) or "–"
        lines_md.append(f"| {title} | {fmt(m[key], digits)} | {fmt(u[key], digits)} | {fmt(ratio[key], 3)} | {pr} |")
    if instr:
        lines_md.append(
            f"| leasegate instructions per response (millions, user space; callgrind, 1 connection, "
            f"{a.instr_duration} s) | {fmt(instr.get('metered', 0) / 1e6, 2)} | "
            f"{fmt(instr.get('unmetered', 0) / 1e6, 2)} | {fmt(instr_ratio, 3)} | exact |"
        )
    lines_md += [
        f"| failed calls | {errors['metered']:,} of {errors['metered'] + requests['metered']:,} "
        f"| {errors['unmetered']:,} of {errors['unmetered'] + requests['unmetered']:,} | | |",
        "",
        "Run-to-run spread of the unmetered variant over rounds ((max − min) / median): "
        f"responses/s {pct(spread(runs, 'unmetered', 'per_s'))}, CPU per response "
        f"{pct(spread(runs, 'unmetered', 'cpu_ms'))}, time to first byte p50 {pct(ttfb_noise)}.",
        "",
        f"Targets: CPU per response ≤ {CPU_TARGET}× unmetered — {cpu_verdict}"
        + f"; time to first byte unchanged within noise — {ttfb_verdict}.",
        "",
        f"Metering happened: {full:,} metered egress lines carry `output_tokens: {int(a.tokens):,}` for "
        f"{requests['metered'] + 1:,} calls (the timed ones and the check's), {unmetered_lines:,} were unmetered, "
        f"{lines:,} lines in all; the check's line: `{a.model_line}`.",
        "",
        f"- **Settings**: {a.rounds} round(s), {a.duration} s runs, {a.conc} connections, {int(a.tokens):,} tokens"
        + (" (**QUICK=1 smoke run**: figures indicative only)" if quick else ""),
        f"- **Machine**: {meta.get('machine', '?')}",
        f"- **leasegate**: {meta.get('leasegate', '?')}; lines on its stderr: {meta.get('lg_errlines', '?')}",
        f"- **Date**: {meta.get('date', '?')}, took {meta.get('elapsed', '?')}",
        f"- **Command**: `{meta.get('command', '?')}`",
        END,
    ]
    section = "\n".join(lines_md) + "\n"
    write_section(a.out_md, BEGIN, END, section)
    print(section)


if __name__ == "__main__":
    main()
