"""A migration's mover pairs: a fresh pair per postcopy resume, dead pairs cleared.

The destination agent is a fake that keeps which receivers it runs (and can be
unreachable, as during a fabric cut); the source's movers are not started
(``movers.start_senders`` is a stub that records them).
"""

from __future__ import annotations

import pytest

from agents.agent import mover_pairs, movers
from agents.agent.mover_pairs import MoverPairs
from flexmig import exceptions


class FakeSenders:
    def __init__(self, mid: str) -> None:
        self.mid, self.killed = mid, False

    def kill(self) -> None:
        self.killed = True

    def wait(self, timeout: float) -> dict:
        return {"bytes": 1, "mid": self.mid}


class DestAgent:
    key = b"k" * 32
    address = "10.0.0.2"

    def __init__(self) -> None:
        self.receiving: set[str] = set()
        self.reachable = True

    def post(self, path: str, body: dict, **_kw) -> dict:
        if not self.reachable:
            raise exceptions.BackendError(backend="agent on B", reason="timed out")
        mid = body["migration_id"]
        if path == "/v1/mover/receive":
            self.receiving.add(mid)
            return {"ports": [7471]}
        if mid not in self.receiving:
            raise exceptions.NotFound(what="mover of migration", name=mid)
        self.receiving.remove(mid)
        return {"aborted": True} if body.get("abort") else {"stats": {"bytes": 1}}


@pytest.fixture
def senders(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeSenders]:
    started: dict[str, FakeSenders] = {}

    def start(state_dir, local, peer, ports, mid, token):
        started[mid] = FakeSenders(mid)
        return started[mid]

    monkeypatch.setattr(mover_pairs.movers, "start_senders", start)
    return started


def _pairs(tmp_path, dest) -> MoverPairs:
    return MoverPairs(str(tmp_path), "10.0.0.1", "ab12cd34ef56", dest, streams=1)


def test_a_resume_gets_a_fresh_pair_once_the_old_one_is_gone_on_both_hosts(tmp_path, senders):
    dest = DestAgent()
    pairs = _pairs(tmp_path, dest)
    assert pairs.open() == "unix://" + movers.socket_path(str(tmp_path), "ab12cd34ef56")
    uri = pairs.reopen(1)
    assert uri == "unix://" + movers.socket_path(str(tmp_path), "ab12cd34ef560001")
    assert senders["ab12cd34ef56"].killed
    assert dest.receiving == {"ab12cd34ef560001"}  # the old receivers were killed first


def test_while_the_destination_is_unreachable_no_pair_starts_and_the_old_is_cleared_later(
    tmp_path, senders
):
    dest = DestAgent()
    pairs = _pairs(tmp_path, dest)
    pairs.open()
    dest.reachable = False
    with pytest.raises(exceptions.FlexMigError):
        pairs.reopen(1)
    assert set(senders) == {"ab12cd34ef56"} and senders["ab12cd34ef56"].killed
    assert dest.receiving == {"ab12cd34ef56"}  # could not be reached: still there
    dest.reachable = True
    pairs.reopen(2)
    assert dest.receiving == {"ab12cd34ef560002"}
    assert pairs.finish(ok=True) == {"send": {"bytes": 1, "mid": "ab12cd34ef560002"},
                                     "recv": {"bytes": 1}}  # fmt: skip
    assert dest.receiving == set()


def test_a_failed_migration_kills_every_pair_it_started(tmp_path, senders):
    dest = DestAgent()
    pairs = _pairs(tmp_path, dest)
    pairs.open()
    dest.reachable = False
    with pytest.raises(exceptions.FlexMigError):
        pairs.reopen(1)
    dest.reachable = True
    pairs.reopen(2)
    assert pairs.finish(ok=False) is None
    assert dest.receiving == set()
    assert all(s.killed for s in senders.values())


def test_a_pair_whose_sender_cannot_start_leaves_no_receivers(tmp_path, monkeypatch):
    dest = DestAgent()

    def refuse(*_args):
        raise exceptions.BackendError(backend="source mover", reason="did not get ready")

    monkeypatch.setattr(mover_pairs.movers, "start_senders", refuse)
    with pytest.raises(exceptions.BackendError):
        _pairs(tmp_path, dest).open()
    assert dest.receiving == set()


def test_a_pair_that_cannot_report_is_killed_on_both_hosts(tmp_path, senders):
    dest = DestAgent()
    pairs = _pairs(tmp_path, dest)
    pairs.open()
    pairs.reopen(1)  # a resume's pair QEMU never used: its sender never ends

    def never_ends(timeout: float) -> dict:
        raise exceptions.BackendError(backend="mover", reason="exited with -1")

    senders["ab12cd34ef560001"].wait = never_ends  # type: ignore[method-assign]
    with pytest.raises(exceptions.BackendError):
        pairs.finish(ok=True)
    assert senders["ab12cd34ef560001"].killed
    assert dest.receiving == set()
