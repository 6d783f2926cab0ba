"""Downtime as the guest sees it: predicted in parts, measured in parts. Pure.

QEMU's ``downtime`` is only part of what a guest notices.  Its heartbeat
stops when the source pauses and starts again when the destination runs it
and, after a postcopy switch, once the pages it touches first have arrived:

- stop-and-copy: the last dirty pages, sent with the guest paused;
- device state and switchover: QEMU's non-iterable state and its handshake
  (what QEMU's downtime measures beyond the last pages);
- libvirt's finish and resume: the destination's bookkeeping before it
  resumes the guest (``docs/benchmarks/switchover.md``: 19-62 ms here).
  Where the link's switchover is learnt, it is learnt from libvirt's
  downtime, which runs from the source's pause to the destination's QEMU
  running again (equal to within 2 ms in the same page's traces): the two
  parts are then one, "device state, finish and resume";
- QEMU's side learnt whole: where earlier plain precopy jobs to the same
  destination were measured, the stop-and-copy and the switchover are one
  part, "QEMU's downtime, learnt": the median of those jobs' libvirt downtime
  (less their writeback), which holds a usual final round's copy.  Only the
  copy a plan forecasts beyond those jobs' own forecast copy is added (a split
  plan: beyond split jobs', learnt apart, whose forecast final round is
  longer than a precopy's by 19-21 ms its QEMU downtime never showed).  Learnt
  apart, a copy forecast short stayed in the learnt switchover and was counted
  again where a later job's copy was forecast long: 37-56 ms forecast for QEMU
  downtimes of 20-40 (``docs/benchmarks/split-first-run.md``);
- the guest's first run in the destination's QEMU: a new process.  Under TCG
  every block of guest code the guest runs is translated again before it
  runs: from the destination's "running" to the guest's first heartbeat
  after a migration, 34-133 ms (median 68 over 12 idle, moderate and
  hot-set guests, QEMU 10.0.13 and libvirt 9.0, 2026-12-02; 5-185, median
  94, with QEMU 10.0.2 and libvirt 11.3), against 0-6 ms after a pause and
  resume in the same process (``docs/benchmarks/switchover.md``).  Under
  KVM nothing is translated; nothing measured here, counted as nothing.
  It is CPU work and follows the host's load: median 70 ms in one sitting
  and 42 in the next (``docs/benchmarks/split-first-run-2.md``), so where a
  probe inside the guest measured earlier precopy jobs to the destination
  (their heartbeat gap less QEMU's downtime), their median is counted.  A
  split guest's first run is its own, learnt from split jobs (their gap less
  QEMU's downtime and the store faults forecast after the resume): the resumed
  guest reads back pages the keeper dropped, and its first run ran median 94
  ms against a precopy's 55 on the same host in one sitting, 76 against 66
  over two (``docs/benchmarks/split-learnt-side-b.md``).  It grows with the
  share of the VM left in the store, since a touch of a random page faults
  with that chance: 49-104 ms at a 75 % budget, 101-177 at 50 and 35 %
  (``docs/benchmarks/split-sitting-d-loaded.md``), so it is learnt as a base
  plus a part per share stored (``fit_split_first_run``), one median only
  until split jobs at different budgets were measured;
- postcopy faults: after a switch, each page the guest touches that has not
  arrived is fetched on demand, behind the pages already queued on the stream
  unless postcopy-preempt gives faults a channel of their own (libvirt turns
  it on by itself where both ends have it: ``knobs.choose_preempt``);
- split's faults on the store: final-round pages and the resumed guest's
  writes that land on the part of its rewritten set beyond the budget each
  read a 4 MiB window from the store (``split.store_faults``);
- the destination's writeback of a file-backed guest's memory file, which
  an older QEMU's msync waits for before the guest runs
  (``writeback.switchover_writeback``): 150-330 ms per 512 MiB guest with
  QEMU 10.0.2, nothing with QEMU >= 10.0.3.  libvirt's fsync of the persisted
  domain is not counted: at most 1 ms in ten lab runs (that module's doc).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics

from flexmig.migration import writeback
from flexmig.policy import split
from flexmig.policy.precopy import Prediction

MIB = 2**20
RESUME_S = 0.035
FIRST_RUN_TCG_S = 0.068
# The stream data queued ahead of a faulted page on a single channel (socket
# buffers and QEMU's send queue), times the faults that stall the guest in a
# row: fitted to docs/benchmarks/modes.md's hot hybrid run (328 ms guest gap,
# 50 ms QEMU downtime, at 100 MiB/s): ~24 MiB of queue drained before the
# guest runs again.
FAULT_QUEUE_BYTES = 24 * MIB
# With postcopy-preempt (which libvirt >= 10.0 turns on by itself) a fault no
# longer waits behind the queue, yet the hot guest's stall after the switch
# stays long and grows as the stream slows: measured, not derived.  Hot hybrid
# runs where libvirt 11.3 had turned preempt on unasked: guest gaps 208 and
# 320 ms at 100 MiB/s (docs/benchmarks/downtime.md, downtime-current-hosts.md)
# and 405 and 375 ms at 64 MiB/s (tests/functional/test_knobs.py, 2026-11-27);
# less the 85 ms of device state and resume, ~20 MiB of stream per stall
# (200 ms at 100 MiB/s, 312 at 64).  Without it (libvirt 9.0): 328 ms at 100
# (modes.md, median of 3), 466 and 230 ms at 64 (test_knobs.py over the
# mover): single runs scatter too widely to say more than "a little shorter".
# (A flat 10 ms guess before.)
PREEMPT_FAULT_BYTES = 20 * MIB

# The guest's first run after a migration, by accelerator (see above): the
# median of the switchover traces' "running -> first beat" on this machine,
# measured apart from the split benchmark whose forecast it feeds.
FIRST_RUN_S = {"tcg": FIRST_RUN_TCG_S, "kvm": 0.0}

LEARNT_SWITCHOVER = "device state, finish and resume"
LEARNT_QEMU_SIDE = "QEMU's downtime, learnt"
COPY_BEYOND_LEARNT = "stop-and-copy beyond the learnt"
# What of libvirt's downtime a forecast counts per VM: this VM's last pages
# (``Forecast.copy_ms``) and its destination's writeback.  A switchover learnt
# from that downtime is the rest: learnt whole, a file-backed guest's msync
# (146 ms forecast for the lab's 512 MiB guest) was counted once in the learnt
# switchover and again as its own part, and the next forecast ran 25 % over
# (2026-11-28).  The writeback stays out of a learnt QEMU side for the same reason.
LEARNT_SWITCHOVER_MIN_S = 0.010
NO_WRITEBACK = writeback.SwitchoverWriteback()


# A line through split first runs needs split jobs whose stored shares differ
# by at least this much (one budget's runs spread by tens of ms: their
# differences say nothing of a slope) and this many such pairs.
MIN_SHARE_SPREAD = 0.1
MIN_SLOPE_PAIRS = 3


@dataclasses.dataclass(frozen=True)
class SplitFirstRun:
    """A split guest's first run as split jobs to one destination measured it:
    a base, plus a part that grows with the share of the VM's memory left in
    the store when it resumes (the whole VM stored: ``per_share_s``)."""

    base_s: float
    per_share_s: float = 0.0

    def at(self, stored_share: float) -> float:
        """
        >>> round(SplitFirstRun(0.02, 0.14).at(0.3), 3), SplitFirstRun(0.09).at(0.6)
        (0.062, 0.09)
        >>> SplitFirstRun(-0.05, 0.1).at(0.2)
        0.0
        """
        return max(0.0, round(self.base_s + self.per_share_s * stored_share, 6))


@dataclasses.dataclass(frozen=True)
class LearntSide:
    """What earlier jobs to one destination measured of the parts every VM's
    downtime has (None: not measured): plain precopy jobs, and split jobs for a
    split guest's first run."""

    qemu_s: float | None = None  # libvirt's downtime less the jobs' writeback: median
    copy_s: float = 0.0  # the same jobs' forecast stop-and-copy: median
    first_run_s: float | None = None  # the guest's gap less QEMU's downtime: median
    # A split guest's, from split jobs: its gap less QEMU's downtime and the
    # store faults its plan forecast (the resumed guest reads dropped pages back).
    split_first_run: SplitFirstRun | None = None
    # QEMU's side and forecast copy as split jobs measured them, learnt apart
    # as their first run is: a split job's downtime can hold the keeper's and
    # the store's work at the switchover, which no precopy job's does.
    split_qemu_s: float | None = None
    split_copy_s: float = 0.0

    def for_mode(self, mode: str, stored_share: float = 0.0) -> LearntSide:
        """What a plan of ``mode`` counts: a split plan split jobs' own first run
        (at the share of the VM it leaves in the store) and QEMU side, each where
        learnt.

        >>> seen = LearntSide(0.03, 0.003, 0.055, SplitFirstRun(0.02, 0.14), 0.025, 0.022)
        >>> split = seen.for_mode("split", 0.5)
        >>> split.first_run_s, split.qemu_s, split.copy_s, seen.for_mode("precopy") == seen
        (0.09, 0.025, 0.022, True)
        >>> LearntSide(0.03, 0.003, 0.055).for_mode("split", 0.5) == LearntSide(0.03, 0.003, 0.055)
        True
        """
        if mode != "split":
            return self
        side = self
        if self.split_first_run is not None:
            side = dataclasses.replace(side, first_run_s=self.split_first_run.at(stored_share))
        if self.split_qemu_s is not None:
            side = dataclasses.replace(side, qemu_s=self.split_qemu_s, copy_s=self.split_copy_s)
        return side


