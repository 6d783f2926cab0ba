"""Expensive requests (plans, inventories) never make cheap ones wait (issue 18).

The gate's bookkeeping on its own, then the whole path on real sockets: the
listener, the API handler and a gated route whose handler blocks until the
test lets it go, so "health answered while every plan is still in hand" is an
ordering fact, not a timing.  No root, no daemons.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pathlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from oslo_config import cfg

from agents.agent import admission, api, auth, listener
from agents.agent import config as agent_config
from agents.agent.client import AgentBusy, AgentClient
from tests.unit.test_agent_hardening import KEY, agent_conf, serving

WAIT_S = 10.0  # bound on every wait in these tests; none should come near it


def _holders(gate: admission.Gate, count: int, release: threading.Event) -> list[threading.Thread]:
    entered = threading.Semaphore(0)

    def hold() -> None:
        with gate.slot():
            entered.release()
            release.wait(WAIT_S)

    threads = [threading.Thread(target=hold, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for _ in range(count):
        assert entered.acquire(timeout=WAIT_S)
    return threads


def test_the_gate_runs_slots_queues_queue_and_refuses_the_rest() -> None:
    gate = admission.Gate("plan", admission.Bounds(slots=2, queue=1), wait_limit_s=WAIT_S)
    release = threading.Event()
    holders = _holders(gate, 2, release)
    queued_ran = threading.Event()

    def queued() -> None:
        with gate.slot():
            queued_ran.set()

    waiter = threading.Thread(target=queued, daemon=True)
    waiter.start()
    for _ in range(int(WAIT_S * 100)):
        if gate.waiting == 1:
            break
        threading.Event().wait(0.01)
    assert (gate.running, gate.waiting) == (2, 1)
    with pytest.raises(admission.Busy) as refused:
        with gate.slot():
            pytest.fail("a fourth request ran beyond 2 slots + 1 queued")
    assert refused.value.retry_after >= 1
    assert not queued_ran.is_set()
    release.set()
    assert queued_ran.wait(WAIT_S)
    for thread in [*holders, waiter]:
        thread.join(WAIT_S)
    assert (gate.running, gate.waiting) == (0, 0)
    assert gate.typical_s > 0  # learned from the requests that ran


def test_a_queued_request_gives_up_at_its_wait_limit() -> None:
    gate = admission.Gate("plan", admission.Bounds(slots=1, queue=1), wait_limit_s=0.2)
    release = threading.Event()
    holders = _holders(gate, 1, release)
    try:
        with pytest.raises(admission.Busy):
            with gate.slot():
                pytest.fail("ran while the only slot was held")
        assert (gate.running, gate.waiting) == (1, 0)
    finally:
        release.set()
        holders[0].join(WAIT_S)


def test_a_failing_request_frees_its_slot() -> None:
    gate = admission.Gate("plan", admission.Bounds(slots=1, queue=0), wait_limit_s=1.0)
    with pytest.raises(RuntimeError):
        with gate.slot():
            raise RuntimeError("libvirt went away")
    with gate.slot():
        assert gate.running == 1


@contextlib.contextmanager
def blocking_plans(workers: int, bounds: admission.Bounds) -> Iterator[tuple[Any, threading.Event]]:
    """An API on a UNIX socket whose /v1/plan blocks until the event is set."""
    release = threading.Event()
    gate = admission.Gate("plan", bounds, wait_limit_s=WAIT_S)
    router = api.Router()
    router.add("GET", "/v1/health", lambda b, m: (200, {"ok": True}))

    def plan(_body: dict[str, Any], _m: Any) -> tuple[int, dict[str, Any]]:
        with gate.slot():
            release.wait(WAIT_S)
            return 200, {"mode": "precopy"}

    router.add("POST", "/v1/plan", plan)
    path = f"/tmp/flexmig-admission-{threading.get_ident()}.sock"
    server = listener.unix_listener(
        path,
        api.make_handler(auth.Verifier(KEY), router),
        listener.Limits(socket_timeout=WAIT_S, workers=workers, max_queued=200),
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield path, release
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(WAIT_S)
        pathlib.Path(path).unlink(missing_ok=True)


def _plan(path: str) -> str:
    try:
        AgentClient(path, 0, KEY, timeout=3 * WAIT_S).post("/v1/plan", {})
    except AgentBusy as exc:
        assert exc.retry_after >= 1
        return "busy"
    return "planned"


def test_health_is_answered_while_100_plans_hold_every_expensive_slot() -> None:
    bounds = admission.Bounds(slots=3, queue=2)
    with blocking_plans(workers=8, bounds=bounds) as (path, release):
        with concurrent.futures.ThreadPoolExecutor(100) as pool:
            plans = [pool.submit(_plan, path) for _ in range(100)]
            # All but slots + queue are refused at once; those refusals must
            # arrive while the admitted plans are still blocked.
            done, _ = concurrent.futures.wait(plans, WAIT_S, concurrent.futures.FIRST_COMPLETED)
            refused_first = [f.result() for f in done]
            health = AgentClient(path, 0, KEY, timeout=WAIT_S).get("/v1/health")
            assert health["ok"] is True
            assert not release.is_set()  # answered with every slot still held
            release.set()
            results = [f.result(timeout=3 * WAIT_S) for f in plans]
    assert set(refused_first) == {"busy"}
    # Plans still unread when the slots freed may have been admitted too.
    assert results.count("planned") >= bounds.slots + bounds.queue
    assert results.count("busy") + results.count("planned") == 100


def test_the_agent_gates_plans_and_inventories(tmp_path: pathlib.Path) -> None:
    conf = agent_conf(tmp_path, allow_orchestration=True, expensive_workers=1, expensive_queued=0)
    with serving(conf) as (agent, port):
        client = AgentClient("127.0.0.1", port, KEY, timeout=WAIT_S)
        agent.gate.running = 1  # the one slot is taken
        body = {"vm": "x", "dest": {"address": "127.0.0.1", "port": 1, "libvirt_uri": "test:///d",
                                    "migration_uri": "tcp://x"}}  # fmt: skip
        for path, payload in (("/v1/plan", body), ("/v1/inventory", {})):
            with pytest.raises(AgentBusy, match="503"):
                client.post(path, payload)
        assert client.get("/v1/health")["ok"] is True
        agent.gate.running = 0


def test_workers_must_leave_room_for_cheap_requests(tmp_path: pathlib.Path) -> None:
    conf = agent_conf(tmp_path, workers=8, expensive_workers=4, expensive_queued=4)
    with pytest.raises(cfg.ConfigFileValueError, match="workers .8. must exceed"):
        agent_config.check_workers(conf)
    agent_config.check_workers(agent_conf(tmp_path, workers=9))
