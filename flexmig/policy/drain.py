"""Planning a host drain: every VM's destination, mode, start and the concurrency.

Emptying a host is many migrations sharing one uplink.  Nova runs them one at
a time in listing order with the same knobs for all; here the plan is made
from what FlexMig knows per VM (its fitted dirty model, RAM, backing) and per
destination (RAM it offers VMs, store space):

1. placement — largest VM first onto the destination with the most RAM left
   (whole: RAM plus QEMU's own free, as the agent checks; a landed VM then
   takes its RAM off what the host offers); a VM no destination holds whole is split
   onto the one with the most RAM left after the whole VMs, and waits for
   them; a VM that fits nowhere is reported before anything moves;
2. modes at a share — each VM's move is the migration engine's own plan
   (``flexmig.migration.planner.plan``: the same request, VM facts, options
   and rules the agent and the Nova driver use), made with the stream's rate
   at that share: with c streams at once each gets ``link / c`` (capped at
   what one stream achieves); a VM whose precopy converges alone but not at
   that share gets postcopy where it can, else it runs *solo*; a VM the
   engine refuses even with the link to itself is reported before anything
   moves;
3. downtime budgets — with the CPUs the guests and migrations share
   (``HostLoad``), each VM's guest-observed gap is forecast at its share
   (``drain_downtime``); a VM that would miss its budget at c at once but not
   alone runs solo; one that misses it even alone is reported before
   anything moves, with the reason;
4. concurrency — each c from 1 to the maximum is simulated
   (``drain_schedule``); the fewest budget misses, then the least downtime
   beyond the budgets, then the soonest finish wins (fewer streams on a tie).

Pure functions: the CLI, the agents and the Nova path gather the inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from flexmig import exceptions
from flexmig.migration import planner
from flexmig.migration.facts import GuestMemory, VmFacts
from flexmig.migration.options import EngineOptions
from flexmig.migration.request import MigrationRequest
from flexmig.policy import drain_downtime, drain_schedule
from flexmig.policy.decision import QEMU_OVERHEAD_BYTES, Decision
from flexmig.policy.dirty_model import DirtyModel

MIB = 2**20
# Nova's own limit is 1; past a few streams a 2-core host spends more on
# context switches than the overlap saves, and every stream's share shrinks.
MAX_CONCURRENCY = 8
# Split keeps at least this much of the VM resident (see decision._split_blocker).
MIN_SPLIT_HOT_BYTES = 64 * MIB


@dataclasses.dataclass(frozen=True)
class DrainVM:
    """A VM to move: the engine's facts, its dirty model fitted once to their samples."""

    facts: VmFacts
    dirty: DirtyModel
    max_downtime_ms: int | None = None  # None: [migration] max_downtime_ms

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def ram_bytes(self) -> int:
        return self.facts.memory.ram_bytes

    @property
    def resident_bytes(self) -> int:
        return self.facts.memory.resident_bytes

    @property
    def file_backed(self) -> bool:
        return self.facts.memory.file_backed

    def request(self) -> MigrationRequest:
        """What the engine is asked for this VM: its mode is the engine's choice."""
        return MigrationRequest(vm=self.name, max_downtime_ms=self.max_downtime_ms)

    @classmethod
    def sized(
        cls,
        name: str,
        ram_bytes: int,
        resident_bytes: int,
        dirty: DirtyModel,
        file_backed: bool = False,
        backing_fs: str | None = "tmpfs",
        max_downtime_ms: int | None = None,
    ) -> DrainVM:
        """A VM known by its size and dirty model only (a Nova flavor, a worked example):
        memory anonymous or a file on ``backing_fs``, no passthrough, running."""
        memory = GuestMemory(
            ram_bytes,
            resident_bytes,
            "file" if file_backed else "anonymous",
            backing_fs if file_backed else None,
            passthrough=False,
        )
        samples = tuple((float(t), dirty.pages(t)) for t in (1, 2, 3))
        return cls(VmFacts(name, memory, samples, paused=False), dirty, max_downtime_ms)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A destination host and what it offers."""

    name: str
    free_for_vms_bytes: int
    store_free_bytes: int
    refusal: str | None = None  # why this host takes nothing (down, disabled)
    # Its agent's facts: its QEMU and store price a file-backed guest's switchover.
    facts: planner.DestinationFacts | None = None


@dataclasses.dataclass(frozen=True)
class Fabric:
    link_bps: float  # the source's uplink, shared by every stream
    stream_bps: float  # what one migration stream achieves alone
    setup_s: float = 0.5  # per migration, before pages move (agents, libvirt)
    switchover_s: float = 0.05
    # switchover_s learnt from libvirt's downtime, which holds the finish and
    # resume already (planner.LinkFacts.switchover_learned).
    switchover_learned: bool = False

    def share(self, streams: int) -> float:
        return drain_schedule.share_bps(self.link_bps, self.stream_bps, streams)


@dataclasses.dataclass(frozen=True)
class Placement:
    vm: str
    dest: str
    split: bool
    free_bytes: int  # what the destination offers this VM (split: its resident budget + QEMU)
    waits_for: tuple[str, ...] = ()
    host: planner.DestinationFacts | None = None  # the destination's Candidate.facts


@dataclasses.dataclass(frozen=True)
class Move:
    """One VM's part of the plan: the engine's plan of its migration, and when."""

    vm: str
    dest: str
    plan: planner.Plan
    solo: bool
    bandwidth_bps: float  # the share its mode was chosen at
    start_s: float
    end_s: float
    waits_for: tuple[str, ...]
    why: str
    guest_gap_ms: float | None = None  # forecast at its share, CPU contention included

    @property
    def decision(self) -> Decision:
        return self.plan.decision

    @property
    def mode(self) -> str:
        return self.plan.mode

    def request(self) -> MigrationRequest:
        """The engine request that carries this move out: the plan's mode, fixed."""
        return dataclasses.replace(self.plan.request, mode=self.mode)


