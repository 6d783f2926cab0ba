"""The Nova driver's migrate data: the destination's offer through Nova's RPC."""

from __future__ import annotations

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from nova.objects import base as obj_base  # noqa: E402
from nova.objects import migrate_data as nova_migrate_data  # noqa: E402

from nova_driver import migrate_data, planning  # noqa: E402

MIB = 2**20


def test_offer_survives_nova_rpc_serialisation() -> None:
    offer = migrate_data.DestinationOffer(
        agent_address="10.250.0.12",
        agent_port=9797,
        scope="migration/m1/instance-00000001/1800000000",
        scoped_key="ab" * 32,
        free_for_vms_bytes=400 * MIB,
        store_free_bytes=8192 * MIB,
        split_budget_bytes=240 * MIB,
        mover=migrate_data.MoverOffer(
            migration_id="ab" * 16, token_salt="5a" * 24, address="10.250.0.12", ports=(7471, 7472)
        ),
    )
    data = nova_migrate_data.LibvirtLiveMigrateData(block_migration=False, bdms=[])
    extended = migrate_data.FlexMigLiveMigrateData.extend(data, offer)
    received = obj_base.NovaObject.obj_from_primitive(extended.obj_to_primitive())
    assert isinstance(received, nova_migrate_data.LibvirtLiveMigrateData)
    assert received.block_migration is False
    assert migrate_data.offer_of(received) == offer
    assert migrate_data.offer_of(data) is None


def test_an_incomplete_offer_is_a_clear_error() -> None:
    offer = migrate_data.FlexMigOffer(agent_address="10.250.0.12", agent_port=9797)
    data = migrate_data.FlexMigLiveMigrateData(flexmig_offer=offer)
    received = obj_base.NovaObject.obj_from_primitive(data.obj_to_primitive())
    with pytest.raises(Exception, match="the destination offer lacks scope, scoped_key"):
        migrate_data.offer_of(received)


SOCKET_OFFER = migrate_data.DestinationOffer("/run/flexmig/agent.sock", 0, "s", "k", 1, 1, None)


def test_peer_endpoint_is_the_destination_agents_own_address() -> None:
    facts = {"agent": {"address": "10.250.0.2", "port": 9797}}
    assert planning.peer_endpoint(SOCKET_OFFER, facts) == {"address": "10.250.0.2", "port": 9797}


@pytest.mark.parametrize(
    "agent",
    [None, "10.0.0.2", {"address": 7, "port": 9797}, {"address": "10.0.0.2", "port": 0},
     {"address": "10.0.0.2", "port": True}, {"address": "10.0.0.2", "port": 70000}],
)  # fmt: skip
def test_peer_endpoint_falls_back_to_the_offer_on_facts_without_a_usable_one(agent) -> None:
    facts = {} if agent is None else {"agent": agent}
    assert planning.peer_endpoint(SOCKET_OFFER, facts) == {
        "address": "/run/flexmig/agent.sock",
        "port": 0,
    }


class _Receivers:
    """The destination agent, as far as its movers go."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, dict]] = []

    def post(self, path: str, body: dict, **kw) -> dict:
        self.posts.append((path, body))
        return {"aborted": True}


@pytest.mark.parametrize(("carried_by", "dropped"), [("qemu-tcp", True), ("mover", False)])
def test_receivers_the_plan_does_not_use_are_aborted_and_leave_the_offer(
    monkeypatch, carried_by, dropped
) -> None:
    # Nova's destination starts receivers before the plan exists; a postcopy plan
    # where libvirt turns postcopy-preempt on goes over QEMU's TCP instead, and
    # the receivers must neither hold the job's end (30 s) nor be reopened for a
    # postcopy recovery.
    import types

    from flexmig.policy.transport import TransportChoice
    from nova_driver import driver

    offer = migrate_data.DestinationOffer(
        "10.250.0.12", 9797, "s", "k", 1, 1, None,
        mover=migrate_data.MoverOffer("m1", "salt", "10.250.0.12", (7471,)),
    )  # fmt: skip
    data = migrate_data.FlexMigLiveMigrateData.extend(
        nova_migrate_data.LibvirtLiveMigrateData(block_migration=False, bdms=[]), offer
    )
    dest = _Receivers()
    monkeypatch.setattr(planning, "destination_agent", lambda offer, timeout, ca: dest)
    plan = types.SimpleNamespace(transport=TransportChoice(carried_by, "why"))
    nova = driver.FlexMigLibvirtDriver.__new__(driver.FlexMigLibvirtDriver)
    kept = nova._drop_unused_receivers(None, offer, plan, data)
    if dropped:
        assert dest.posts == [("/v1/mover/finish", {"migration_id": "m1", "abort": True})]
        assert kept.mover is None and migrate_data.offer_of(data).mover is None
    else:
        assert dest.posts == [] and kept == offer == migrate_data.offer_of(data)


@pytest.mark.parametrize(
    ("carried_by", "parallel", "ports"),
    [("mover", 0, [7471]), ("mover", 2, [7471, 7472, 7473]), ("qemu-tcp", 2, None)],
)
def test_the_senders_use_one_receiver_per_connection_qemu_opens(carried_by, parallel, ports):
    # The destination offers receivers for Nova's parallel connections; a plan
    # that drops them (postcopy) sends over the first one only.
    import types

    from flexmig.policy.transport import TransportChoice
    from nova_driver import mover_streams

    class Source(_Receivers):
        def post(self, path: str, body: dict, **kw) -> dict:
            super().post(path, body)
            return {"uri": "tcp:127.0.0.1:7000"}

    offer = migrate_data.DestinationOffer(
        "10.250.0.12", 9797, "s", "k", 1, 1, None,
        mover=migrate_data.MoverOffer("m1", "salt", "10.250.0.12", (7471, 7472, 7473, 7474)),
    )  # fmt: skip
    plan = types.SimpleNamespace(transport=TransportChoice(carried_by, "why"), parallel=parallel)
    source = Source()
    uri = mover_streams.start_senders(source, plan, offer)  # type: ignore[arg-type]
    if ports is None:
        assert uri is None and source.posts == []
        return
    body = {"migration_id": "m1", "token_salt": "salt", "peer": "10.250.0.12", "ports": ports}
    assert uri == "tcp:127.0.0.1:7000" and source.posts == [("/v1/mover/send", body)]


@pytest.mark.parametrize(
    ("transport", "rdma", "streams"),
    [("mover", False, 5), ("auto", True, 5), ("auto", False, None)],
)
def test_the_destination_receives_where_the_transport_resolves_to_the_mover(
    transport, rdma, streams
):
    # QEMU's multifd opens its main connection and one per channel (4 here).
    from flexmig.migration.options import EngineOptions
    from nova_driver import mover_streams

    class Destination(_Receivers):
        def post(self, path: str, body: dict, **kw) -> dict:
            super().post(path, body)
            return {"address": "10.250.0.12", "ports": [7471 + i for i in range(body["streams"])]}

    dest = Destination()
    opts = EngineOptions(transport=transport)
    facts = {"rdma_provider": rdma}
    offer = mover_streams.start_receivers(dest, facts, "m1", opts, 4)  # type: ignore[arg-type]
    if streams is None:
        assert offer is None and dest.posts == []
        return
    assert [(path, body["streams"]) for path, body in dest.posts] == [("/v1/mover/receive", 5)]
    assert offer.ports == (7471, 7472, 7473, 7474, 7475) and offer.address == "10.250.0.12"
    assert offer.token_salt == dest.posts[0][1]["token_salt"]
