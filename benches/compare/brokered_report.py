#!/usr/bin/env python3
"""The "Brokered HTTPS" section of RESULTS.md from brokered.sh's raw runs.

Invariant: the section between the markers is replaced whole (or appended); nothing else in
the file changes. Medians over rounds; a run with errors is shown, never hidden.
"""
import argparse
import glob
import json
import os
import re
import statistics

BEGIN, END = "<!-- brokered:begin -->", "<!-- brokered:end -->"
VARIANTS = ["direct", "lg-terminated", "lg-blind", "mitmproxy", "squid-bump"]
TITLES = {
    "direct": "direct",
    "lg-terminated": "leasegate, terminated (secret put in)",
    "lg-blind": "leasegate, blind tunnel",
    "mitmproxy": "mitmproxy (mitmdump + addon)",
    "squid-bump": "Squid ssl-bump",
}


def load(runs):
    """{(figure, variant): [run, ...]} from rROUND_FIGURE_VARIANT.json files."""
    out = {}
    for path in sorted(glob.glob(os.path.join(runs, "r*_*_*.json"))):
        m = re.match(r"r(\d+)_(ka1|ka32|hs-resume|hs-full)_(.+)\.json$", os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, ValueError):
            run = {"requests": 0, "errors": 1, "first_error": "no result", "per_s": 0, "p50_us": 0, "p99_us": 0}
        out.setdefault((m.group(2), m.group(3)), []).append(run)
    return out


def med(runs, fig, v, key):
    vals = [r[key] for r in runs.get((fig, v), []) if r.get("requests", 0) > 0]
    return statistics.median(vals) if vals else None


def num(x, unit=""):
    return "–" if x is None else f"{x:,.0f}{unit}"