@dataclasses.dataclass(frozen=True)
class DrainPlan:
    source: str
    concurrency: int
    moves: tuple[Move, ...]  # in start order
    unplaceable: dict[str, str]  # VM -> why no host can take it
    alternatives: dict[int, float]  # concurrency -> simulated total seconds
    fabric: Fabric
    # What each move's engine plan was made with (a re-plan uses the same).
    options: EngineOptions = dataclasses.field(default_factory=EngineOptions)
    load: drain_downtime.HostLoad | None = None
    # VM -> why its guest will notice more than its downtime budget.
    downtime_misses: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return max((m.end_s for m in self.moves), default=0.0)

    def explain(self) -> str:
        lines = [
            f"drain {self.source}: {len(self.moves)} VM(s), {self.concurrency} at once, "
            f"predicted {self.total_s:.1f} s "
            f"(link {self.fabric.link_bps / MIB:.0f} MiB/s, one stream "
            f"{self.fabric.stream_bps / MIB:.0f} MiB/s)",
            "  concurrency: "
            + ", ".join(f"{c} -> {t:.1f} s" for c, t in sorted(self.alternatives.items())),
        ]
        for vm, why in self.unplaceable.items():
            lines.append(f"  {vm}: STAYS — {why}")
        for vm, why in self.downtime_misses.items():
            lines.append(f"  {vm}: WILL MISS ITS DOWNTIME BUDGET — {why}")
        for move in self.moves:
            gap = f"; guest gap ~{move.guest_gap_ms:.0f} ms" if self.load is not None else ""
            lines.append(
                f"  {move.vm} -> {move.dest} {move.mode.upper()}"
                f"{' (solo)' if move.solo else ''}: {move.start_s:.1f}..{move.end_s:.1f} s"
                f" at {move.bandwidth_bps / MIB:.0f} MiB/s — {move.why}{gap}"
            )
        return "\n".join(lines)


def _validate(vms: Sequence[DrainVM], candidates: Sequence[Candidate], fabric: Fabric) -> None:
    problems = []
    names = [vm.name for vm in vms]
    if len(set(names)) != len(names):
        problems.append("VM names repeat")
    if len({c.name for c in candidates}) != len(candidates):
        problems.append("destination names repeat")
    if fabric.link_bps <= 0 or fabric.stream_bps <= 0:
        problems.append("link and stream bandwidth must be > 0")
    if fabric.setup_s < 0 or fabric.switchover_s < 0:
        problems.append("setup and switchover times must be >= 0")
    for vm in vms:
        if vm.ram_bytes <= 0 or not 0 <= vm.resident_bytes <= vm.ram_bytes:
            problems.append(f"{vm.name}: RAM must be > 0 and resident bytes within it")
    if problems:
        raise exceptions.InvalidInput(what="drain inputs", reason="; ".join(problems))


