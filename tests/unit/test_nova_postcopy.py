"""The Nova path's postcopy recovery: paused on a stall, resumed on fresh movers.

Nova's rollback destroys the destination's domain; after the switch to
postcopy that is the VM.  These tests hold the two pieces the driver uses
instead: the monitor pauses (not aborts) a stalled postcopy, and the agents'
mover pairs give each resume attempt a fresh pair once the dead one is gone on
both hosts.  The agents are fakes that keep which movers they run.
"""

from __future__ import annotations

import itertools
import types

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from flexmig import exceptions  # noqa: E402
from nova_driver import monitor, postcopy  # noqa: E402
from tests.unit.engine_fakes import make_plan  # noqa: E402
from tests.unit.test_nova_monitor import LV, FakeGuest, _info, nova_helpers  # noqa: E402, F401

MIB = 2**20
MOVER_ID = "0f25fdf1045340008000000000000abc"


class Agent:
    """A fake agent: its movers by id; unreachable like a host behind a cut link."""

    def __init__(self, name: str, running: set[str] | None = None) -> None:
        self.name = name
        self.running = set(running or ())
        self.reachable = True
        self.posts: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict, **_kw) -> dict:
        if not self.reachable:
            raise exceptions.BackendError(backend=f"agent on {self.name}", reason="timed out")
        self.posts.append((path, body))
        mid = body["migration_id"]
        if path in ("/v1/mover/receive", "/v1/mover/send"):
            self.running.add(mid)
            return {"ports": [7471], "address": "10.0.0.2", "uri": f"unix:///run/fm/mig-{mid}.sock"}
        if mid not in self.running:
            raise exceptions.NotFound(what="mover of migration", name=mid)
        self.running.remove(mid)
        return {"aborted": True} if body.get("abort") else {"stats": {"bytes": 1}}


def test_a_resume_pair_replaces_the_offers_pair_on_both_hosts():
    local, dest = Agent("A", {MOVER_ID}), Agent("B", {MOVER_ID})
    pairs = postcopy.AgentMoverPairs(local, dest, MOVER_ID)  # type: ignore[arg-type]
    uri = pairs.reopen(1)
    assert uri == f"unix:///run/fm/mig-{MOVER_ID}0001.sock"
    assert local.running == dest.running == {MOVER_ID + "0001"}
    pairs.finish(ok=True)
    assert local.running == dest.running == set()
    assert ("/v1/mover/finish", {"migration_id": MOVER_ID + "0001"}) in dest.posts


def test_no_pair_while_the_destination_is_cut_off_then_one_after():
    local, dest = Agent("A", {MOVER_ID}), Agent("B", {MOVER_ID})
    pairs = postcopy.AgentMoverPairs(local, dest, MOVER_ID)  # type: ignore[arg-type]
    dest.reachable = False
    with pytest.raises(exceptions.FlexMigError):
        pairs.reopen(1)
    assert local.running == set()  # this host's side of the dead pair is gone
    dest.reachable = True
    pairs.reopen(2)
    assert local.running == dest.running == {MOVER_ID + "0002"}


def test_a_half_started_pair_is_killed_and_a_failed_recovery_leaves_no_movers():
    local, dest = Agent("A", {MOVER_ID}), Agent("B", {MOVER_ID})
    pairs = postcopy.AgentMoverPairs(local, dest, MOVER_ID)  # type: ignore[arg-type]
    original = local.post

    def send_refused(path, body, **kw):
        if path == "/v1/mover/send":
            raise exceptions.BackendError(backend="source movers", reason="did not get ready")
        return original(path, body, **kw)

    local.post = send_refused  # type: ignore[method-assign]
    with pytest.raises(exceptions.BackendError):
        pairs.reopen(1)
    assert dest.running == set()  # the receivers it had started were killed
    local.post = original  # type: ignore[method-assign]
    pairs.reopen(2)
    pairs.finish(ok=False)
    assert local.running == dest.running == set()


class DomainGuest(FakeGuest):
    def __init__(self, infos: list) -> None:
        super().__init__(infos)
        self._domain = types.SimpleNamespace(
            abortJobFlags=lambda flags: self.calls.append(f"pause-postcopy {flags}")
        )


def test_a_stalled_postcopy_is_paused_for_the_resume_never_aborted(nova_helpers, monkeypatch):  # noqa: F811
    ticks = itertools.count(0, 4)  # 4 s a poll: a stall of 15 s takes 4 polls
    monkeypatch.setattr(monitor.time, "monotonic", lambda: float(next(ticks)))
    lv = types.SimpleNamespace(**vars(LV), VIR_DOMAIN_ABORT_JOB_POSTCOPY=1)
    plan = make_plan(hot=True, file_backed=False)
    after = plan.decision.postcopy_after_round
    moving = [_info(LV.VIR_DOMAIN_JOB_UNBOUNDED, after + i, 500 + 100 * i) for i in range(2)]
    stuck = [_info(LV.VIR_DOMAIN_JOB_UNBOUNDED, after + 1, 600) for _ in range(8)]
    guest = DomainGuest([*moving, *stuck, _info(LV.VIR_DOMAIN_JOB_FAILED, after + 1, 600)])
    migration, ended = types.SimpleNamespace(status="running"), []
    watch = monitor.PlanMonitor(lv, None, plan, migration, 15.0, 5.0, {})
    watch.run(
        None,
        guest,
        types.SimpleNamespace(done=lambda: False),
        lambda info: ended.append("done"),
        lambda info, status: ended.append("failed"),
    )
    assert watch.control.switched
    assert "pause-postcopy 1" in guest.calls and "abort" not in guest.calls
    assert ended == ["failed"]


def test_the_source_is_read_on_novas_connection_and_its_loss_is_a_backend_error():
    """The recovery reads the source on Nova's Host connection (reopened by Nova
    after a libvirtd restart); Nova's HypervisorUnavailable never leaks raw."""
    from nova import exception as nova_exception

    from nova_driver import driver

    live = object()
    nova = driver.FlexMigLibvirtDriver.__new__(driver.FlexMigLibvirtDriver)
    nova._host = types.SimpleNamespace(get_connection=lambda: live)
    assert nova._source_connection() is live

    def unavailable():
        raise nova_exception.HypervisorUnavailable()

    nova._host = types.SimpleNamespace(get_connection=unavailable)
    with pytest.raises(exceptions.BackendError, match="no connection to this host's libvirt"):
        nova._source_connection()
