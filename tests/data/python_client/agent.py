"""An agent that knows nothing of leasegate: one chat completion with the standard library, to
the OpenAI-shaped API at argv[1], with the key in OPENAI_API_KEY (a placeholder: the proxy puts
the real key in) through HTTPS_PROXY, trusting SSL_CERT_FILE. Prints the answer's status and
usage as one JSON line."""

import json
import os
import sys
import urllib.request

base = sys.argv[1]
body = {
    "model": "gpt-4o-mini",
    "messages": [{"role": "user", "content": "say hello to the orchestrator"}],
}
request = urllib.request.Request(
    base + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={
        "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json",
    },
    method="POST",
)
with urllib.request.urlopen(request, timeout=30) as answer:
    print(json.dumps({"status": answer.status, "usage": json.load(answer)["usage"]}))
