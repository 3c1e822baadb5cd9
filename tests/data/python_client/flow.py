"""The Python client against a real leasegate (tests/it/admin/python_client.rs starts it).

argv: the plain origin's URL (allowed to the root and its child), a URL on a host the root
allows and the child does not, and the OpenAI-shaped API's base URL (brokered: the proxy holds
its key). The admin URL and token come from the environment, as an orchestrator's do; the
environment also names a proxy that does not exist, which the client must not use.

Asserts as it goes (a failure exits non-zero with the traceback) and prints one JSON line of
what it saw for the test to compare with the journal.
"""

import json
import os
import sys
import urllib.parse
from datetime import timedelta

from leasegate import AdminUnreachable, Client, LeasegateError, Usage

plain_url, refused_url, openai_base = sys.argv[1:4]
agent = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent.py")


def host(url: str) -> str:
    return urllib.parse.urlsplit(url).hostname or ""


def fails(call, status):
    try:
        call()
    except LeasegateError as e:
        assert e.status == status, (e.status, e.message, e.body)
        return e
    raise AssertionError(f"expected a {status}")


client = Client()  # LEASEGATE_ADMIN_URL and LEASEGATE_ADMIN_TOKEN_FILE
assert client.token, "the token file was read"
assert os.environ["HTTPS_PROXY"].startswith("http://127.0.0.1:9"), "a proxy nobody runs"

root = client.issue(
    name="tester",
    purpose="orchestrate the python client test",
    hosts=[host(plain_url), host(refused_url), host(openai_base)],
    tokens=5000,
    lifetime=timedelta(minutes=10),
    idempotency_key="python-client-root",
)
assert root.parent_id is None and not root.replayed, root
assert root.budget == {"tokens": 5000, "depth": 4, "fan_out": 8}, root.budget
assert "budget.depth set to 4" in root.narrowed, root.narrowed
assert root.token and root.token.startswith(root.id + "."), "the lease's own token"
assert root.ca is not None and "BEGIN CERTIFICATE" in root.ca, "the proxy brokers secrets"
# A retry under the same key is the same lease; another body under it is refused.
again = client.issue(
    name="tester",
    purpose="orchestrate the python client test",
    hosts=[host(plain_url), host(refused_url), host(openai_base)],
    tokens=5000,
    lifetime=timedelta(minutes=10),
    idempotency_key="python-client-root",
)
assert again.replayed and again.id == root.id and again.token == root.token, again
fails(
    lambda: client.issue(
        name="tester", purpose="other", hosts=["x.test"], idempotency_key="python-client-root"
    ),
    422,
)

# The child, issued with the root's own token: asked wider in hosts, smaller in budget.
child = root.child(
    name="tester",
    purpose="a sub-agent that only calls the model",
    hosts=[host(plain_url), host(openai_base), "evil.test"],
    tokens=600,
)
assert child.parent_id == root.id, child
assert child.hosts == [host(plain_url), host(openai_base)], child.hosts
assert child.budget["tokens"] == 600 < root.budget["tokens"], child.budget
assert child.budget["depth"] == 3, child.budget
assert any(n.startswith("allow.hosts -1") for n in child.narrowed), child.narrowed
assert child.proxy_url and child.id in child.proxy_url, "--credentials id"
openai_env = {p.env: p.placeholder for p in child.placeholders}
assert set(openai_env) == {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}, child.placeholders

