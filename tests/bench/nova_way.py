"""Nova's own live migration, as its libvirt driver runs it, for the benchmarks' baselines.

What Nova does (``nova/virt/libvirt/migration.py`` and the driver's monitor,
with its defaults): libvirt precopy peer-to-peer, no postcopy
(``live_migration_permit_post_copy = False``), no auto-converge; a monitor
polls the job every 0.5 s and

- raises the downtime limit along ``downtime_steps``: ``live_migration_downtime``
  (500 ms) reached in ``live_migration_downtime_steps`` (10) *linear* steps
  ``live_migration_downtime_delay`` (75 s) per GiB apart; a step applies once
  the elapsed time is past its mark;
- once the elapsed time is past ``live_migration_completion_timeout`` (800 s)
  per GiB of data (the flavor's RAM here: shared storage, no block
  migration), takes ``live_migration_timeout_action``: ``abort`` (the
  default) asks libvirt to abort the job, at every poll while it still runs;
  ``force_complete`` switches to postcopy where permitted, else pauses the
  guest.  Not while postcopy runs.
- The progress timeout (``live_migration_progress_timeout``) was 0 (off) by
  default from Pike and was removed later: not emulated.

Nova itself waits for ever if the abort does not end the job (the instance
stays ``migrating``).  A benchmark must not, so past what Nova does every
wait here is bounded (``Bounds``): each libvirt call, the abort's effect
(after ``abort_grace_s`` the still-incoming domain on the destination is
destroyed, as libvirt's answer for ending an incoming migration says, and
only while the source still runs the guest, so nothing is lost), and the
whole job (after ``end_grace_s`` more the watch gives up and says so).  What
held the drain, and why, is in the result.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import libvirt

from flexmig import exceptions, hypervisor
from flexmig_lab import vm
from flexmig_lab.lab import Lab

POLL_S = 0.5  # Nova's monitor sleeps 0.5 s between polls


@dataclasses.dataclass(frozen=True)
class NovaConf:
    """Nova's ``[libvirt]`` live-migration options, at Nova's defaults."""

    completion_timeout: int = 800  # s per GiB; 0: never
    timeout_action: str = "abort"  # abort | force_complete
    downtime_ms: int = 500
    downtime_steps: int = 10
    downtime_delay: int = 75  # s per GiB between steps
    permit_post_copy: bool = False


@dataclasses.dataclass(frozen=True)
class Bounds:
    """The benchmark's own limits beyond Nova's (Nova has none)."""

    call_s: float = 20.0  # one libvirt call
    abort_grace_s: float = 30.0  # from the first abort to ending the incoming side
    end_grace_s: float = 30.0  # from ending the incoming side to giving up the watch


NOVA_DEFAULTS = NovaConf()
BOUNDS = Bounds()


def downtime_steps(data_gb: float, conf: NovaConf = NOVA_DEFAULTS) -> list[tuple[int, int]]:
    """Nova's (seconds after start, max downtime ms) steps: linear, as its driver has them.

    >>> downtime_steps(0.25)[:3], downtime_steps(0.25)[-1]
    ([(0, 50), (18, 95), (36, 140)], (180, 500))
    >>> downtime_steps(3, NovaConf(downtime_ms=400, downtime_delay=30))[1]
    (90, 76)
    """
    delay = int(conf.downtime_delay * data_gb)
    base = conf.downtime_ms / conf.downtime_steps
    offset = (conf.downtime_ms - base) / conf.downtime_steps
    return [(int(delay * i), int(base + offset * i)) for i in range(conf.downtime_steps + 1)]


def completion_timeout_s(data_gb: float, conf: NovaConf = NOVA_DEFAULTS) -> int:
    """Nova's completion timeout for this much data, in whole seconds.

    >>> completion_timeout_s(0.25), completion_timeout_s(0.125)
    (200, 100)
    """
    return int(conf.completion_timeout * data_gb)


@dataclasses.dataclass
class Watch:
    """What the monitor has done so far (seconds since the migration started)."""

    downtime_ms: int | None = None
    first_abort_s: float | None = None
    forced: bool = False
    postcopy: bool = False
    ended_incoming_s: float | None = None


# Actions: ("downtime", ms), ("abort", 0), ("postcopy", 0), ("pause", 0),
# ("end-incoming", 0), ("give-up", 0).
Act = tuple[str, int]


def decide(
    elapsed_s: float,
    data_gb: float,
    watch: Watch,
    conf: NovaConf = NOVA_DEFAULTS,
    bounds: Bounds = BOUNDS,
) -> list[Act]:
    """What Nova's monitor (and past it, the benchmark's bounds) does at this poll.

    >>> w = Watch()
    >>> decide(1.0, 0.25, w)
    [('downtime', 50)]
    >>> w.downtime_ms = 50
    >>> decide(19.0, 0.25, w), decide(150.0, 0.25, w)
    ([('downtime', 95)], [('downtime', 410)])
    >>> w.downtime_ms = 500
    >>> decide(200.0, 0.25, w), decide(200.5, 0.25, w)
    ([], [('abort', 0)])

    Nova aborts at every poll while the job runs; the benchmark ends the
    incoming side ``abort_grace_s`` after the first abort, and gives up
    ``end_grace_s`` after that:

    >>> w.first_abort_s = 200.5
    >>> decide(230.0, 0.25, w), decide(231.0, 0.25, w)
    ([('abort', 0)], [('abort', 0), ('end-incoming', 0)])
    >>> w.ended_incoming_s = 231.0
    >>> decide(262.0, 0.25, w)
    [('abort', 0), ('give-up', 0)]

    Once postcopy runs there is no timeout action (the VM's state is split):

    >>> decide(300.0, 0.25, Watch(downtime_ms=500, postcopy=True))
    []
    """
    acts: list[Act] = []
    marks = [ms for at, ms in downtime_steps(data_gb, conf) if elapsed_s > at]
    if marks and marks[-1] != watch.downtime_ms:
        acts.append(("downtime", marks[-1]))
    timeout = completion_timeout_s(data_gb, conf)
    if watch.postcopy or not timeout or elapsed_s <= timeout:
        return acts
    if conf.timeout_action == "force_complete":
        if not watch.forced:
            acts.append(("postcopy" if conf.permit_post_copy else "pause", 0))
        return acts
    acts.append(("abort", 0))
    if watch.first_abort_s is None:
        return acts
    if watch.ended_incoming_s is None and elapsed_s - watch.first_abort_s > bounds.abort_grace_s:
        acts.append(("end-incoming", 0))
    elif (
        watch.ended_incoming_s is not None
        and elapsed_s - watch.ended_incoming_s > bounds.end_grace_s
    ):
        acts.append(("give-up", 0))
    return acts


@dataclasses.dataclass
class Result:
    state: str  # moved | aborted | failed | stuck
    held_s: float  # how long this VM's migration held its drain slot
    note: str = ""
    events: list[str] = dataclasses.field(default_factory=list)


def outcome(
    worker_ended: bool, errors: list[BaseException], watch: Watch, where: str | None, dest: str
) -> tuple[str, str]:
    """(state, note) of a finished watch, from what libvirt said and where the VM runs.

    >>> outcome(True, [], Watch(), "B", "B")
    ('moved', '')
    >>> outcome(True, [RuntimeError("canceled by client")], Watch(first_abort_s=200.5), "A", "B")
    ('aborted', 'Nova aborted it at its completion timeout (200 s); it stays on A')
    >>> outcome(False, [], Watch(first_abort_s=200.5, ended_incoming_s=231.0), "A", "B")[0]
    'stuck'
    >>> outcome(True, [RuntimeError("x")], Watch(), None, "B")
    ('failed', 'x; the VM runs nowhere')
    """
    if not worker_ended:
        return "stuck", (
            "Nova's abort did not end libvirt's job, nor did ending the incoming side; "
            f"the watch gave up with the VM on {where or 'no host'}"
        )
    if not errors and where == dest:
        return "moved", ""
    if watch.first_abort_s is not None and where not in (None, dest):
        how = " after the benchmark ended the incoming side" if watch.ended_incoming_s else ""
        return "aborted", (
            f"Nova aborted it at its completion timeout ({int(watch.first_abort_s)} s)"
            f"{how}; it stays on {where}"
        )
    error = str(errors[0]) if errors else "libvirt reported no error"
    return "failed", f"{error}; the VM runs {'on ' + where if where else 'nowhere'}"


class _Monitor:
    """One Nova-style watch of one libvirt migration job, every call bounded."""

    def __init__(self, lab: Lab, name: str, dest: str, data_gb: float, conf, bounds) -> None:
        self.lab, self.name, self.dest = lab, name, dest
        self.data_gb, self.conf, self.bounds = data_gb, conf, bounds
        self.watch = Watch()
        self.events: list[str] = []
        self._abort_in_flight: threading.Thread | None = None

    def _call(self, fn: Callable[[], object], what: str) -> object | None:
        try:
            return hypervisor.bounded(fn, self.bounds.call_s, f"{what} ({self.name})")
        except (libvirt.libvirtError, exceptions.Timeout) as exc:
            self.events.append(f"{what}: {exc}")
            return None

    def _abort(self, dom: libvirt.virDomain, elapsed: float) -> None:
        if self.watch.first_abort_s is None:
            self.watch.first_abort_s = elapsed
            stats = self._call(dom.jobStats, "job stats at the abort") or {}
            self.events.append(
                f"abort at {elapsed:.0f} s: iteration {stats.get('memory_iteration')}, "
                f"remaining {stats.get('memory_remaining', 0) >> 20} MiB"
            )
        if self._abort_in_flight is not None and self._abort_in_flight.is_alive():
            return  # Nova's next abort would queue behind the stuck one
        self._abort_in_flight = threading.Thread(
            target=self._call, args=(dom.abortJob, "abort"), daemon=True
        )
        self._abort_in_flight.start()

    def _end_incoming(self, elapsed: float) -> None:
        """Destroy the destination's still-incoming domain (the source keeps the guest)."""
        self.watch.ended_incoming_s = elapsed
        host = self.lab.host(self.dest)
        with hypervisor.connect(host.local_uri, host.name) as conn:
            dom = self._call(lambda: hypervisor.find_domain(conn, self.name), "find incoming")
            if dom is None:
                self.events.append(f"{elapsed:.0f} s: no incoming domain on {self.dest}")
                return
            state = self._call(dom.state, "incoming state") or (None, None)
            if state[0] == libvirt.VIR_DOMAIN_RUNNING:
                self.events.append(f"{elapsed:.0f} s: {self.dest} already runs it; left alone")
                return
            self._call(dom.destroy, "destroy the incoming domain")
            self.events.append(f"{elapsed:.0f} s: destroyed the incoming domain on {self.dest}")

    def apply(self, dom: libvirt.virDomain, acts: list[Act], elapsed: float) -> bool:
        """Carry out one poll's acts; False once the watch gives up."""
        for kind, value in acts:
            if kind == "downtime":
                self._call(lambda v=value: dom.migrateSetMaxDowntime(v), "set max downtime")
                self.watch.downtime_ms = value
            elif kind == "abort":
                self._abort(dom, elapsed)
            elif kind == "postcopy":
                self.watch.forced = True
                self.watch.postcopy = self._call(dom.migrateStartPostCopy, "postcopy") == 0
            elif kind == "pause":
                self.watch.forced = True
                self._call(dom.suspend, "pause")
            elif kind == "end-incoming":
                self._end_incoming(elapsed)
            elif kind == "give-up":
                return False
        return True


def migrate(
    lab: Lab,
    name: str,
    dest: str,
    data_gb: float,
    conf: NovaConf = NOVA_DEFAULTS,
    bounds: Bounds = BOUNDS,
) -> Result:
    """Live-migrate ``name`` to ``dest`` the way Nova's libvirt driver does, bounded."""
    source = lab.host(vm.LabVM(lab, name).locate() or "A")
    target = lab.host(dest)
    flags = (
        libvirt.VIR_MIGRATE_LIVE
        | libvirt.VIR_MIGRATE_PEER2PEER
        | libvirt.VIR_MIGRATE_PERSIST_DEST
        | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
        | (libvirt.VIR_MIGRATE_POSTCOPY if conf.permit_post_copy else 0)
    )
    params = {libvirt.VIR_MIGRATE_PARAM_URI: target.spec.migration_uri}
    monitor = _Monitor(lab, name, dest, data_gb, conf, bounds)
    start = time.monotonic()
    with hypervisor.connect(source.local_uri, source.name) as conn:
        dom = conn.lookupByName(name)
        # The migration call on a connection of its own: the monitor's calls
        # (stats, downtime, abort) never queue behind it.
        worker, errors = hypervisor.start_migration(
            dom, source.name, target.spec.libvirt_uri, params, flags, source.local_uri
        )
        while worker.is_alive():
            worker.join(POLL_S)
            if not worker.is_alive():
                break
            elapsed = time.monotonic() - start
            if not monitor.apply(
                dom, decide(elapsed, data_gb, monitor.watch, conf, bounds), elapsed
            ):
                break
    held = time.monotonic() - start
    where = vm.LabVM(lab, name).locate()
    state, note = outcome(not worker.is_alive(), errors, monitor.watch, where, dest)
    return Result(state, held, note, monitor.events)
