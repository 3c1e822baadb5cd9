"""A local MCP server (the official `mcp` SDK's MCPServer, streamable HTTP) with three tools.

Usage: server.py PORT CALLS_FILE [CERT KEY]. Every tool call it runs is appended to
CALLS_FILE, one name a line, so a test knows which calls reached it. With CERT and KEY it
serves HTTPS. It prints "ready" once listening.
"""

import sys

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings

port, calls = int(sys.argv[1]), sys.argv[2]
tls = sys.argv[3:5]

server = MCPServer("notes")


def ran(name: str) -> None:
    with open(calls, "a") as f:
        f.write(name + "\n")


@server.tool()
def read_note(id: int) -> str:
    """Reads a note."""
    ran("read_note")
    return f"note {id}: buy milk"


@server.tool()
def delete_note(id: int) -> str:
    """Deletes a note."""
    ran("delete_note")
    return f"deleted {id}"


@server.tool()
def send_mail(to: str) -> str:
    """Sends a mail."""
    ran("send_mail")
    return f"sent to {to}"


# The proxy names the server by a test host name, not localhost.
security = TransportSecuritySettings(enable_dns_rebinding_protection=False)
app = server.streamable_http_app(transport_security=security)
config = uvicorn.Config(
    app,
    host="127.0.0.1",
    port=port,
    log_level="warning",
    ssl_certfile=tls[0] if tls else None,
    ssl_keyfile=tls[1] if tls else None,
)
uvicorn_server = uvicorn.Server(config)
print("ready", flush=True)
uvicorn_server.run()