def fit_split_first_run(points: list[tuple[float | None, float]]) -> SplitFirstRun | None:
    """A split guest's first run from split jobs' (stored share, first run)
    points (share None: a job recorded before shares were): the Theil-Sen line,
    the median of the slopes between jobs at different shares, never falling
    (more of the VM stored never makes the first run shorter), through the
    median of what is left; one median where too few jobs differ in share.
    Medians, not least squares: one stalled run (a 936 ms first run among
    50-120 ms ones, docs/benchmarks/split-learnt-side.md) moves neither.

    >>> d = [(0.3, 0.104), (0.6, 0.106), (0.8, 0.120), (0.3, 0.060), (0.6, 0.177),
    ...      (0.8, 0.101), (0.3, 0.049), (0.6, 0.125), (0.8, 0.114)]
    >>> line = fit_split_first_run(d)
    >>> round(line.at(0.3), 3), round(line.at(0.8), 3)
    (0.085, 0.12)
    >>> fit_split_first_run([(0.3, 0.104), (0.6, 0.2), (None, 0.09)])
    SplitFirstRun(base_s=0.104, per_share_s=0.0)
    >>> fit_split_first_run([]) is None
    True
    """
    if not points:
        return None
    known = [(x, y) for x, y in points if x is not None]
    slopes = [
        (y2 - y1) / (x2 - x1)
        for (x1, y1), (x2, y2) in itertools.combinations(known, 2)
        if abs(x2 - x1) >= MIN_SHARE_SPREAD
    ]
    if len(slopes) < MIN_SLOPE_PAIRS:
        return SplitFirstRun(round(statistics.median(y for _x, y in points), 6))
    slope = max(0.0, statistics.median(slopes))
    base = statistics.median(y - slope * x for x, y in known)
    return SplitFirstRun(round(base, 6), round(slope, 6))


