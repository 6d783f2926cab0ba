"""What split migration costs beyond the precopy that carries its pages.

Split moves pages by precopy; the destination then pays three things a
destination with enough RAM does not (seed 003, VMemDirect):

- **spill**: once the resident budget is full, every further page the stream
  brings must reach the store before its memory can be reused.  The agent's
  residency keeper writes 1 MiB-aligned chunks, so the store absorbs them at
  its sequential write bandwidth; the stream slows to that rate only where
  the store is slower than the stream.
- **the final round under the cap**: the keeper keeps *headroom* free below
  the cap, sized from the predicted final round, so the last pages land
  without reclaim.  If the final round outgrows the headroom, the rest waits
  on reclaim's page-sized writeback (seed 003: 4.3x slower than chunks).
- **the switchover msync**: a QEMU older than 10.0.3 syncs file-backed guest
  RAM before it reports the incoming migration done, inside the downtime: the
  final round and whatever arrived in the keeper's last interval is written
  then (``dirty_at_completion``).  Whether the destination's QEMU does is a
  fact of the host, not of split: ``planner.destination_writeback`` counts
  it as the downtime's "destination msync" part, as for any file-backed VM.
  Counted here too, every split plan carried 20-30 ms of it in its
  stop-and-copy, twice over on an old QEMU and never seen on a new one
  (QEMU downtimes 18-38 ms, ``docs/benchmarks/split-sitting-e.md``).
- **faults on the store**: the part of the rewritten set that does not fit
  the budget lives in the store.  A final-round page or a guest write that
  lands there faults, and each fault reads a whole 4 MiB window (QEMU maps
  guest RAM MADV_HUGEPAGE, and the kernel then reads two huge pages' worth
  whatever read_ahead_kb says): the final round's inside QEMU's downtime,
  the resumed guest's before its first heartbeat.  The destination agent
  measures one such fault (``store_fault_s``).

Pure functions: the agent and the planner feed them facts.
"""

from __future__ import annotations

import dataclasses
import math

from flexmig.policy import precopy
from flexmig.policy.dirty_model import IDLE, DirtyModel

MIB = 2**20
KEEPER_INTERVAL_S = 0.1  # the destination keeper's period (agents/agent/split_store.py)
MIN_HEADROOM_BYTES = 16 * MIB
# Reclaim writes page-sized pieces: seed 003 measured 4.3x slower than 1 MiB chunks.
PAGE_WRITE_SLOWDOWN = 4.3
# What one fault on a dropped page reads (agents/agent/facts.py measures it).
FAULT_WINDOW_BYTES = 4 * MIB
# How long the resumed guest's writer runs before its heartbeat gets the CPU:
# Linux's default scheduling latency (6 ms) with both runnable at resume.
WRITER_SLICE_S = 0.006


@dataclasses.dataclass(frozen=True)
class StoreFacts:
    budget_bytes: int  # the VM's resident cap on the destination (cgroup limit)
    write_bps: float  # the store's measured write bandwidth in 1 MiB chunks
    qemu_own_bytes: int  # QEMU's own memory charged under the same cap
    # One fault on a page not in memory, a 4 MiB read (0: not measured; a
    # read at the write bandwidth is assumed).
    fault_s: float = 0.0

    def fault_or_assumed_s(self) -> float:
        """The measured fault, or one 4 MiB read at the write bandwidth.

        >>> StoreFacts(0, 400 * MIB, 0).fault_or_assumed_s()
        0.01
        """
        return self.fault_s or FAULT_WINDOW_BYTES / self.write_bps


@dataclasses.dataclass(frozen=True)
class StoreFaults:
    """Faults on the part of the rewritten set that the budget cannot hold."""

    off_budget_bytes: float  # of the rewritten set, beyond the resident room
    final_round: int  # faults while the final round lands (QEMU's downtime)
    first_heartbeat: int  # faults of the resumed guest before its first heartbeat
    fault_s: float
    # Of the VM's resident memory, the share beyond the room, in the store at
    # resume: the chance that the resumed guest's touch of a page faults.
    stored_share: float = 0.0

    @property
    def final_round_s(self) -> float:
        return self.final_round * self.fault_s

    @property
    def first_heartbeat_s(self) -> float:
        return self.first_heartbeat * self.fault_s


NO_FAULTS = StoreFaults(0.0, 0, 0, 0.0)


