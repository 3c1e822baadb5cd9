#!/usr/bin/env python3
"""The "The edge's cost per call" section of RESULTS.md from edge.sh's raw runs.

    edge_report.py RUNS OUT_MD 'ROUNDS|DURATION|CONC|TOKENS|BYTES|CLK_TCK|INSTR_S|MACHINE|REV|DATE|TOOK|COMMAND'

Invariant: the section between the markers is replaced whole (or appended); nothing else in
the file changes. Medians over rounds; each variant's ratio to unread is given per round too,
and the noise is unread's own spread over rounds: a difference inside it is a tie.
"""
import json
import os
import statistics
import sys

from brokered_report import write_section

BEGIN, END = "<!-- edge:begin -->", "<!-- edge:end -->"
VARIANTS = ["unread", "mcp", "steps", "metered", "reserved"]
TITLES = {
    "unread": "unread",
    "mcp": "MCP `tools/call` read",
    "steps": "MCP + `budget.steps`",
    "metered": "metered",
    "reserved": "metered + `budget.tokens`",
}


def run_of(runs, r, v, tick):
    try:
        with open(os.path.join(runs, f"r{r}_{v}.load")) as f:
            load = json.load(f)
        with open(os.path.join(runs, f"r{r}_{v}.ticks")) as f:
            ticks = int(f.read())
    except (OSError, ValueError):
        return None
    n = load.get("requests", 0)
    if not n:
        return None
    return {
        "per_s": load["per_s"],
        "cpu_us": ticks / tick / n * 1e6,
        "p50_ms": load["p50_us"] / 1000,
        "n": n,
        "errors": load.get("errors", 0),
    }


def instructions(runs, v):
    try:
        with open(os.path.join(runs, f"instr-{v}.ir")) as f:
            ir = int(f.read().strip() or 0)
        with open(os.path.join(runs, f"instr-{v}.load")) as f:
            n = json.load(f)["requests"]
    except (OSError, ValueError, KeyError):
        return None
    return ir / n if n and ir else None


def spread(values):
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


def main(runs, out_md, meta):
    (rounds, duration, conc, tokens, nbytes, tick, instr_s, machine, rev, date, took, command) = meta.split("|")
    rounds, tick = int(rounds), int(tick)
    got = {v: [run_of(runs, r, v, tick) for r in range(1, rounds + 1)] for v in VARIANTS}
    instr = {v: instructions(runs, v) for v in VARIANTS}
    rows = [
        ("calls/s", "per_s", "{:,.0f}"),
        ("leasegate CPU per call (µs, user+sys)", "cpu_us", "{:,.0f}"),
        ("call p50 (ms)", "p50_ms", "{:.2f}"),
    ]
    head = "| | " + " | ".join(TITLES[v] for v in VARIANTS) + " |"
    out = [
        "## The edge's cost per call: MCP reading, steps, metering and reservations beside the unread path",
        "",
        f"Written by `edge.sh`. Kept-alive HTTPS `POST {{path}}` through leasegate terminating `origin.test`, "
        f"the origin streaming a {int(tokens):,}-token Chat Completions answer ({int(nbytes):,} bytes). Five leasegate "
        "processes, each differing from **unread** (a secret without `meter`, no MCP server: the request relayed "
        "unread) in one thing: **MCP** (`--mcp-server` names the origin; the body is a JSON-RPC `tools/call` read, "
        "judged along the chain's `allow.tools` and written on the egress line), **MCP + steps** (the lease has "
        "`budget.steps`: the step reserved and kept in the spend log), **metered** (`meter = \"openai\"`: the "
        "request read for its bound, the answer for its usage), **metered + tokens** (the lease has "
        "`budget.tokens`: the bound reserved along the chain and fsynced to the spend log before the call goes "
        "out). CPU is the process's user+sys time over a run divided by its calls; instructions are callgrind's, "
        f"one connection for {instr_s} s (user space only). Medians over {rounds} round(s) of {duration} s, "
        f"{conc} connections; the variants rotate in each round.",
        "",
        head,
        "|---|" + "---|" * len(VARIANTS),
    ]
    med = {}
    for title, key, fmt in rows:
        cells = []
        for v in VARIANTS:
            values = [g[key] for g in got[v] if g]
            med[(v, key)] = statistics.median(values) if values else None
            cells.append(fmt.format(med[(v, key)]) if values else "—")
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    cells = [f"{instr[v] / 1e6:.3f}" if instr[v] else "—" for v in VARIANTS]
    out.append("| leasegate instructions per call (millions, callgrind) | " + " | ".join(cells) + " |")
    base_i = instr["unread"]
    out.append("| instructions / unread | " + " | ".join(
        f"{instr[v] / base_i:.3f}" if instr[v] and base_i else "—" for v in VARIANTS) + " |")
    out.append("| added instructions per call (thousands) | " + " | ".join(
        f"{(instr[v] - base_i) / 1e3:+,.0f}" if instr[v] and base_i else "—" for v in VARIANTS) + " |")
    for key, title in [("cpu_us", "CPU per call / unread, per round"), ("per_s", "calls/s / unread, per round")]:
        cells = []
        for v in VARIANTS:
            ratios = [g[key] / b[key] for g, b in zip(got[v], got["unread"]) if g and b]
            cells.append(", ".join(f"{x:.3f}" for x in ratios) if ratios else "—")
        out.append(f"| {title} | " + " | ".join(cells) + " |")
    out.append("| failed calls | " + " | ".join(
        f"{sum(g['errors'] for g in got[v] if g):,} of {sum(g['n'] for g in got[v] if g):,}" for v in VARIANTS) + " |")
    unread_cpu = [g["cpu_us"] for g in got["unread"] if g]
    unread_rate = [g["per_s"] for g in got["unread"] if g]
    noise = spread(unread_cpu) if len(unread_cpu) > 1 else None
    out += [
        "",
        "Run-to-run spread of unread over rounds ((max − min) / median): "
        + (f"CPU per call {noise:.0%}, calls/s {spread(unread_rate):.0%}." if noise is not None else "one round only."),
        "",
    ]
    verdicts = []
    for v in VARIANTS[1:]:
        a, b = med.get((v, "cpu_us")), med.get(("unread", "cpu_us"))
        if not (a and b):
            continue
        ratio = a / b
        word = "a tie" if noise is not None and abs(ratio - 1) <= noise else ("more" if ratio > 1 else "less")
        verdicts.append(f"{TITLES[v]} {ratio:.3f}× ({word})")
    out.append("CPU per call against unread: " + "; ".join(verdicts) + ". Instructions are exact where CPU time is noisy.")
    out += [
        "",
        f"- **Settings**: {rounds} round(s), {duration} s runs, {conc} connections, {int(tokens):,} tokens",
        f"- **Machine**: {machine}",
        f"- **leasegate**: {rev}",
        f"- **Date**: {date}, took {took}",
        f"- **Command**: `{command}`",
    ]
    text = "\n".join(out).replace("{path}", f"/v1/chat/completions?tokens={tokens}")
    write_section(out_md, BEGIN, END, f"{BEGIN}\n{text}\n{END}\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
