"""Postcopy recovery on the Nova path: the engine's resume, never Nova's rollback.

Nova answers a failed live migration with its rollback, whose destination half
destroys the incoming domain.  Before the switch to postcopy that is right
(the VM is whole on the source); after it, the destination holds the running
half of the VM's memory, and destroying it loses the VM.  So once the plan
switched, a broken migration is resumed by the engine's own recovery
(``MigrationJob.recover_postcopy``, the agent path's), with a fresh mover pair
per attempt over the mover transport (``AgentMoverPairs``, through the two
agents' APIs).  A postcopy that cannot be resumed raises
``PostcopyNotRecovered``: Nova then puts the instance in ERROR without a
rollback, and the VM stays paused on both hosts, recoverable.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agents.agent import movers
from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig.migration import recovery
from flexmig.migration.libvirt_job import JobConfig, JobResult, MigrationJob
from flexmig.migration.planner import Plan

LOG = logging.getLogger(__name__)
FINISH_TIMEOUT_S = 40.0


class PostcopyNotRecovered(exceptions.FlexMigError):
    msg_fmt = "FlexMig could not resume the postcopy of %(vm)s: %(reason)s"


class AgentMoverPairs:
    """A Nova migration's mover pairs, through the agents: the source's local
    agent sends (full key), the destination's receives (the migration-scoped
    credential, which may start and finish the resume pairs of its own
    migration only: ``auth.scoped_mover_ids``)."""

    def __init__(self, local: AgentClient, dest: AgentClient, mover_id: str) -> None:
        self.local = local
        self.dest = dest
        self.base_id = mover_id
        self.current: str | None = mover_id  # the offer's pair, until a resume
        self.dead: list[str] = []

    def reopen(self, attempt: int) -> str:
        """Clear the dead pairs on both hosts, then a fresh one: QEMU's URI.
        Raises FlexMigError while either agent cannot be reached."""
        if self.current is not None:
            self.dead.append(self.current)
            self.current = None
        self._clear_dead(quiet=False)
        mid = recovery.resume_transport_id(self.base_id, attempt)
        salt = movers.new_token_salt()
        self.dead.append(mid)  # until both ends run
        try:
            reply = self.dest.post(
                "/v1/mover/receive", {"migration_id": mid, "token_salt": salt, "streams": 1}
            )
            body = {
                "migration_id": mid,
                "token_salt": salt,
                "peer": str(reply["address"]),
                "ports": list(reply["ports"]),
            }
            uri = str(self.local.post("/v1/mover/send", body)["uri"])
        except exceptions.FlexMigError:
            self._clear_dead(quiet=True)
            raise
        self.dead.remove(mid)
        self.current = mid
        return uri

    def finish(self, ok: bool) -> None:
        """The current pair's statistics (ok) or it killed; every dead pair killed."""
        if self.current is not None:
            if ok:
                for agent in (self.local, self.dest):
                    self._post_quietly(agent, {"migration_id": self.current})
            else:
                self.dead.append(self.current)
            self.current = None
        self._clear_dead(quiet=True)

    def _clear_dead(self, quiet: bool) -> None:
        for mid in list(self.dead):
            try:
                for agent in (self.local, self.dest):
                    self._abort(agent, mid)
            except exceptions.FlexMigError as exc:
                if not quiet:
                    raise
                LOG.warning("FlexMig: movers %s not cleared: %s", mid, exc)
                continue
            self.dead.remove(mid)

    @staticmethod
    def _abort(agent: AgentClient, mid: str) -> None:
        try:
            agent.post("/v1/mover/finish", {"migration_id": mid, "abort": True})
        except exceptions.NotFound:
            pass  # gone already, or never started on that side

    @staticmethod
    def _post_quietly(agent: AgentClient, body: dict[str, Any]) -> None:
        try:
            agent.post("/v1/mover/finish", body, timeout=FINISH_TIMEOUT_S)
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: movers %s: %s", body["migration_id"], exc)


def resume(
    domain: Any,
    host: str,
    plan: Plan,
    config: JobConfig,
    on_event: Callable[[str], None],
) -> JobResult:
    """The engine's postcopy recovery for a migration Nova started."""
    job = MigrationJob(domain, host, plan, config, on_event=on_event)
    return job.recover_postcopy()
