"""Python `httpx` as an agent runs it through a terminated host: the proxy from HTTPS_PROXY,
the CA from SSL_CERT_FILE, the placeholder from GITHUB_TOKEN in its Authorization header.

    python3 httpx_get.py http1|http2 URL

`http2` needs the `h2` package (httpx then offers both by ALPN). Prints "status N HTTP/V", a
refusal's code (x-leasegate-refusal: CODE) when there is one, and the body, or the exception;
exits 0 for a 2xx answer, 1 otherwise.
"""
import os
import sys

import httpx

headers = {"Authorization": "Bearer " + os.environ["GITHUB_TOKEN"]}
try:
    with httpx.Client(http2=sys.argv[1] == "http2", timeout=20) as client:
        response = client.get(sys.argv[2], headers=headers)
except httpx.HTTPError as e:
    print(f"{type(e).__name__}: {e}")
    sys.exit(1)
print("status", response.status_code, response.http_version)
if "x-leasegate-refusal" in response.headers:
    print("x-leasegate-refusal:", response.headers["x-leasegate-refusal"])
print(response.text, end="")
sys.exit(0 if response.is_success else 1)
