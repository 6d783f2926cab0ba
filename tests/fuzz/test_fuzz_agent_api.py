"""Fuzzing the agent's control API: bodies, headers and signatures.

Two targets.  The signature check alone (:class:`agents.agent.auth.Verifier`):
a correctly signed request is accepted once, and the same request with any one
part changed (method, path, body, timestamp, nonce, signature, scope) is
refused with :class:`~agents.agent.auth.AuthError`, nothing else.  And the
whole agent as clients reach it: raw HTTP requests written to a real listener
(a UNIX socket) in front of a real :class:`~agents.agent.service.Agent`
(libvirt's test driver, its store and state in a temporary directory), some
unsigned, some signed and then tampered with, some signed right with a fuzzed
body.  Every request gets an HTTP answer, never the catch-all "internal error";
an unsigned or tampered request gets 401 (or http.server's own 400/501 for a
request it cannot parse) and reaches no handler; and no refused request
(status >= 400) changes anything: the files under the agent's directories, its
split reservations, movers, flushers and migration records are the same.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from agents.agent import api, auth, listener
from agents.agent.service import Agent, limits
from tests.unit.test_agent_hardening import KEY, agent_conf

RESPONSE_TIMEOUT = 5.0
FIELDS = [
    "vm", "ram_bytes", "budget_bytes", "headroom_bytes", "migration_id", "mode", "flows",
    "peer", "address", "port", "ports", "dest", "transport", "streams", "parallel",
    "token_salt", "bandwidth_mib", "max_downtime_ms", "migration_uri", "libvirt_uri",
    "store_writeback", "probe", "abort", "reason", "auto",
]  # fmt: skip
SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16)
)  # fmt: skip
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6),
                                                                         inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
OBJECTS = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), VALUES, max_size=5)
BODIES = (
    OBJECTS.map(lambda d: json.dumps(d).encode())
    | VALUES.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=300)
    | st.just(b"")
)
TOKEN = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=12)
# Header names of the fuzzed part; the framing ones are the request builder's.
HEADER_NAME = TOKEN.filter(
    lambda n: n.split(":")[0].strip().lower() not in ("content-length", "host", "connection")
)
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
CREDENTIAL_HEADERS = [auth.HEADER_TS, auth.HEADER_NONCE, auth.HEADER_SIG, auth.HEADER_SCOPE]
TAMPERED = ["method", "path", "body", "ts", "nonce", "sig", "scope"]


def concrete_paths(router: api.Router) -> list[str]:
    """One path that each route's pattern matches (its groups filled with '1')."""
    paths = []
    for _method, pattern, _handler in router.routes:
        text = re.sub(r"\(\?P<\w+>[^)]*\)", "1", pattern.pattern).strip("^$")
        assert pattern.match(text), text
        paths.append(text)
    return paths


# -- the signature check ------------------------------------------------------------
def _signed(method: str, path: str, body: bytes, now: float, scoped: bool):
    if not scoped:
        return auth.sign(KEY, method, path, body, now=now)
    scope = auth.scope_for("5f0c", "instance-1", now + 60)
    return auth.sign(auth.scoped_key(KEY, scope), method, path, body, now=now, scope=scope)


def _tamper(part: str, method: str, path: str, body: bytes, headers: dict, junk: str):
    headers = dict(headers)
    if part == "method":
        method = "POST" if method == "GET" else "GET"
    elif part == "path":
        path = path + (junk or "x")
    elif part == "body":
        body = body + (junk or "x").encode()
    elif part == "ts":
        headers[auth.HEADER_TS] = junk if junk != headers[auth.HEADER_TS] else "0"
    elif part == "nonce":
        headers[auth.HEADER_NONCE] = headers[auth.HEADER_NONCE] + (junk or "x")
    elif part == "sig":
        sig = headers[auth.HEADER_SIG]
        headers[auth.HEADER_SIG] = ("0" if sig[0] != "0" else "1") + sig[1:] + junk[:0]
    else:
        scope = auth.scope_for("5f0c", "instance-2" + junk, 1800000000)
        headers[auth.HEADER_SCOPE] = scope
    return method, path, body, headers


