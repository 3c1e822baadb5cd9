"""GET one URL with Python `requests`, which reads HTTPS_PROXY and REQUESTS_CA_BUNDLE itself.

Prints "status N" and the body, or the exception, and exits 0 for a 2xx answer, 1 otherwise.
"""
import sys

import requests

try:
    response = requests.get(sys.argv[1], timeout=20)
except requests.RequestException as e:
    print(e)
    sys.exit(1)
print("status", response.status_code)
print(response.text, end="")
sys.exit(0 if response.ok else 1)
