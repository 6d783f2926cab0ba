"""What a restarted source agent makes of a migration its predecessor left unended.

The agent keeps its migration records on disk (``agents.agent.migration_records``).
A record that was still "planning" or "running" when the agent died says
nothing about how the migration ended: libvirt's peer-to-peer job outlives the
agent that started it and may complete, fail, or still run.  The record is
therefore not trusted but reconciled against what libvirt shows on both hosts,
the way Nova's compute manager settles migrations a restarted service finds
in flight (``nova.compute.manager._init_instance``).

The rule the cases keep: a VM that runs on exactly one host is never touched;
one paused by the dead agent's stop-and-copy (not by postcopy) is resumed
where it is whole, so it never stays on no host.

The functions here are pure; ``agents.agent.migration_records`` does the I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import libvirt

# Where the VM stands on one host, as read from libvirt (``domain_view``).
RUNNING = "running"
PAUSED = "paused"  # paused, not for postcopy (the dead agent's stop-and-copy)
POSTCOPY_PAUSED = "postcopy-paused"  # postcopy broke: its memory is split between hosts
MIGRATED = "migrated"  # shut off as migrated, or undefined (UNDEFINE_SOURCE)
ABSENT = "absent"  # no such domain, or shut off for another reason
UNKNOWN = "unknown"  # libvirt (or the destination agent) did not answer

# What the agent does about it.
FOLLOW = "follow"  # libvirt's job still runs (or a host cannot be read): look again
SETTLE = "settle"  # the record ends; nothing to do to the VM
RESUME_SOURCE = "resume-source"  # resume the VM on the source, then settle
RESUME_DEST = "resume-dest"  # resume the VM on the destination, then settle

RESTARTED = "the source agent restarted during the migration"
FROM_LIBVIRT = "agent restarted during the migration; outcome read from libvirt"


@dataclasses.dataclass(frozen=True)
class Verdict:
    state: str  # running (FOLLOW) | completed | failed
    action: str
    note: str  # the record's event, or its error when failed
    vm_here: bool = False  # the VM is whole on the source: clean the destination up


def domain_view(exists: bool, state: int = 0, reason: int = 0) -> str:
    """One host's domain, as ``reconcile`` reads it.

    >>> domain_view(True, libvirt.VIR_DOMAIN_RUNNING, 1)
    'running'
    >>> domain_view(True, libvirt.VIR_DOMAIN_PAUSED, libvirt.VIR_DOMAIN_PAUSED_POSTCOPY)
    'postcopy-paused'
    >>> domain_view(True, libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED)
    'migrated'
    >>> domain_view(False), domain_view(True, libvirt.VIR_DOMAIN_SHUTOFF, 0)
    ('migrated', 'absent')
    """
    if not exists:
        # The agent migrates with UNDEFINE_SOURCE: a completed migration leaves no domain.
        return MIGRATED
    if state == libvirt.VIR_DOMAIN_RUNNING:
        return RUNNING
    if state == libvirt.VIR_DOMAIN_PAUSED:
        return POSTCOPY_PAUSED if reason == libvirt.VIR_DOMAIN_PAUSED_POSTCOPY else PAUSED
    if (state, reason) == (libvirt.VIR_DOMAIN_SHUTOFF, libvirt.VIR_DOMAIN_SHUTOFF_MIGRATED):
        return MIGRATED
    return ABSENT


def reconcile(record_state: str, source: str, job_active: bool, dest: str) -> Verdict:
    """How a migration left "planning"/"running" by a dead agent ended.

    ``source``/``dest``: ``domain_view`` on each host (``dest`` ABSENT where the
    destination has no such domain, UNKNOWN where it could not be asked);
    ``job_active``: libvirt has a migration job on the source's domain.

    >>> reconcile("running", RUNNING, True, UNKNOWN).action
    'follow'
    >>> v = reconcile("running", MIGRATED, False, RUNNING); (v.state, v.action)
    ('completed', 'settle')
    >>> v = reconcile("running", RUNNING, False, ABSENT); (v.state, v.vm_here)
    ('failed', True)
    >>> reconcile("running", PAUSED, False, ABSENT).action
    'resume-source'
    >>> reconcile("running", MIGRATED, False, PAUSED).action
    'resume-dest'
    >>> reconcile("running", MIGRATED, False, UNKNOWN).action
    'follow'
    """
    if job_active or source == UNKNOWN:
        return Verdict("running", FOLLOW, "libvirt's migration job is still active on the source")
    if source == RUNNING:
        return _stayed_here(record_state)
    if source == PAUSED and dest not in (RUNNING, POSTCOPY_PAUSED):
        return Verdict(
            "failed",
            RESUME_SOURCE,
            f"{RESTARTED} and libvirt's job ended with the VM paused on the source "
            "(stop-and-copy): resumed there; the VM stayed on the source",
            vm_here=True,
        )
    if POSTCOPY_PAUSED in (source, dest):
        return Verdict(
            "failed",
            SETTLE,
            f"{RESTARTED} and postcopy broke: the VM is paused on both hosts with its "
            "memory split between them; resume it with 'virsh migrate --postcopy "
            "--postcopy-resume'",
        )
    return _left_here(source, dest)


def _stayed_here(record_state: str) -> Verdict:
    """The source runs the VM and libvirt has no job: nothing was handed over
    (libvirt only stops the source's VM once the destination's runs)."""
    when = "before the migration started" if record_state == "planning" else "and libvirt's job"
    ended = "" if record_state == "planning" else " ended without moving the VM"
    return Verdict(
        "failed", SETTLE, f"{RESTARTED} {when}{ended}; the VM stayed on the source", vm_here=True
    )


def _left_here(source: str, dest: str) -> Verdict:
    """The source no longer runs the VM (migrated, gone, or paused while the
    destination runs it)."""
    if dest == RUNNING:
        return Verdict("completed", SETTLE, FROM_LIBVIRT)
    if dest == PAUSED and source != PAUSED:
        # The dead agent's stop-and-copy paused the VM; the switchover kept it paused.
        return Verdict("completed", RESUME_DEST, FROM_LIBVIRT + "; resumed on the destination")
    if dest == UNKNOWN:
        return Verdict("running", FOLLOW, "the destination cannot be asked where the VM runs")
    return Verdict(
        "failed",
        SETTLE,
        f"{RESTARTED} and the VM runs on neither host (source: {source}, destination: "
        f"{dest}); nothing was touched",
    )


# Rounds a precopy must iterate while followed, none of them bringing what is
# left to send below its earlier low, before it counts as stuck: a precopy that
# converges lowers it every round, and a long first round is no round at all.
ORPHAN_MIN_ROUNDS = 3


def abort_orphaned_precopy(
    source: str, remaining_by_round: Sequence[int], followed_s: float, converge_timeout_s: float
) -> bool:
    """Whether a restarted agent aborts the precopy its predecessor left running.

    ``remaining_by_round``: libvirt's ``memory_remaining`` as each new round
    began, in the order the follower saw them.  The dead agent's controller
    bounded the job (the plan's switch to postcopy, the in-flight correction,
    ``converge_timeout``); without it libvirt's precopy of a VM that rewrites
    faster than the link carries iterates for ever (the fault campaign's
    postcopy/mover/kill-src-agent/round cell: 159 rounds, 14 GiB sent for a
    256 MiB guest in 10 min).  One whose last ORPHAN_MIN_ROUNDS rounds left no
    less to send than before them, ``converge_timeout`` after the restart, is
    aborted: in precopy the VM runs whole on the source, and an abort keeps it
    there.  Never a postcopy (the VM's memory is split) nor a paused VM.

    >>> stuck = [9, 8, 9, 9, 8]  # MiB left at each round: no new low in the last three
    >>> abort_orphaned_precopy(RUNNING, stuck, 31.0, 30.0)
    True
    >>> abort_orphaned_precopy(RUNNING, [64, 40, 25, 16, 10], 31.0, 30.0)  # converging
    False
    >>> abort_orphaned_precopy(RUNNING, stuck, 29.0, 30.0)  # not yet converge_timeout
    False
    >>> abort_orphaned_precopy(RUNNING, [9, 9], 99.0, 30.0)  # too few rounds to tell
    False
    >>> abort_orphaned_precopy(POSTCOPY_PAUSED, stuck, 31.0, 30.0)
    False
    >>> abort_orphaned_precopy(PAUSED, stuck, 99.0, 30.0)  # stop-and-copy: it is ending
    False
    """
    if source != RUNNING or followed_s < converge_timeout_s:
        return False
    if len(remaining_by_round) <= ORPHAN_MIN_ROUNDS:
        return False
    before, last = remaining_by_round[:-ORPHAN_MIN_ROUNDS], remaining_by_round[-ORPHAN_MIN_ROUNDS:]
    return min(last) >= min(before)


def orphan_aborted(rounds_followed: int, followed_s: float) -> str:
    """The record's error when the follower aborted a stuck precopy.

    >>> print(orphan_aborted(40, 31.2))  # doctest: +NORMALIZE_WHITESPACE
    aborted libvirt's precopy: 40 rounds in 31 s after the restart left no less to
    send, and the agent that drove it (its switch, correction and timeouts) is gone;
    the VM stayed on the source
    """
    return (
        f"aborted libvirt's precopy: {rounds_followed} rounds in {followed_s:.0f} s after "
        "the restart left no less to send, and the agent that drove it (its switch, "
        "correction and timeouts) is gone; the VM stayed on the source"
    )


def gave_up(last: Verdict, seconds: float) -> Verdict:
    """The record's end when libvirt's view did not settle within ``seconds``:
    reported as failed, naming what was last seen, never as where the VM is.

    >>> v = gave_up(reconcile("running", UNKNOWN, False, UNKNOWN), 600); v.state
    'failed'
    >>> v.note[-38:]
    'source); look at libvirt on both hosts'
    """
    return Verdict(
        "failed",
        SETTLE,
        f"{RESTARTED}; where the VM runs did not settle within {seconds:.0f} s "
        f"({last.note}); look at libvirt on both hosts",
    )
