"""Nova's way as the drain benchmark emulates it (tests/bench/nova_way.py): its
decisions poll by poll, and bounded waits when libvirt does not answer."""

import contextlib
import threading
import time

import libvirt

from tests.bench import nova_way


def run_polls(data_gb, until_s, conf=nova_way.NOVA_DEFAULTS, on_abort_ends_at=None):
    """Drive ``decide`` as the monitor does (0.5 s polls), the job never ending
    by itself; returns every (elapsed, act) and the final watch."""
    watch, done = nova_way.Watch(), []
    t = 0.5
    while t <= until_s:
        acts = nova_way.decide(t, data_gb, watch, conf)
        for kind, value in acts:
            done.append((t, kind, value))
            if kind == "downtime":
                watch.downtime_ms = value
            elif kind == "abort" and watch.first_abort_s is None:
                watch.first_abort_s = t
            elif kind == "end-incoming":
                watch.ended_incoming_s = t
            elif kind in ("pause", "postcopy"):
                watch.forced = True
        if any(kind == "give-up" for _, kind, _ in done):
            break
        t += 0.5
    return done, watch


def test_downtime_rises_linearly_to_nova_s_limit_then_the_timeout_aborts():
    done, watch = run_polls(0.125, 120)  # 128 MiB: 9 s steps, 100 s timeout
    steps = [(t, v) for t, k, v in done if k == "downtime"]
    assert [v for _, v in steps] == [50, 95, 140, 185, 230, 275, 320, 365, 410, 455, 500]
    assert steps[1][0] > 9 and steps[-1][0] > 90
    aborts = [t for t, k, _ in done if k == "abort"]
    assert aborts[0] > 100 and aborts[0] <= 100.5
    # Nova asks again at every poll while the job runs
    assert len(aborts) == len([t for t in range(201, 241)])


def test_an_abort_that_never_takes_is_bounded():
    done, watch = run_polls(0.125, 400)
    ended = [t for t, k, _ in done if k == "end-incoming"]
    gave_up = [t for t, k, _ in done if k == "give-up"]
    assert len(ended) == 1 and 130 < ended[0] <= 131.5
    assert len(gave_up) == 1 and 161 < gave_up[0] <= 162.5  # the watch ends: no hang


def test_force_complete_pauses_once_without_postcopy_and_switches_with_it():
    conf = nova_way.NovaConf(timeout_action="force_complete")
    done, _ = run_polls(0.125, 150, conf)
    assert [k for _, k, _ in done if k not in ("downtime",)] == ["pause"]
    conf = nova_way.NovaConf(timeout_action="force_complete", permit_post_copy=True)
    done, _ = run_polls(0.125, 150, conf)
    assert [k for _, k, _ in done if k not in ("downtime",)] == ["postcopy"]


def test_no_timeout_action_while_postcopy_runs_or_with_the_timeout_off():
    assert nova_way.decide(500, 0.125, nova_way.Watch(downtime_ms=500, postcopy=True)) == []
    off = nova_way.NovaConf(completion_timeout=0)
    assert nova_way.decide(5000, 0.125, nova_way.Watch(downtime_ms=500), off) == []


def test_outcomes_name_where_the_vm_is():
    aborted = nova_way.Watch(first_abort_s=100.5, ended_incoming_s=131.0)
    state, note = nova_way.outcome(True, [RuntimeError("x")], aborted, "A", "B")
    assert state == "aborted" and "ended the incoming side" in note and "stays on A" in note
    assert nova_way.outcome(False, [], aborted, "A", "B")[0] == "stuck"
    # a migration that completed although an abort was sent counts as moved
    assert nova_way.outcome(True, [], aborted, "B", "B")[0] == "moved"


class HangingDomain:
    """A libvirt domain whose abortJob never returns (what the hung run met)."""

    def __init__(self):
        self.aborts = 0
        self.release = threading.Event()

    def jobStats(self):
        return {"memory_iteration": 40, "memory_remaining": 64 << 20}

    def abortJob(self):
        self.aborts += 1
        self.release.wait(30)
        return 0


def test_a_hanging_abort_blocks_neither_the_watch_nor_piles_up_calls():
    dom = HangingDomain()
    bounds = nova_way.Bounds(call_s=0.2)
    monitor = nova_way._Monitor(None, "d-hot", "B", 0.125, nova_way.NOVA_DEFAULTS, bounds)
    t0 = time.monotonic()
    for elapsed in (100.5, 101.0, 101.5):
        assert monitor.apply(dom, [("abort", 0)], elapsed)
    assert time.monotonic() - t0 < 1.0  # the watch went on polling
    time.sleep(0.3)
    assert dom.aborts == 1  # the next aborts waited for the stuck one
    assert monitor.watch.first_abort_s == 100.5
    assert any("abort at 100 s: iteration 40, remaining 64 MiB" in e for e in monitor.events)
    assert any("Timed out" in e for e in monitor.events)
    dom.release.set()
    assert not monitor.apply(dom, [("give-up", 0)], 200.0)


class IncomingDomain:
    def __init__(self, state):
        self._state = state
        self.destroyed = False

    def state(self):
        return [self._state, 0]

    def destroy(self):
        self.destroyed = True
        return 0


class FakeLab:
    class Host:
        name = "B"
        local_uri = "qemu+unix:///fake"

    def host(self, _name):
        return self.Host()


def end_incoming_with(monkeypatch, dom):
    @contextlib.contextmanager
    def connect(_uri, _host):
        yield object()

    monkeypatch.setattr(nova_way.hypervisor, "connect", connect)
    monkeypatch.setattr(nova_way.hypervisor, "find_domain", lambda _conn, _name: dom)
    monitor = nova_way._Monitor(
        FakeLab(), "d-hot", "B", 0.125, nova_way.NOVA_DEFAULTS, nova_way.BOUNDS
    )
    monitor.apply(None, [("end-incoming", 0)], 131.0)
    return monitor


def test_ending_the_incoming_side_destroys_only_a_domain_still_incoming(monkeypatch):
    incoming = IncomingDomain(libvirt.VIR_DOMAIN_PAUSED)
    monitor = end_incoming_with(monkeypatch, incoming)
    assert incoming.destroyed and monitor.watch.ended_incoming_s == 131.0
    running = IncomingDomain(libvirt.VIR_DOMAIN_RUNNING)  # the guest already runs there
    monitor = end_incoming_with(monkeypatch, running)
    assert not running.destroyed
    assert any("already runs it; left alone" in e for e in monitor.events)
    monitor = end_incoming_with(monkeypatch, None)
    assert any("no incoming domain" in e for e in monitor.events)
