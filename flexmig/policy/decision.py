"""Choosing a migration mode per VM, with the reasons in plain language.

precopy   — when it is predicted to converge within the downtime budget.
postcopy  — hybrid: precopy first, then switch, when precopy is predicted not
            to converge (seed 001 asks for exactly this) and postcopy is
            allowed for the VM.
split     — when the destination lacks the free RAM for the VM: its memory
            lands in a VM-dedicated file in the destination's store with only
            a budget of it resident (seed 003).  Needs file-backed memory.
Otherwise precopy with auto-converge (CPU throttling), the one way left to
make a non-converging precopy finish.
"""

from __future__ import annotations

import dataclasses

from flexmig import exceptions
from flexmig.policy import precopy, split
from flexmig.policy.dirty_model import DirtyModel

# The modes, written once: options, the agent API and the CLI take them from here.
MODES = ("precopy", "postcopy", "split")
REQUESTABLE_MODES = ("auto", *MODES)
MIB = 2**20
# QEMU's own memory besides guest RAM (device state, TCG buffers, libs);
# it must stay resident on the destination whatever the mode.
QEMU_OVERHEAD_BYTES = 160 * MIB
# What of QEMU's own memory is charged to the capped group (TCG buffers,
# device state, libraries touched): measured on the lab's QEMU 10 guests.
QEMU_CHARGED_BYTES = 64 * MIB
# A store's write bandwidth before its agent has measured one (a SATA SSD).
DEFAULT_STORE_WRITE_BPS = 400.0 * MIB


