"""Encoded flow dumps shared between the endpoint's connections.

Monitoring systems poll the whole table, many at once: 20 clients dumping 10k
flows had the endpoint encode 10k entries for each of them, one request after
another, in the process that also judges new flows (one interpreter lock), and
the operator's own ``ovs-ofctl`` queued behind them (docs/benchmarks/offload-load.md).
Counters only move when the service polls (every ``[offload] poll_interval``),
so an encoded answer is reused for every request selecting the same flows for
``[openflow_stats] dump_reuse_s``: one encoding per interval, whatever the number
of clients.  What each client gets is still framed for it (its xid, its version).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

# Distinct requests kept at once (plain dumps, a few selections); beyond that the
# oldest answers go, so odd selections cannot grow memory.
MAX_KEPT = 16


class SharedDumps:
    """Answers (lists of encoded entries) by request, each reused for ``max_age`` s."""

    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self._clock = clock
        self._kept: dict[Hashable, tuple[float, list[bytes]]] = {}
        self.built = 0  # answers encoded (the rest were reused)

    def answer(self, key: Hashable, build: Callable[[], list[bytes]]) -> list[bytes]:
        """The kept answer to ``key`` while it is fresh (see :meth:`fresh`), else
        ``build()``'s, kept from when it is done."""
        now = self._clock()
        kept = self._kept.get(key)
        if kept is not None and now < kept[0]:
            return kept[1]
        parts = build()
        self.built += 1
        done = self._clock()
        if self.max_age > 0:
            self._kept = {k: v for k, v in self._kept.items() if done < v[0]}
            while len(self._kept) >= MAX_KEPT:
                del self._kept[min(self._kept, key=lambda k: self._kept[k][0])]
            self._kept[key] = (done + self.fresh(done - now), parts)
        return parts

    def fresh(self, build_s: float) -> float:
        """How long an answer that took ``build_s`` to encode is reused: ``max_age``,
        or as long as it took when that is longer, so a loaded host (where the
        interpreter is shared and encoding slows down) spends at most about half
        of the endpoint's time encoding instead of all of it.

        >>> SharedDumps(0.25).fresh(0.1), SharedDumps(0.25).fresh(0.8)
        (0.25, 0.8)
        """
        return max(self.max_age, build_s)
