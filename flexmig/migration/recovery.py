"""Postcopy recovery decisions: what the job does next once postcopy broke.

Once postcopy has started the VM's memory is split between the hosts, so a
broken stream is never aborted: QEMU pauses postcopy on both sides and the job
resumes it (libvirt's ``VIR_MIGRATE_POSTCOPY_RESUME``), which opens a *new*
stream between the same two QEMUs.  Over QEMU's own TCP the same URI serves
again.  Over the mover transport it cannot: the mover pair that carried the
stream exits with it (a killed mover, a fabric cut longer than the movers'
timeout), so every resume needs a fresh pair, and the old pair must be gone
first (the destination QEMU only accepts a recovery once its old stream is
closed).  The fault campaign's postcopy/mover/cut-30s cell lost its VM to a
job that kept resuming over the dead pair's socket.

The functions here are pure; ``libvirt_job.MigrationJob._recover`` does the I/O.
"""

from __future__ import annotations

import dataclasses

# What the job does next.
SOURCE_RUNS = "source-runs"  # libvirt rolled back: the VM runs whole on the source
LANDED = "landed"  # the stream survived: the VM runs on the destination
RESUME = "resume"  # try POSTCOPY_RESUME (after delay_s, on a fresh transport if asked)
GIVE_UP = "give-up"  # out of time: the VM stays paused, recoverable
WAIT = "wait"  # QEMU still carries a stream: leave it (and its transport) alone
DEST_GONE = "dest-gone"  # the destination QEMU ended: nothing left to resume into

# The source QEMU's migration states (query-migrate) in which a stream is still
# carrying the VM: a resume libvirt reported failed may be going on all the
# same (libvirt 9.0 does not know QEMU >= 9.1's postcopy-recover-setup and
# fails its side of a recovery that QEMU completes; seen in the lab).  Tearing
# down its mover pair for another attempt would break it again.
QEMU_MOVING = frozenset(
    {"postcopy-active", "postcopy-recover-setup", "postcopy-recover", "device", "completed"}
)
WAIT_POLL_S = 1.0
# libvirt's refusal while another thread (a stuck resume call) owns the job.
STUCK_JOB = "is being actively monitored by another thread"
# The job's own word for a resume call it stopped waiting for: one that
# holds the VM's migration job as well (a CI run's give-up, 2026-11-29).
ABANDONED_CALL = "libvirt's resume call did not end within"

# Between resume attempts: long enough for a daemon or link to come back, short
# enough that a 2 s cut costs about that; doubled per failure, capped.
FIRST_DELAY_S = 2.0
MAX_DELAY_S = 10.0


@dataclasses.dataclass(frozen=True)
class RecoveryView:
    """What the job knows before the next attempt (read at the edges)."""

    runs_on_source: bool
    landed_on_destination: bool
    attempts: int  # resume attempts made so far
    time_left_s: float  # until the recovery deadline
    fresh_transport: bool  # the transport must be reopened for every resume
    qemu_status: str = ""  # the source QEMU's migration state; "": unknown
    # The destination's libvirt answered that the VM is not active there: its
    # QEMU ended (killed, crashed).  An unreachable libvirt is not this.
    destination_gone: bool = False


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str
    delay_s: float = 0.0
    reopen: bool = False  # obtain a fresh transport (a new mover pair) first


def retry_delay_s(
    attempts: int, first_s: float = FIRST_DELAY_S, cap_s: float = MAX_DELAY_S
) -> float:
    """The wait before the next attempt, after ``attempts`` made so far.

    >>> [retry_delay_s(n) for n in range(6)]
    [2.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    """
    if attempts <= 1:
        return first_s
    return min(cap_s, first_s * 2 ** (attempts - 1))


def next_step(view: RecoveryView) -> Step:
    """The next thing to do for a postcopy that broke.

    Where the VM already runs decides first (whole on the source: libvirt
    rolled back; on the destination: QEMU's stream outlived libvirt's job).
    A source QEMU still migrating is waited for.  Otherwise resume, on a fresh
    transport where the old one died with its stream, unless the wait before
    it would cross the deadline.

    >>> view = RecoveryView(False, False, attempts=0, time_left_s=120.0, fresh_transport=True)
    >>> next_step(view)
    Step(kind='resume', delay_s=2.0, reopen=True)
    >>> next_step(dataclasses.replace(view, fresh_transport=False, attempts=3))
    Step(kind='resume', delay_s=8.0, reopen=False)
    >>> next_step(dataclasses.replace(view, time_left_s=1.0)).kind
    'give-up'
    >>> next_step(dataclasses.replace(view, landed_on_destination=True, time_left_s=0)).kind
    'landed'
    >>> next_step(dataclasses.replace(view, attempts=2, qemu_status="postcopy-recover"))
    Step(kind='wait', delay_s=1.0, reopen=False)
    >>> next_step(dataclasses.replace(view, attempts=2, qemu_status="postcopy-paused")).kind
    'resume'
    >>> next_step(dataclasses.replace(view, destination_gone=True)).kind
    'dest-gone'
    """
    if view.runs_on_source:
        return Step(SOURCE_RUNS)
    if view.landed_on_destination:
        return Step(LANDED)
    if view.destination_gone:
        return Step(DEST_GONE)
    if view.qemu_status in QEMU_MOVING:
        if view.time_left_s <= WAIT_POLL_S:
            return Step(GIVE_UP)
        return Step(WAIT, delay_s=WAIT_POLL_S)
    delay = retry_delay_s(view.attempts)
    if view.time_left_s <= delay:
        return Step(GIVE_UP)
    return Step(RESUME, delay_s=delay, reopen=view.fresh_transport)