def _split_refusal(vm: DrainVM, dest: Candidate, free: int, store: int) -> str | None:
    if not vm.file_backed:
        return "its memory is not file-backed, so split cannot place it"
    if store < vm.ram_bytes:
        return f"{dest.name}'s store has {store // MIB} MiB left"
    if free < QEMU_OVERHEAD_BYTES + MIN_SPLIT_HOT_BYTES:
        return f"{dest.name} has {free // MIB} MiB left, below QEMU's own plus a minimal hot set"
    return None


def place(
    vms: Sequence[DrainVM], candidates: Sequence[Candidate]
) -> tuple[list[Placement], dict[str, str]]:
    """Destinations for every VM that can go somewhere; the others with the reason.

    Two greedy orders are tried, largest VM first and smallest first (which
    keeps small VMs whole and splits a big one when the big one whole would
    leave them nowhere); the one leaving fewer VMs behind, then fewer split,
    wins.

    >>> vm = lambda n, mib, fb=True: DrainVM.sized(n, mib * MIB, mib * MIB, DirtyModel(0, 1), fb)
    >>> hosts = [Candidate("B", 1000 * MIB, 4096 * MIB), Candidate("C", 700 * MIB, 0)]
    >>> placed, refused = place([vm("a", 256), vm("b", 256), vm("big", 900)], hosts)
    >>> [(p.vm, p.dest, p.split, p.waits_for) for p in placed]
    [('a', 'B', False, ()), ('b', 'B', False, ()), ('big', 'B', True, ('a', 'b'))]
    >>> for part in place([vm("huge", 900, fb=False)], hosts)[1]["huge"].split("; "):
    ...     print(part)
    needs 1060 MiB whole (RAM + QEMU), the most any destination has is 1000 MiB
    split: its memory is not file-backed, so split cannot place it
    """
    tries = [
        _place_in_order(sorted(vms, key=lambda v: (sign * v.ram_bytes, v.name)), candidates)
        for sign in (-1, 1)
    ]
    return min(tries, key=lambda t: (len(t[1]), sum(p.split for p in t[0])))


def _place_in_order(
    vms: Sequence[DrainVM], candidates: Sequence[Candidate]
) -> tuple[list[Placement], dict[str, str]]:
    usable = [c for c in candidates if c.refusal is None]
    free = {c.name: c.free_for_vms_bytes for c in usable}
    store = {c.name: c.store_free_bytes for c in usable}
    facts = {c.name: c.facts for c in usable}
    placed: list[Placement] = []
    deferred: list[DrainVM] = []
    for vm in vms:
        need = vm.ram_bytes + QEMU_OVERHEAD_BYTES
        fits = [c.name for c in usable if free[c.name] >= need]
        if not fits:
            deferred.append(vm)
            continue
        dest = max(fits, key=lambda name: free[name])
        placed.append(Placement(vm.name, dest, False, free[dest], host=facts[dest]))
        # The agents' accounting: a landed VM takes its RAM from what the host
        # offers; QEMU's own memory is asked of the incoming VM only.
        free[dest] -= vm.ram_bytes
    refused: dict[str, str] = {}
    for vm in deferred:
        dest, why = _split_destination(vm, usable, free, store)
        if dest is None:
            most = max(free.values(), default=0)
            refused[vm.name] = (
                f"needs {(vm.ram_bytes + QEMU_OVERHEAD_BYTES) // MIB} MiB whole (RAM + QEMU), "
                f"the most any destination has is {most // MIB} MiB; split: {why}"
            )
            continue
        waits = tuple(p.vm for p in placed if p.dest == dest)
        placed.append(Placement(vm.name, dest, True, free[dest], waits, facts[dest]))
        free[dest], store[dest] = 0, store[dest] - vm.ram_bytes
    return placed, refused


def _split_destination(
    vm: DrainVM, usable: Sequence[Candidate], free: Mapping[str, int], store: Mapping[str, int]
) -> tuple[str | None, str]:
    why = "no destination is available"
    best = None
    for c in sorted(usable, key=lambda c: -free[c.name]):
        refusal = _split_refusal(vm, c, free[c.name], store[c.name])
        if refusal is None:
            best = c.name
            break
        why = refusal if why == "no destination is available" else why
    return best, why


