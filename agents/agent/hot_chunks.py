"""The guest's rewritten set, read on the source just before a split migration.

The destination's keeper (residency.py) ranks what it may drop by what the
migration stream shows it: a chunk the source sends again in a later round
is one the guest rewrites.  That evidence comes late: the keeper must make
room while the first round still fills the budget, before any chunk was sent
twice.  The lab's hot-set guest (64 MiB rewritten at 2,000 pages/s) had its
hot chunks, sent early in the first round and aged the longest, dropped as
written once, and the final round read them back from the store inside the
downtime (split-35, two channels: 96-158 MiB read back between the source's
stop and the resume, QEMU's downtime 136-216 ms; docs/benchmarks/README.md).

The source has the evidence the destination lacks: a split VM's memory is a
file (split needs it), and the guest's writes mark that file's pages dirty
in the source's page cache.  So, for a chunk map of what the guest writes
now: write the file back (waiting, so every page dirty before is clean),
wait ``interval_s``, and read per 1 MiB chunk how many pages are dirty again
(``cachestat``).  The writeback is the I/O the kernel's flusher does for a
file-backed VM anyway, within its dirty-expiry time; the guest's next write
to each page cleaned takes a write fault.

Memory on tmpfs or hugetlbfs has no writeback (its pages are always dirty),
and kernels before 6.5 have no ``cachestat``: no map then, and the keeper
goes by the stream alone.  The map's granule is the page cache's folio: on a
filesystem with large folios a write dirties its whole 2 MiB folio, so a hot
page marks its neighbouring chunk too (both come back together on a fault
anyway, residency.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from agents.agent import cachestat, residency
from flexmig import exceptions

LOG = logging.getLogger("flexmig.agent.hot_chunks")
MAX_INTERVAL_S = 10.0
# How long the writeback before the sample may hold the migration's start (a
# VM with much memory never written back gets no map rather than a late start;
# under Nova's default 10 s [flexmig] agent_timeout with the interval).
WRITEBACK_TIMEOUT_S = 5.0
MAX_RANGES = 1 << 16
# sync_file_range: every page dirty now written, and waited for.
SYNC_ALL = (
    residency.SYNC_FILE_RANGE_WAIT_BEFORE
    | residency.SYNC_FILE_RANGE_WRITE
    | residency.SYNC_FILE_RANGE_WAIT_AFTER
)


def check_ranges(ranges: object, ram_bytes: int) -> list[tuple[int, int]]:
    """A hint's ``[[first chunk, count], ...]``, checked against the VM's size.

    >>> check_ranges([[0, 2], [10, 1]], 16 << 20)
    [(0, 2), (10, 1)]
    >>> check_ranges([[15, 2]], 16 << 20)
    Traceback (most recent call last):
    ...
    flexmig.exceptions.InvalidInput: Invalid hot chunks: [15, 2] is not a run of chunks \
inside the VM's 16 (first >= 0, count >= 1)
    """
    chunks = residency.chunks_in(ram_bytes)
    if not isinstance(ranges, list) or len(ranges) > MAX_RANGES:
        raise exceptions.InvalidInput(
            what="hot chunks", reason=f"expected a list of at most {MAX_RANGES} [first, count]"
        )
    out = []
    for run in ranges:
        ok = isinstance(run, list) and len(run) == 2
        ok = ok and all(isinstance(n, int) and not isinstance(n, bool) for n in run)
        if not ok or run[0] < 0 or run[1] < 1 or run[0] + run[1] > chunks:
            raise exceptions.InvalidInput(
                what="hot chunks",
                reason=f"{run!r} is not a run of chunks inside the VM's {chunks} "
                "(first >= 0, count >= 1)",
            )
        out.append((run[0], run[1]))
    return out


def chunks_of(ranges: Sequence[tuple[int, int]]) -> frozenset[int]:
    """The chunks of runs.

    >>> sorted(chunks_of([(0, 2), (5, 1)]))
    [0, 1, 5]
    """
    return frozenset(c for first, count in ranges for c in range(first, first + count))


def written_chunks(
    path: str, ram_bytes: int, interval_s: float, timeout_s: float = WRITEBACK_TIMEOUT_S
) -> list[tuple[int, int]] | None:
    """Runs of 1 MiB chunks of ``path`` the guest wrote within ``interval_s``
    (None: this file or kernel cannot say)."""
    if not 0 < interval_s <= MAX_INTERVAL_S:
        raise exceptions.InvalidInput(
            what="hot sample interval", reason=f"{interval_s} s not in (0, {MAX_INTERVAL_S}]"
        )
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if not cachestat.available(fd):
            return None
        _write_back(fd, timeout_s)
        time.sleep(interval_s)
        chunks = residency.chunks_in(ram_bytes)
        _cached, dirty = cachestat.chunk_pages(fd, chunks, residency.CHUNK_BYTES)
    finally:
        os.close(fd)
    return residency.ranges(c for c, pages in enumerate(dirty) if pages)


def _write_back(fd: int, timeout_s: float) -> None:
    """Write the whole file back and wait for it, for at most ``timeout_s``.

    In a thread of its own, on its own descriptor: sync_file_range cannot be
    interrupted, and a store slower than the timeout must not hold the
    migration (the thread finishes on its own and closes what it holds).
    """
    own = os.dup(fd)
    errors: list[OSError] = []

    def sync() -> None:
        try:
            residency.sync_file_range(own, 0, 0, SYNC_ALL)
        except OSError as exc:
            errors.append(exc)
        finally:
            os.close(own)

    worker = threading.Thread(target=sync, name="hot-chunks-writeback", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise exceptions.Timeout(seconds=timeout_s, what="the VM's memory file to be written back")
    if errors:
        raise errors[0]


HotAnswer = tuple[list[list[int]] | None, str]  # runs, or None and why not
# What the answer may wait beyond the writeback and the interval: privsep's
# round trip, the cachestat calls and the hint's post.
ANSWER_SLACK_S = 5.0
T = TypeVar("T")


class SampleAhead(Generic[T]):
    """A hot-chunk sample taken in a thread of its own while the migration is
    planned, so that its interval (1 s by default, plus the writeback) hides
    behind the plan's dirty-rate samples instead of delaying the job's start.

    Its answer is still awaited before the job starts: the keeper must have
    the hint before its first drop (in the first round), which is what it is
    for.  ``failed`` makes the answer of a sample that raised or is late.
    """

    def __init__(self, sample: Callable[[], T], failed: Callable[[str], T], name: str) -> None:
        self._failed = failed
        self._answer = failed("not sampled")
        self._done = threading.Event()
        threading.Thread(target=self._take, args=(sample,), name=name, daemon=True).start()

    def _take(self, sample: Callable[[], T]) -> None:
        try:
            self._answer = sample()
        except Exception as exc:  # a bug here costs the hint, never the migration
            LOG.exception("the hot-chunk sample failed")
            self._answer = self._failed(f"the sample failed: {exc!r}")
        finally:
            self._done.set()

    def answer(self, timeout_s: float) -> T:
        """The sample's answer, waiting at most ``timeout_s`` for it."""
        if not self._done.wait(timeout_s):
            return self._failed(f"the sample did not end within {timeout_s:g} s")
        return self._answer


def no_runs(why: str) -> HotAnswer:
    return None, why
