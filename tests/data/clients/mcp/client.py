"""The official `mcp` SDK's streamable HTTP client, unmodified, through the proxy its
environment names (HTTP_PROXY / HTTPS_PROXY, SSL_CERT_FILE).

Usage: client.py URL STEP... where each STEP is `list` or `call:TOOL`. Prints one JSON line per
step: the tools listed, or a call's text, or the error the SDK raised.
"""

import asyncio
import json
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def main(url: str, steps: list[str]) -> None:
    async with streamable_http_client(url) as (read, write, *_):
        async with ClientSession(read, write) as session:
            await session.initialize()
            for step in steps:
                try:
                    if step == "list":
                        listed = await session.list_tools()
                        out = {"step": step, "tools": sorted(t.name for t in listed.tools)}
                    else:
                        tool = step.split(":", 1)[1]
                        result = await session.call_tool(tool, {"id": 1} if "note" in tool else {"to": "a@b.test"})
                        text = "".join(c.text for c in result.content if hasattr(c, "text"))
                        out = {"step": step, "text": text, "is_error": result.is_error}
                except Exception as e:  # what the SDK raised, as an agent would see it
                    out = {"step": step, "error": type(e).__name__, "message": str(e)}
                print(json.dumps(out), flush=True)


asyncio.run(main(sys.argv[1], sys.argv[2:]))