def _engine_plan(
    vm: DrainVM, placement: Placement, fabric: Fabric, bw: float, opts: EngineOptions
) -> planner.Plan:
    """The engine's plan for this VM at this destination with a stream of ``bw``."""
    return planner.plan(
        vm.request(),
        vm.facts,
        dataclasses.replace(
            placement.host or planner.DestinationFacts(0, 0),
            free_for_vms_bytes=placement.free_bytes,
            store_free_bytes=vm.ram_bytes if placement.split else 0,
            split_reserved=None,
        ),
        planner.LinkFacts(
            stream_bps=bw,
            setup_s=fabric.setup_s,
            switchover_s=fabric.switchover_s,
            switchover_learned=fabric.switchover_learned,
        ),
        opts,
        dirty=vm.dirty,
    )


Chosen = tuple[planner.Plan, bool, float, str]  # (engine plan, solo, its bandwidth, why)


def _mode_at_share(
    vm: DrainVM,
    placement: Placement,
    fabric: Fabric,
    streams: int,
    opts: EngineOptions,
    load: drain_downtime.HostLoad | None = None,
) -> Chosen:
    """The engine's plan for a VM sharing the link and the CPUs with ``streams - 1`` others.

    A VM whose guest would notice more than its budget at that share, but not
    with the CPUs and the link to itself, runs solo.
    """
    chosen = _mode_for_link(vm, placement, fabric, streams, opts)
    engine_plan, solo, _, _ = chosen
    if load is None or solo or streams == 1:
        return chosen
    budget = engine_plan.downtime_budget_ms
    shared_gap = drain_downtime.guest_gap_ms(engine_plan.guest_downtime, load, streams)
    if shared_gap <= budget:
        return chosen
    alone = _engine_plan(vm, placement, fabric, fabric.share(1), opts)
    alone_gap = drain_downtime.guest_gap_ms(alone.guest_downtime, load, 1)
    if alone_gap > budget:
        return chosen  # alone would not save it: reported as a miss
    why = (
        f"{alone.decision.reasons[2]}; alone: its guest would notice ~{shared_gap:.0f} ms at "
        f"{streams} at once (CPUs shared), ~{alone_gap:.0f} ms alone, budget {budget} ms"
    )
    return alone, True, fabric.share(1), why


def _mode_for_link(
    vm: DrainVM, placement: Placement, fabric: Fabric, streams: int, opts: EngineOptions
) -> Chosen:
    """The engine's plan for a VM sharing the link with ``streams - 1`` others.

    Refused at the share (the mode it would need is not allowed), or not
    converging there while it would alone: the VM runs solo with the link to itself.
    """
    shared, whole = fabric.share(streams), fabric.share(1)
    try:
        at_share = _engine_plan(vm, placement, fabric, shared, opts)
    except exceptions.PolicyRefused as exc:
        if streams == 1:
            raise
        why = f"at a 1/{streams} share the engine refuses it ({exc}): it runs alone"
        return _engine_plan(vm, placement, fabric, whole, opts), True, whole, why
    decision = at_share.decision
    converges = decision.transfer == "postcopy" or decision.prediction.converged
    if converges or streams == 1:
        why = (
            decision.reasons[2] if streams == 1 else f"{decision.reasons[2]} at a 1/{streams} share"
        )
        return at_share, False, shared, why
    alone = _engine_plan(vm, placement, fabric, whole, opts)
    if alone.decision.prediction.converged:
        blocker = planner.blockers(vm.facts, planner.DestinationFacts(0, 0), opts)[0]
        return (
            alone,
            True,
            whole,
            f"precopy converges only with the link to itself ({alone.decision.reasons[2]}); "
            f"at a 1/{streams} share it would not, and postcopy is out "
            f"({blocker or 'not allowed'})",
        )
    return at_share, False, shared, decision.reasons[2]


def _works(
    vms: Mapping[str, DrainVM],
    placements: Sequence[Placement],
    fabric: Fabric,
    streams: int,
    opts: EngineOptions,
    load: drain_downtime.HostLoad | None = None,
) -> tuple[list[drain_schedule.Work], dict[str, Chosen]]:
    chosen = {p.vm: _mode_at_share(vms[p.vm], p, fabric, streams, opts, load) for p in placements}
    works = []
    for p in placements:
        engine_plan, solo, bw, _ = chosen[p.vm]
        pred = engine_plan.decision.prediction
        moved = float(pred.total_bytes)
        works.append(
            drain_schedule.Work(
                p.vm,
                fixed_s=max(0.0, pred.total_time_s - moved / bw),
                bytes=moved,
                solo=solo,
                after=p.waits_for,
            )
        )
    # A split VM waits for its destination's whole VMs, so it goes last: first
    # even when it runs solo (a solo migration holds its place in the order,
    # and one waiting at the head for VMs behind it would block them all).
    # Then solo migrations first (the link is quiet and their timing the least
    # sure), then longest first (list scheduling's rule against a long tail).
    works.sort(key=lambda w: (bool(w.after), not w.solo, -(w.fixed_s + w.bytes / fabric.share(1))))
    return works, chosen