# The environment: inherited proxy settings and the operator's token go, the lease's come.
env = child.environ(
    {
        "PATH": os.environ["PATH"],
        "HTTPS_PROXY": "http://elsewhere:1",
        "Foo_Proxy": "x",
        "no_proxy": "*",
        "NO_PROXY": "*",
        "LEASEGATE_ADMIN_TOKEN": "the operator's",
        "LEASEGATE_ADMIN_TOKEN_FILE": "/operator/token",
    }
)
assert "Foo_Proxy" not in env and "LEASEGATE_ADMIN_TOKEN_FILE" not in env, env
assert env["HTTPS_PROXY"] == env["http_proxy"] == env["ALL_PROXY"] == child.proxy_url, env
assert env["NO_PROXY"] == env["no_proxy"] == "", env
assert env["LEASEGATE_ADMIN_TOKEN"] == child.token, "its own token, not the operator's"
assert env["OPENAI_API_KEY"] == openai_env["OPENAI_API_KEY"]
bundle, ca_file = env["SSL_CERT_FILE"], env["NODE_EXTRA_CA_CERTS"]
assert env["REQUESTS_CA_BUNDLE"] == env["CURL_CA_BUNDLE"] == env["GIT_SSL_CAINFO"] == bundle
assert open(ca_file).read().strip() == child.ca.strip()
assert open(bundle).read().rstrip().endswith(child.ca.strip()), "system roots, then the CA"
assert oct(os.stat(os.path.dirname(bundle)).st_mode & 0o777) == "0o700", "a private directory"
assert child.environ({"PATH": "/bin"})["SSL_CERT_FILE"] == bundle, "written once"

# Agents under the child: curl to the plain origin (allowed), to a host only the root allows
# (refused), and a Python agent calling the model through the broker.
curl = ["curl", "-sS", "--max-time", "20", "-D", "-", "-w", "\n%{http_code}"]
allowed = child.run(curl + [plain_url], capture_output=True, text=True)
assert allowed.returncode == 0, allowed.stderr
assert allowed.stdout.endswith("hello from origin\n\n200"), allowed.stdout
refused = child.run(curl + [refused_url], capture_output=True, text=True)
assert refused.returncode == 0, refused.stderr
assert refused.stdout.endswith("\n403"), refused.stdout
assert "x-leasegate-refusal: host-not-allowed" in refused.stdout.lower(), refused.stdout
called = child.run(
    [sys.executable, agent, openai_base], capture_output=True, text=True, timeout=60
)
assert called.returncode == 0, called.stderr
answer = json.loads(called.stdout)
assert answer["status"] == 200, answer
tokens = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]

# What the API says while they run: the call counts in the child and in the root's subtree.
assert client.usage(child).tokens == tokens
assert client.usage(root).tokens == tokens
assert client.get(child)["status"] == "open"
# A lease's token may not end another lease, and an unknown lease is not found.
fails(lambda: child.own_client().stop(root.id), 403)
fails(lambda: client.get("0f9b7c1e-4a2d-4c6e-9b1f-2d3e4f5a6b7c"), 404)

child_usage = client.complete(child, reason="the sub-agent is done")
assert child_usage.tokens == tokens, child_usage
closed = fails(lambda: client.complete(child), 409)
assert closed.body["closed"]["event"] == "completed", closed.body
root_usage = root.complete()  # with its own token
assert root_usage == Usage(tokens=tokens, cost_usd=root_usage.cost_usd), root_usage
assert client.get(root)["status"] == "completed"

# Errors: a contract refusal, a bad token, an admin API nobody runs, a client-side mistake.
empty = fails(lambda: client.issue(name="tester", purpose="", hosts=["x.test"]), 422)
assert empty.reasons == ["R1"] and empty.refusal_id, (empty.reasons, empty.body)
fails(lambda: Client(token="not-the-token").get(root.id), 401)
try:
    Client(admin_url="http://127.0.0.1:9").get(root.id)
    raise AssertionError("nothing listens there")
except AdminUnreachable as e:
    assert e.status == 0, e
try:
    client.issue(name="tester", purpose="both", hosts=["x.test"], lifetime=5, expires_at="x")
    raise AssertionError("lifetime and expires_at together")
except ValueError:
    pass

print(
    json.dumps(
        {
            "root": root.id,
            "child": child.id,
            "child_narrowed": child.narrowed,
            "tokens": tokens,
            "child_usage": {"tokens": child_usage.tokens, "cost_usd": child_usage.cost_usd},
            "root_usage": {"tokens": root_usage.tokens, "cost_usd": root_usage.cost_usd},
            "refusal_id": empty.refusal_id,
        }
    )
)
