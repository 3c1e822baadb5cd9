"""The admin API client: issue leases, run agents under them, end them, read their usage.

Every call goes straight to the admin API, never through an HTTP proxy: the orchestrator's own
environment may well name leasegate as its proxy, and admin calls routed through it would be
refused (or, worse, charged to a lease).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = [
    "AdminUnreachable",
    "Client",
    "DEFAULT_ADMIN_URL",
    "DEV_TOKEN_FILE",
    "Lease",
    "LeasegateError",
    "Placeholder",
    "Usage",
    "manifest_of",
]

#: Where `leasegate serve` listens for admin calls unless told otherwise.
DEFAULT_ADMIN_URL = "http://127.0.0.1:3129"

#: The admin token `leasegate serve --dev` writes, relative to the directory it runs in.
DEV_TOKEN_FILE = Path(".leasegate") / "admin-token"

#: System root bundles, the first one present is used (Debian/Ubuntu/Alpine, Fedora/RHEL, macOS/BSD).
SYSTEM_ROOTS = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/cert.pem",
)

#: Which file each CA variable names when an answer carries a CA but no ``variables``: the
#: bundle (system roots, then the CA) for most clients, the CA alone for Node (which adds it to
#: its own roots).
CA_VARIABLES = {
    "SSL_CERT_FILE": "bundle",
    "REQUESTS_CA_BUNDLE": "bundle",
    "CURL_CA_BUNDLE": "bundle",
    "GIT_SSL_CAINFO": "bundle",
    "NODE_EXTRA_CA_CERTS": "ca",
}

Json = Dict[str, Any]
LeaseRef = Union[str, "Lease"]


class LeasegateError(Exception):
    """A non-2xx answer from the admin API.

    ``status`` is the HTTP status (0: no answer at all, see :class:`AdminUnreachable`),
    ``message`` the answer's ``error``, ``reasons`` the contract's refusal reasons (``R1``,
    ``vendor:leasegate:fan-out-full``, ...; empty when the answer gave none), ``body`` the whole
    JSON answer, ``retry_after`` the seconds a 429 or 503 asked to wait.
    """

    def __init__(
        self,
        status: int,
        message: str,
        reasons: Sequence[str] = (),
        body: Optional[Json] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        self.status = status
        self.message = message
        self.reasons: List[str] = list(reasons)
        self.body: Json = dict(body or {})
        self.retry_after = retry_after
        text = f"{status}: {message}" if status else message
        if self.reasons:
            text += f" (reasons: {', '.join(self.reasons)})"
        super().__init__(text)

    @property
    def refusal_id(self) -> Optional[str]:
        """The id the refusal was recorded under in the journal, if it was one."""
        value = self.body.get("refusal_id")
        return value if isinstance(value, str) else None


class AdminUnreachable(LeasegateError):
    """The admin API did not answer (refused connection, timeout, bad address): status 0."""

    def __init__(self, url: str, reason: object) -> None:
        super().__init__(0, f"the admin API at {url} did not answer: {reason}")


@dataclass(frozen=True)
class Usage:
    """What a lease and its descendants used, as the proxy measured their model calls.

    ``None`` means unmeasured (no metered call; for ``cost_usd`` also: a call without a price),
    never zero.
    """

    tokens: Optional[int] = None
    cost_usd: Optional[float] = None

    @classmethod
    def from_json(cls, value: Any) -> Usage:
        """The ``usage`` member of a ``complete`` answer."""
        if not isinstance(value, dict):
            return cls()
        tokens = value.get("tokens")
        cost = value.get("cost_usd")
        return cls(
            tokens=int(tokens) if isinstance(tokens, (int, float)) else None,
            cost_usd=float(cost) if isinstance(cost, (int, float)) else None,
        )

    @classmethod
    def from_spent(cls, spent: Any) -> Usage:
        """A lease view's ``model.subtree_spent``: tokens once a call was metered, the cost once
        every call was priced (what ``complete`` records)."""
        if not isinstance(spent, dict) or not spent.get("calls"):
            return cls()
        tokens = spent.get("tokens")
        cost = spent.get("cost_usd")
        priced = not spent.get("unpriced") and isinstance(cost, (int, float))
        return cls(
            tokens=int(tokens) if isinstance(tokens, (int, float)) else None,
            cost_usd=float(cost) if priced and isinstance(cost, (int, float)) else None,
        )


@dataclass(frozen=True)
class Placeholder:
    """A brokered secret's stand-in: the agent holds ``placeholder`` in ``env``; the proxy puts
    the real value of ``secret`` in its place on the way out."""

    secret: str
    env: str
    placeholder: str = field(repr=False)


def _token_from_file(path: Union[str, Path]) -> Optional[str]:
    text = Path(path).read_text(encoding="utf-8").strip()
    return text or None


def _resolve_token(token: Optional[str], token_file: Union[str, Path, None]) -> Optional[str]:
    if token:
        return token
    if os.environ.get("LEASEGATE_ADMIN_TOKEN"):
        return os.environ["LEASEGATE_ADMIN_TOKEN"].strip()
    named = token_file or os.environ.get("LEASEGATE_ADMIN_TOKEN_FILE")
    if named:
        # Named, so it must be there: a typo should not fall back to no token at all.
        return _token_from_file(named)
    if DEV_TOKEN_FILE.is_file():
        return _token_from_file(DEV_TOKEN_FILE)
    return None


def _utc_text(at: Union[str, datetime]) -> str:
    if isinstance(at, str):
        return at
    if at.tzinfo is None:
        raise ValueError("expires_at must be an aware datetime (e.g. datetime.now(timezone.utc))")
    at = at.astimezone(timezone.utc)
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _lease_id(lease: LeaseRef) -> str:
    return lease.id if isinstance(lease, Lease) else lease


def manifest_of(
    *,
    name: str,
    purpose: str,
    hosts: Sequence[str] = (),
    deny_hosts: Sequence[str] = (),
    tools: Sequence[str] = (),
    approvals: Sequence[str] = (),
    tokens: Optional[int] = None,
    cost_usd: Optional[float] = None,
    steps: Optional[int] = None,
    depth: Optional[int] = None,
    fan_out: Optional[int] = None,
) -> Json:
    """The declared manifest the convenience arguments of :meth:`Client.issue` stand for.
    Members left out get the server's empty defaults."""
    if isinstance(hosts, str) or isinstance(deny_hosts, str) or isinstance(tools, str):
        raise TypeError("hosts, deny_hosts and tools are lists of strings, not one string")
    budget: Json = {}
    for key, value in (
        ("tokens", tokens),
        ("cost_usd", cost_usd),
        ("steps", steps),
        ("depth", depth),
        ("fan_out", fan_out),
    ):
        if value is not None:
            budget[key] = value
    manifest: Json = {
        "agent": {"name": name},
        "intent": {"purpose": purpose},
        "allow": {"hosts": list(hosts), "tools": list(tools)},
        "deny": {"hosts": list(deny_hosts)},
        "budget": budget,
        "approvals": list(approvals),
    }
    return manifest


