"""What a source agent has learnt of migrating to each destination: the
stream's rate, setup and switchover, QEMU's side of the downtime and the
guest's first run, from its completed jobs and guest-probe reports."""

from __future__ import annotations

import dataclasses
import statistics

from flexmig.migration import downtime, planner

EWMA_WEIGHT = 0.5
# The switchover is the median of the last few: one slow switchover on a loaded
# host (a 390 ms guest gap among 133-ms ones, docs/benchmarks/downtime-first-run.md)
# moved an average halfway and the next forecast with it.
SWITCHOVER_SAMPLES = 5
# A capped job whose average stays this far under its cap was not held by it:
# the lab's TCG guest streamed 59 MiB/s under a 100 MiB/s cap, and forecasts
# that assumed the cap were 30-40 % short (docs/benchmarks/split-kernel-lru.md).
CAP_HELD_SHARE = 0.9
# A split guest's first run is a line in the share of it stored, which needs
# jobs at several budgets: three budgets' worth of the recent ones.
SPLIT_FIRST_RUN_SAMPLES = 3 * SWITCHOVER_SAMPLES


@dataclasses.dataclass
class LinkEstimate:
    """What the agent has measured about migrating to one destination."""

    fabric_bps: float = 0.0  # raw path, by probe
    fabric_measured_at: float = 0.0
    stream_bps: float | None = None  # QEMU's migration stream (memory_bps), learned
    setup_s: float = 0.0  # job start until the first page moves
    switchover_s: float = 0.05
    timings_learned: int = 0  # completed jobs setup_s and switchover_s come from
    switchover_recent: list[float] = dataclasses.field(default_factory=list)  # newest last
    # QEMU's side as plain precopy jobs measured it: [downtime less writeback,
    # forecast copy] per job, newest last (downtime.qemu_side_sample).
    qemu_side_recent: list[list[float]] = dataclasses.field(default_factory=list)
    # The guest's first run, where a probe inside it reported its gap, newest last.
    first_run_recent: list[float] = dataclasses.field(default_factory=list)
    # A split guest's first run, from split jobs' reports (their resumed guest
    # reads back pages the keeper dropped): [the share of the VM its plan left
    # in the store, first run] per job, newest last.  A bare number: a job
    # learnt before shares were, kept for the median.
    split_first_run_recent: list[list[float] | float] = dataclasses.field(default_factory=list)
    # QEMU's side of split jobs, [downtime less writeback and final-round store
    # faults, forecast copy] per job, newest last (downtime.split_qemu_side_sample).
    split_qemu_side_recent: list[list[float]] = dataclasses.field(default_factory=list)

    @property
    def learnt_timings(self) -> bool:
        """Whether setup_s and switchover_s were learnt (the drain reads the same
        rule from the reported estimate)."""
        return planner.timings_were_learnt(self.timings_learned, self.stream_bps)

    @property
    def learnt_side(self) -> downtime.LearntSide:
        """The medians of the recent jobs' QEMU side, copy and first run.

        >>> LinkEstimate().learnt_side == downtime.NOTHING_LEARNT
        True
        >>> side = [[0.03, 0.01], [0.05, 0.002], [0.02, 0.02]]
        >>> LinkEstimate(qemu_side_recent=side, first_run_recent=[0.04, 0.06]).learnt_side
        LearntSide(qemu_s=0.03, copy_s=0.01, first_run_s=0.05, split_first_run=None, \
split_qemu_s=None, split_copy_s=0.0)
        >>> LinkEstimate(split_first_run_recent=[0.09, [0.5, 0.07]]).learnt_side.split_first_run
        SplitFirstRun(base_s=0.08, per_share_s=0.0)
        """
        qemu_s, copy_s = _median_side(self.qemu_side_recent)
        split_qemu_s, split_copy_s = _median_side(self.split_qemu_side_recent)
        return downtime.LearntSide(
            qemu_s, copy_s, _median_or_none(self.first_run_recent),
            downtime.fit_split_first_run(_split_points(self.split_first_run_recent)),
            split_qemu_s, split_copy_s,
        )  # fmt: skip

    def learn(
        self,
        stats: dict[str, int],
        cap_bps: float | None = None,
        forecast: downtime.Forecast | None = None,
    ) -> None:
        """One completed precopy job's statistics.

        ``cap_bps``: the job's bandwidth cap.  A job the cap held says only that
        the stream carries at least that much; one that stayed under it moved at
        the stream's own rate.  Either way its setup (the destination QEMU's
        start) and switchover are the link's: without them a capped host's
        forecasts missed seconds of setup.  ``forecast``: the job's downtime
        forecast, whose per-VM parts are not the link's switchover."""
        bps, elapsed_ms = stats.get("memory_bps", 0), stats.get("time_elapsed", 0)
        if bps <= 0 or elapsed_ms <= 0:
            return
        downtime_s = stats.get("downtime", 0) / 1000
        transfer_s = stats.get("memory_processed", 0) / bps
        setup = max(0.0, elapsed_ms / 1000 - transfer_s - downtime_s)
        had_timings = self.learnt_timings
        self._learn_rate(bps, cap_bps)
        self.setup_s = _ewma(self.setup_s if had_timings else None, setup)
        if had_timings and not self.switchover_recent:  # saved before the samples were
            self.switchover_recent = [self.switchover_s]
        forecast = forecast or downtime.Forecast({})
        sample = downtime.switchover_sample(downtime_s, forecast)
        self.switchover_recent = _recent(self.switchover_recent, sample)
        self.switchover_s = statistics.median(self.switchover_recent)
        side = downtime.qemu_side_sample(downtime_s, forecast)
        self.qemu_side_recent = _recent(self.qemu_side_recent, list(side))
        self.timings_learned += 1

    def learn_split_side(
        self, stats: dict[str, int], forecast: downtime.Forecast, final_round_faults_s: float
    ) -> None:
        """One completed split job's QEMU side: its libvirt downtime less its
        destination's writeback and the final round's store faults its plan
        forecast.  Nothing else of it is the link's (``teaches_the_link``)."""
        if stats.get("downtime") is None:
            return
        side = downtime.split_qemu_side_sample(
            stats["downtime"] / 1000, forecast, final_round_faults_s
        )
        self.split_qemu_side_recent = _recent(self.split_qemu_side_recent, list(side))

    def learn_first_run(
        self,
        guest_gap_s: float,
        downtime_s: float,
        split_faults_s: float | None = None,
        stored_share: float | None = None,
    ) -> None:
        """One job's guest-observed gap and libvirt downtime: a plain precopy's,
        or (``split_faults_s``: the store faults its plan forecast after the
        resume; ``stored_share``: the share of the VM it left in the store, None
        where its plan did not say) a split's."""
        sample = downtime.first_run_sample(guest_gap_s, downtime_s, split_faults_s or 0.0)
        if split_faults_s is None:
            self.first_run_recent = _recent(self.first_run_recent, sample)
            return
        point = sample if stored_share is None else [stored_share, sample]
        self.split_first_run_recent = _recent(
            self.split_first_run_recent, point, SPLIT_FIRST_RUN_SAMPLES
        )

    def _learn_rate(self, bps: float, cap_bps: float | None) -> None:
        if not cap_held(bps, cap_bps):
            self.stream_bps = _ewma(self.stream_bps, bps)
        elif self.stream_bps is not None and bps > self.stream_bps:
            self.stream_bps = float(bps)  # a floor: the stream carried at least this