@given(
    method=st.sampled_from(["GET", "POST"]),
    path=st.sampled_from(["/v1/health", "/v1/split/instance-1", "/v1/split/cleanup"]) | TOKEN,
    body=BODIES,
    scoped=st.booleans(),
    part=st.sampled_from(TAMPERED),
    junk=HEADER_VALUE,
)
@example(method="GET", path="/v1/health", body=b"", scoped=False, part="ts", junk="nan")
@example(method="GET", path="/v1/health", body=b"", scoped=False, part="ts", junk="1e400")
def test_a_signed_request_changed_anywhere_is_refused(method, path, body, scoped, part, junk):
    now = 1_800_000_000.0
    verifier = auth.Verifier(KEY)
    headers = _signed(method, path, body, now, scoped)
    t_method, t_path, t_body, t_headers = _tamper(part, method, path, body, headers, junk)
    with pytest.raises(auth.AuthError):
        verifier.verify(t_method, t_path, t_headers, t_body, now=now)
    try:
        verifier.verify(method, path, headers, body, now=now)
    except auth.AuthError:
        # Only a scoped credential may be refused as it was signed: its routes are few.
        assert scoped
        return
    with pytest.raises(auth.AuthError, match="replayed"):
        verifier.verify(method, path, headers, body, now=now)


@given(st.dictionaries(st.sampled_from(CREDENTIAL_HEADERS) | TOKEN, HEADER_VALUE, max_size=6))
@example({auth.HEADER_TS: "inf", auth.HEADER_NONCE: "a", auth.HEADER_SIG: "b"})
@example({auth.HEADER_TS: "1800000000", auth.HEADER_NONCE: "a", auth.HEADER_SIG: "b",
          auth.HEADER_SCOPE: "migration/1/vm/notanumber"})  # fmt: skip
def test_any_credential_headers_but_a_valid_signature_are_refused(headers):
    with pytest.raises(auth.AuthError):
        auth.Verifier(KEY).verify("GET", "/v1/health", headers, b"", now=1_800_000_000.0)


# -- the whole agent over a real listener ----------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-api")
    conf = agent_conf(tmp, allow_orchestration="false")
    agent = Agent(conf)
    reached: list[str] = []
    for i, (method, pattern, handler) in enumerate(agent.router.routes):
        agent.router.routes[i] = (method, pattern, _recording(handler, reached))
    path = str(tmp / "api.sock")
    handler = api.make_handler(auth.Verifier(agent.key), agent.router)
    server = listener.unix_listener(path, handler, limits(conf))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield agent, path, tmp, reached
    server.shutdown()
    server.server_close()
    thread.join(5)


def _recording(handler, reached):
    def record(body, match):
        reached.append(match.string)
        return handler(body, match)

    return record


def agent_state(agent: Agent, tmp: Path) -> dict:
    files = sorted(
        (str(Path(d, f).relative_to(tmp)), os.path.getsize(Path(d, f)))
        for d, _dirs, names in os.walk(tmp)
        for f in names
        if f != "api.sock"
    )
    return {
        "files": files,
        "receivers": sorted(agent.receivers),
        "flushers": sorted(agent.flushers),
        "keepers": sorted(agent.keepers),
        "migrations": sorted(agent.migrations.records),
    }


def exchange(path: str, request: bytes) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(RESPONSE_TIMEOUT)
        sock.connect(path)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)  # a short body is short, never waited for
        reply = b""
        deadline = time.monotonic() + RESPONSE_TIMEOUT
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3}) ", status_line)
    assert m, f"no HTTP answer: {reply[:200]!r}"
    return int(m.group(1)), rest.partition(b"\r\n\r\n")[2]