class Client:
    """The admin API of one leasegate.

    ``admin_url``: the argument, else ``$LEASEGATE_ADMIN_URL``, else http://127.0.0.1:3129.
    The bearer token: ``token``, else ``$LEASEGATE_ADMIN_TOKEN``, else the file ``token_file``
    or ``$LEASEGATE_ADMIN_TOKEN_FILE`` names, else ``.leasegate/admin-token`` when it exists
    (what ``leasegate serve --dev`` writes), else none (a server without an admin token).
    A lease's own ``token`` works too: it issues that lease's children and ends that lease.
    """

    def __init__(
        self,
        admin_url: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Union[str, Path, None] = None,
        *,
        timeout: float = 30.0,
    ) -> None:
        url = admin_url or os.environ.get("LEASEGATE_ADMIN_URL") or DEFAULT_ADMIN_URL
        self.admin_url = url.rstrip("/")
        self.token = _resolve_token(token, token_file)
        self.timeout = timeout
        # No proxy, whatever HTTPS_PROXY / HTTP_PROXY / ALL_PROXY the environment names.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"Client(admin_url={self.admin_url!r}, token={'set' if self.token else None})"

    def request(
        self,
        method: str,
        path: str,
        body: Optional[Json] = None,
        headers: Optional[Mapping[str, str]] = None,
    ) -> Tuple[int, Json]:
        """One admin call: its status and JSON answer. A non-2xx answer raises
        :class:`LeasegateError`; no answer raises :class:`AdminUnreachable`."""
        url = self.admin_url + path
        data = None if body is None else json.dumps(body).encode("utf-8")
        sent = {"Accept": "application/json"}
        if data is not None:
            sent["Content-Type"] = "application/json"
        if self.token:
            sent["Authorization"] = f"Bearer {self.token}"
        sent.update(headers or {})
        req = urllib.request.Request(url, data=data, headers=sent, method=method)
        try:
            with self._opener.open(req, timeout=self.timeout) as answer:
                return answer.status, _json_of(answer.read())
        except urllib.error.HTTPError as e:
            raise _error_of(e) from None
        except (urllib.error.URLError, OSError) as e:
            reason = e.reason if isinstance(e, urllib.error.URLError) else e
            raise AdminUnreachable(self.admin_url, reason) from e

    def issue(
        self,
        *,
        name: Optional[str] = None,
        purpose: Optional[str] = None,
        hosts: Sequence[str] = (),
        deny_hosts: Sequence[str] = (),
        tools: Sequence[str] = (),
        approvals: Sequence[str] = (),
        tokens: Optional[int] = None,
        cost_usd: Optional[float] = None,
        steps: Optional[int] = None,
        depth: Optional[int] = None,
        fan_out: Optional[int] = None,
        lifetime: Union[int, float, timedelta, None] = None,
        expires_at: Union[str, datetime, None] = None,
        parent: Optional[LeaseRef] = None,
        idempotency_key: Optional[str] = None,
        manifest: Optional[Json] = None,
    ) -> Lease:
        """``POST /leases``: a lease for agent ``name``, allowed ``hosts``, with the budget given.

        ``manifest`` (a whole declared manifest) replaces every convenience argument from
        ``name`` to ``fan_out``. ``lifetime`` (seconds or a timedelta; the server's default is
        an hour) or ``expires_at`` (an aware datetime or a UTC timestamp), not both. ``parent``
        makes it a child, which the server narrows to its parent (``Lease.narrowed`` says how).
        With ``idempotency_key``, a retry (after a 503 or a lost answer) returns the same lease.
        """
        if manifest is None:
            if name is None or purpose is None:
                raise TypeError("issue() needs name= and purpose= (or a whole manifest=)")
            manifest = manifest_of(
                name=name,
                purpose=purpose,
                hosts=hosts,
                deny_hosts=deny_hosts,
                tools=tools,
                approvals=approvals,
                tokens=tokens,
                cost_usd=cost_usd,
                steps=steps,
                depth=depth,
                fan_out=fan_out,
            )
        body: Json = {"manifest": manifest}
        if parent is not None:
            body["parent_lease_id"] = _lease_id(parent)
        if lifetime is not None and expires_at is not None:
            raise ValueError("give lifetime or expires_at, not both")
        if lifetime is not None:
            seconds = lifetime.total_seconds() if isinstance(lifetime, timedelta) else lifetime
            body["lifetime_seconds"] = seconds
        if expires_at is not None:
            body["expires_at"] = _utc_text(expires_at)
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key is not None else {}
        _, answer = self.request("POST", "/leases", body, headers)
        return Lease.from_answer(answer, self)

    def get(self, lease: LeaseRef) -> Json:
        """``GET /leases/{id}``: the lease view (status, closed, counters, model, ...)."""
        return self.request("GET", f"/leases/{_lease_id(lease)}")[1]

    def complete(self, lease: LeaseRef, reason: Optional[str] = None) -> Usage:
        """``POST /leases/{id}/complete``: the lease's work is done; what it used."""
        _, answer = self.request("POST", f"/leases/{_lease_id(lease)}/complete", _reason(reason))
        return Usage.from_json(answer.get("usage"))

    def stop(self, lease: LeaseRef, reason: Optional[str] = None) -> None:
        """``POST /leases/{id}/stop``: end the lease early (its tunnels close)."""
        self.request("POST", f"/leases/{_lease_id(lease)}/stop", _reason(reason))

    def revoke(self, lease: LeaseRef, reason: str) -> bool:
        """``POST /leases/{id}/revoke``: whether this call revoked it (False: it already was)."""
        _, answer = self.request(
            "POST", f"/leases/{_lease_id(lease)}/revoke", {"reason": reason}
        )
        return bool(answer.get("revoked"))

    def usage(self, lease: LeaseRef) -> Usage:
        """What the lease and its subtree have used so far (``model.subtree_spent``)."""
        model = self.get(lease).get("model")
        return Usage.from_spent(model.get("subtree_spent") if isinstance(model, dict) else None)