def headroom_bytes(final_round_bytes: float, bandwidth_bps: float, budget_bytes: int) -> int:
    """Free room the keeper keeps under the cap: the final round plus two intervals.

    Two keeper intervals of stream cover what arrives between the keeper's
    look and its drop; never less than 16 MiB, never more than half the budget.

    >>> headroom_bytes(4 * MIB, 100 * MIB, 240 * MIB) // MIB
    24
    >>> headroom_bytes(400 * MIB, 100 * MIB, 240 * MIB) // MIB
    120
    """
    want = final_round_bytes + 2 * KEEPER_INTERVAL_S * bandwidth_bps
    return int(min(budget_bytes // 2, max(MIN_HEADROOM_BYTES, want)))


def store_faults(
    rewritten_bytes: float,
    room_bytes: float,
    final_bytes: float,
    writer_pages_per_s: float,
    fault_s: float,
    page_size: int = 4096,
) -> StoreFaults:
    """Faults on the rewritten set's part beyond the room, final round then resume.

    The keeper drops the rewritten set last, so what of it exceeds the room
    is what lives in the store.  The final round's pages spread over the
    rewritten set; those landing off budget fault, one fault per 4 MiB
    window at most.  The resumed guest's writer then runs one scheduler
    slice before the heartbeat, its writes spread the same way (random, as
    the lab's dirtier writes) over the windows the final round left.

    A 512 MiB guest rewriting 128 MiB with 93 MiB of room (a 179 MiB budget,
    35%), a 5 MiB final round, 20 ms per fault: 35 MiB off budget is nine
    windows, and the final round's 350 pages off budget reach all nine,
    180 ms inside QEMU's downtime.

    >>> f = store_faults(128 * MIB, 93 * MIB, 5 * MIB, 45_000, 0.02)
    >>> f.off_budget_bytes // MIB, f.final_round, f.first_heartbeat, round(f.final_round_s, 2)
    (35, 9, 0, 0.18)

    A guest that nearly stopped writing (a 10 KiB final round) faults once
    then; resumed, its writer's 101 touches off budget in its slice reach
    the other 23 of 24 windows: 460 ms before its first heartbeat.

    >>> f = store_faults(256 * MIB, 160 * MIB, 0.01 * MIB, 45_000, 0.02)
    >>> f.final_round, f.first_heartbeat, round(f.first_heartbeat_s, 2)
    (1, 23, 0.46)
    >>> store_faults(64 * MIB, 93 * MIB, 5 * MIB, 45_000, 0.02) == NO_FAULTS
    True
    """
    off = max(0.0, rewritten_bytes - room_bytes)
    if off <= 0 or rewritten_bytes <= 0:
        return NO_FAULTS
    windows = math.ceil(off / FAULT_WINDOW_BYTES)
    share = off / rewritten_bytes
    final = min(windows, math.ceil(final_bytes / page_size * share))
    touches = writer_pages_per_s * WRITER_SLICE_S * share
    first = min(windows - final, math.ceil(touches))
    return StoreFaults(off, final, first, fault_s)


def faults(
    pre: precopy.Prediction, xfer: precopy.Transfer, store: StoreFacts, dirty: DirtyModel = IDLE
) -> StoreFaults:
    """``store_faults`` for a plan: the rewritten set is the dirty model's M.

    M is capped at the VM's pages: a model fitted elsewhere (a drain's, an
    API caller's) may not be, and a guest cannot rewrite more than it has.
    A 512 MiB guest in a 179 MiB budget: 25 MiB headroom, 64 MiB of QEMU's
    own, 90 MiB of room.

    >>> x = precopy.Transfer(ram_pages=131072, resident_pages=65536, page_size=4096,
    ...                      bandwidth_bps=100 * MIB, switchover_s=0.05)
    >>> p = precopy.Prediction("precopy", (), True, "", 2.6, 260 * MIB, 0.1, 0)
    >>> d = DirtyModel(m_pages=32768, tau_s=0.5)
    >>> f = faults(p, x, StoreFacts(179 * MIB, 400 * MIB, 64 * MIB, fault_s=0.02), d)
    >>> f.off_budget_bytes // MIB, f.final_round, f.first_heartbeat, f.stored_share
    (38, 10, 0, 0.6484)
    >>> huge = DirtyModel(m_pages=10**9, tau_s=0.5)
    >>> faults(p, x, StoreFacts(179 * MIB, 400 * MIB, 64 * MIB), huge).off_budget_bytes // MIB
    422
    """
    final = final_round_bytes(pre, xfer)
    headroom = headroom_bytes(final, xfer.bandwidth_bps, store.budget_bytes)
    capped = dataclasses.replace(dirty, m_pages=min(dirty.m_pages, xfer.ram_pages))
    room = max(0, store.budget_bytes - headroom - store.qemu_own_bytes)
    found = store_faults(
        capped.m_pages * xfer.page_size,
        room,
        final,
        capped.initial_rate(),
        store.fault_or_assumed_s(),
        xfer.page_size,
    )
    return dataclasses.replace(
        found, stored_share=stored_share(xfer.resident_pages * xfer.page_size, room)
    )


def stored_share(resident_bytes: float, room_bytes: float) -> float:
    """The share of a VM's resident memory that does not fit its room.

    >>> stored_share(400 * MIB, 100 * MIB), stored_share(400 * MIB, 500 * MIB), stored_share(0, 1)
    (0.75, 0.0, 0.0)
    """
    if resident_bytes <= 0:
        return 0.0
    return round(max(0.0, resident_bytes - room_bytes) / resident_bytes, 4)


def dirty_at_completion(final_round: float, bandwidth_bps: float) -> float:
    """What of a split VM's memory file is still dirty when the migration
    completes: the keeper starts writeback of every dirty chunk each interval,
    so the final round and what arrived in the last two intervals.  Counted as
    the whole resident budget (the flusher-less case's bound), a split-75
    forecast put 527 ms on a switchover the guest saw take 229
    (docs/benchmarks/split-kernel-lru.md).

    >>> dirty_at_completion(2 * MIB, 100 * MIB) / MIB
    22.0
    """
    return final_round + 2 * KEEPER_INTERVAL_S * bandwidth_bps


def final_round_bytes(pre: precopy.Prediction, xfer: precopy.Transfer) -> float:
    """What the stop-and-copy carries: the downtime beyond the switchover, at the stream's rate.

    >>> x = precopy.Transfer(1, 1, 4096, bandwidth_bps=100 * MIB, switchover_s=0.05)
    >>> final_round_bytes(precopy.Prediction("precopy", (), True, "", 1, 1, 0.1, 0), x) / MIB
    5.0
    """
    return max(0.0, (pre.downtime_s - xfer.switchover_s) * xfer.bandwidth_bps)


def predict(
    pre: precopy.Prediction,
    xfer: precopy.Transfer,
    store: StoreFacts,
    store_faults: StoreFaults = NO_FAULTS,
) -> precopy.Prediction:
    """The precopy prediction with split's own costs added.

    ``store_faults``: the final round's faults add to both the downtime and
    the total; the resumed guest's come after both (``downtime.predict``).
    A store slower than the stream holds the stream back by what spills; a
    final round inside the headroom lands without reclaim:

    >>> x = precopy.Transfer(ram_pages=131072, resident_pages=65536, page_size=4096,
    ...                      bandwidth_bps=100 * MIB, switchover_s=0.05)
    >>> p = precopy.Prediction("precopy", (), True, "", 2.6, 260 * MIB, 0.06, 0)
    >>> s = predict(p, x, StoreFacts(240 * MIB, 50 * MIB, 80 * MIB))
    >>> round(s.total_time_s, 2), round(s.downtime_s * 1000)
    (3.8, 60)
    >>> s = predict(p, x, StoreFacts(240 * MIB, 800 * MIB, 80 * MIB))
    >>> round(s.total_time_s, 2), round(s.downtime_s * 1000)
    (2.6, 60)
    >>> f = StoreFaults(35 * MIB, 9, 0, 0.02)
    >>> s = predict(p, x, StoreFacts(240 * MIB, 800 * MIB, 80 * MIB), f)
    >>> round(s.total_time_s, 2), round(s.downtime_s * 1000)
    (2.78, 240)

    A final round beyond the headroom waits on reclaim's page-sized writes (145
    MiB in 120 of headroom: 25 MiB at 4.3x their time in chunks):

    >>> big = precopy.Prediction("precopy", (), True, "", 2.6, 260 * MIB, 1.5, 0)
    >>> round(predict(big, x, StoreFacts(240 * MIB, 50 * MIB, 80 * MIB)).downtime_s, 2)
    3.65
    """
    final_bytes = final_round_bytes(pre, xfer)
    headroom = headroom_bytes(final_bytes, xfer.bandwidth_bps, store.budget_bytes)
    room = max(0, store.budget_bytes - headroom - store.qemu_own_bytes)
    spill = max(0.0, pre.total_bytes - final_bytes - room)
    # The stream waits on the store only for the part of its rate the store lacks.
    stream_wait = max(0.0, spill / store.write_bps - spill / xfer.bandwidth_bps)
    overflow = max(0.0, final_bytes - headroom)
    reclaim = overflow * PAGE_WRITE_SLOWDOWN / store.write_bps
    faults_s = store_faults.final_round_s
    return dataclasses.replace(
        pre,
        mode="split",
        stop_reason=f"{pre.stop_reason}; {spill / MIB:.0f} MiB spill to the store",
        total_time_s=pre.total_time_s + stream_wait + reclaim + faults_s,
        downtime_s=pre.downtime_s + reclaim + faults_s,
    )