def _read_by_agent(length: str | None, body: bytes) -> bytes | None:
    """The body the agent reads (Content-Length bytes, short if fewer were sent),
    or None when it refuses the declared length."""
    if length is None:
        return body
    try:
        declared = int(length)
    except ValueError:
        return None
    return body[:declared] if 0 <= declared <= api.MAX_BODY else None


def _signed_right(method: str, path: str, headers: dict, body: bytes) -> bool:
    try:
        auth.Verifier(KEY).verify(method, path, headers, body)
    except auth.AuthError:
        return False
    return True


def build(method: str, path: str, headers: dict, body: bytes, length: str | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: agent"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


REQUESTS = st.fixed_dictionaries(
    {
        "method": st.sampled_from(["GET", "POST"]) | st.sampled_from(["PUT", "DELETE", "get"]),
        "route": st.integers(0, 63),
        "path_junk": st.none() | st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E),
                                         max_size=12),
        "body": BODIES,
        "signing": st.sampled_from(["none", "valid", "tampered", "fuzzed"]),
        "part": st.sampled_from(TAMPERED),
        "junk": HEADER_VALUE,
        "fuzzed": st.dictionaries(st.sampled_from(CREDENTIAL_HEADERS) | HEADER_NAME,
                                  HEADER_VALUE, max_size=5),
        "length": st.none() | st.sampled_from(["-1", "65537", "abc", "0", "1e3", " 2"]),
    }
)  # fmt: skip


def _req(**changed):
    """A request of the REQUESTS shape, for the regression examples."""
    base = {"method": "GET", "route": 0, "path_junk": None, "body": b"", "signing": "valid",
            "part": "body", "junk": "", "fuzzed": {}, "length": None}  # fmt: skip
    return base | changed


@given(REQUESTS)
@example(_req(method="POST", route=3, body=b'{"vm": "a"}'))
@example(_req(method="POST", route=3, body=b"[1]"))
@example(_req(method="POST", route=3, body=b"\xff\xfe", length="1"))
@example(_req(signing="tampered", part="ts", junk="nan"))
# Found by the campaign (harness, not agent): a tampered body cut back to the
# signed one by Content-Length, and a path tampered with a space that
# http.server's request-line split removes, are correctly signed requests.
@example(_req(signing="tampered", part="body", length="0"))
@example(_req(signing="tampered", part="path", junk=" "))
@example(_req(method="get", route=2, signing="tampered", part="method"))
def test_any_request_is_answered_and_a_refused_one_changes_nothing(served, req):  # fmt: skip
    agent, sock_path, tmp, reached = served
    paths = concrete_paths(agent.router)
    path = paths[req["route"] % len(paths)] + (req["path_junk"] or "")
    method, body = req["method"], req["body"]
    signing = req["signing"]
    headers: dict = {}
    if signing == "fuzzed":
        headers = req["fuzzed"]
    elif signing in ("valid", "tampered"):
        headers = auth.sign(KEY, method, path, body)
        if signing == "tampered":
            method, path, body, headers = _tamper(req["part"], method, path, body, headers,
                                                  req["junk"])  # fmt: skip
    before = agent_state(agent, tmp)
    reached.clear()
    status, reply = exchange(sock_path, build(method, path, headers, body, req["length"]))
    assert b"internal error" not in reply, reply
    assert status != 500 or reply.startswith(b"{"), reply
    if status >= 400:
        assert agent_state(agent, tmp) == before, (status, reply)
    read = _read_by_agent(req["length"], body)
    # http.server splits the request line on whitespace: the method and path it
    # routes (and the agent verifies) are the first two words, if there are three.
    words = f"{method} {path} HTTP/1.1".split()
    signed = len(words) == 3 and read is not None and _signed_right(*words[:2], headers, read)
    if words[0] not in ("GET", "POST") or not signed:
        # Unsigned, tampered, or the body the agent reads is not the one signed.
        assert not reached, (signing, status, reply)
        assert status in (400, 401, 501), (status, reply)
    # The agent's own answer: JSON whatever the status, or the probe's bytes.
    elif not (status == 200 and words[1].startswith("/v1/probe/")):
        json.loads(reply)
