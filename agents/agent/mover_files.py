"""What a mover leaves in the agent's state directory, and how long it stays.

Each mover has a base path ``<state_dir>/mover-<pair id>-<role><stream>``:
``.token`` (its credential), ``.ready`` (a sender reached its receiver),
``.stats`` (its statistics, written when it ends) and ``.log`` (its output).
The token, ready and stats files are hand-overs between the agent and a
running mover; none outlives the mover.  The log is removed when the mover
ended well.  A mover that failed, was killed, or outlived the agent that
started it keeps its log, renamed ``<base>.failed.log`` so an operator (and
the fault campaign) can tell a kept diagnostic from a leftover; only the
KEPT_FAILED_LOGS newest of those stay, the rest are pruned whenever one is
added.

An agent that restarts finds its predecessor's files (``sweep``): those of
movers no longer running are retired at once; movers still running (the
predecessor was killed mid-migration: their stream may still carry a postcopy
VM's memory, so killing them could lose it) are left to end and retired then
by ``Orphans.reap``, or killed once they have run ORPHAN_MAX_S.  Movers this
agent started whose migration never comes back for them (the other agent died)
are ``movers.reap_unclaimed``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import time
from pathlib import Path

LOG = logging.getLogger("flexmig.agent.mover_files")
KEPT_FAILED_LOGS = 20  # ~ the last few failed migrations' worth, a few KiB each
FAILED_LOG = ".failed.log"
HANDOVER = (".token", ".ready", ".stats")
# Longer than any stream the agent starts runs between its checks (the job's own
# timeouts end a migration well before); an orphan older than this is stuck.
ORPHAN_MAX_S = 3600.0


def failed_log(base: Path) -> Path:
    return base.parent / f"{base.name}{FAILED_LOG}"


def retire(base: Path, ok: bool, keep: int = KEPT_FAILED_LOGS) -> Path | None:
    """Remove an ended mover's files; a failed one's log is kept (returned).

    ``ok``: the mover ended by itself with status 0 (its log says nothing an
    operator needs).
    """
    for suffix in HANDOVER:
        base.with_suffix(suffix).unlink(missing_ok=True)
    log = base.with_suffix(".log")
    if ok or not log.exists():
        log.unlink(missing_ok=True)
        return None
    kept = failed_log(base)
    log.replace(kept)
    prune_failed_logs(base.parent, keep)
    return kept if kept.exists() else None


def prune_failed_logs(state_dir: Path, keep: int = KEPT_FAILED_LOGS) -> list[Path]:
    """Delete all but the ``keep`` newest kept logs; returns those deleted."""
    kept = sorted(state_dir.glob(f"mover-*{FAILED_LOG}"), key=_mtime, reverse=True)
    for path in kept[keep:]:
        path.unlink(missing_ok=True)
    return kept[keep:]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def base_of(path: Path) -> Path | None:
    """The mover base a state file belongs to (None: not a mover's file)."""
    name = path.name
    if not name.startswith("mover-") or name.endswith(FAILED_LOG):
        return None
    for suffix in (*HANDOVER, ".log"):
        if name.endswith(suffix):
            return path.with_name(name[: -len(suffix)])
    return None


def pair_of(base: Path) -> str:
    """The pair id (a migration's, or a resume's) in ``mover-<pair>-<role><n>``."""
    return base.name.split("-")[1]


def live_movers(state_dir: Path, proc: Path = Path("/proc")) -> dict[Path, int]:
    """Running processes whose token file is a mover's in ``state_dir``: base -> pid."""
    found: dict[Path, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        for flag, value in itertools.pairwise(argv):
            if flag == b"--token-file":
                token = Path(os.fsdecode(value))
                if token.parent == state_dir and (base := base_of(token)) is not None:
                    found[base] = int(entry.name)
    return found


@dataclasses.dataclass
class Orphan:
    base: Path
    pid: int
    found_at: float


def sweep(state_dir: Path, proc: Path = Path("/proc")) -> list[Orphan]:
    """At agent start: retire every mover that is not running; the running
    ones (orphans of the previous agent) are returned for ``Orphans``."""
    live = live_movers(state_dir, proc)
    bases = {b for p in state_dir.glob("mover-*") if (b := base_of(p)) is not None}
    for base in bases - set(live):
        # A stats file: the mover ended well but its agent died before reading it.
        retire(base, ok=base.with_suffix(".stats").exists())
    live_pairs = {pair_of(b) for b in live}
    for sock in state_dir.glob("mig-*.sock"):
        if sock.name[len("mig-") : -len(".sock")] not in live_pairs:
            sock.unlink(missing_ok=True)
    prune_failed_logs(state_dir)
    now = time.monotonic()
    return [Orphan(base, pid, now) for base, pid in sorted(live.items())]


class Orphans:
    """Movers a previous agent started, retired once they end."""

    def __init__(self, found: list[Orphan], max_age_s: float = ORPHAN_MAX_S) -> None:
        self.found = found
        self.max_age_s = max_age_s

    def reap(self, now: float | None = None) -> list[Orphan]:
        """Retire the orphans that ended (killing those past max_age_s first),
        and their pair's socket once none of the pair runs; returns the rest."""
        now = time.monotonic() if now is None else now
        for orphan in self.found:
            if now - orphan.found_at > self.max_age_s and _alive(orphan.pid):
                LOG.warning("killing mover %s (pid %d): orphaned, stuck", orphan.base, orphan.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(orphan.pid, signal.SIGKILL)
        running = [o for o in self.found if _alive(o.pid)]
        ended = [o for o in self.found if o not in running]
        for orphan in ended:
            # Its exit status went to whoever adopted it: a stats file is the sign it ended well.
            retire(orphan.base, ok=orphan.base.with_suffix(".stats").exists())
        for pair in {pair_of(o.base) for o in ended} - {pair_of(o.base) for o in running}:
            (ended[0].base.parent / f"mig-{pair}.sock").unlink(missing_ok=True)
        self.found = running
        return running


def _alive(pid: int) -> bool:
    """Still running (a zombie counts as ended: its parent is not this agent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
