"""A host drain driven through Nova's API (nova_driver.drain) on FlexMig's plan.

Nova's functional harness runs the API, conductor, scheduler, placement and
three nova-compute services (src, dest1, dest2) with FlexMigLibvirtDriver,
each with its own flexmig-agent (``harness.InProcessAgent``); the drain
reads servers and services from Nova's API, destination facts from the
agents, and moves every server with ``os-migrateLive`` to the plan's host.
What is asserted is what Nova reports: where each server ends, how many
servers were migrating at once (sampled from the API while the drain ran),
and which server never got a migration.
"""

from __future__ import annotations

import os
import threading
import time
import unittest
from typing import Any

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

from nova.tests.functional import integrated_helpers  # noqa: E402
from nova.tests.functional.libvirt import base as libvirt_base  # noqa: E402

from nova_driver import drain as nova_drain  # noqa: E402
from nova_driver import driver as _driver  # noqa: E402, F401  (registers [flexmig])
from tests.nova_functional import harness  # noqa: E402

MIB = 2**20
DEST_BUDGET_MB = 1536  # two 512 MiB servers each (each needs 672 MiB free on arrival)
NOVA_LIMIT = 2


class AdminAPI:
    """``nova_drain.NovaAPI`` over the harness's admin client."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def get(self, path: str) -> dict[str, Any]:
        return dict(self.client.api_get(path).body)

    def post(self, path: str, body: dict[str, Any]) -> None:
        self.client.api_post(path, body)


@unittest.skipUnless(
    os.path.exists(harness.API_PASTE),
    f"{harness.API_PASTE} is missing: tools/setup.sh fetches it from nova's sdist",
)
class TestNovaDrain(
    harness.FlexMigDriverMixin, libvirt_base.ServersTestBase, integrated_helpers.InstanceHelperMixin
):
    ADMIN_API = True
    microversion = "latest"

    def setUp(self) -> None:
        super().setUp()
        self.agents = {"src": self.useFixture(harness.InProcessAgent(memory_budget_mb=8192))}
        for host in ("dest1", "dest2"):
            self.agents[host] = self.useFixture(harness.InProcessAgent(DEST_BUDGET_MB))
        self.guests = self.useFixture(harness.GuestWorkloads(self._connection_for, by_uri=True))
        self.useFixture(
            harness.RemoteLibvirt(
                lambda host: (
                    self.computes[host].driver._host.get_connection()
                    if host in self.computes
                    else None
                )
            )
        )
        self.flags(
            agent_address="127.0.0.1", agent_key_file=self.agents["src"].key_file, group="flexmig"
        )
        self.flags(
            dirty_sample_seconds=[1, 2],
            bandwidth_probe_mib=8,
            stream_bandwidth_mib=64,
            max_downtime_ms=300,
            group="migration",
        )
        self.flags(max_concurrent_live_migrations=NOVA_LIMIT)
        for host in ("src", "dest1", "dest2"):
            self.flags(agent_port=self.agents[host].port, group="flexmig")
            self.start_compute(hostname=host)
        self.small = self._create_flavor(memory_mb=512, vcpu=1, disk=1, ephemeral=0)
        self.huge = self._create_flavor(memory_mb=4096, vcpu=1, disk=1, ephemeral=0)
        self.api_adapter = AdminAPI(self.admin_api)

    def _connection_for(self, dconnuri: str) -> Any:
        for host in ("dest1", "dest2"):
            if f"//{host}/" in dconnuri:
                return self.computes[host].driver._host.get_connection()
        raise AssertionError(f"no destination for {dconnuri}")

    def _agent_for(self, host: str) -> Any:
        agent = self.agents.get(host)
        return agent.client() if agent else None

    def _boot(self, flavor: str) -> dict[str, Any]:
        return self._create_server(flavor_id=flavor, host="src", networks="none")

    def _where(self, server: dict[str, Any]) -> str:
        return self.admin_api.get_server(server["id"])["OS-EXT-SRV-ATTR:host"]

    def _watch_migrating(self, servers: list[dict[str, Any]], stop: threading.Event) -> list[int]:
        seen: list[int] = []

        def watch() -> None:
            while not stop.is_set():
                states = [
                    self.admin_api.get_server(s["id"])["OS-EXT-STS:task_state"] for s in servers
                ]
                seen.append(sum(1 for t in states if t == "migrating"))
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()
        return seen

    def test_drain_moves_every_server_to_its_planned_host_within_novas_limit(self) -> None:
        servers = [self._boot(self.small) for _ in range(4)]
        huge = self._boot(self.huge)
        stop = threading.Event()
        migrating = self._watch_migrating([*servers, huge], stop)
        events: list[str] = []
        try:
            plan, report = nova_drain.drain_host(
                self.api_adapter,
                "src",
                self._agent_for,
                nova_limit=NOVA_LIMIT,
                max_concurrency=4,
                on_event=events.append,
            )
        finally:
            stop.set()
        assert report is not None
        self.assertLessEqual(plan.concurrency, NOVA_LIMIT)
        self.assertGreater(max(migrating), 0, "no migration was ever seen running")
        self.assertLessEqual(max(migrating), NOVA_LIMIT, migrating)
        names = {
            s["id"]: self.admin_api.get_server(s["id"])["OS-EXT-SRV-ATTR:instance_name"]
            for s in [*servers, huge]
        }
        planned = {m.vm: m.dest for m in plan.moves}
        for server in servers:
            self.assertEqual(planned[names[server["id"]]], self._where(server))
            self.assertEqual("ACTIVE", self.admin_api.get_server(server["id"])["status"])
        # Two per destination: the plan spread them as the agents' RAM allows.
        self.assertEqual(["dest1", "dest1", "dest2", "dest2"], sorted(planned.values()))
        # The huge one was reported before anything moved and never touched.
        self.assertIn(names[huge["id"]], plan.unplaceable)
        self.assertEqual("src", self._where(huge))
        self.assertEqual(
            [],
            self.admin_api.api_get(f"/os-migrations?instance_uuid={huge['id']}").body["migrations"],
        )
        self.assertEqual({"completed": 4, "unplaceable": 1}, report.counts())
        self.assertTrue(any("planned from its flavor" in e for e in events), events)

    def test_dry_run_moves_nothing_and_raising_the_limit_warns(self) -> None:
        servers = [self._boot(self.small) for _ in range(3)]
        events: list[str] = []
        plan, report = nova_drain.drain_host(
            self.api_adapter,
            "src",
            self._agent_for,
            nova_limit=1,
            max_concurrency=3,
            raise_limit=True,
            dry_run=True,
            on_event=events.append,
        )
        self.assertIsNone(report)
        self.assertEqual(3, len(plan.moves))
        self.assertTrue(any("max_concurrent_live_migrations=1" in e for e in events), events)
        for server in servers:
            self.assertEqual("src", self._where(server))
            self.assertEqual(
                [],
                self.admin_api.api_get(f"/os-migrations?instance_uuid={server['id']}").body[
                    "migrations"
                ],
            )
