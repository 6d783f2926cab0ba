"""What a destination makes a file-backed guest wait for at switchover.

Two things found in the lab's switchover traces (docs/benchmarks/switchover.md),
both invisible in QEMU's own downtime:

- QEMU before 10.0.3 (and 7.2 before 7.2.19) msyncs all of a file-backed
  guest's RAM when the incoming migration completes, before the guest runs:
  every dirty page of the memory file is written out inside the downtime
  (strace: ``msync(.., 536870912, MS_SYNC) <0.21 s>`` for 512 MiB).  QEMU
  dropped it for volatile memory ("migration: Don't sync volatile memory after
  migration completes").  The forecast counts it (``switchover_writeback``).
- libvirt persists the domain on the destination before resuming it
  (VIR_MIGRATE_PERSIST_DEST, as Nova asks) and fsyncs that XML file.  When
  /etc/libvirt and memory_backing_dir share an ext4 filesystem, that fsync
  commits the filesystem's journal, which in data=ordered mode waits for the
  memory file's data already allocated on disk: strace saw 128-242 ms in two
  lab runs on 2026-11-24 (under load, strace attached).  The forecast does
  not count it: measured with syscall tracepoints on 2026-11-29 in the split
  benchmark's conditions, libvirtd's fsyncs took at most 1 ms in all ten runs,
  seven with the agent's writeback on and three with it off, where the
  forecast had counted 130-670 ms.  ext4 delays allocation until writeback, and
  its commit does not write pages not yet allocated; what the agent's flusher
  has in flight is small.  Explain still names a shared filesystem (``notes``)
  as a risk an operator can remove.

Neither is FlexMig's to change on a host; the plan says so, so an operator
can (update QEMU, give memory_backing_dir its own filesystem).
"""

from __future__ import annotations

import dataclasses

# QEMU versions in libvirt's encoding (major * 1,000,000 + minor * 1,000 + micro).
QEMU_SKIPS_VOLATILE_SYNC = 10_000_003
QEMU_72_STABLE_WITH_FIX = 7_002_019
LIBVIRT_CONFIG_DIR = "/etc/libvirt"
MIB = 2**20
# The share of a file-backed guest's resident memory still dirty in the
# destination's page cache when the incoming migration completes, while the
# destination agent's flusher (on by default on both paths: the request's
# store_writeback, the Nova driver's pre_live_migration) writes the file back
# every 0.2 s.  Fitted to docs/benchmarks/switchover.md (512 MiB guest with
# ~240 MiB resident, 100 MiB/s stream, QEMU 10.0.2: msync 158-262 ms at the
# lab store's ~500 MiB/s durable write rate, i.e. ~100 MiB of 240) and
# consistent with docs/benchmarks/writeback.md (the flusher left 33 of 86 ms).
DIRTY_LEFT_WITH_FLUSHER = 0.4
# A store's durable write rate before its agent has measured one (a SATA
# SSD; the split decision assumes the same).
DEFAULT_WRITE_BPS = 400.0 * MIB
PARTS = ("destination msync",)
FSYNC_NOT_COUNTED = (
    "nothing: the destination's QEMU does not msync; libvirt's persist fsync not counted"
)


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
            "libvirt's fsync of the domain before resuming it can wait for the guest memory's "
            "writeback (ext4 data=ordered; not counted in the forecast): give "
            "memory_backing_dir a filesystem of its own"
        )
    return out


def dirty_at_completion(resident_bytes: int, flusher: bool) -> float:
    """Bytes of the destination's memory file still dirty when the migration completes.

    Every page the guest had resident arrives in the file; without the
    agent's flusher none of it has reached the disk yet (a migration lasts
    well under the kernel's 30 s dirty expiry).

    >>> dirty_at_completion(240 * MIB, flusher=True) / MIB
    96.0
    >>> dirty_at_completion(240 * MIB, flusher=False) / MIB
    240.0
    """
    return resident_bytes * (DIRTY_LEFT_WITH_FLUSHER if flusher else 1.0)


@dataclasses.dataclass(frozen=True)
class SwitchoverWriteback:
    """What the destination writes back inside the downtime, by whom, and why."""

    msync_s: float = 0.0
    reason: str = ""

    def parts_s(self) -> dict[str, float]:
        return dict.fromkeys(PARTS, self.msync_s)  # PARTS is the msync alone


def switchover_writeback(
    file_backed: bool,
    dirty_bytes: float,
    qemu_version: int,
    store_shares_libvirt_fs: bool | None,
    write_bps: float,
) -> SwitchoverWriteback:
    """The destination's wait for a file-backed guest's dirty memory file.

    ``write_bps``: the destination store's measured durable write rate (its
    agent's probe, 1 MiB writes then fdatasync); 0: not measured, a SATA
    SSD's assumed.  Unknown facts (an older agent) add nothing, and say so.
    libvirt's persist fsync is not counted (see the module's doc), and the
    reason says so where the store shares libvirt's filesystem.

    >>> old, new = 10_000_002, 10_000_013
    >>> round(switchover_writeback(True, 100 * MIB, old, True, 500 * MIB).msync_s, 3)
    0.2
    >>> w = switchover_writeback(True, 100 * MIB, new, True, 500 * MIB)
    >>> w.parts_s(), w.reason.startswith(FSYNC_NOT_COUNTED)
    ({'destination msync': 0.0}, True)
    >>> switchover_writeback(False, 0, old, True, 0).reason
    ''
    """
    if not file_backed:
        return SwitchoverWriteback()
    rate = write_bps or DEFAULT_WRITE_BPS
    syncs = qemu_syncs_file_ram(qemu_version)
    if syncs:
        how = (
            f"~{dirty_bytes / MIB:,.0f} MiB of the memory file still dirty at "
            f"{rate / MIB:,.0f} MiB/s ({'measured' if write_bps else 'assumed, not measured'})"
        )
        return SwitchoverWriteback(
            msync_s=dirty_bytes / rate,
            reason=f"destination QEMU's msync at completion writes {how}",
        )
    if syncs is None:
        return SwitchoverWriteback(
            reason="destination's QEMU version unknown: its msync at completion (QEMU before "
            "10.0.3) not counted"
        )
    if store_shares_libvirt_fs:
        return SwitchoverWriteback(
            reason=f"{FSYNC_NOT_COUNTED} (its store shares {LIBVIRT_CONFIG_DIR}'s filesystem; "
            "its fsyncs took at most 1 ms in every lab run)"
        )
    return SwitchoverWriteback(
        reason="nothing: the destination's QEMU does not msync"
        + ("" if store_shares_libvirt_fs is None else " and its store has a filesystem of its own")
    )