def cap_held(bps: float, cap_bps: float | None) -> bool:
    """Whether a job's bandwidth cap, not the stream, set its rate.

    >>> MIB = 2**20
    >>> cap_held(98 * MIB, 100 * MIB), cap_held(59 * MIB, 100 * MIB), cap_held(59 * MIB, None)
    (True, False, False)
    """
    return cap_bps is not None and bps >= CAP_HELD_SHARE * cap_bps


def describe_learnt(link: LinkEstimate) -> str:
    """What the agent has learnt of a destination, for a plan's explanation.

    >>> describe_learnt(LinkEstimate())
    'no migration to this destination measured yet'
    >>> describe_learnt(LinkEstimate(setup_s=1.5, switchover_s=0.04, timings_learned=2))
    'learned from 2 earlier migration(s): setup 1.50 s, switchover 40 ms (stream rate not \
learnt: they ran under a bandwidth cap)'
    >>> describe_learnt(LinkEstimate(stream_bps=2**27, setup_s=1.0, timings_learned=1))
    'learned from 1 earlier migration(s): setup 1.00 s, switchover 50 ms, stream 128 MiB/s'
    >>> describe_learnt(LinkEstimate(stream_bps=2**27, setup_s=1.0))
    'learned from earlier: setup 1.00 s, switchover 50 ms, stream 128 MiB/s'
    """
    if not link.learnt_timings:
        return "no migration to this destination measured yet"
    count = f"{link.timings_learned} earlier migration(s)" if link.timings_learned else "earlier"
    text = (
        f"learned from {count}: setup {link.setup_s:.2f} s, "
        f"switchover {link.switchover_s * 1000:.0f} ms"
    )
    text += _describe_side(link.learnt_side)
    if link.stream_bps is None:
        return text + " (stream rate not learnt: they ran under a bandwidth cap)"
    return text + f", stream {link.stream_bps / 2**20:.0f} MiB/s"