def _reason(reason: Optional[str]) -> Json:
    return {} if reason is None else {"reason": reason}


def _json_of(data: bytes) -> Json:
    if not data:
        return {}
    value = json.loads(data.decode("utf-8"))
    return value if isinstance(value, dict) else {"value": value}


def _error_of(e: urllib.error.HTTPError) -> LeasegateError:
    data = e.read()
    try:
        body = _json_of(data)
    except ValueError:
        body = {"error": data.decode("utf-8", "replace").strip()}
    message = body.get("error")
    reasons = body.get("reasons")
    retry = e.headers.get("Retry-After") if e.headers else None
    try:
        retry_after = float(retry) if retry is not None else None
    except ValueError:
        retry_after = None
    return LeasegateError(
        e.code,
        message if isinstance(message, str) else (e.reason or "error"),
        [str(r) for r in reasons] if isinstance(reasons, list) else (),
        body,
        retry_after,
    )


def _is_proxy_variable(name: str) -> bool:
    lower = name.lower()
    return lower == "no_proxy" or lower.endswith("_proxy")


@dataclass
class Lease:
    """A lease the admin API issued (the ``POST /leases`` answer) and what an agent needs to run
    under it.

    ``token`` is the lease's own proxy token: a bearer for its children and its own ending.
    ``ca`` is the interception CA's PEM when the proxy brokers secrets (else None), and
    ``ca_variables`` says which variables point at a ``bundle`` (system roots + CA) and which at
    the ``ca`` alone. ``narrowed`` says what the server took away from what was asked.
    """

    id: str
    token: Optional[str] = field(repr=False)
    credential: Optional[str] = field(repr=False)
    proxy_url: str = field(repr=False)
    expires_at: str
    parent_id: Optional[str] = None
    issued_at: Optional[str] = None
    manifest: Optional[Json] = field(default=None, repr=False)
    narrowed: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict, repr=False)
    ca: Optional[str] = field(default=None, repr=False)
    ca_variables: Dict[str, str] = field(default_factory=dict, repr=False)
    placeholders: List[Placeholder] = field(default_factory=list, repr=False)
    port: Optional[int] = None
    replayed: bool = False
    answer: Json = field(default_factory=dict, repr=False, compare=False)
    _client: Optional[Client] = field(default=None, repr=False, compare=False)
    _ca_dir: Optional[str] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_answer(cls, answer: Json, client: Optional[Client] = None) -> Lease:
        """A lease from the ``POST /leases`` answer, issued through ``client``."""
        ca = answer.get("ca")
        ca_pem = ca.get("pem") if isinstance(ca, dict) else None
        variables = ca.get("variables") if isinstance(ca, dict) else None
        env = answer.get("env")
        port = answer.get("port")
        return cls(
            id=str(answer["lease_id"]),
            token=answer.get("token"),
            credential=answer.get("credential"),
            proxy_url=str(answer.get("proxy_url") or ""),
            expires_at=str(answer.get("expires_at") or ""),
            parent_id=answer.get("parent_lease_id"),
            issued_at=answer.get("issued_at"),
            manifest=answer.get("manifest"),
            narrowed=[str(n) for n in answer.get("narrowed") or []],
            env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
            ca=ca_pem if isinstance(ca_pem, str) else None,
            ca_variables=(
                {str(k): str(v) for k, v in variables.items()}
                if isinstance(variables, dict)
                else {}
            ),
            placeholders=[
                Placeholder(str(p["secret"]), str(p["env"]), str(p["placeholder"]))
                for p in answer.get("placeholders") or []
                if isinstance(p, dict)
            ],
            port=port if isinstance(port, int) else None,
            replayed=bool(answer.get("replayed")),
            answer=answer,
            _client=client,
        )

    @property
    def budget(self) -> Json:
        """The granted budget (``{}`` when the answer carried no manifest, as a replay may)."""
        budget = (self.manifest or {}).get("budget")
        return budget if isinstance(budget, dict) else {}

    @property
    def hosts(self) -> List[str]:
        """The granted allow list."""
        allow = (self.manifest or {}).get("allow")
        hosts = allow.get("hosts") if isinstance(allow, dict) else None
        return [str(h) for h in hosts] if isinstance(hosts, list) else []

    def own_client(self) -> Client:
        """A client of the same admin API holding this lease's own token as its bearer."""
        if not self.token:
            raise ValueError(f"lease {self.id}'s answer carried no token")
        url = self._client.admin_url if self._client else None
        timeout = self._client.timeout if self._client else 30.0
        return Client(admin_url=url, token=self.token, timeout=timeout)

    def child(
        self,
        *,
        name: Optional[str] = None,
        purpose: Optional[str] = None,
        hosts: Sequence[str] = (),
        deny_hosts: Sequence[str] = (),
        tools: Sequence[str] = (),
        approvals: Sequence[str] = (),
        tokens: Optional[int] = None,
        cost_usd: Optional[float] = None,
        steps: Optional[int] = None,
        depth: Optional[int] = None,
        fan_out: Optional[int] = None,
        lifetime: Union[int, float, timedelta, None] = None,
        expires_at: Union[str, datetime, None] = None,
        idempotency_key: Optional[str] = None,
        manifest: Optional[Json] = None,
    ) -> Lease:
        """A child of this lease, issued with this lease's own token (not the operator's):
        the server narrows it to this lease, and ``narrowed`` on the answer says how."""
        return self.own_client().issue(
            name=name,
            purpose=purpose,
            hosts=hosts,
            deny_hosts=deny_hosts,
            tools=tools,
            approvals=approvals,
            tokens=tokens,
            cost_usd=cost_usd,
            steps=steps,
            depth=depth,
            fan_out=fan_out,
            lifetime=lifetime,
            expires_at=expires_at,
            parent=self.id,
            idempotency_key=idempotency_key,
            manifest=manifest,
        )

    def complete(self, reason: Optional[str] = None) -> Usage:
        """Completes this lease with its own token; what it and its subtree used."""
        return self.own_client().complete(self.id, reason)

    def stop(self, reason: Optional[str] = None) -> None:
        """Stops this lease with its own token."""
        self.own_client().stop(self.id, reason)

    def environ(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """The environment an agent runs under this lease with.

        ``base`` (default ``os.environ``) without any inherited proxy setting (every variable
        whose lower-cased name is ``no_proxy`` or ends in ``_proxy``) and without the
        operator's admin credentials (``LEASEGATE_ADMIN_TOKEN`` becomes this lease's own token,
        ``LEASEGATE_ADMIN_TOKEN_FILE`` goes), then the answer's ``env``; when the proxy
        terminates TLS, the CA variables point at files in a private temporary directory
        (removed when this object goes).
        """
        source = os.environ if base is None else base
        env = {k: v for k, v in source.items() if not _is_proxy_variable(k)}
        env.pop("LEASEGATE_ADMIN_TOKEN_FILE", None)
        env.pop("LEASEGATE_ADMIN_TOKEN", None)
        if self.token:
            # An agent that issues its own sub-agents (with this package) finds its lease's
            # token, never the orchestrator's.
            env["LEASEGATE_ADMIN_TOKEN"] = self.token
        if self._client is not None:
            env["LEASEGATE_ADMIN_URL"] = self._client.admin_url
        env.update(self.env)
        if self.ca is not None:
            files = self._ca_files()
            for variable, kind in (self.ca_variables or CA_VARIABLES).items():
                env[variable] = files["ca" if kind == "ca" else "bundle"]
        return env

    def _ca_files(self) -> Dict[str, str]:
        """The CA alone and the bundle (system roots + CA), written once."""
        assert self.ca is not None
        if self._ca_dir is None or not os.path.isdir(self._ca_dir):
            directory = tempfile.mkdtemp(prefix=f"leasegate-{self.id[:8]}-")
            roots = next((p for p in SYSTEM_ROOTS if os.path.isfile(p)), None)
            pem = self.ca if self.ca.endswith("\n") else self.ca + "\n"
            system = Path(roots).read_text(encoding="utf-8") if roots else ""
            if system and not system.endswith("\n"):
                system += "\n"
            for name, text in (("ca.pem", pem), ("bundle.pem", system + pem)):
                path = os.path.join(directory, name)
                descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "w", encoding="utf-8") as out:
                    out.write(text)
            self._ca_dir = directory
            weakref.finalize(self, shutil.rmtree, directory, True)
        return {
            "ca": os.path.join(self._ca_dir, "ca.pem"),
            "bundle": os.path.join(self._ca_dir, "bundle.pem"),
        }

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs ``argv`` under this lease (``subprocess.run`` with :meth:`environ`; an ``env``
        given is the base instead of ``os.environ``)."""
        env = self.environ(kwargs.pop("env", None))
        return subprocess.run(list(argv), env=env, **kwargs)
