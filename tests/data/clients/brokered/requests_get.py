"""Python `requests` as an agent runs it through a terminated host: the proxy from HTTPS_PROXY,
the CA from REQUESTS_CA_BUNDLE, the placeholder from GITHUB_TOKEN in its Authorization header.
`requests` (urllib3) speaks HTTP/1.1 only, through a proxy or not.

    python3 requests_get.py URL

Prints "status N HTTP/1.1", a refusal's code (x-leasegate-refusal: CODE) when there is one,
and the body, or the exception; exits 0 for a 2xx answer, 1 otherwise.
"""
import os
import sys

import requests

headers = {"Authorization": "Bearer " + os.environ["GITHUB_TOKEN"]}
try:
    response = requests.get(sys.argv[1], headers=headers, timeout=20)
except requests.RequestException as e:
    print(e)
    sys.exit(1)
print("status", response.status_code, {10: "HTTP/1.0", 11: "HTTP/1.1"}[response.raw.version])
if "x-leasegate-refusal" in response.headers:
    print("x-leasegate-refusal:", response.headers["x-leasegate-refusal"])
print(response.text, end="")
sys.exit(0 if response.ok else 1)