NOTHING_LEARNT = LearntSide()


@dataclasses.dataclass(frozen=True)
class Forecast:
    parts_ms: dict[str, float]
    reasons: tuple[str, ...] = ()  # how the parts that depend on the hosts were counted
    # The plan's own stop-and-copy (a part only where QEMU's side is not learnt):
    # what a job's downtime is learnt beside.
    copy_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return sum(self.parts_ms.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in self.parts_ms.items() if v >= 0.5)
        return f"{self.total_ms:.0f} ms ({parts})"


def first_run_s(accelerator: str) -> float:
    """The guest's first run in the destination's new QEMU (an unknown accelerator: KVM's).

    >>> first_run_s("tcg") > first_run_s("kvm") == first_run_s("hvf") == 0.0
    True
    """
    return FIRST_RUN_S.get(accelerator, FIRST_RUN_S["kvm"])


def predict(
    prediction: Prediction,
    transfer: str,
    switchover_s: float,
    bandwidth_bps: float,
    preempt: bool,
    resume_s: float | None = RESUME_S,
    dest_writeback: writeback.SwitchoverWriteback = NO_WRITEBACK,
    store_faults: split.StoreFaults = split.NO_FAULTS,
    first_run: float = 0.0,
    learnt: LearntSide = NOTHING_LEARNT,
) -> Forecast:
    """The guest-observed downtime of a plan, part by part.

    ``resume_s`` None: ``switchover_s`` was learnt from libvirt's downtime,
    which holds libvirt's finish and resume; ``first_run`` the guest's first
    run on the destination (``first_run_s``); ``learnt`` what earlier jobs to
    the destination measured, counted instead of the parts it covers.

    >>> from flexmig.policy.precopy import Prediction
    >>> p = Prediction("postcopy", (), True, "", 5.0, 0.05, 0.05, 1000)
    >>> predict(p, "postcopy", 0.05, 100 * MIB, preempt=False).describe()
    '325 ms (device state 50, finish and resume 35, postcopy faults 240)'
    >>> predict(p, "postcopy", 0.05, 100 * MIB, preempt=True).total_ms
    285.0
    >>> w = writeback.SwitchoverWriteback(msync_s=0.2, reason="old QEMU")
    >>> f = predict(p, "precopy", 0.05, 100 * MIB, False, dest_writeback=w)
    >>> f.describe(), f.reasons
    ('285 ms (device state 50, finish and resume 35, destination msync 200)', ('old QEMU',))

    Split's faults on the store (the final round's are inside its downtime
    already) are named as a part of their own:

    >>> s = Prediction("split", (), True, "", 5.0, 0.05, 0.28, 0)
    >>> f = split.StoreFaults(35 * MIB, 9, 2, 0.02)
    >>> predict(s, "precopy", 0.05, 100 * MIB, False, store_faults=f).describe()
    '355 ms (stop-and-copy 50, device state 50, finish and resume 35, store faults 220)'

    A learnt switchover holds the resume; a TCG guest's first run is its own part:

    >>> m = Prediction("precopy", (), True, "", 5.0, 0.05, 0.045, 0)
    >>> predict(m, "precopy", 0.04, 100 * MIB, False, None, first_run=0.07).describe()
    '115 ms (stop-and-copy 5, device state, finish and resume 40, first run 70)'

    QEMU's side and the first run learnt: only the copy beyond the learnt
    jobs' own forecast copy is added, and the copy is kept for learning:

    >>> seen = LearntSide(qemu_s=0.03, copy_s=0.002, first_run_s=0.04)
    >>> f = predict(m, "precopy", 0.04, 100 * MIB, False, None, first_run=0.07, learnt=seen)
    >>> f.describe(), f.copy_ms
    ("73 ms (QEMU's downtime, learnt 30, stop-and-copy beyond the learnt 3, first run 40)", 5.0)
    """
    final_faults_s = final_round_faults_s(prediction, store_faults)
    copy_s = stop_and_copy_s(prediction, switchover_s, store_faults)
    parts = _qemu_side(copy_s, switchover_s, resume_s, learnt)
    parts["first run"] = first_run if learnt.first_run_s is None else learnt.first_run_s
    parts["postcopy faults"] = 0.0
    if transfer == "postcopy":
        queued = PREEMPT_FAULT_BYTES if preempt else FAULT_QUEUE_BYTES
        parts["postcopy faults"] = queued / bandwidth_bps
    if store_faults.off_budget_bytes:
        parts["store faults"] = final_faults_s + store_faults.first_heartbeat_s
    parts |= dest_writeback.parts_s()
    reasons = (dest_writeback.reason,) if dest_writeback.reason else ()
    return Forecast(
        {name: round(s * 1000, 1) for name, s in parts.items()}, reasons, round(copy_s * 1000, 1)
    )


