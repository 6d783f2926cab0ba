"""The mover pairs of one migration the source agent runs (the ``mover`` transport).

A migration starts with one pair (one mover per stream on each host).  When
postcopy breaks, that pair is gone with its stream, so every resume attempt
gets a pair of its own (``reopen``, the job's ``reopen_transport``): the dead
pair is cleared on both hosts first -- the destination QEMU accepts a recovery
only once its old stream is closed, and the destination's receivers of the old
pair hold it open until they are killed -- then a fresh one is started the
same way as the first, under its own id (``recovery.resume_transport_id``).
A dead pair whose destination side could not be reached (the fabric still
cut) is remembered and cleared at the next attempt or at the end.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from agents.agent import auth, movers
from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig.migration import recovery

LOG = logging.getLogger("flexmig.agent.mover_pairs")
FINISH_TIMEOUT_S = 40.0  # the destination waits up to 30 s for its movers' statistics


class MoverPairs:
    def __init__(
        self,
        state_dir: str,
        listen_address: str,
        migration_id: str,
        dest: AgentClient,
        streams: int,
    ) -> None:
        self.state_dir = state_dir
        self.listen_address = listen_address
        self.migration_id = migration_id
        self.dest = dest
        self.streams = streams
        self.current: str | None = None  # the id of the live pair
        self.sender: movers.MoverSet | None = None
        self.dead: list[str] = []  # pairs whose destination side is not cleared yet

    def open(self) -> str:
        """The migration's first pair; QEMU's migration URI."""
        return self._start(self.migration_id)

    def reopen(self, attempt: int) -> str:
        """A fresh pair for postcopy resume ``attempt``: the old one cleared on
        both hosts, then started like the first.  Raises FlexMigError while the
        destination cannot be reached (the job tries again later)."""
        self._drop_current()
        self._clear_dead()
        return self._start(recovery.resume_transport_id(self.migration_id, attempt))

    def finish(self, ok: bool) -> dict[str, Any] | None:
        """Both sides' statistics of the pair that completed, or every pair killed."""
        if not ok or self.current is None or self.sender is None:
            self._drop_current()
            self._clear_dead(quiet=True)
            return None
        mid, sender = self.current, self.sender
        Path(movers.socket_path(self.state_dir, mid)).unlink(missing_ok=True)
        self._clear_dead(quiet=True)
        try:
            stats = {"send": sender.wait(timeout=30)}
            body = {"migration_id": mid}
            reply = self.dest.post("/v1/mover/finish", body, timeout=FINISH_TIMEOUT_S)
            stats["recv"] = reply["stats"]
        except exceptions.FlexMigError:
            # Both ends go whatever happened; the caller says what was lost.
            self._drop_current()
            self._clear_dead(quiet=True)
            raise
        self.current, self.sender = None, None
        return stats

    def _start(self, mid: str) -> str:
        # Scoped to this pair and never sent: the destination derives the same
        # token from the salt and the key this request is signed with.
        salt = movers.new_token_salt()
        token = auth.mover_token(self.dest.key, mid, salt)
        body = {"migration_id": mid, "token_salt": salt, "streams": self.streams}
        # Counted dead until both sides run: a receive whose reply was lost
        # still has its receivers killed.
        self.dead.append(mid)
        try:
            ports = self.dest.post("/v1/mover/receive", body)["ports"]
            self.sender = movers.start_senders(
                self.state_dir, self.listen_address, self.dest.address, ports, mid, token
            )
        except exceptions.FlexMigError:
            self._clear_dead(quiet=True)
            raise
        self.dead.remove(mid)
        self.current = mid
        return "unix://" + movers.socket_path(self.state_dir, mid)

    def _drop_current(self) -> None:
        """Kill this host's side of the live pair; its other side joins the dead."""
        if self.sender is not None:
            self.sender.kill()
            self.sender = None
        if self.current is not None:
            Path(movers.socket_path(self.state_dir, self.current)).unlink(missing_ok=True)
            self.dead.append(self.current)
            self.current = None

    def _clear_dead(self, quiet: bool = False) -> None:
        """Kill the destination's movers of every dead pair (NotFound: gone already)."""
        for mid in list(self.dead):
            try:
                self.dest.post("/v1/mover/finish", {"migration_id": mid, "abort": True})
            except exceptions.NotFound:
                pass
            except exceptions.FlexMigError as exc:
                if not quiet:
                    raise
                LOG.warning("movers %s on %s not cleared: %s", mid, self.dest.address, exc)
                continue
            self.dead.remove(mid)