def plan(
    source: str,
    vms: Sequence[DrainVM],
    candidates: Sequence[Candidate],
    fabric: Fabric,
    max_concurrency: int = 4,
    opts: EngineOptions | None = None,
    load: drain_downtime.HostLoad | None = None,
) -> DrainPlan:
    """The drain that finishes soonest, explained per VM and in total.

    ``opts``: the source's ``[migration]`` options (allowed modes, downtime
    budget), the ones its engine will plan each migration with.  ``load``:
    the CPUs the guests and the migrations share (None: CPU to spare); with
    it, the plan keeps each guest within its downtime budget where it can,
    and where it cannot, their gaps as small as the host allows.

    Four idle 256 MiB VMs, 64 MiB touched each, 1 s of fixed cost per migration,
    a 100 MiB/s link one stream fills alone: running them together overlaps
    the fixed costs.

    >>> idle = DirtyModel(0, 1)
    >>> vms = [DrainVM.sized(f"vm{i}", 256 * MIB, 64 * MIB, idle, True) for i in range(4)]
    >>> hosts = [Candidate("B", 2048 * MIB, 0), Candidate("C", 2048 * MIB, 0)]
    >>> p = plan("A", vms, hosts, Fabric(100 * MIB, 100 * MIB, setup_s=1.0, switchover_s=0.0))
    >>> p.concurrency, round(p.total_s, 2), round(p.alternatives[1], 2)
    (4, 3.56, 6.56)
    """
    if not 1 <= max_concurrency <= MAX_CONCURRENCY:
        raise exceptions.InvalidInput(
            what="max concurrency", reason=f"{max_concurrency} not in 1..{MAX_CONCURRENCY}"
        )
    _validate(vms, candidates, fabric)
    opts = opts or EngineOptions()
    by_name = {vm.name: vm for vm in vms}
    placements, refused = place(vms, candidates)
    placements, refused = _engine_refusals(by_name, placements, refused, fabric, opts)
    dests = {p.vm: p for p in placements}
    best = None
    alternatives: dict[int, float] = {}
    for streams in range(1, min(max_concurrency, max(1, len(placements))) + 1):
        works, chosen = _works(by_name, placements, fabric, streams, opts, load)
        slots = drain_schedule.simulate(works, streams, fabric.link_bps, fabric.stream_bps)
        alternatives[streams] = drain_schedule.makespan(slots)
        misses = _misses(chosen, load, streams)
        rank = _rank(chosen, load, streams, len(misses), alternatives[streams])
        if best is None or rank < best[4]:
            best = (streams, slots, chosen, misses, rank)
    moves: list[Move] = []
    misses = {}
    if best is not None:
        streams, slots, chosen, misses, _ = best
        for slot in sorted(slots, key=lambda s: (s.start_s, s.name)):
            engine_plan, solo, bw, why = chosen[slot.name]
            gap = drain_downtime.guest_gap_ms(
                engine_plan.guest_downtime, load, 1 if solo else streams
            )
            moves.append(
                Move(
                    slot.name,
                    dests[slot.name].dest,
                    engine_plan,
                    solo,
                    bw,
                    slot.start_s,
                    slot.end_s,
                    dests[slot.name].waits_for,
                    why,
                    gap,
                )
            )
    return DrainPlan(
        source=source,
        concurrency=best[0] if best else 0,
        moves=tuple(moves),
        unplaceable=refused,
        alternatives=alternatives,
        fabric=fabric,
        options=opts,
        load=load,
        downtime_misses=misses,
    )


def _misses(
    chosen: Mapping[str, Chosen], load: drain_downtime.HostLoad | None, streams: int
) -> dict[str, str]:
    """The VMs whose guests are forecast to notice more than their budgets, and why."""
    misses = {}
    for name, (engine_plan, solo, _, _) in chosen.items():
        why = drain_downtime.miss_reason(
            engine_plan.guest_downtime, load, 1 if solo else streams, engine_plan.downtime_budget_ms
        )
        if why is not None:
            misses[name] = why
    return misses


