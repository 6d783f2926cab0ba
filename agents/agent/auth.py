"""Request authentication between FlexMig components: HMAC-SHA256 over the request.

Every request carries a timestamp, a nonce and a signature over
(method, path, timestamp, nonce, body) made with the deployment's shared key.
The agent rejects a bad or missing signature, a timestamp outside the allowed
skew and a nonce it has already seen, so a captured request cannot be replayed.

A migration-scoped credential is a key derived from the shared one for one
VM's migration until an expiry (``scoped_key``): its holder signs with it and
names the scope in a header.  The agent accepts it only for what a migration's
source needs from its destination (reads, and releasing that one VM's split
reservation), and only until it expires, so the Nova driver can hand it across
hosts in the migrate data without handing out the deployment key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import threading
import time

from flexmig import exceptions

MAX_SKEW_S = 30.0
HEADER_TS = "X-FlexMig-Timestamp"
HEADER_NONCE = "X-FlexMig-Nonce"
HEADER_SIG = "X-FlexMig-Signature"
HEADER_SCOPE = "X-FlexMig-Scope"
SCOPE_RE = re.compile(
    r"^migration/(?P<id>[0-9A-Za-z-]{1,64})/(?P<vm>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})"
    r"/(?P<expires>[0-9]{1,12})$"
)
# What a migration-scoped credential may read: liveness, host facts, the
# fabric probe and split status.  The changes it may make: releasing its own
# VM's split reservation, handing over its own VM's hot chunks, finishing its
# own migration's receiving movers, and starting and finishing the fresh pairs
# a postcopy resume of that migration needs (all checked against the body).
SCOPED_READS = tuple(
    re.compile(p)
    for p in (r"^/v1/health$", r"^/v1/facts$", r"^/v1/probe/[0-9]{1,3}$", r"^/v1/split/[^/]+$")
)
SCOPED_RELEASE = "/v1/split/cleanup"
SCOPED_HINT = "/v1/split/hot"
SCOPED_MOVER_FINISH = "/v1/mover/finish"
SCOPED_MOVER_RECEIVE = "/v1/mover/receive"
MIN_KEY_BYTES = 16


class AuthError(exceptions.FlexMigError):
    msg_fmt = "Authentication failed: %(reason)s"


def _digest(key: bytes, method: str, path: str, ts: str, nonce: str, body: bytes) -> str:
    msg = b"\n".join(
        [
            method.upper().encode(),
            path.encode(),
            ts.encode(),
            nonce.encode(),
            hashlib.sha256(body).hexdigest().encode(),
        ]
    )
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def scope_for(migration_id: str, vm: str, expires: float) -> str:
    """The scope string of a credential for one VM's migration, valid until ``expires``.

    >>> scope_for("5f0c", "instance-00000001", 1800000000.5)
    'migration/5f0c/instance-00000001/1800000000'
    """
    return f"migration/{migration_id}/{vm}/{int(expires)}"


def scoped_key(key: bytes, scope: str) -> bytes:
    """The key a scoped credential signs with, derived from the shared key."""
    return hmac.new(key, b"flexmig-scope\n" + scope.encode(), hashlib.sha256).hexdigest().encode()


def mover_token(key: bytes, migration_id: str, salt: str) -> str:
    """The movers' per-migration token, derived on both ends from the deployment key.

    Only the random salt travels in the request, so the token is never on the
    wire, TLS or not; a new salt per migration makes every token new.
    """
    msg = b"flexmig-mover\n" + migration_id.encode() + b"\n" + salt.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:48]


def sign(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    now: float | None = None,
    scope: str | None = None,
) -> dict[str, str]:
    """Headers that authenticate one request (``key`` is the scoped key when ``scope``)."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    headers = {
        HEADER_TS: ts,
        HEADER_NONCE: nonce,
        HEADER_SIG: _digest(key, method, path, ts, nonce, body),
    }
    if scope is not None:
        headers[HEADER_SCOPE] = scope
    return headers


