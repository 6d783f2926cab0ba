"""Request authentication between FlexMig components: HMAC-SHA256 over the request.

Every request carries a timestamp, a nonce and a signature over
(method, path, timestamp, nonce, body) made with the deployment's shared key.
The agent rejects a bad or missing signature, a timestamp outside the allowed
skew and a nonce it has already seen, so a captured request cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from flexmig import exceptions

MAX_SKEW_S = 30.0
HEADER_TS = "X-FlexMig-Timestamp"
HEADER_NONCE = "X-FlexMig-Nonce"
HEADER_SIG = "X-FlexMig-Signature"
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


def sign(
    key: bytes, method: str, path: str, body: bytes, now: float | None = None
) -> dict[str, str]:
    """Headers that authenticate one request."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(12)
    return {
        HEADER_TS: ts,
        HEADER_NONCE: nonce,
        HEADER_SIG: _digest(key, method, path, ts, nonce, body),
    }


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
            skew = abs(now - float(ts))
        except ValueError:
            raise AuthError(reason="malformed timestamp") from None
        if skew > self.max_skew_s:
            raise AuthError(reason=f"timestamp {skew:.0f} s off (max {self.max_skew_s:.0f} s)")
        expected = _digest(self.key, method, path, ts, nonce, body)
        if not hmac.compare_digest(expected, sig):
            raise AuthError(reason="bad signature")
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if now - t <= self.max_skew_s}
            if nonce in self._seen:
                raise AuthError(reason="replayed request")
            self._seen[nonce] = now


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
