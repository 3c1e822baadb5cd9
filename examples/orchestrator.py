#!/usr/bin/env python3
"""An orchestrator on leasegate's admin API: two agents under two leases, each allowed its own
host, and a sub-agent of the first under a child lease that its parent's own token issued,
narrower and with a smaller budget. Each agent is a subprocess (Python's urllib, which knows
nothing of leasegate but the proxy variables its lease's environment sets). Prints what the
server narrowed, what each agent got, then completes every lease and prints its usage.

    leasegate serve --dev &                    # writes .leasegate/admin-token
    python3 examples/orchestrator.py           # from that directory
    python3 examples/orchestrator.py --researcher-url https://api.github.com/ \\
        --writer-url https://pypi.org/simple/

The admin API and its token come from the environment, as for the client: LEASEGATE_ADMIN_URL
(default http://127.0.0.1:3129), LEASEGATE_ADMIN_TOKEN or LEASEGATE_ADMIN_TOKEN_FILE, else
./.leasegate/admin-token. The URLs the agents fetch (whose hosts their leases allow) come from
the flags or LEASEGATE_EXAMPLE_RESEARCHER_URL and LEASEGATE_EXAMPLE_WRITER_URL.

Uses the installed `leasegate` package (pip install ./clients/python), else the one in this
repository.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import List, Optional, Tuple

try:
    import leasegate
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python" / "src"))
    import leasegate

from leasegate import Client, Lease, LeasegateError, Usage

# The agent: fetches each URL through whatever proxy its environment names, and prints one line
# per URL: the status and the body's first line, or the refusal code leasegate answered with.
AGENT = r"""
import sys, urllib.error, urllib.request
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, timeout=20) as answer:
            first = answer.read(200).decode("utf-8", "replace").splitlines()[:1]
            print(url, "->", answer.status, *first)
    except urllib.error.HTTPError as e:
        print(url, "->", e.code, e.headers.get("x-leasegate-refusal") or e.reason)
    except OSError as e:
        print(url, "-> failed:", e)
"""


def host_of(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        raise SystemExit(f"{url}: not a URL with a host")
    return host


def describe(role: str, lease: Lease, parent: Optional[Tuple[str, Lease]] = None) -> None:
    under = f" under {parent[0]} {parent[1].id}, issued with its token" if parent else ""
    tokens = lease.budget.get("tokens", "unlimited")
    print(f"issued {role} {lease.id}{under}: hosts {', '.join(lease.hosts)}; tokens {tokens}")
    for change in lease.narrowed:
        print(f"  narrowed: {change}")


def spent(usage: Usage) -> str:
    tokens = "unmeasured" if usage.tokens is None else str(usage.tokens)
    cost = "unmeasured" if usage.cost_usd is None else f"${usage.cost_usd:.4f}"
    return f"tokens {tokens}, cost {cost}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--researcher-url",
        default=os.environ.get("LEASEGATE_EXAMPLE_RESEARCHER_URL", "https://example.com/"),
    )
    parser.add_argument(
        "--writer-url",
        default=os.environ.get("LEASEGATE_EXAMPLE_WRITER_URL", "https://example.org/"),
    )
    parser.add_argument("--tokens", type=int, default=20_000, help="each agent's token budget")
    args = parser.parse_args()
    researching, writing = host_of(args.researcher_url), host_of(args.writer_url)

    client = Client()
    print(f"admin API {client.admin_url} (leasegate client {leasegate.__version__})")
    researcher = client.issue(
        name="researcher",
        purpose=f"read {researching}",
        hosts=[researching],
        tokens=args.tokens,
        fan_out=2,
        lifetime=600,
    )
    writer = client.issue(
        name="writer",
        purpose=f"write to {writing}",
        hosts=[writing],
        tokens=args.tokens,
        depth=0,
        lifetime=600,
    )
    # The researcher's own token issues its sub-agent: it may ask for anything, and gets at most
    # what the researcher has (the writer's host is taken out, and said to be).
    sub_agent = researcher.child(
        name="sub-agent",
        purpose=f"fetch one page of {researching}",
        hosts=[researching, writing],
        tokens=args.tokens // 10,
    )
    describe("researcher", researcher)
    describe("writer", writer)
    describe("sub-agent", sub_agent, ("researcher", researcher))

    # The three agents run at once, each under its own lease; the sub-agent also tries the
    # writer's host, which its lease does not allow.
    runs: List[Tuple[str, Lease, "subprocess.Popen[str]"]] = []
    for role, lease, urls in (
        ("researcher", researcher, [args.researcher_url]),
        ("writer", writer, [args.writer_url]),
        ("sub-agent", sub_agent, [args.researcher_url, args.writer_url]),
    ):
        process = subprocess.Popen(
            [sys.executable, "-c", AGENT, *urls],
            env=lease.environ(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        runs.append((role, lease, process))
    failed = 0
    for role, _, process in runs:
        output, _ = process.communicate(timeout=60)
        failed += process.returncode != 0
        for line in output.splitlines():
            print(f"{role}: {line}")

    # Children first: a parent's completion ends its subtree.
    for role, lease in (("sub-agent", sub_agent), ("researcher", researcher), ("writer", writer)):
        try:
            usage = client.complete(lease, reason="the orchestrator is done")
        except LeasegateError as e:
            closed = e.body.get("closed") or {}
            print(f"{role} {lease.id} was already closed: {closed.get('event')} ({e.message})")
            continue
        print(f"completed {role} {lease.id}: {spent(usage)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
