"""Did the VM land? The check between "libvirt says completed" and "record it moved".

A source domain that is gone or no longer running is what a finished
migration looks like from the source, and also what a VM destroyed on the
source mid-migration looks like: Nova's ``get_job_info`` and ``find_job_type``
read both as COMPLETED.  Recording the second as a move puts the VM on a
destination that never got it.  So before the move is recorded, the
destination's libvirt is asked whether it runs the VM.

Each answer is one of four; the verdict weighs them:

- the destination runs it (active: running, or paused as a paused VM arrives
  paused): it LANDED, at the first such answer;
- it has no such domain, or has it defined but not running: it is LOST, once
  the asks are used up without it being found running (asked again first: a
  wrong "lost" puts a running VM in ERROR);
- no answer (unreachable, an error, a call past its deadline): UNKNOWN when
  no ask was answered, and the caller keeps the source's reading (a check
  that cannot be made must not fail migrations that worked).

The functions here are pure; the I/O is the caller's ``ask``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

# Three asks 2 s apart: a destination whose libvirt hiccups once still
# answers, and a lost VM is reported within seconds, not minutes.
ASKS = 3
INTERVAL_S = 2.0
# One ask's deadline (connect, look up, read the state): libvirt's client
# waits for a reply without limit.
ASK_TIMEOUT_S = 30.0


class Answer(enum.Enum):
    RUNS = "runs"
    NOT_FOUND = "not found"
    NOT_RUNNING = "not running"
    UNANSWERED = "unanswered"


class Verdict(enum.Enum):
    LANDED = "landed"
    LOST = "lost"
    UNKNOWN = "unknown"


def verdict(answers: Sequence[Answer]) -> Verdict:
    """What the answers so far say.

    >>> verdict([Answer.UNANSWERED, Answer.RUNS])
    <Verdict.LANDED: 'landed'>
    >>> verdict([Answer.NOT_FOUND, Answer.UNANSWERED, Answer.UNANSWERED])
    <Verdict.LOST: 'lost'>
    >>> verdict([Answer.UNANSWERED] * 3)
    <Verdict.UNKNOWN: 'unknown'>
    """
    if Answer.RUNS in answers:
        return Verdict.LANDED
    if any(a in (Answer.NOT_FOUND, Answer.NOT_RUNNING) for a in answers):
        return Verdict.LOST
    return Verdict.UNKNOWN


def ask_again(answers: Sequence[Answer], asks: int = ASKS) -> bool:
    """Whether to ask once more: until it is found running or the asks run out.

    >>> ask_again([Answer.NOT_FOUND])
    True
    >>> ask_again([Answer.NOT_FOUND, Answer.RUNS])
    False
    >>> ask_again([Answer.UNANSWERED] * ASKS)
    False
    """
    return Answer.RUNS not in answers and len(answers) < asks


def confirm(
    ask: Callable[[], Answer],
    sleep: Callable[[float], None],
    asks: int = ASKS,
    interval_s: float = INTERVAL_S,
) -> tuple[Verdict, list[Answer]]:
    """Ask until ``ask_again`` says stop; the verdict and every answer (for the log)."""
    answers: list[Answer] = []
    while True:
        answers.append(ask())
        if not ask_again(answers, asks):
            return verdict(answers), answers
        sleep(interval_s)


def describe(answers: Sequence[Answer]) -> str:
    """The answers as a log reads them.

    >>> describe([Answer.UNANSWERED, Answer.NOT_FOUND])
    'unanswered, not found'
    """
    return ", ".join(a.value for a in answers)
