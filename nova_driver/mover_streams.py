"""A Nova migration's movers, through the two hosts' agents.

Where the ``[migration] transport`` resolves to the mover, the destination's
agent starts receiving movers in ``pre_live_migration``, before there is a
plan, and the offer names them; once the plan uses them the source's agent
starts the sending movers towards them and hands QEMU their URI; when the job
ends both sides finish them (statistics after a success, killed after a
failure).  A plan that leaves the mover (postcopy where libvirt turns
postcopy-preempt on) has the destination's receivers aborted at once.  The
resume pairs of a postcopy recovery are ``nova_driver.postcopy``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from oslo_log import log as logging

from agents.agent import auth, movers
from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig.migration.options import EngineOptions
from flexmig.migration.planner import Plan
from flexmig.policy.transport import choose_transport
from nova_driver.migrate_data import DestinationOffer, MoverOffer

LOG = logging.getLogger(__name__)
FINISH_TIMEOUT_S = 40.0


def streams(parallel: int) -> int:
    """The connections QEMU opens for ``parallel`` channels: multifd opens the
    main connection and one per channel.

    >>> streams(0), streams(1), streams(4)
    (1, 1, 5)
    """
    return parallel + 1 if parallel > 1 else 1


def unused(offer: DestinationOffer, plan: Plan) -> bool:
    """Whether the offer names receivers the plan will not send to."""
    return offer.mover is not None and plan.transport.transport != "mover"


def start_receivers(
    agent: AgentClient,
    facts: dict[str, Any],
    migration_id: str,
    opts: EngineOptions,
    parallel: int,
) -> MoverOffer | None:
    """Receiving movers on the destination's ``agent`` where the transport resolves
    to them (``parallel``: Nova's parallel connections); their offer."""
    choice = choose_transport(
        opts.transport, facts.get("rdma_provider") is True, opts.tcp_fabric_transport
    )
    if choice.transport != "mover":
        return None
    mid, salt = auth.mover_id(migration_id), movers.new_token_salt()
    body = {"migration_id": mid, "token_salt": salt, "streams": streams(parallel)}
    reply = agent.post("/v1/mover/receive", body)
    return MoverOffer(
        migration_id=mid,
        token_salt=salt,
        address=str(reply["address"]),
        ports=tuple(int(port) for port in reply["ports"]),
    )


def start_senders(agent: AgentClient, plan: Plan, offer: DestinationOffer) -> str | None:
    """The source ``agent``'s sending movers towards the offer's receivers: QEMU's URI."""
    if plan.transport.transport != "mover" or offer.mover is None:
        return None
    # Parallel connections carry precopy only: a plan that dropped them
    # uses the first receiver; the destination's others are aborted at the end.
    body = {
        "migration_id": offer.mover.migration_id,
        "token_salt": offer.mover.token_salt,
        "peer": offer.mover.address,
        "ports": list(offer.mover.ports[: streams(plan.parallel)]),
    }
    return str(agent.post("/v1/mover/send", body)["uri"])


def finish(sides: Iterable[tuple[str, AgentClient]], mover: MoverOffer, ok: bool) -> None:
    """Each side's movers once the job ended: statistics, or killed after a failure."""
    body: dict[str, Any] = {"migration_id": mover.migration_id}
    if not ok:
        body["abort"] = True
    for side, agent in sides:
        try:
            reply = agent.post("/v1/mover/finish", body, timeout=FINISH_TIMEOUT_S)
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: %s movers: %s", side, exc)
            continue
        if "stats" in reply:
            stats = reply["stats"]
            LOG.info(
                "FlexMig: %s movers moved %s bytes in %s stream(s) at %s MiB/s",
                side,
                stats.get("bytes"),
                stats.get("streams"),
                stats.get("mib_per_s"),
            )