class Verifier:
    def __init__(self, key: bytes, max_skew_s: float = MAX_SKEW_S) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise exceptions.InvalidInput(
                what="agent key", reason=f"must be at least {MIN_KEY_BYTES} bytes"
            )
        self.key = key
        self.max_skew_s = max_skew_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def verify(
        self, method: str, path: str, headers: dict[str, str], body: bytes, now: float | None = None
    ) -> None:
        now = time.time() if now is None else now
        ts, nonce, sig = (headers.get(h) for h in (HEADER_TS, HEADER_NONCE, HEADER_SIG))
        if not ts or not nonce or not sig:
            raise AuthError(reason="missing credential headers")
        try:
            stamp = float(ts)
        except ValueError:
            raise AuthError(reason="malformed timestamp") from None
        # float() also takes "nan": its skew compares false with any bound, so a
        # request signed with it would never expire and could be replayed once
        # its nonce left the replay cache.
        if not math.isfinite(stamp):
            raise AuthError(reason="malformed timestamp")
        skew = abs(now - stamp)
        if skew > self.max_skew_s:
            raise AuthError(reason=f"timestamp {skew:.0f} s off (max {self.max_skew_s:.0f} s)")
        key = self._key_for(method, path, body, headers.get(HEADER_SCOPE), now)
        expected = _digest(key, method, path, ts, nonce, body)
        if not hmac.compare_digest(expected, sig):
            raise AuthError(reason="bad signature")
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= self.max_skew_s}
            if nonce in self._seen:
                raise AuthError(reason="replayed request")
            self._seen[nonce] = now

    def _key_for(self, method: str, path: str, body: bytes, scope: str | None, now: float) -> bytes:
        if scope is None:
            return self.key
        match = SCOPE_RE.match(scope)
        if not match:
            raise AuthError(reason="malformed credential scope")
        if now > int(match.group("expires")):
            raise AuthError(reason=f"the credential for migration {match.group('id')} expired")
        read = method == "GET" and any(p.match(path) for p in SCOPED_READS)
        vm = match.group("vm")
        own = (
            _releases_own_vm(method, path, body, vm)
            or _hints_own_vm(method, path, body, vm)
            or _finishes_own_movers(method, path, body, match.group("id"))
        )
        if not read and not own:
            raise AuthError(reason=f"a migration-scoped credential may not {method} {path}")
        return scoped_key(self.key, scope)


def _releases_own_vm(method: str, path: str, body: bytes, vm: str) -> bool:
    if method != "POST" or path != SCOPED_RELEASE:
        return False
    try:
        return json.loads(body) == {"vm": vm}
    except ValueError:
        return False


def _hints_own_vm(method: str, path: str, body: bytes, vm: str) -> bool:
    """The source's hot chunks for the scope's own VM (the agent checks the chunks)."""
    if method != "POST" or path != SCOPED_HINT:
        return False
    try:
        request = json.loads(body)
    except ValueError:
        return False
    return isinstance(request, dict) and set(request) == {"vm", "chunks"} and request["vm"] == vm


def mover_id(migration_id: str) -> str:
    """The movers' id of a migration (hex): a Nova migration's UUID without dashes.

    >>> mover_id("5f0c2b1e-0000-4000-8000-00000000abcd")
    '5f0c2b1e00004000800000000000abcd'
    """
    return migration_id.replace("-", "")


def _finishes_own_movers(method: str, path: str, body: bytes, scope_id: str) -> bool:
    if method != "POST" or path not in (SCOPED_MOVER_FINISH, SCOPED_MOVER_RECEIVE):
        return False
    try:
        request = json.loads(body)
    except ValueError:
        return False
    if not isinstance(request, dict):
        return False
    mid = request.get("migration_id")
    if path == SCOPED_MOVER_RECEIVE:
        # Only a resume's fresh pair: the first one the destination started itself.
        extra = {"token_salt", "streams"}
        return is_resume_mover_id(mid, scope_id) and set(request) - {"migration_id"} <= extra
    own = mid == mover_id(scope_id) or is_resume_mover_id(mid, scope_id)
    return (
        own and set(request) - {"migration_id"} <= {"abort"} and request.get("abort", True) is True
    )


def is_resume_mover_id(mid: object, scope_id: str) -> bool:
    """Whether ``mid`` names a postcopy resume's pair of the scope's migration
    (``recovery.resume_transport_id``: its mover id and a 4-digit attempt).

    >>> is_resume_mover_id("5f0c0001", "5f0c"), is_resume_mover_id("5f0c", "5f0c")
    (True, False)
    >>> is_resume_mover_id("5f0c00zz", "5f0c"), is_resume_mover_id("5f0c0000", "5f0c")
    (False, False)
    """
    base = mover_id(scope_id)
    if not isinstance(mid, str) or len(mid) != len(base) + 4 or not mid.startswith(base):
        return False
    attempt = mid[len(base) :]
    return all(c in "0123456789abcdef" for c in attempt) and int(attempt, 16) >= 1


def load_key(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        raise exceptions.InvalidInput(what="agent key file", reason=f"{path}: {exc}") from exc
    if len(key) < MIN_KEY_BYTES:
        raise exceptions.InvalidInput(
            what="agent key file", reason=f"{path} holds fewer than {MIN_KEY_BYTES} bytes"
        )
    return key