def ratio(a, b):
    return None if a is None or not b else a / b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out-md", required=True)
    ap.add_argument("--rounds", required=True)
    ap.add_argument("--duration", required=True)
    ap.add_argument("--conc", required=True)
    ap.add_argument("--quick", default="0")
    ap.add_argument("--meta", action="append", default=[])
    a = ap.parse_args()
    meta = dict(m.split("=", 1) for m in a.meta)
    runs = load(a.runs)
    lg = "lg-terminated"

    def cell(fig, v, key, unit="", vs=()):
        x = med(runs, fig, v, key)
        refs = [f"{ratio(x, med(runs, fig, r, key)):.2f}× {short}" for r, short in vs
                if v != r and ratio(x, med(runs, fig, r, key)) is not None]
        return num(x, unit) + (f" ({', '.join(refs)})" if refs else "")

    vs = [("direct", "d"), ("mitmproxy", "mitm"), ("squid-bump", "sq")]
    d50 = med(runs, "ka1", "direct", "p50_us")
    rows = [
        ("HTTPS keep-alive, 1 conn: requests/s", lambda v: cell("ka1", v, "per_s", vs=vs)),
        ("HTTPS keep-alive, 1 conn: p50 latency", lambda v: cell("ka1", v, "p50_us", " µs")),
        ("HTTPS keep-alive, 1 conn: p50 added over direct",
         lambda v: num(None if med(runs, "ka1", v, "p50_us") is None or d50 is None
                       else med(runs, "ka1", v, "p50_us") - d50, " µs")),
        ("HTTPS keep-alive, 1 conn: p99 latency", lambda v: cell("ka1", v, "p99_us", " µs")),
        (f"HTTPS keep-alive, {a.conc} conns: requests/s", lambda v: cell("ka32", v, "per_s", vs=vs)),
        (f"HTTPS keep-alive, {a.conc} conns: p50 latency", lambda v: cell("ka32", v, "p50_us", " µs")),
        (f"HTTPS keep-alive, {a.conc} conns: p99 latency", lambda v: cell("ka32", v, "p99_us", " µs")),
        ("failed requests, all runs", lambda v: errors(runs, v, ("ka1", "ka32"))),
    ]
    lines = [BEGIN, "## Brokered HTTPS: terminated host, blind tunnel, mitmproxy, Squid ssl-bump", ""]
    lines.append(
        "Written by `brokered.sh`. Kept-alive HTTPS requests (`GET /small`, 64 bytes, HTTP/1.1) "
        "to one local origin: through leasegate ending the client's TLS for a host a secret is for "
        "and putting the secret in (`Authorization: Bearer …`), through leasegate tunnelling blind "
        "to the same origin under another of its names, through mitmproxy (`mitmdump` with a "
        "one-line addon setting `Authorization`) and through Squid with `ssl_bump bump all` and "
        "`request_header_add Authorization`; the origin direct for scale. Every proxy verifies the "
        "origin's certificate; the client verifies the proxy's leaf (or the origin's) against the "
        "CA it was given. Before the runs each variant's `/auth` answer is checked: the header "
        "reached the origin through the three that put it in, and not through the other two.")
    lines.append("")
    quick = " (**QUICK=1 smoke run: not figures to quote**)" if a.quick == "1" else ""
    lines += [
        f"- **Date**: {meta.get('date', '?')} (run took {meta.get('elapsed', '?')})",
        f"- **Machine**: {meta.get('machine', '?')}",
        f"- **leasegate**: {meta.get('leasegate', '?')}",
        f"- **Squid**: {meta.get('squid', '?')}; **mitmproxy**: {meta.get('mitmproxy', '?')}",
        "- **Load tool**: `compare-harness https-load` / `https-handshakes` (Rust: tokio, rustls "
        "with ring, hyper's HTTP/1.1 client; ALPN http/1.1), the same for every variant",
        f"- **Settings**: {a.rounds} round(s), {a.duration} s per run, variants alternating "
        f"within each figure, medians over rounds; unpinned, every process on every core{quick}",
        f"- **Reproduce**: `{meta.get('command', '?')}`",
        "",
        "| figure | " + " | ".join(TITLES[v] for v in VARIANTS) + " |",
        "|---|" + "---:|" * len(VARIANTS),
    ]
    for title, f in rows:
        lines.append(f"| {title} | " + " | ".join(f(v) for v in VARIANTS) + " |")
    lines += ["", "`× d`, `× mitm`, `× sq` = ratio to direct, mitmproxy, Squid ssl-bump. Latency is "
              "from the request's first byte written to the response's last byte read.", ""]

    # New connections: tunnel + TLS handshake + one GET + close, one at a time.
    hv = ["direct", "lg-terminated", "lg-blind"]
    lines += [
        "**A new connection**, one at a time: (CONNECT and 200, through a proxy) + TLS handshake + "
        "one GET + close, with the client keeping TLS sessions to resume with (rustls's default "
        "in-memory store) or none. *resumed* is what the handshakes were, as the client's TLS "
        "reports it.",
        "",
        "| figure | " + " | ".join(TITLES[v] for v in hv) + " |",
        "|---|" + "---:|" * len(hv),
    ]
    for fig, label in (("hs-resume", "client resumes"), ("hs-full", "no resumption")):
        lines.append(f"| {label}: connections/s | " + " | ".join(num(med(runs, fig, v, "per_s")) for v in hv) + " |")
        lines.append(f"| {label}: p50 per connection | " + " | ".join(num(med(runs, fig, v, "p50_us"), " µs") for v in hv) + " |")
        lines.append(f"| {label}: p50 added over direct | " + " | ".join(
            num(None if med(runs, fig, v, "p50_us") is None or med(runs, fig, "direct", "p50_us") is None
                else med(runs, fig, v, "p50_us") - med(runs, fig, "direct", "p50_us"), " µs") for v in hv) + " |")
        lines.append(f"| {label}: handshakes resumed | " + " | ".join(resumed(runs, fig, v) for v in hv) + " |")
    lines.append(f"| failed connections, all runs | " + " | ".join(errors(runs, v, ("hs-resume", "hs-full")) for v in hv) + " |")
    lines.append("")
    lines.append(
        f"Notes: leasegate ran with RUST_LOG=warn, its egress log to a file "
        f"({meta.get('egress_with_secret', '?')} lines with the secret put in; lease status at the "
        f"end: {meta.get('lease', '?')}; {meta.get('lg_errlines', '?')} stderr lines); Squid with "
        "its access log to a file, `workers 1`; mitmdump with `-q`. The terminated and blind "
        "variants are one leasegate process and one lease; the blind one asks for `blind.test`, "
        "another name of the origin's certificate, which no secret is for.")
    lines.append("")

    # Targets.
    def target(name, ok, text):
        state = "–" if ok is None else ("**met**" if ok else "**missed**")
        return f"- {name}: {state} — {text}"

    r_m32 = ratio(med(runs, "ka32", lg, "per_s"), med(runs, "ka32", "mitmproxy", "per_s"))
    r_s32 = ratio(med(runs, "ka32", lg, "per_s"), med(runs, "ka32", "squid-bump", "per_s"))
    r_m1 = ratio(med(runs, "ka1", lg, "per_s"), med(runs, "ka1", "mitmproxy", "per_s"))
    r_s1 = ratio(med(runs, "ka1", lg, "per_s"), med(runs, "ka1", "squid-bump", "per_s"))
    added = None if med(runs, "ka1", lg, "p50_us") is None or d50 is None else med(runs, "ka1", lg, "p50_us") - d50
    f2 = lambda x: "?" if x is None else f"{x:.2f}"
    lines += [
        "### Targets (terminated host)",
        "",
        target(f"requests/s ≥ 10× mitmproxy ({a.conc} conns)", None if r_m32 is None else r_m32 >= 10,
               f"{f2(r_m32)}× (1 conn: {f2(r_m1)}×)"),
        target(f"requests/s ≥ 2× Squid ssl-bump ({a.conc} conns)", None if r_s32 is None else r_s32 >= 2,
               f"{f2(r_s32)}× (1 conn: {f2(r_s1)}×)"),
        target("p50 added over direct ≤ 150 µs (1 conn, kept alive)", None if added is None else added <= 150,
               f"{num(added, ' µs')} (direct p50 {num(d50, ' µs')})"),
        END,
    ]
    section = "\n".join(lines) + "\n"
    write_section(a.out_md, BEGIN, END, section)
    print(section)


def write_section(out_md, begin, end, section):
    """Replaces the part of OUT_MD between the markers BEGIN and END by SECTION (or appends it)."""
    try:
        with open(out_md) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    old = re.sub(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", "", old, flags=re.S).rstrip("\n")
    with open(out_md, "w") as f:
        f.write((old + "\n\n" if old else "") + section)


def errors(runs, v, figs):
    n = sum(r.get("errors", 0) for fig in figs for r in runs.get((fig, v), []))
    total = n + sum(r.get("requests", 0) for fig in figs for r in runs.get((fig, v), []))
    first = next((r.get("first_error") for fig in figs for r in runs.get((fig, v), []) if r.get("first_error")), None)
    first = first and first.replace("|", "\\|")[:160]
    return f"{n:,} of {total:,}" + (f" (first: {first})" if first else "")


def resumed(runs, fig, v):
    res = sum(r.get("resumed", 0) for r in runs.get((fig, v), []))
    full = sum(r.get("full", 0) for r in runs.get((fig, v), []))
    return f"{res:,} of {res + full:,}"


if __name__ == "__main__":
    main()
