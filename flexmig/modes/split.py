"""Split: the VM lands in the destination's store with only its hot set resident.

The transfer itself is precopy (or hybrid where the store's filesystem lets
userfaultfd serve the file); what makes it split is the destination side,
prepared by the destination agent before the incoming QEMU receives a page:
a reservation that the host's libvirt hook turns into a memory cgroup capping
the new QEMU process at the budget.
"""

from flexmig.modes.base import MigrationMode, ModeInfo


class SplitMode(MigrationMode):
    def describe(self) -> ModeInfo:
        return ModeInfo(
            name="split",
            needs_postcopy=False,
            needs_file_backing=True,
            summary="VM memory in a sparse per-VM file in the destination store, "
            "resident set capped by a memory cgroup set before pages arrive",
        )
