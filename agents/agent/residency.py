"""Keeping an incoming split VM's resident memory under its budget, ahead of need.

Without this, the memory cgroup's cap is the mechanism: the VM's memory fills
the cap, and from then on every page QEMU writes (the incoming stream, the
final round inside the downtime) waits for memcg reclaim, which waits for
writeback of page-sized pieces.  The lab measured 232-258 ms of the
switchover spent exactly there (docs/benchmarks/switchover.md).

The keeper does what seed 003 (VMemDirect) does on its own: it decides where
each page lives.  Every INTERVAL_S it

1. reads, per chunk of the file, how many of its pages the page cache holds
   and how many were written since the last writeback (``cachestat``, Linux
   >= 6.5; older kernels: QEMU's page map of the guest-RAM mapping, which
   sees only the pages QEMU maps, and a sample of page flags in
   ``/proc/kpageflags``);
2. counts each chunk's writes across intervals (never written, written
   once, rewritten: ``record_writes``) and ages it with 8 bits, like seed
   003's per-page history (a bit per interval, shifted right): a chunk is
   *referenced* in an interval when it is dirty again after being written
   back, or resident again after the keeper dropped it;
3. starts writeback of every dirty chunk in 1 MiB-aligned ranges (the store
   sees large writes, not reclaim's 4 KiB ones: 4.3x slower in seed 003);
   the chunks it keeps (the rewritten set, the source's hint) only every
   second, where the destination's QEMU does not sync guest RAM in the
   downtime (``chunks_to_write_back``: rewritten folios written back at every
   look were the writes the guest's first faults after the resume queued
   behind);
4. when the cgroup's charge is above its target (the cap minus headroom for
   the final round), picks chunks to drop (never-written ones first, then
   written-once ones, the rewritten set last: ``drop_order``), waits for
   their writeback and drops them with ``process_madvise(MADV_PAGEOUT)``
   (and the readahead QEMU does not map with ``POSIX_FADV_DONTNEED``) down
   to a low mark half the headroom below the target, or lower by what the
   charge grew between looks lately, so the next interval's stream lands in
   free room: clean file pages are simply unmapped and freed, no I/O inside
   QEMU's faults;
5. once libvirt says the guest runs here, drops nothing more: the guest's
   reads now say what is hot, and only the kernel sees them (accessed bits),
   so the cap's reclaim picks by its LRU among pages step 3 keeps clean.

Why "written since the last writeback" is the evidence of hotness here: the
destination sees the guest only through what arrives. A page the source sends
again in a later round is one the guest rewrote: the rewritten set is what the
source's dirty-rate model calls hot, and what the guest will touch first after
switchover.  Reads leave no trace this kernel exposes to the keeper (no
soft-dirty, no idle-page tracking on this build), except a dropped chunk
coming back, which is counted.

The granule the kernel really moves is larger than a page: QEMU maps guest RAM
MADV_HUGEPAGE, and on a filesystem with large folios (ext4 since Linux 6.16)
the store's page cache is then held in 2 MiB folios, PMD-mapped, and a fault
on a dropped page reads two of them, 4 MiB (measured on this host's 6.18
kernel; without the advice one page).  A page that is hot keeps its whole
folio resident.

Which is why residency is read from the page cache, not from QEMU's page
map: each fault's readahead caches up to 4 MiB that QEMU does not map (zero
pages it read to compare, neighbours of a page it wrote), all charged to the
VM.  At a split-50 switchover in the lab (tests/bench/split_trace.py) the
VM's cgroup held 248 MiB of its file and QEMU mapped 7 MiB of it: a keeper
counting mapped pages dropped the pages being written (the only ones it saw)
and left the readahead to the cap's reclaim.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import os
from collections.abc import Collection, Iterable, Sequence

PAGE = 4096
CHUNK_BYTES = 1 << 20
CHUNK_PAGES = CHUNK_BYTES // PAGE
AGE_BITS = 8
HOT_BIT = 1 << (AGE_BITS - 1)
SAMPLES_PER_CHUNK = 8
PM_PRESENT = 1 << 63
PM_PFN_MASK = (1 << 55) - 1
KPF_DIRTY = 1 << 4
MADV_PAGEOUT = 21
SYS_PROCESS_MADVISE = 440  # x86_64 and arm64 share the generic number
IOV_MAX = 1024
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4

_PRESENT_TABLE = bytes(1 if b & 0x80 else 0 for b in range(256))
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def chunks_in(size_bytes: int) -> int:
    """1 MiB chunks covering ``size_bytes``.

    >>> chunks_in(1 << 20), chunks_in((1 << 20) + 1)
    (1, 2)
    """
    return (size_bytes + CHUNK_BYTES - 1) // CHUNK_BYTES


def sync_file_range(fd: int, offset: int, nbytes: int, flags: int) -> None:
    """sync_file_range(2), which Python's os lacks; OSError with its errno."""
    if _LIBC.sync_file_range(fd, offset, nbytes, flags):
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