def _rank(
    chosen: Mapping[str, Chosen],
    load: drain_downtime.HostLoad | None,
    streams: int,
    misses: int,
    total_s: float,
) -> tuple[int, float, float]:
    """How a concurrency compares (lower is better): fewer budget misses, then less
    downtime beyond the budgets in all, then a sooner finish.

    Where budgets cannot all be met, the guests' gaps come before the drain's
    time: in the lab (docs/benchmarks/drain-alone.md) one at a time cost 11 %
    more time and halved the worst gaps of four at once.  Without a load the
    gaps do not depend on the concurrency and the soonest finish decides; a
    tie (to the millisecond, to 1 us) keeps fewer streams.
    """
    over = 0.0
    for engine_plan, solo, _, _ in chosen.values():
        gap = drain_downtime.guest_gap_ms(engine_plan.guest_downtime, load, 1 if solo else streams)
        over += max(0.0, gap - engine_plan.downtime_budget_ms)
    return misses, round(over), round(total_s, 6)


def _engine_refusals(
    vms: Mapping[str, DrainVM],
    placements: list[Placement],
    refused: dict[str, str],
    fabric: Fabric,
    opts: EngineOptions,
) -> tuple[list[Placement], dict[str, str]]:
    """VMs the engine will not migrate even with the link to themselves, with its reason.

    A VM it refuses is reported before anything moves; the VMs that waited
    for it (a split VM on the same host) no longer need to.
    """
    kept, refused = [], dict(refused)
    for p in placements:
        try:
            _engine_plan(vms[p.vm], p, fabric, fabric.share(1), opts)
        except exceptions.PolicyRefused as exc:
            refused[p.vm] = str(exc)
            continue
        kept.append(p)
    gone = {p.vm for p in placements} - {p.vm for p in kept}
    return [
        dataclasses.replace(p, waits_for=tuple(w for w in p.waits_for if w not in gone))
        for p in kept
    ], refused


def without(candidates: Iterable[Candidate], moves: Iterable[Move]) -> list[Candidate]:
    """Candidates with the RAM and store already promised to ``moves`` taken off.

    Re-planning the rest of a drain starts from here: what has started keeps
    its destination.
    """
    taken: dict[str, int] = {}
    stored: dict[str, int] = {}
    for move in moves:
        split = move.mode == "split"
        taken[move.dest] = taken.get(move.dest, 0) + (
            move.decision.ram_bytes if not split else 1 << 62
        )
        if split:
            stored[move.dest] = stored.get(move.dest, 0) + move.decision.ram_bytes
    return [
        dataclasses.replace(
            c,
            free_for_vms_bytes=max(0, c.free_for_vms_bytes - taken.get(c.name, 0)),
            store_free_bytes=max(0, c.store_free_bytes - stored.get(c.name, 0)),
        )
        for c in candidates
    ]


def slowdown(planned_s: float, elapsed_s: float, fraction_done: float) -> float:
    """How much slower than planned a running migration goes (1.0: on plan).

    The projection is elapsed / fraction done; early on (under 10% done) the
    elapsed time alone is the evidence.

    >>> slowdown(10.0, 5.0, 0.5)
    1.0
    >>> slowdown(10.0, 8.0, 0.4)
    2.0
    >>> slowdown(10.0, 15.0, 0.0)
    1.5
    """
    if planned_s <= 0:
        return 1.0
    projected = elapsed_s / fraction_done if fraction_done >= 0.1 else elapsed_s
    return max(1.0, projected / planned_s)


def replan(
    current: DrainPlan,
    remaining: Sequence[DrainVM],
    candidates: Sequence[Candidate],
    started: Sequence[Move],
    factor: float,
    max_concurrency: int,
) -> DrainPlan:
    """The rest of a drain when migrations run ``factor`` times slower than planned.

    The link is taken to be that much slower; what has started keeps its
    destination and RAM.
    """
    fabric = dataclasses.replace(
        current.fabric,
        link_bps=current.fabric.link_bps / factor,
        stream_bps=current.fabric.stream_bps / factor,
    )
    return plan(
        current.source,
        remaining,
        without(candidates, started),
        fabric,
        max_concurrency,
        current.options,
        current.load,
    )
