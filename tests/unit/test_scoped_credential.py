"""Migration-scoped agent credentials: what they may do, and for how long."""

from __future__ import annotations

import json

import pytest

from agents.agent import auth

KEY = b"deployment-shared-key-0123456789"
NOW = 1_800_000_000.0
SCOPE = auth.scope_for("0f25fdf1-0453", "instance-00000001", NOW + 600)
SCOPED_KEY = auth.scoped_key(KEY, SCOPE)


def _verify(method: str, path: str, body: bytes = b"", scope: str = SCOPE, now: float = NOW):
    headers = auth.sign(SCOPED_KEY, method, path, body, now=now, scope=scope)
    auth.Verifier(KEY).verify(method, path, headers, body, now=now)


@pytest.mark.parametrize("path", ["/v1/health", "/v1/facts", "/v1/probe/8", "/v1/split/vm-1"])
def test_reads_are_allowed(path: str) -> None:
    _verify("GET", path)


def test_releasing_its_own_vm_is_allowed() -> None:
    _verify("POST", "/v1/split/cleanup", json.dumps({"vm": "instance-00000001"}).encode())


def test_handing_over_its_own_vms_hot_chunks_is_allowed() -> None:
    body = {"vm": "instance-00000001", "chunks": [[0, 4]]}
    _verify("POST", "/v1/split/hot", json.dumps(body).encode())


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/split/cleanup", {"vm": "instance-00000002"}),
        ("POST", "/v1/split/hot", {"vm": "instance-00000002", "chunks": []}),
        ("POST", "/v1/split/hot", {"vm": "instance-00000001", "chunks": [], "x": 1}),
        ("POST", "/v1/split/sample-hot", {"vm": "instance-00000001", "ram_bytes": 1}),
        (
            "POST",
            "/v1/split/prepare",
            {"vm": "instance-00000001", "ram_bytes": 1, "budget_bytes": 1},
        ),
        ("POST", "/v1/migrations", {"vm": "instance-00000001", "dest": {}}),
        ("GET", "/v1/migrations", None),
    ],
)
def test_anything_else_is_refused(method: str, path: str, body: dict | None) -> None:
    raw = json.dumps(body).encode() if body is not None else b""
    with pytest.raises(auth.AuthError, match="may not"):
        _verify(method, path, raw)


def test_an_expired_credential_is_refused() -> None:
    with pytest.raises(auth.AuthError, match="expired"):
        _verify("GET", "/v1/facts", now=NOW + 601)


def test_a_widened_scope_does_not_verify() -> None:
    # The holder cannot stretch its expiry: the key was derived for the original scope.
    longer = auth.scope_for("0f25fdf1-0453", "instance-00000001", NOW + 86400)
    with pytest.raises(auth.AuthError, match="bad signature"):
        _verify("GET", "/v1/facts", scope=longer)


def test_a_malformed_scope_is_refused() -> None:
    with pytest.raises(auth.AuthError, match="malformed"):
        _verify("GET", "/v1/facts", scope="migration/../../etc")


def test_the_scoped_key_is_not_the_shared_key() -> None:
    headers = auth.sign(SCOPED_KEY, "GET", "/v1/facts", b"", now=NOW)  # no scope header
    with pytest.raises(auth.AuthError, match="bad signature"):
        auth.Verifier(KEY).verify("GET", "/v1/facts", headers, b"", now=NOW)


@pytest.mark.parametrize("stamp", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_signed_non_finite_timestamp_is_refused(stamp: str) -> None:
    body = b"{}"
    headers = auth.sign(KEY, "GET", "/v1/facts", body, now=NOW)
    headers[auth.HEADER_TS] = stamp
    # Signed by the key holder, so only the timestamp check can refuse it.
    headers[auth.HEADER_SIG] = auth._digest(
        KEY, "GET", "/v1/facts", stamp, headers[auth.HEADER_NONCE], body
    )
    with pytest.raises(auth.AuthError):
        auth.Verifier(KEY).verify("GET", "/v1/facts", headers, body, now=NOW)


# The migration's mover id is its id without dashes; a postcopy resume over the
# movers needs a fresh pair, which the source's Nova driver starts and finishes
# on the destination with this credential (nova_driver/postcopy.py).
OWN_MOVERS = auth.mover_id("0f25fdf1-0453")


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS}),
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS, "abort": True}),
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS + "0001", "abort": True}),
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS + "0003"}),
        ("/v1/mover/receive", {"migration_id": OWN_MOVERS + "0001", "token_salt": "ab" * 24}),
        (
            "/v1/mover/receive",
            {"migration_id": OWN_MOVERS + "00ff", "token_salt": "ab" * 24, "streams": 1},
        ),
    ],
)
def test_its_own_movers_and_their_resume_pairs_are_allowed(path: str, body: dict) -> None:
    _verify("POST", path, json.dumps(body).encode())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # The first pair is the destination's own to start, and other migrations' never.
        ("/v1/mover/receive", {"migration_id": OWN_MOVERS, "token_salt": "ab" * 24}),
        ("/v1/mover/receive", {"migration_id": "0f25fdf104540001", "token_salt": "ab" * 24}),
        ("/v1/mover/receive", {"migration_id": OWN_MOVERS + "0000", "token_salt": "ab" * 24}),
        ("/v1/mover/receive", {"migration_id": OWN_MOVERS + "0001", "peer": "10.0.0.9"}),
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS + "00001"}),
        ("/v1/mover/finish", {"migration_id": OWN_MOVERS, "abort": False}),
        ("/v1/mover/finish", ["not", "an", "object"]),
        ("/v1/mover/send", {"migration_id": OWN_MOVERS + "0001"}),
    ],
)
def test_other_mover_requests_are_refused(path: str, body: object) -> None:
    with pytest.raises(auth.AuthError, match="may not POST"):
        _verify("POST", path, json.dumps(body).encode())