@dataclasses.dataclass(frozen=True)
class MigrationInputs:
    vm: str
    ram_bytes: int
    resident_bytes: int  # pages ever touched (file-backed: the file's allocation)
    dirty: DirtyModel
    bandwidth_bps: float
    dest_free_bytes: int  # what the destination can give VMs
    dest_store_free_bytes: int  # free space in the destination's split store
    file_backed: bool
    max_downtime_ms: int = 300
    # Why postcopy cannot be used for this VM (a passthrough device, memory in
    # a file that userfaultfd cannot serve, policy), or None when it can.
    postcopy_blocker: str | None = None
    # Why split cannot be used for this move (operator policy), or None.
    split_blocker: str | None = None
    page_size: int = 4096
    switchover_s: float = 0.05
    round_overhead_s: float = 0.0
    setup_s: float = 0.0
    # The destination's split store: its write bandwidth in 1 MiB chunks (0:
    # not measured, DEFAULT_STORE_WRITE_BPS assumed) and which memory cgroup
    # caps split VMs there (its agent's description).
    dest_store_write_bps: float = 0.0
    dest_memory_cgroup: str = ""
    # One fault on the store, a 4 MiB read (0: not measured, assumed at the
    # write bandwidth).
    dest_store_fault_s: float = 0.0
    # The store's page-cache folio size, which reclaim frees at a time (0: unknown).
    dest_store_folio_bytes: int = 0

    def transfer(self) -> precopy.Transfer:
        return precopy.Transfer(
            ram_pages=self.ram_bytes // self.page_size,
            resident_pages=max(1, self.resident_bytes // self.page_size),
            page_size=self.page_size,
            bandwidth_bps=self.bandwidth_bps,
            switchover_s=self.switchover_s,
            round_overhead_s=self.round_overhead_s,
            setup_s=self.setup_s,
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    vm: str
    ram_bytes: int
    mode: str  # precopy | postcopy | split
    transfer: str  # how pages move: precopy | postcopy (split uses either)
    max_downtime_ms: int
    postcopy_after_round: int | None
    auto_converge: bool
    memory_budget_bytes: int | None  # split: resident cap on the destination
    headroom_bytes: int | None  # split: kept free under the cap for the final round
    prediction: precopy.Prediction
    alternatives: dict[str, str]  # other modes: their prediction or why not
    reasons: tuple[str, ...]
    # split: faults on the rewritten set's part beyond the budget
    store_faults: split.StoreFaults = split.NO_FAULTS

    def explain(self) -> str:
        lines = [f"{self.vm}: {self.mode.upper()}"]
        lines += [f"  - {r}" for r in self.reasons]
        lines.append(f"  predicted: {self.prediction.summary()}")
        for mode, text in self.alternatives.items():
            lines.append(f"  {mode}: {text}")
        return "\n".join(lines)


def _validate(inp: MigrationInputs, requested: str) -> None:
    problems = []
    if requested not in REQUESTABLE_MODES:
        problems.append(f"mode {requested!r} is not one of {', '.join(REQUESTABLE_MODES)}")
    if inp.ram_bytes <= 0 or inp.resident_bytes < 0 or inp.resident_bytes > inp.ram_bytes:
        problems.append("RAM must be > 0 and resident bytes within it")
    if inp.bandwidth_bps <= 0:
        problems.append("bandwidth must be > 0")
    if not 1 <= inp.max_downtime_ms <= 60_000:
        problems.append(f"max downtime {inp.max_downtime_ms} ms not in 1..60000")
    if problems:
        raise exceptions.InvalidInput(what="migration inputs", reason="; ".join(problems))


def _describe_workload(inp: MigrationInputs) -> str:
    if inp.dirty.m_pages <= 0:
        return "the guest dirties no measurable memory"
    return (
        f"the guest rewrites a set of {inp.dirty.m_pages:,.0f} pages "
        f"(half-life {inp.dirty.tau_s:.2f} s, {inp.dirty.initial_rate():,.0f} pages/s "
        f"at first)"
    )


def split_budget(ram_bytes: int, dest_free_bytes: int) -> int | None:
    """Resident budget for an incoming VM the destination cannot hold whole, else None.

    The destination keeps QEMU's own memory resident and gives the VM's
    memory what is left; split then places the rest in the store file.

    >>> split_budget(512 * MIB, 2048 * MIB) is None
    True
    >>> split_budget(512 * MIB, 400 * MIB) // MIB
    240
    """
    if dest_free_bytes >= ram_bytes + QEMU_OVERHEAD_BYTES:
        return None
    return max(0, dest_free_bytes - QEMU_OVERHEAD_BYTES)


def _split_blocker(inp: MigrationInputs) -> str | None:
    if inp.split_blocker:
        return f"unavailable: {inp.split_blocker}"
    if not inp.file_backed:
        return (
            "unavailable: the VM's memory is not file-backed, and libvirt cannot change "
            "the backing during migration (enable [libvirt] file_backed_memory)"
        )
    if inp.dest_store_free_bytes < inp.ram_bytes:
        return (
            f"unavailable: the destination store has {inp.dest_store_free_bytes // MIB} MiB "
            f"free, the VM needs {inp.ram_bytes // MIB} MiB"
        )
    if inp.dest_free_bytes < QEMU_OVERHEAD_BYTES + 64 * MIB:
        return (
            f"unavailable: the destination has {inp.dest_free_bytes // MIB} MiB free, "
            f"below QEMU's own {QEMU_OVERHEAD_BYTES // MIB} MiB plus a minimal hot set"
        )
    return None


def _fits(inp: MigrationInputs) -> bool:
    return split_budget(inp.ram_bytes, inp.dest_free_bytes) is None


def decide(inp: MigrationInputs, requested: str = "auto") -> Decision:
    """Pick the mode and its parameters; ``requested`` forces one (or says why not)."""
    _validate(inp, requested)
    xfer = inp.transfer()
    budget_s = inp.max_downtime_ms / 1000
    pre = precopy.simulate_precopy(inp.dirty, xfer, budget_s)
    switch = precopy.best_switch_round(inp.dirty, xfer)
    hybrid = precopy.simulate_hybrid(inp.dirty, xfer, switch)
    split_blocker = _split_blocker(inp)
    fits = _fits(inp)
    alternatives = {
        "precopy": pre.summary()
        + ("" if pre.converged else f" — does not converge " f"({pre.stop_reason})"),
        "postcopy": hybrid.summary()
        if inp.postcopy_blocker is None
        else f"unavailable: {inp.postcopy_blocker}",
        "split": split_blocker or "available: destination store can hold the VM",
    }
    if not fits:
        need = (inp.ram_bytes + QEMU_OVERHEAD_BYTES) // MIB
        short = (
            f"the destination has {inp.dest_free_bytes // MIB} MiB free for VMs, "
            f"the VM needs {need} MiB"
        )
        alternatives["precopy"] = alternatives["postcopy"] = "unavailable: " + short
    mode = _choose(inp, requested, pre, fits, split_blocker, alternatives)
    return _parameters(inp, mode, pre, hybrid, switch, alternatives)


def _choose(
    inp: MigrationInputs,
    requested: str,
    pre: precopy.Prediction,
    fits: bool,
    split_blocker: str | None,
    alternatives: dict[str, str],
) -> str:
    if requested != "auto":
        blocked = alternatives[requested]
        if blocked.startswith("unavailable"):
            raise exceptions.PolicyRefused(inp.vm, [f"{requested} is {blocked}"])
        return requested
    if not fits:
        if split_blocker:
            raise exceptions.PolicyRefused(
                inp.vm,
                [
                    f"precopy and postcopy are {alternatives['precopy']}",
                    f"split is {split_blocker}",
                ],
            )
        return "split"
    if pre.converged or inp.postcopy_blocker is not None:
        return "precopy"
    return "postcopy"


def _mode_reason(inp: MigrationInputs, mode: str, pre: precopy.Prediction, switch: int) -> str:
    """Why this mode, in the operator's terms."""
    if mode == "split":
        return (
            f"destination has {inp.dest_free_bytes // MIB} MiB free, less than the "
            f"VM's {inp.ram_bytes // MIB} MiB plus QEMU's own: split places the "
            "VM's memory in its store file with only the hot set resident"
        )
    if mode == "precopy" and pre.converged:
        return f"precopy converges in {len(pre.rounds)} round(s) within the budget"
    if mode == "precopy":
        why = inp.postcopy_blocker or "precopy was requested"
        return (
            f"precopy does not converge ({pre.stop_reason}) and postcopy is out "
            f"({why}): auto-converge will throttle the guest's CPUs"
        )
    return (
        f"precopy does not converge ({pre.stop_reason}); hybrid switches to "
        f"postcopy after round {switch}"
    )


def _parameters(
    inp: MigrationInputs,
    mode: str,
    pre: precopy.Prediction,
    hybrid: precopy.Prediction,
    switch: int,
    alternatives: dict[str, str],
) -> Decision:
    reasons = [
        _describe_workload(inp),
        f"the migration stream moves {inp.bandwidth_bps / MIB:,.0f} MiB/s; "
        f"the downtime budget is {inp.max_downtime_ms} ms",
    ]
    can_postcopy = inp.postcopy_blocker is None
    transfer = {"precopy": "precopy", "postcopy": "postcopy"}.get(
        mode, "postcopy" if not pre.converged and can_postcopy else "precopy"
    )
    reasons.append(_mode_reason(inp, mode, pre, switch))
    prediction = hybrid if transfer == "postcopy" else pre
    downtime_ms = inp.max_downtime_ms
    if transfer == "precopy" and pre.converged:
        downtime_ms, prediction = precopy.tightest_downtime(
            inp.dirty, inp.transfer(), inp.max_downtime_ms
        )
        if downtime_ms < inp.max_downtime_ms:
            reasons.append(
                f"a {downtime_ms} ms downtime limit converges too, at under 10% more "
                "total time: it is used instead of the full budget"
            )
    budget = split_budget(inp.ram_bytes, inp.dest_free_bytes) if mode == "split" else None
    headroom, faults = None, split.NO_FAULTS
    if budget is not None:
        prediction, headroom, faults = _split_costs(inp, prediction, budget, reasons)
    elif inp.dest_memory_cgroup:
        reasons.append(f"the destination would cap a split VM with {inp.dest_memory_cgroup}")
    return Decision(
        vm=inp.vm,
        ram_bytes=inp.ram_bytes,
        mode=mode,
        transfer=transfer,
        max_downtime_ms=downtime_ms,
        postcopy_after_round=switch if transfer == "postcopy" else None,
        auto_converge=transfer == "precopy" and not pre.converged,
        memory_budget_bytes=budget,
        headroom_bytes=headroom,
        prediction=prediction,
        alternatives={k: v for k, v in alternatives.items() if k != mode},
        reasons=tuple(reasons),
        store_faults=faults,
    )


def _split_costs(
    inp: MigrationInputs, pre: precopy.Prediction, budget: int, reasons: list[str]
) -> tuple[precopy.Prediction, int, split.StoreFaults]:
    """Split's prediction (its own costs on top of the precopy), the keeper's headroom
    and the faults on the store."""
    write_bps = inp.dest_store_write_bps or DEFAULT_STORE_WRITE_BPS
    xfer = inp.transfer()
    store = split.StoreFacts(budget, write_bps, QEMU_CHARGED_BYTES, inp.dest_store_fault_s)
    faults = split.faults(pre, xfer, store, inp.dirty)
    prediction = split.predict(pre, xfer, store, faults)
    headroom = split.headroom_bytes(split.final_round_bytes(pre, xfer), xfer.bandwidth_bps, budget)
    measured = "measured" if inp.dest_store_write_bps else "assumed, not measured"
    reasons.append(
        f"the destination keeps {budget // MIB} MiB resident ({headroom // MIB} MiB of it "
        f"free for the final round) and writes the rest to its store at "
        f"{write_bps / MIB:,.0f} MiB/s ({measured})"
        + (f"; capped by {inp.dest_memory_cgroup}" if inp.dest_memory_cgroup else "")
    )
    reasons.append(_describe_faults(faults, store, bool(inp.dest_store_fault_s)))
    if inp.dest_store_folio_bytes > inp.page_size:
        reasons.append(_describe_folios(inp.dest_store_folio_bytes))
    return prediction, headroom, faults


def _describe_folios(folio_bytes: int) -> str:
    """Explain's line on a store whose page cache is held in large folios.

    >>> print(_describe_folios(2 * MIB))  # doctest: +NORMALIZE_WHITESPACE
    the destination's store holds its page cache in 2 MiB folios, which reclaim frees
    whole: a hot page keeps its 2 MiB resident, so a rewritten set scattered through
    guest RAM needs more than its size in the budget (docs/benchmarks/split-page-cache.md)
    """
    return (
        f"the destination's store holds its page cache in {folio_bytes // MIB} MiB folios, "
        f"which reclaim frees whole: a hot page keeps its {folio_bytes // MIB} MiB resident, "
        "so a rewritten set scattered through guest RAM needs more than its size in the "
        "budget (docs/benchmarks/split-page-cache.md)"
    )


def _describe_faults(faults: split.StoreFaults, store: split.StoreFacts, measured: bool) -> str:
    """Explain's line on faults on the store.

    >>> f = split.StoreFaults(35 * MIB, 9, 2, 0.02)
    >>> _describe_faults(f, split.StoreFacts(179 * MIB, 400 * MIB, 0, 0.02), True)
    "a fault on the store reads a 4 MiB window in 20 ms (measured); 35 MiB of the \
rewritten set does not fit the budget: 9 faults in the final round (+180 ms of downtime), \
2 before the guest's first heartbeat (+40 ms)"
    """
    head = (
        f"a fault on the store reads a {split.FAULT_WINDOW_BYTES // MIB} MiB window in "
        f"{store.fault_or_assumed_s() * 1000:.0f} ms "
        f"({'measured' if measured else 'assumed: a read at the write rate'})"
    )
    if not faults.off_budget_bytes:
        return f"{head}; the rewritten set fits the budget: no faults expected"
    return (
        f"{head}; {faults.off_budget_bytes / MIB:.0f} MiB of the rewritten set does not fit "
        f"the budget: {faults.final_round} faults in the final round "
        f"(+{faults.final_round_s * 1000:.0f} ms of downtime), {faults.first_heartbeat} before "
        f"the guest's first heartbeat (+{faults.first_heartbeat_s * 1000:.0f} ms)"
    )