# -- decisions (pure) -----------------------------------------------------


def age(ages: Sequence[int], referenced: Iterable[int]) -> list[int]:
    """One aging step: shift every chunk's history right, set the top bit if referenced.

    >>> age([0, 0x80, 0xFF], [0])
    [128, 64, 127]
    """
    out = [a >> 1 for a in ages]
    for chunk in referenced:
        out[chunk] |= HOT_BIT
    return out


def target_bytes(limit_bytes: int, headroom_bytes: int) -> int:
    """What the cgroup's charge is kept at: the cap less headroom for the final round.

    >>> target_bytes(240 << 20, 48 << 20) >> 20
    192
    >>> target_bytes(64 << 20, 100 << 20) >> 20
    32
    """
    return max(limit_bytes // 2, limit_bytes - headroom_bytes)


def low_mark(limit_bytes: int, headroom_bytes: int) -> int:
    """Where a drop takes the charge: the target less half the headroom, never below half.

    >>> low_mark(256 << 20, 24 << 20) >> 20
    220
    >>> low_mark(100 << 20, 90 << 20) >> 20
    50
    """
    target = target_bytes(limit_bytes, headroom_bytes)
    return max(limit_bytes // 2, target - headroom_bytes // 2)


def drop_pages(
    charge_bytes: int,
    target: int,
    low: int,
    guest_runs_here: bool = False,
    growth_bytes: int = 0,
    floor: int = 0,
) -> int:
    """Pages to drop now: none while the next interval's growth stays under the
    target; else down to the low mark, or lower by that growth (never below
    ``floor``); none once the guest runs here.

    Once the guest runs, its reads are evidence the keeper cannot see and the
    kernel's LRU can (the pages' accessed bits); the keeper only keeps the
    store written back, so the cap's reclaim finds clean pages and waits on no
    I/O.  Dropping by write history after the move too, split-50's guest ran
    at 629 pages/s (split-resumed-headroom.md); left to the LRU, at 726-823
    (split-kernel-lru.md).

    Dropping only the excess over the target left the charge at the target,
    and the next interval's stream (10 MiB at 100 MiB/s) took it to the cap:
    the lab's trace (tests/bench/split_trace.py) found the cap hit hundreds of
    times per split migration (memory.failcnt), i.e. reclaim made the room.

    ``growth_bytes`` is what the charge grew between two looks lately
    (``charge_growth``): more than the stream, as each fault QEMU takes on
    the store reads 4 MiB ahead.  Half the headroom below the target was not
    room enough for it: at split-75 the charge rose 20-30 MiB a look, from
    the low mark to the cap, and at split-35 a cap hit just before the
    source stopped put QEMU in ``reclaim_throttle`` (split_trace, hot-set
    guest).

    >>> drop_pages(230 << 20, 220 << 20, 200 << 20) * PAGE >> 20
    30
    >>> drop_pages(220 << 20, 220 << 20, 200 << 20)
    0
    >>> drop_pages(230 << 20, 220 << 20, 200 << 20, guest_runs_here=True)
    0

    Growing 30 MiB a look, a charge 10 MiB under the target is dropped now,
    down to 30 MiB under the target, but not below the floor:

    >>> drop_pages(210 << 20, 220 << 20, 200 << 20, growth_bytes=30 << 20) * PAGE >> 20
    20
    >>> drop_pages(210 << 20, 220 << 20, 200 << 20, growth_bytes=30 << 20, floor=195 << 20)
    3840
    """
    if guest_runs_here or charge_bytes + growth_bytes <= target:
        return 0
    down_to = max(floor, min(low, target - growth_bytes))
    return max(0, charge_bytes - down_to) // PAGE


def charge_growth(recent_bytes: Sequence[int]) -> int:
    """The growth to make room for: the largest of the last looks' (a burst
    repeats; an average would leave every other look at the cap).

    >>> charge_growth([3 << 20, 28 << 20, -40 << 20]) >> 20
    28
    >>> charge_growth([])
    0
    """
    return max(0, *recent_bytes) if recent_bytes else 0


NEVER_WRITTEN, WRITTEN_ONCE, REWRITTEN = 0, 1, 2
WRITE_CLASSES = ("never written", "written once", "rewritten")


def record_writes(
    writes: Sequence[int], dirty_before: Collection[int], dirty_now: Collection[int]
) -> list[int]:
    """Count each chunk's writes: one per look that finds it dirty after a clean look.

    The keeper starts writeback of every dirty chunk at each look, so a
    chunk dirty now and clean at the last look was written again since.  A
    chunk dirty at two looks in a row is one write still going on (the
    stream crossing an interval), not two: the precopy's later rounds, or
    the guest itself, come back to a page seconds apart.

    >>> record_writes([0, 1, 1, 0], dirty_before={1, 2}, dirty_now={0, 1, 3})
    [1, 1, 1, 1]
    >>> record_writes([1, 1, 1, 1], dirty_before={0, 1, 3}, dirty_now={2})
    [1, 1, 2, 1]
    """
    out = list(writes)
    for chunk in dirty_now:
        if chunk not in dirty_before:
            out[chunk] += 1
    return out


def write_class(writes: int) -> int:
    """NEVER_WRITTEN, WRITTEN_ONCE or REWRITTEN.

    >>> [WRITE_CLASSES[write_class(n)] for n in (0, 1, 5)]
    ['never written', 'written once', 'rewritten']
    """
    return min(writes, REWRITTEN)


def drop_order(
    resident: Sequence[int],
    ages: Sequence[int],
    writes: Sequence[int],
    excess_pages: int,
    hinted: Collection[int] = (),
) -> list[int]:
    """Resident chunks to drop until ``excess_pages`` would be freed, in drop order.

    Never-written chunks go first (zero pages QEMU only read to compare: a
    fault brings them back from a hole), then chunks written once (the
    guest's kernel, programs and data that the source sent once), the
    rewritten set last: pages sent again in a later round are the ones the
    guest rewrites, and the ones it touches first after resume.

    ``hinted`` chunks rank with the rewritten set from the start: the
    chunks the source saw the guest write just before the migration
    (hot_chunks.py).  The keeper makes room during the first round, before
    any chunk was sent twice: at split-35 the lab's hot-set guest had its
    66 hot chunks dropped as written once, and the final round read them
    back inside the downtime.  An 8-bit age
    forgets in eight intervals (0.8 s): ordered by age alone the keeper
    dropped the guest's kernel and working set while 228 MiB of zero pages
    stayed resident (tests/bench/split_trace.py at budgets 50% and 35%).
    Within a class the coldest go first, then the fuller chunks (more freed
    per call), then high addresses (the guest kernel sits low).

    >>> drop_order([256, 256, 256, 256], [0, 0x80, 0, 0], [2, 0, 1, 1], 300)
    [1, 3]
    >>> drop_order([256, 256, 10, 0], [0x80, 0, 0, 0], [0, 0, 0, 0], 300)
    [1, 2, 0]
    >>> drop_order([256, 256], [0, 0], [0, 0], 0)
    []

    A hinted chunk written once goes after the other written-once chunks:

    >>> drop_order([256, 256, 256], [0, 0, 0], [1, 1, 1], 300)
    [2, 1]
    >>> drop_order([256, 256, 256], [0, 0, 0], [1, 1, 1], 300, hinted={2})
    [1, 0]
    """
    hinted = frozenset(hinted)

    def rank(i: int) -> tuple[int, int, int, int]:
        kind = REWRITTEN if i in hinted else write_class(writes[i])
        return (kind, ages[i], -resident[i], -i)

    order = sorted((i for i, pages in enumerate(resident) if pages), key=rank)
    chosen, freed = [], 0
    for chunk in order:
        if freed >= excess_pages:
            break
        chosen.append(chunk)
        freed += resident[chunk]
    return chosen


def chunks_to_write_back(
    resident: Sequence[int],
    writes: Sequence[int],
    hinted: Collection[int],
    look: int,
    kept_every: int,
) -> list[int]:
    """Resident chunks whose writeback the keeper starts at look number ``look``.

    The chunks a drop may take soon (never written, written once) every
    look, so that a drop finds them clean.  The chunks it keeps (the
    rewritten set and the source's hint, dropped last) only every
    ``kept_every`` looks: with 2 MiB folios one rewritten page makes its
    whole folio dirty, so the hot-set guest had all of its 64 MiB rewritten
    set written back at every look, 640 MB/s.  In the guest's gap after the
    resume the keeper's writes were 98-156 MiB (tests/bench/gap_trace.py,
    split-50 and split-35), the store's write requests took 17 ms each, and
    the guest's faults on dropped chunks, reads on the same store, 3-4 ms
    each behind them (31 ms for eight); kept once a second, three faults in
    a gap without other I/O took 5.6 ms in all.  ``kept_every`` is 1 where
    the destination's QEMU writes all dirty guest RAM inside the downtime
    (before 10.0.3: writeback.py), which a dirtier file would lengthen.

    >>> chunks_to_write_back([256, 256, 256, 0], [1, 2, 1, 2], {2}, 3, 10)
    [0]
    >>> chunks_to_write_back([256, 256, 256, 0], [1, 2, 1, 2], {2}, 10, 10)
    [0, 1, 2]
    >>> chunks_to_write_back([256, 256, 256, 0], [1, 2, 1, 2], {2}, 3, 1)
    [0, 1, 2]
    """
    every_kept = look % max(1, kept_every) == 0
    return [
        c
        for c, pages in enumerate(resident)
        if pages and (every_kept or (write_class(writes[c]) != REWRITTEN and c not in hinted))
    ]


def dropped_by_class(
    resident: Sequence[int], writes: Sequence[int], chunks: Iterable[int]
) -> list[int]:
    """Pages of ``chunks`` by write class: what a drop took (the keeper's stats).

    >>> dropped_by_class([256, 256, 10], [0, 3, 1], [0, 1, 2])
    [256, 10, 256]
    """
    out = [0] * len(WRITE_CLASSES)
    for chunk in chunks:
        out[write_class(writes[chunk])] += resident[chunk]
    return out


def ranges(chunks: Iterable[int]) -> list[tuple[int, int]]:
    """Adjacent chunks merged into (first chunk, count) runs, for fewer system calls.

    >>> ranges([5, 1, 2, 3, 9])
    [(1, 3), (5, 1), (9, 1)]
    """
    runs: list[tuple[int, int]] = []
    for chunk in sorted(chunks):
        if runs and runs[-1][0] + runs[-1][1] == chunk:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((chunk, 1))
    return runs


@dataclasses.dataclass
class ChunkScan:
    resident: list[int]  # resident pages per chunk (page cache, or mapped where no cachestat)
    dirty: set[int]  # chunks with a sampled page written since its writeback


# -- the QEMU process (I/O) -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class GuestRam:
    """QEMU's shared mapping of a VM's memory file, seen from outside QEMU."""

    pid: int
    address: int
    size: int
    path: str

    @classmethod
    def find(cls, pid: int, size: int) -> GuestRam:
        """The mapping of exactly ``size`` bytes backed by a file (guest RAM)."""
        with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if end - start == size and len(fields) >= 6 and fields[5].startswith("/"):
                    return cls(pid, start, size, fields[5])
        raise LookupError(f"QEMU pid {pid} has no {size >> 20} MiB file mapping")

    @property
    def chunks(self) -> int:
        return chunks_in(self.size)

    def scan(self, pagemap_fd: int, kpageflags_fd: int | None) -> ChunkScan:
        """Resident pages per chunk; dirty chunks by sampled page flags (None: not sampled,
        the caller counts them with cachestat)."""
        raw = os.pread(pagemap_fd, self.size // PAGE * 8, self.address // PAGE * 8)
        entries = array.array("Q", raw)
        # The present bit is the top bit of each entry's last byte: counted in C.
        present = raw[7::8].translate(_PRESENT_TABLE)
        resident, dirty = [], set()
        step = CHUNK_PAGES // SAMPLES_PER_CHUNK
        for chunk in range(self.chunks):
            resident.append(present.count(1, chunk * CHUNK_PAGES, (chunk + 1) * CHUNK_PAGES))
            if not resident[-1] or kpageflags_fd is None:
                continue
            for e in entries[chunk * CHUNK_PAGES : (chunk + 1) * CHUNK_PAGES : step]:
                pfn = e & PM_PFN_MASK
                if e & PM_PRESENT and pfn:
                    flags = int.from_bytes(os.pread(kpageflags_fd, 8, pfn * 8), "little")
                    if flags & KPF_DIRTY:
                        dirty.add(chunk)
                        break
        return ChunkScan(resident, dirty)

    def write_back(self, fd: int, chunks: Iterable[int], wait: bool) -> None:
        """Write chunk ranges of the file back; ``wait``: until they are clean."""
        flags = SYNC_FILE_RANGE_WRITE
        if wait:
            flags |= SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WAIT_AFTER
        for first, count in ranges(chunks):
            sync_file_range(fd, first * CHUNK_BYTES, count * CHUNK_BYTES, flags)

    def forget(self, fd: int, chunks: Iterable[int]) -> None:
        """Drop the chunks' clean pages QEMU does not map (readahead) from the page cache.

        MADV_PAGEOUT frees only what QEMU maps; the pages a fault's readahead
        brought in are charged to the VM too and stay until reclaim takes them.
        """
        for first, count in ranges(chunks):
            os.posix_fadvise(fd, first * CHUNK_BYTES, count * CHUNK_BYTES, os.POSIX_FADV_DONTNEED)

    def page_out(self, pidfd: int, chunks: Iterable[int]) -> int:
        """Drop chunks from QEMU's memory (they must be clean); bytes the kernel took."""
        runs = ranges(chunks)
        done = 0
        for at in range(0, len(runs), IOV_MAX):
            batch = runs[at : at + IOV_MAX]
            iov = (_IoVec * len(batch))(
                *(
                    _IoVec(self.address + first * CHUNK_BYTES, count * CHUNK_BYTES)
                    for first, count in batch
                )
            )
            n = _LIBC.syscall(SYS_PROCESS_MADVISE, pidfd, iov, len(batch), MADV_PAGEOUT, 0)
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_madvise(MADV_PAGEOUT): {os.strerror(err)}")
            done += n
        return done