def landed_event(attempts: int, last_error: str) -> str:
    """What the job says when it finds the VM running on the destination.

    After a resume attempt that libvirt reported failed, the VM landing is
    that resume completing: libvirt 9.0 fails its side of a recovery on QEMU
    >= 9.1's postcopy-recover-setup event it does not know, while QEMU carries
    the recovery through (seen in the lab).  Without an attempt, QEMU's own
    stream survived the cut.

    >>> landed_event(0, "")
    'the migration completed over its own stream; nothing to resume'
    >>> landed_event(1, "job 'migration in' failed in post-copy phase")
    ... # doctest: +NORMALIZE_WHITESPACE
    "postcopy resumed and completed (attempt 1; QEMU completed the resume that libvirt
    reported failed: job 'migration in' failed in post-copy phase)"
    """
    if attempts == 0:
        return "the migration completed over its own stream; nothing to resume"
    return (
        f"postcopy resumed and completed (attempt {attempts}; QEMU completed the resume "
        f"that libvirt reported failed: {last_error})"
    )


def destination_lost(vm: str) -> str:
    """The error when the destination QEMU ended after the switch to postcopy.

    From the switch on the guest runs there and its newest pages exist only in
    that QEMU: postcopy recovery repairs a broken stream between two living
    QEMUs, not a dead one (QEMU's own postcopy documentation), so no resume
    can help and none is tried.

    >>> print(destination_lost("vm1"))  # doctest: +NORMALIZE_WHITESPACE
    the destination QEMU of vm1 ended after the switch to postcopy, with the pages the
    guest had written there since: postcopy cannot be resumed into it, and the VM
    cannot run whole on either host (the risk every postcopy takes; a broken link is
    recoverable, a lost QEMU is not). The source holds the VM paused as it was at the
    switch, older than what the guest wrote to its disks since: do not resume it there;
    destroy it and start it again from its disks
    """
    return (
        f"the destination QEMU of {vm} ended after the switch to postcopy, with the pages "
        "the guest had written there since: postcopy cannot be resumed into it, and the VM "
        "cannot run whole on either host (the risk every postcopy takes; a broken link is "
        "recoverable, a lost QEMU is not). The source holds the VM paused as it was at the "
        "switch, older than what the guest wrote to its disks since: do not resume it "
        "there; destroy it and start it again from its disks"
    )


def resume_transport_id(migration_id: str, attempt: int) -> str:
    """The id of the transport opened for resume ``attempt`` (hex, like the
    migration's): its own mover files and socket, never the dead pair's.

    >>> resume_transport_id("3fa2c19b07de", 1)
    '3fa2c19b07de0001'
    """
    if attempt < 1:
        raise ValueError(f"resume attempts count from 1, not {attempt}")
    return f"{migration_id}{attempt:04x}"


def given_up(timeout_s: float, attempts: int, last_error: str, dest_libvirt_uri: str) -> str:
    """The error of a postcopy that could not be resumed in time: where the VM
    is and how an operator resumes it.

    >>> print(given_up(120, 5, "no fresh movers: B unreachable", "qemu+tcp://b/system"))
    ... # doctest: +NORMALIZE_WHITESPACE
    postcopy could not be resumed within 120 s (5 attempts; last: no fresh movers: B
    unreachable); the VM is paused on both hosts, its memory split between them, and
    nothing was destroyed: it is recoverable. Once the link is back, resume it from the
    source host: virsh migrate --live --p2p --postcopy --postcopy-resume <vm>
    qemu+tcp://b/system <a migration URI that reaches the destination QEMU, e.g.
    tcp://<destination>>
    """
    text = (
        f"postcopy could not be resumed within {timeout_s:.0f} s ({attempts} attempts; "
        f"last: {last_error or 'none made'}); the VM is paused on both hosts, its memory "
        "split between them, and nothing was destroyed: it is recoverable. Once the link "
        "is back, resume it from the source host: virsh migrate --live --p2p --postcopy "
        f"--postcopy-resume <vm> {dest_libvirt_uri} <a migration URI that reaches the "
        "destination QEMU, e.g. tcp://<destination>>"
    )
    if STUCK_JOB in last_error or ABANDONED_CALL in last_error:
        text += (
            ". libvirt's own resume call is stuck and holds the VM's migration job "
            "(seen with libvirt 9.0 and QEMU >= 9.1, whose postcopy-recover-setup state "
            "it does not know): restart libvirtd on the source host first (running "
            "domains are kept)"
        )
    return text
