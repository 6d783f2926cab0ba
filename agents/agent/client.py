"""Client for the agent API: signs every request, wraps every failure."""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any

from agents.agent import auth, listener
from flexmig import exceptions

# The agent API's port, written once: the agent's, Nova's and the CLI's defaults.
DEFAULT_PORT = 9797


class AgentError(exceptions.BackendError):
    msg_fmt = "Agent %(agent)s: %(reason)s"


class AgentBusy(AgentError):
    """The agent refused an expensive request for load; nothing was started."""

    def __init__(self, agent: str, reason: str, retry_after: int) -> None:
        super().__init__(agent=agent, reason=reason)
        self.retry_after = retry_after


def _error(agent: str, what: str, status: int, reply: dict[str, Any]) -> exceptions.FlexMigError:
    """The exception an error reply stands for: the API's kinds map back to ours."""
    text = f"Agent {agent}: {what}: {status} {reply.get('error')}"
    if status == 409 and isinstance(reply.get("reasons"), list):
        return exceptions.PolicyRefused(str(reply.get("vm")), [str(r) for r in reply["reasons"]])
    if status == 404:
        return exceptions.NotFound(text)
    if status == 400:
        return exceptions.InvalidInput(text)
    if status == 503 and isinstance(reply.get("retry_after"), int):
        reason = f"{what}: {status} {reply.get('error')}"
        return AgentBusy(agent, reason, reply["retry_after"])
    return AgentError(agent=agent, reason=f"{what}: {status} {reply.get('error')}")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _exchange(
    conn: http.client.HTTPConnection, method: str, path: str, data: bytes, headers: dict
) -> tuple[http.client.HTTPResponse, bytes]:
    """One request and its reply.  An agent refuses a body it will not take
    (too large, say) as soon as it has read the headers, and closes: the rest of
    the body then meets a closed socket.  Its reply is already on the way, and
    says why; a send error is raised only when there is no reply to read."""
    try:
        conn.request(method, path, body=data, headers=headers)
    except (BrokenPipeError, ConnectionResetError) as send_error:
        try:
            resp = conn.getresponse()
            return resp, resp.read()
        except (OSError, http.client.HTTPException):
            raise send_error from None
    resp = conn.getresponse()
    return resp, resp.read()


class AgentClient:
    """``address`` is an IP (with ``port``) or, with port 0, a UNIX socket path.

    With ``scope`` the client holds a migration-scoped credential: ``key`` is
    the scoped key (``auth.scoped_key``), not the deployment's.  With
    ``ca_file`` it speaks TLS and verifies the agent's certificate against
    that CA (the deployment's); UNIX sockets never leave the host and stay
    plain.
    """

    def __init__(
        self,
        address: str,
        port: int,
        key: bytes,
        timeout: float = 10.0,
        scope: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.address = address
        self.port = port
        self.key = key
        self.timeout = timeout
        self.scope = scope
        self.tls = listener.client_tls(ca_file) if ca_file and port else None

    @property
    def name(self) -> str:
        return f"{self.address}:{self.port}" if self.port else self.address

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.port == 0:
            return _UnixHTTPConnection(self.address, timeout)
        if self.tls is not None:
            return http.client.HTTPSConnection(
                self.address, self.port, timeout=timeout, context=self.tls
            )
        return http.client.HTTPConnection(self.address, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        headers = auth.sign(self.key, method, path, data, scope=self.scope)
        headers["Content-Type"] = "application/json"
        conn = self._connection(timeout or self.timeout)
        try:
            resp, payload = _exchange(conn, method, path, data, headers)
        except (OSError, http.client.HTTPException) as exc:
            raise AgentError(agent=self.name, reason=f"{method} {path}: {exc}") from exc
        finally:
            conn.close()
        try:
            result = json.loads(payload or b"{}")
        except ValueError:
            raise AgentError(agent=self.name, reason=f"{method} {path}: non-JSON reply") from None
        if resp.status >= 400:
            raise _error(self.name, f"{method} {path}", resp.status, result)
        return result

    def probe_bandwidth(self, mib: int) -> float:
        """Bytes/s pulling ``mib`` MiB from the agent: the fabric's measured rate."""
        path = f"/v1/probe/{mib}"
        headers = auth.sign(self.key, "GET", path, b"", scope=self.scope)
        conn = self._connection(self.timeout)
        try:
            start = time.monotonic()
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            size = 0
            while chunk := resp.read(1 << 20):
                size += len(chunk)
            elapsed = time.monotonic() - start
        except (OSError, http.client.HTTPException) as exc:
            raise AgentError(agent=self.name, reason=f"bandwidth probe: {exc}") from exc
        finally:
            conn.close()
        if resp.status != 200 or size != mib << 20:
            raise AgentError(agent=self.name, reason=f"bandwidth probe: status {resp.status}")
        return size / elapsed

    def get(self, path: str, **kw: Any) -> dict[str, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        return self.request("POST", path, body, **kw)