def _qemu_side(
    copy_s: float, switchover_s: float, resume_s: float | None, learnt: LearntSide
) -> dict[str, float]:
    """QEMU's side of the downtime: learnt whole where measured, else copy plus switchover."""
    if learnt.qemu_s is not None:
        beyond = max(0.0, copy_s - learnt.copy_s)
        return {LEARNT_QEMU_SIDE: learnt.qemu_s, COPY_BEYOND_LEARNT: beyond}
    return {
        "stop-and-copy": copy_s,
        "device state" if resume_s is not None else LEARNT_SWITCHOVER: switchover_s,
        "finish and resume": resume_s or 0.0,
    }


def stop_and_copy_s(
    prediction: Prediction, switchover_s: float, store_faults: split.StoreFaults = split.NO_FAULTS
) -> float:
    """The last pages' copy: QEMU's downtime less its switchover and the final
    round's faults on a split VM's store.

    >>> round(stop_and_copy_s(Prediction("precopy", (), True, "", 5.0, 0.05, 0.045, 0), 0.04), 3)
    0.005
    """
    final_faults = final_round_faults_s(prediction, store_faults)
    return max(0.0, prediction.downtime_s - final_faults - switchover_s)


def final_round_faults_s(prediction: Prediction, store_faults: split.StoreFaults) -> float:
    """The final round's faults on a split VM's store, inside QEMU's downtime
    (never more than the downtime the plan forecasts).

    >>> p = Prediction("split", (), True, "", 5.0, 0.05, 0.1, 0)
    >>> final_round_faults_s(p, split.StoreFaults(35 * MIB, 9, 0, 0.02))
    0.1
    """
    return min(store_faults.final_round_s, prediction.downtime_s)


def _writeback_s(forecast: Forecast) -> float:
    return sum(forecast.parts_ms.get(name, 0.0) for name in writeback.PARTS) / 1000


