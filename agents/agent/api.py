"""The agent's control API: JSON over HTTP, every request authenticated.

A request without a valid credential gets 401, a malformed one 400, one for
something that does not exist 404; none changes anything.  A migration the
policy refuses gets 409 with its reasons; an expensive request refused for
load 503 with Retry-After (admission.py); a backend failure (libvirt, a peer
agent, a command) 502; a bug 500, logged with its traceback.  Every error
comes back as JSON with the FlexMig message, never as a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from agents.agent import admission, auth, listener
from flexmig import exceptions

LOG = logging.getLogger("flexmig.agent.api")
MAX_BODY = 64 * 1024
# A refused body is read and dropped up to this much so the refusal reaches
# its sender (see _refuse_body); beyond it the connection is simply closed.
REFUSED_BODY_DRAIN = 16 * 2**20
Handler = Callable[[dict[str, Any], re.Match[str]], tuple[int, dict[str, Any]]]


class BadRequest(exceptions.InvalidInput):
    msg_fmt = "Bad request: %(reason)s"


class Forbidden(exceptions.FlexMigError):
    msg_fmt = "Forbidden: %(reason)s"


def check_fields(
    body: dict[str, Any],
    required: dict[str, type | tuple[type, ...]],
    optional: dict[str, type | tuple[type, ...]] | None = None,
) -> None:
    """Exact-shape check: required keys with types, optional keys, nothing else."""
    optional = optional or {}
    unknown = set(body) - set(required) - set(optional)
    if unknown:
        raise BadRequest(reason=f"unknown field(s) {sorted(unknown)}")
    for key in required:
        if key not in body:
            raise BadRequest(reason=f"missing field {key!r}")
    for key, kind in {**required, **optional}.items():
        if key in body and (
            not isinstance(body[key], kind) or isinstance(body[key], bool) and kind is int
        ):
            raise BadRequest(reason=f"field {key!r} has the wrong type")


def error_reply(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The HTTP status and JSON body an error becomes.

    >>> error_reply(exceptions.PolicyRefused("vm1", ["split is unavailable"]))
    (409, {'error': 'FlexMig refuses to migrate vm1: split is unavailable', \
'kind': 'refused', 'vm': 'vm1', 'reasons': ['split is unavailable']})
    >>> error_reply(KeyError("x"))[0]
    500
    """
    if isinstance(exc, exceptions.NotFound):
        return 404, {"error": str(exc), "kind": "not_found"}
    if isinstance(exc, ValueError | exceptions.InvalidInput):
        return 400, {"error": str(exc), "kind": "invalid_input"}
    if isinstance(exc, Forbidden):
        return 403, {"error": str(exc), "kind": "forbidden"}
    if isinstance(exc, exceptions.PolicyRefused):
        reply = {"error": str(exc), "kind": "refused", "vm": exc.vm, "reasons": list(exc.reasons)}
        return 409, reply
    if isinstance(exc, admission.Busy):
        return 503, {"error": str(exc), "kind": "busy", "retry_after": exc.retry_after}
    if isinstance(exc, exceptions.BackendError):
        return 502, {"error": str(exc), "kind": "backend"}
    if isinstance(exc, exceptions.FlexMigError):
        return 500, {"error": str(exc), "kind": "error"}
    error = exceptions.InternalError(action="serving the request", error=repr(exc))
    return 500, {"error": str(error), "kind": "internal"}


class Router:
    def __init__(self) -> None:
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        self.routes.append((method, re.compile(f"^{pattern}$"), handler))

    def dispatch(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        allowed = False
        for m, pattern, handler in self.routes:
            match = pattern.match(path)
            if match and m == method:
                return handler(body, match)
            allowed = allowed or bool(match)
        return (
            (405, {"error": "method not allowed"}) if allowed else (404, {"error": "no such path"})
        )


def make_handler(verifier: auth.Verifier, router: Router) -> type[BaseHTTPRequestHandler]:
    class RequestHandler(BaseHTTPRequestHandler):
        server_version = "flexmig-agent"

        def log_message(self, fmt: str, *args: Any) -> None:
            peer = self.client_address[0] if self.client_address else "unix"
            LOG.info("%s " + fmt, peer, *args)

        def _reply(self, status: int, payload: dict[str, Any] | bytes) -> None:
            raw = isinstance(payload, bytes)
            data = payload if raw else json.dumps(payload, default=str).encode()
            self.send_response(status)
            self.send_header(
                "Content-Type", "application/octet-stream" if raw else "application/json"
            )
            if not raw and "retry_after" in payload:
                self.send_header("Retry-After", str(payload["retry_after"]))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refuse_body(self, length: int) -> None:
            """400 for a body over MAX_BODY.  Closing with the body unread makes
            the kernel answer the rest of it with a reset, and a reset can
            discard the reply before its sender reads it; so the body is read
            and dropped first, bounded by REFUSED_BODY_DRAIN and the request's
            deadline."""
            self.close_connection = True
            self._reply(400, {"error": f"body must be 0..{MAX_BODY} bytes"})
            self.wfile.flush()
            left = min(length, REFUSED_BODY_DRAIN) if length > 0 else 0
            try:
                while left > 0:
                    chunk = self.rfile.read1(min(left, 65536))
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass  # the sender gave up or the deadline cut it: nothing to keep

        def _handle(self, method: str) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                self._refuse_body(length)
                return
            raw = self.rfile.read(length)
            self.server.request_read()  # the whole request is here: no more deadline
            try:
                verifier.verify(method, self.path, dict(self.headers.items()), raw)
            except auth.AuthError as exc:
                self._reply(401, {"error": str(exc)})
                return
            try:
                body = json.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise BadRequest(reason="the body must be a JSON object")
                status, payload = router.dispatch(method, self.path, body)
            except Exception as exc:
                status, payload = error_reply(exc)
                if status == 500:
                    LOG.exception("internal error on %s %s", method, self.path)
            self._reply(status, payload)

        def do_GET(self) -> None:
            self._handle("GET")

        def do_POST(self) -> None:
            self._handle("POST")

    return RequestHandler


def make_servers(
    address: str,
    port: int,
    unix_socket: str | None,
    verifier: auth.Verifier,
    router: Router,
    limits: listener.Limits | None = None,
    tls: ssl.SSLContext | None = None,
) -> list[listener.Listener]:
    """The API on ``address:port`` (TLS when ``tls``) and, if given, a UNIX socket."""
    limits = limits or listener.Limits()
    handler = make_handler(verifier, router)
    servers = [listener.tcp_listener(address, port, handler, limits, tls)]
    if unix_socket:
        servers.append(listener.unix_listener(unix_socket, handler, limits))
    return servers
