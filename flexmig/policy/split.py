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
- **the switchover msync**: QEMU syncs file-backed guest RAM before it reports
  the incoming migration done, inside the downtime: the final round and
  whatever arrived in the keeper's last interval is written then.

Pure functions: the agent and the planner feed them facts.
"""

from __future__ import annotations

import dataclasses

from flexmig.policy import precopy

MIB = 2**20
KEEPER_INTERVAL_S = 0.1  # the destination keeper's period (agents/agent/split_store.py)
MIN_HEADROOM_BYTES = 16 * MIB
# Reclaim writes page-sized pieces: seed 003 measured 4.3x slower than 1 MiB chunks.
PAGE_WRITE_SLOWDOWN = 4.3


@dataclasses.dataclass(frozen=True)
class StoreFacts:
    budget_bytes: int  # the VM's resident cap on the destination (cgroup limit)
    write_bps: float  # the store's measured write bandwidth in 1 MiB chunks
    qemu_own_bytes: int  # QEMU's own memory charged under the same cap


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


def predict(
    pre: precopy.Prediction, xfer: precopy.Transfer, store: StoreFacts
) -> precopy.Prediction:
    """The precopy prediction with split's own costs added.

    >>> x = precopy.Transfer(ram_pages=131072, resident_pages=65536, page_size=4096,
    ...                      bandwidth_bps=100 * MIB, switchover_s=0.05)
    >>> p = precopy.Prediction("precopy", (), True, "", 2.6, 260 * MIB, 0.06, 0)
    >>> s = predict(p, x, StoreFacts(240 * MIB, 50 * MIB, 80 * MIB))
    >>> round(s.total_time_s, 2), round(s.downtime_s * 1000)
    (4.02, 280)
    >>> s = predict(p, x, StoreFacts(240 * MIB, 800 * MIB, 80 * MIB))
    >>> round(s.total_time_s, 2), round(s.downtime_s * 1000)
    (2.61, 74)
    """
    final_bytes = max(0.0, (pre.downtime_s - xfer.switchover_s) * xfer.bandwidth_bps)
    headroom = headroom_bytes(final_bytes, xfer.bandwidth_bps, store.budget_bytes)
    room = max(0, store.budget_bytes - headroom - store.qemu_own_bytes)
    spill = max(0.0, pre.total_bytes - final_bytes - room)
    # The stream waits on the store only for the part of its rate the store lacks.
    stream_wait = max(0.0, spill / store.write_bps - spill / xfer.bandwidth_bps)
    overflow = max(0.0, final_bytes - headroom)
    reclaim = overflow * PAGE_WRITE_SLOWDOWN / store.write_bps
    msync = (min(final_bytes, headroom) + KEEPER_INTERVAL_S * xfer.bandwidth_bps) / store.write_bps
    downtime = pre.downtime_s + reclaim + msync
    return dataclasses.replace(
        pre,
        mode="split",
        stop_reason=f"{pre.stop_reason}; {spill / MIB:.0f} MiB spill to the store",
        total_time_s=pre.total_time_s + stream_wait + reclaim + msync,
        downtime_s=downtime,
    )
