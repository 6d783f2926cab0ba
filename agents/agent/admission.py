"""Admission of the agent's expensive requests, apart from the cheap ones.

The listener's workers take connections in arrival order and only learn the
route once the request is read, so before this gate a burst of plans (each
holding a worker for the seconds of its dirty-rate sampling, seed 000's
model needs several intervals) filled every worker and the queue behind
them: a health check sent meanwhile waited for plans ahead of it to finish
(27 s with 100 concurrent plans in the lab).  Now the expensive routes run
at most ``slots`` at once with at most ``queue`` more waiting for a slot;
the rest are refused at once with 503 and a Retry-After, so they hold a
worker for milliseconds.  The listener keeps ``workers - slots - queue``
workers that an expensive request can never hold: cheap routes always find
one within the time it takes to read and refuse a request.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from flexmig import exceptions

# Weight of the newest duration in the running estimate of how long an
# expensive request takes (the Retry-After a refused one is told).
DURATION_WEIGHT = 0.3
MAX_RETRY_AFTER_S = 300


class Busy(exceptions.FlexMigError):
    msg_fmt = (
        "The agent is busy with %(running)d %(what)s requests (%(waiting)d waiting); "
        "retry after %(retry_after)d s"
    )

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.retry_after = int(kwargs["retry_after"])  # type: ignore[call-overload]


@dataclasses.dataclass(frozen=True)
class Bounds:
    slots: int = 4
    queue: int = 4


def decide(running: int, waiting: int, bounds: Bounds) -> str:
    """What happens to an expensive request arriving now: run, wait or refuse.

    >>> decide(0, 0, Bounds(slots=2, queue=1))
    'run'
    >>> decide(2, 0, Bounds(slots=2, queue=1))
    'wait'
    >>> decide(2, 1, Bounds(slots=2, queue=1))
    'refuse'
    >>> decide(1, 1, Bounds(slots=2, queue=2))  # a slot is free but others wait first
    'wait'
    """
    if running < bounds.slots and waiting == 0:
        return "run"
    if waiting < bounds.queue:
        return "wait"
    return "refuse"


def retry_after_s(typical_s: float, running: int, waiting: int, bounds: Bounds) -> int:
    """Whole seconds until a refused request could expect a slot: the requests
    in hand, ``slots`` at a time, each taking ``typical_s``.

    >>> retry_after_s(6.5, running=4, waiting=4, bounds=Bounds(slots=4, queue=4))
    13
    >>> retry_after_s(0.0, 1, 0, Bounds(slots=1, queue=0))  # nothing measured yet
    1
    >>> retry_after_s(100.0, 8, 8, Bounds(slots=1, queue=8))
    300
    """
    rounds = math.ceil((running + waiting) / max(1, bounds.slots))
    return min(MAX_RETRY_AFTER_S, max(1, math.ceil(rounds * typical_s)))


def reserve(workers: int, bounds: Bounds) -> int:
    """Listener workers that no expensive request can hold.

    >>> reserve(16, Bounds(slots=4, queue=4))
    8
    """
    return workers - bounds.slots - bounds.queue


class Gate:
    """Runs one kind of expensive request within ``bounds`` (see the module)."""

    def __init__(self, what: str, bounds: Bounds, wait_limit_s: float) -> None:
        self.what = what
        self.bounds = bounds
        self.wait_limit_s = wait_limit_s
        self.running = 0
        self.waiting = 0
        self.typical_s = 0.0
        self._cond = threading.Condition()

    def _refusal(self) -> Busy:
        return Busy(
            what=self.what,
            running=self.running,
            waiting=self.waiting,
            retry_after=retry_after_s(self.typical_s, self.running, self.waiting, self.bounds),
        )

    def _acquire(self) -> None:
        with self._cond:
            verdict = decide(self.running, self.waiting, self.bounds)
            if verdict == "refuse":
                raise self._refusal()
            if verdict == "wait":
                self.waiting += 1
                try:
                    free = self._cond.wait_for(
                        lambda: self.running < self.bounds.slots, self.wait_limit_s
                    )
                finally:
                    self.waiting -= 1
                if not free:
                    raise self._refusal()
            self.running += 1

    def _release(self, seconds: float) -> None:
        with self._cond:
            self.running -= 1
            self.typical_s = (
                seconds
                if not self.typical_s
                else (1 - DURATION_WEIGHT) * self.typical_s + DURATION_WEIGHT * seconds
            )
            self._cond.notify()

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold one slot for the body, or raise Busy (nothing was started)."""
        self._acquire()
        started = time.monotonic()
        try:
            yield
        finally:
            self._release(time.monotonic() - started)
