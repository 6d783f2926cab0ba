"""The mode plugin interface: describe what it is, shape the job, react to progress."""

from __future__ import annotations

import abc
import dataclasses

import libvirt

from flexmig.policy.decision import Decision

BASE_FLAGS = (
    libvirt.VIR_MIGRATE_LIVE
    | libvirt.VIR_MIGRATE_PEER2PEER
    | libvirt.VIR_MIGRATE_PERSIST_DEST
    | libvirt.VIR_MIGRATE_UNDEFINE_SOURCE
)


@dataclasses.dataclass(frozen=True)
class ModeInfo:
    name: str
    summary: str
    needs_postcopy: bool
    needs_file_backing: bool


class MigrationMode(abc.ABC):
    """A way of migrating; stateless apart from what one job tells it."""

    @abc.abstractmethod
    def describe(self) -> ModeInfo:
        """What this mode is and what it needs from the VM and hosts."""

    def flags(self, decision: Decision) -> int:
        flags = BASE_FLAGS
        if decision.auto_converge:
            flags |= libvirt.VIR_MIGRATE_AUTO_CONVERGE
        if decision.transfer == "postcopy":
            flags |= libvirt.VIR_MIGRATE_POSTCOPY
        return flags

    def should_switch_to_postcopy(self, decision: Decision, stats: dict[str, int]) -> bool:
        """Hybrid: switch once the decision's precopy rounds are done.

        libvirt's memory_iteration counts dirty-bitmap syncs: it reads k+1
        while round k+1 runs, i.e. once k full rounds are done.
        """
        if decision.transfer != "postcopy" or decision.postcopy_after_round is None:
            return False
        return stats.get("memory_iteration", 0) > decision.postcopy_after_round
