"""Facts and plans for the engine's unit tests (no libvirt, no agents)."""

from __future__ import annotations

import math

from flexmig.migration import planner
from flexmig.migration.facts import GuestMemory, VmFacts
from flexmig.migration.options import EngineOptions
from flexmig.migration.request import MigrationRequest

MIB = 2**20
PAGE = 4096


def samples(m_pages: float, tau_s: float, intervals=(1, 2, 3)) -> tuple:
    """Dirty-rate samples of a workload that follows seed 000's curve exactly."""
    return tuple((float(t), m_pages * (1 - 0.5 ** (t / tau_s))) for t in intervals)


MODERATE = samples(32768, 32768 * math.log(2) / 5000)
HOT = samples(32768, 32768 * math.log(2) / 200_000)


def vm_facts(
    hot: bool = False,
    file_backed: bool = True,
    backing_fs: str | None = "ext4",
    paused: bool = False,
) -> VmFacts:
    memory = GuestMemory(
        ram_bytes=512 * MIB,
        resident_bytes=200 * MIB,
        backing="file" if file_backed else "anonymous",
        backing_fs=backing_fs if file_backed else None,
        passthrough=False,
    )
    return VmFacts("vm", memory, HOT if hot else MODERATE, paused)


def make_plan(
    hot: bool = False, file_backed: bool = True, free_mib: int = 4096, **request
) -> planner.Plan:
    return planner.plan(
        MigrationRequest(vm="vm", **request),
        vm_facts(hot=hot, file_backed=file_backed),
        planner.DestinationFacts(free_mib * MIB, 8192 * MIB),
        planner.LinkFacts(fabric_bps=300 * MIB),
        EngineOptions(),
    )