def switchover_sample(downtime_s: float, forecast: Forecast) -> float:
    """What one job's libvirt downtime says of the link's switchover: that
    downtime less the parts its plan forecast per VM (its copy and its
    destination's writeback), never under 10 ms (a forecast that overcounted
    them says nothing below that).

    >>> f = Forecast({"device state": 50.0, "destination msync": 116.0}, copy_ms=11.0)
    >>> round(switchover_sample(0.190, f), 3), switchover_sample(0.110, f)
    (0.063, 0.01)
    >>> switchover_sample(0.045, Forecast({}))
    0.045
    """
    per_vm_s = forecast.copy_ms / 1000 + _writeback_s(forecast)
    return max(LEARNT_SWITCHOVER_MIN_S, downtime_s - per_vm_s)


def qemu_side_sample(downtime_s: float, forecast: Forecast) -> tuple[float, float]:
    """What one job's libvirt downtime says of QEMU's side on its link: (that
    downtime less its destination's writeback, never under 10 ms; the copy its
    plan forecast, which the first holds).

    >>> f = Forecast({"destination msync": 116.0}, copy_ms=11.0)
    >>> qemu_side_sample(0.190, f), qemu_side_sample(0.100, f)
    ((0.074, 0.011), (0.01, 0.011))
    """
    side = max(LEARNT_SWITCHOVER_MIN_S, round(downtime_s - _writeback_s(forecast), 6))
    return side, forecast.copy_ms / 1000


def split_qemu_side_sample(
    downtime_s: float, forecast: Forecast, final_round_faults_s: float
) -> tuple[float, float]:
    """``qemu_side_sample`` of a split job: its downtime also holds the final
    round's faults on the store, which a later plan forecasts as its own part.

    >>> split_qemu_side_sample(0.190, Forecast({}, copy_ms=21.0), 0.1)
    (0.09, 0.021)
    """
    return qemu_side_sample(downtime_s - final_round_faults_s, forecast)


def first_run_sample(
    guest_gap_s: float, downtime_s: float, forecast_faults_s: float = 0.0
) -> float:
    """The guest's first run on the destination, as one job measured it: its
    heartbeat gap less QEMU's downtime and the faults its plan forecast after
    the resume (never below nothing: the heartbeat's own period blurs both ends).

    >>> round(first_run_sample(0.074, 0.031), 3), first_run_sample(0.020, 0.031)
    (0.043, 0.0)
    >>> round(first_run_sample(0.148, 0.035, 0.020), 3)
    0.093
    """
    return max(0.0, round(guest_gap_s - downtime_s - forecast_faults_s, 6))


def over_budget(forecast_ms: float, budget_ms: int) -> str | None:
    """The warning explain gives before anything moves, or None.

    >>> over_budget(340.0, 300)
    'the guest is predicted to notice 340 ms, 40 ms over its 300 ms budget: no plan \
the hosts allow meets it'
    >>> over_budget(120.0, 300) is None
    True
    """
    if forecast_ms <= budget_ms:
        return None
    return (
        f"the guest is predicted to notice {forecast_ms:.0f} ms, {forecast_ms - budget_ms:.0f} "
        f"ms over its {budget_ms} ms budget: no plan the hosts allow meets it"
    )


def measured(stats: dict[str, int], guest_gap_ms: float | None = None) -> dict[str, float | None]:
    """The downtime's parts from libvirt's completed-job statistics and the guest.

    libvirt's ``downtime`` runs from the source's pause to the destination's
    resume as libvirt saw it; ``downtime_net`` the same across both hosts'
    clocks.  What the guest noticed beyond that is libvirt's and the guest's
    own (resume, postcopy faults).

    >>> measured({"downtime": 60, "downtime_net": 80}, 140.0)
    {'qemu_downtime_ms': 60.0, 'libvirt_downtime_net_ms': 80.0, 'guest_ms': 140.0, \
'beyond_qemu_ms': 80.0}
    """
    qemu = stats.get("downtime")
    net = stats.get("downtime_net")
    beyond = None
    if guest_gap_ms is not None and qemu is not None:
        beyond = round(guest_gap_ms - qemu, 1)
    return {
        "qemu_downtime_ms": float(qemu) if qemu is not None else None,
        "libvirt_downtime_net_ms": float(net) if net is not None else None,
        "guest_ms": guest_gap_ms,
        "beyond_qemu_ms": beyond,
    }


def excess(budget_ms: int, observed_ms: float | None) -> float | None:
    """By how much a migration exceeded its budget (None: it did not, or unmeasured).

    >>> excess(300, 849.0)
    549.0
    >>> excess(300, 120.0) is None
    True
    """
    if observed_ms is None or observed_ms <= budget_ms:
        return None
    return round(observed_ms - budget_ms, 1)