def _describe_side(side: downtime.LearntSide) -> str:
    """
    >>> _describe_side(downtime.LearntSide(0.031, 0.004, 0.042))
    ", QEMU's downtime 31 ms, the guest's first run 42 ms"
    >>> _describe_side(downtime.LearntSide(0.031, 0.004))
    ", QEMU's downtime 31 ms"
    >>> _describe_side(downtime.LearntSide(0.031, 0.004, 0.042, downtime.SplitFirstRun(0.094)))
    ", QEMU's downtime 31 ms, the guest's first run 42 ms, a split guest's 94 ms"
    >>> line = downtime.SplitFirstRun(0.02, 0.14)
    >>> _describe_side(downtime.LearntSide(0.031, 0.004, None, line))
    ", QEMU's downtime 31 ms, a split guest's 20 ms plus 14 ms per 10 % of it stored"
    >>> _describe_side(downtime.LearntSide(None, 0.0, None, None, 0.022, 0.02))
    ", split jobs' QEMU downtime 22 ms"
    """
    text = f", QEMU's downtime {side.qemu_s * 1000:.0f} ms" if side.qemu_s is not None else ""
    if side.first_run_s is not None:
        text += f", the guest's first run {side.first_run_s * 1000:.0f} ms"
    line = side.split_first_run
    if line is not None:
        text += f", a split guest's {line.base_s * 1000:.0f} ms"
        if line.per_share_s:
            text += f" plus {line.per_share_s * 100:.0f} ms per 10 % of it stored"
    if side.split_qemu_s is not None:
        text += f", split jobs' QEMU downtime {side.split_qemu_s * 1000:.0f} ms"
    return text


def teaches_the_link(mode: str, switched_to_postcopy: bool) -> bool:
    """Whether a completed job's statistics say what the link does: a plain
    precopy's do; a split's switchover also holds the store's work (a 500 ms
    "switchover" learnt from one made the next precopy's forecast 320 ms), and a
    postcopy's statistics end at the switch.

    >>> teaches_the_link("precopy", False), teaches_the_link("split", False)
    (True, False)
    >>> teaches_the_link("postcopy", True), teaches_the_link("precopy", True)
    (False, False)
    """
    return mode == "precopy" and not switched_to_postcopy


def _recent(values: list, sample: object, keep: int = SWITCHOVER_SAMPLES) -> list:
    """``values`` with ``sample`` added, the newest ``keep`` kept."""
    return [*values, sample][-keep:]


def _split_points(recent: list) -> list[tuple[float | None, float]]:
    """(stored share or None, first run) of each recorded split job; an entry
    of neither shape (a hand-edited links.json) is passed over, not a planning
    error on every later split to the destination.

    >>> _split_points([0.09, [0.5, 0.07], [0.5], "x", [0.2, None], True])
    [(None, 0.09), (0.5, 0.07)]
    """
    points = []
    for entry in recent:
        if _is_number(entry):
            points.append((None, float(entry)))
        elif isinstance(entry, list) and len(entry) == 2 and all(map(_is_number, entry)):
            points.append((float(entry[0]), float(entry[1])))
    return points


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _median_side(recent: list[list[float]]) -> tuple[float | None, float]:
    """The median QEMU side and forecast copy of [side, copy] samples (None, 0: none).

    >>> _median_side([[0.03, 0.01], [0.05, 0.002], [0.02, 0.02]]), _median_side([])
    ((0.03, 0.01), (None, 0.0))
    """
    if not recent:
        return None, 0.0
    return (
        statistics.median(side for side, _copy in recent),
        statistics.median(copy for _side, copy in recent),
    )


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else current + EWMA_WEIGHT * (sample - current)
