"""leasegate: a typed client for leasegate's admin API, for orchestrators.

Issue a lease, run an agent under it, end it and read what it used::

    from leasegate import Client

    client = Client()  # $LEASEGATE_ADMIN_URL / $LEASEGATE_ADMIN_TOKEN, or serve --dev's token
    lease = client.issue(name="worker", purpose="summarise the issue", hosts=["api.openai.com"], tokens=10_000)
    lease.run(["python3", "agent.py"], check=True)
    print(lease.complete())

Standard library only; every admin call goes straight to the admin API, never through a proxy.
"""

from ._client import (
    DEFAULT_ADMIN_URL,
    DEV_TOKEN_FILE,
    AdminUnreachable,
    Client,
    Lease,
    LeasegateError,
    Placeholder,
    Usage,
    manifest_of,
)

__all__ = [
    "DEFAULT_ADMIN_URL",
    "DEV_TOKEN_FILE",
    "AdminUnreachable",
    "Client",
    "Lease",
    "LeasegateError",
    "Placeholder",
    "Usage",
    "manifest_of",
]

__version__ = "0.2.0"
