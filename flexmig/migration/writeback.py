"""What a destination makes a file-backed guest wait for at switchover.

Two things found in the lab's switchover traces (docs/benchmarks/switchover.md),
both invisible in QEMU's own downtime:

- QEMU before 10.0.3 (and 7.2 before 7.2.19) msyncs all of a file-backed
  guest's RAM when the incoming migration completes, before the guest runs:
  every dirty page of the memory file is written out inside the downtime
  (strace: ``msync(.., 536870912, MS_SYNC) <0.21 s>`` for 512 MiB).  QEMU
  dropped it for volatile memory ("migration: Don't sync volatile memory after
  migration completes").
- libvirt persists the domain on the destination before resuming it
  (VIR_MIGRATE_PERSIST_DEST, as Nova asks) and fsyncs that XML file.  When
  /etc/libvirt and memory_backing_dir share an ext4 filesystem, that fsync
  commits the filesystem's journal, which in data=ordered mode first writes
  the guest memory's freshly allocated pages: 128-242 ms in the lab, 0-35 ms
  with the store on a filesystem of its own.

Neither is FlexMig's to change on a host; the plan says so, so an operator
can (update QEMU, give memory_backing_dir its own filesystem).
"""

from __future__ import annotations

# QEMU versions in libvirt's encoding (major * 1,000,000 + minor * 1,000 + micro).
QEMU_SKIPS_VOLATILE_SYNC = 10_000_003
QEMU_72_STABLE_WITH_FIX = 7_002_019
LIBVIRT_CONFIG_DIR = "/etc/libvirt"


def qemu_syncs_file_ram(qemu_version: int) -> bool | None:
    """Whether this QEMU msyncs file-backed RAM before resuming an incoming guest.

    None: version unknown.  Stable branches other than 7.2 are taken as
    unfixed before 10.0.3 (the fix reached 7.2.19 and 10.0.3; others unchecked).

    >>> qemu_syncs_file_ram(10_000_002), qemu_syncs_file_ram(10_000_013)
    (True, False)
    >>> qemu_syncs_file_ram(7_002_022), qemu_syncs_file_ram(8_002_002), qemu_syncs_file_ram(0)
    (False, True, None)
    """
    if not qemu_version:
        return None
    if QEMU_72_STABLE_WITH_FIX <= qemu_version < 7_003_000:
        return False
    return qemu_version < QEMU_SKIPS_VOLATILE_SYNC


def notes(file_backed: bool, qemu_version: int, store_shares_libvirt_fs: bool | None) -> list[str]:
    """What the destination adds to a file-backed guest's downtime, for explain."""
    if not file_backed:
        return []
    out = []
    if qemu_syncs_file_ram(qemu_version):
        out.append(
            "the destination's QEMU (before 10.0.3) writes all of the guest's dirty memory "
            "file out before the guest resumes, inside the downtime: update QEMU"
        )
    if store_shares_libvirt_fs:
        out.append(
            f"the destination's memory_backing_dir shares a filesystem with {LIBVIRT_CONFIG_DIR}: "
            "libvirt's fsync of the domain before resuming it waits for the guest memory's "
            "writeback (ext4 data=ordered): give memory_backing_dir a filesystem of its own"
        )
    return out
