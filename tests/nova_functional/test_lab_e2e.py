"""End to end: Nova's ``os-migrateLive`` moves a real QEMU guest between two lab hosts.

Nova's in-process API, conductor, scheduler and placement (its functional
harness) with two nova-compute services running FlexMigLibvirtDriver against
the REAL libvirtd of lab hosts A and B (over their sockets, from this
namespace), each with that host's real flexmig-agent.  The one thing not
Nova's own is how the guest came to be: Nova's ``spawn`` would build a disk
image through glance, which the harness does not have, so the server's boot
adopts a lab guest (the measuring guest, with Nova's instance name and UUID)
on host A.  Everything from ``os-migrateLive`` on is Nova and FlexMig on real
libvirt and QEMU; the guest then verifies its memory page by page.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
import urllib.parse
from typing import Any
from unittest import mock

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")

import fixtures  # noqa: E402
from nova.tests.fixtures import libvirt as fakelibvirt  # noqa: E402
from nova.tests.functional import integrated_helpers  # noqa: E402
from oslo_utils.fixture import uuidsentinel as uuids  # noqa: E402

from flexmig import hypervisor  # noqa: E402
from flexmig_lab import (  # noqa: E402
    endpoints,
    offload,
    traffic,
    vmspec,
)
from flexmig_lab import vm as lab_vm  # noqa: E402
from flexmig_lab.lab import CGROUP_ROOT  # noqa: E402
from tests.nova_functional.harness import API_PASTE, FlexMigDriverMixin  # noqa: E402
from tests.nova_functional.test_live_migration import FINAL_STATES  # noqa: E402

pytestmark = pytest.mark.lab
HOSTS = {"lab-a": "A", "lab-b": "B"}
WAIT_S = 300.0
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Guest:
    """The lab guest a server's boot adopts, and the flavor that matches it."""

    ram_mb: int
    workload: str
    memory_backing: str = "file"


# Rewrites 64 MiB of checksummed pages, 2,000 pages/s: precopy converges.
MODERATE = Guest(256, "dirtier:wss=64M,rate=2000")
# Rewrites 256 MiB at 150,000 pages/s, far above a 24 MiB/s stream; anonymous
# memory, which userfaultfd serves: hybrid postcopy.
HOT = Guest(512, "dirtier:wss=256M,rate=150000", memory_backing="anonymous")
HOT_LINK_MIB = 24
# 300 MiB of checksummed working set on a 512 MiB VM, for a destination giving VMs 400 MiB.
BIG = Guest(512, "dirtier:wss=300M,rate=2000")


def _adopting_spawn(test: Any) -> Any:
    """Nova's spawn replaced by booting the lab's measuring guest as this instance."""

    def spawn(driver: Any, context: Any, instance: Any, *args: Any, **kwargs: Any) -> None:
        plain_xml = vmspec.domain_xml
        guest = test.guest

        def with_nova_uuid(spec: Any, kernel: str, initrd: str) -> str:
            xml = plain_xml(spec, kernel, initrd)
            return xml.replace("</name>", f"</name>\n  <uuid>{instance.uuid}</uuid>", 1)

        with mock.patch.object(vmspec, "domain_xml", with_nova_uuid):
            lab_vm.create(
                test.lab,
                HOSTS[driver._flexmig_lab_host],
                ram=f"{guest.ram_mb}M",
                workload=guest.workload,
                memory_backing=guest.memory_backing,
                name=instance.name,
            )

    return spawn


@pytest.mark.usefixtures("nova_lab")
class TestNovaMovesRealGuest(
    FlexMigDriverMixin,
    integrated_helpers._IntegratedTestBase,
    integrated_helpers.InstanceHelperMixin,
):
    ADMIN_API = True
    microversion = "latest"
    lab: Any = None  # set by the nova_lab fixture

    def setUp(self) -> None:
        if not os.path.exists(API_PASTE):
            self.skipTest(f"{API_PASTE} is missing: tools/setup.sh fetches it")
        super().setUp()
        self.flags(instances_path=self.useFixture(fixtures.TempDir()).path)
        self.flags(virt_type="qemu", file_backed_memory=16384, group="libvirt")
        self.flags(ram_allocation_ratio=1.0, reserved_host_memory_mb=0)
        self.flags(agent_key_file=str(self.lab.key_file), group="flexmig")
        self.flags(dirty_sample_seconds=[1, 2], group="migration")
        self.useFixture(
            fixtures.MonkeyPatch(
                "nova.virt.libvirt.driver.LibvirtDriver.spawn", _adopting_spawn(self)
            )
        )
        # Nova's harness forbids the libvirt event thread; the driver works without
        # it (it polls job state), as Nova's own functional tests do.
        fakelibvirt.disable_event_thread(self)
        # …and forbids reading this machine's interfaces (Nova's my_ip check).
        self.useFixture(fixtures.MockPatch("nova.compute.utils.get_machine_ips", return_value=[]))
        self.computes = {}
        for nova_host, lab_host in HOSTS.items():
            self.computes[nova_host] = self._start_lab_compute(nova_host, lab_host)
        self.guest = MODERATE

    def _start_lab_compute(self, nova_host: str, lab_host: str) -> Any:
        host = self.lab.host(lab_host)
        # Each compute's nova.conf points at its host's libvirtd (here: its
        # socket, reachable from this namespace).
        self.flags(connection_uri=host.local_uri, group="libvirt")
        # Each host has its own compute-node identity (Nova keeps it in a file
        # under state_path, which the computes in this process share).
        node_uuid = str(getattr(uuids, f"node_{nova_host}"))
        with mock.patch("nova.virt.node.get_local_node_uuid", return_value=node_uuid):
            compute = self.start_service("compute", host=nova_host)
            compute.driver._host.get_node_uuid()
        # …and at its host's agent, whose API this namespace reaches on its
        # UNIX socket (AgentClient: port 0).
        compute.driver._agent_endpoint = (str(host.agent_socket), 0)
        compute.driver._flexmig_lab_host = nova_host
        # The driver asks the destination's libvirt, at Nova's migration URI
        # (qemu+tcp://lab-b/system), whether it runs a migrated VM: a name only
        # the lab's namespaces resolve.  From here, that host's socket.
        connect = compute.driver._host._connect

        def lab_connect(uri: str, read_only: bool) -> Any:
            peer = HOSTS.get(urllib.parse.urlsplit(uri).hostname or "")
            return connect(self.lab.host(peer).local_uri if peer else uri, read_only)

        compute.driver._host._connect = lab_connect
        return compute

    def tearDown(self) -> None:
        for name in lab_vm.list_vms(self.lab):
            if name.startswith("instance-"):
                lab_vm.destroy(self.lab, name)
        super().tearDown()

    def _wait_for_end(self, server: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            found = self.admin_api.api_get(f"/os-migrations?instance_uuid={server['id']}").body[
                "migrations"
            ]
            current = self.admin_api.get_server(server["id"])
            if (
                found
                and found[0]["status"] in FINAL_STATES
                and not current["OS-EXT-STS:task_state"]
            ):
                return found[0]
            time.sleep(0.5)
        self.fail(f"the live migration did not end within {WAIT_S:.0f} s")

    def _running_on(self, name: str) -> list[str]:
        where = []
        for lab_host in HOSTS.values():
            host = self.lab.host(lab_host)
            with hypervisor.connect(host.local_uri, lab_host) as conn:
                dom = hypervisor.find_domain(conn, name)
                if dom is not None and dom.isActive():
                    where.append(lab_host)
        return where

    def _boot_and_migrate(
        self, guest: Guest, before_migration: Any = None
    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """Boot ``guest`` on lab-a through Nova, live-migrate it to lab-b through Nova's API.

        ``before_migration(lab_guest)`` runs once the guest is up on lab-a.
        Returns (instance name, the finished migration, what the guest saw).
        """
        self.guest = guest
        flavor = self._create_flavor(memory_mb=guest.ram_mb, vcpu=1, disk=0, ephemeral=0)
        body = self._build_server(flavor_id=flavor, networks="none", host="lab-a")
        server = self.admin_api.post_server({"server": body})
        # A TCG guest boots in seconds to tens of seconds on this machine.
        server = self._wait_for_server_parameter(server, {"status": "ACTIVE"}, max_retries=240)
        name = self.admin_api.get_server(server["id"])["OS-EXT-SRV-ATTR:instance_name"]
        self.assertEqual(["A"], self._running_on(name))
        lab_guest = lab_vm.LabVM(self.lab, name)
        if before_migration is not None:
            before_migration(lab_guest)
        start_ns = time.monotonic_ns()

        self.api.post_server_action(
            server["id"], {"os-migrateLive": {"host": "lab-b", "block_migration": "auto"}}
        )
        migration = self._wait_for_end(server)

        self.assertEqual("completed", migration["status"])
        current = self.admin_api.get_server(server["id"])
        self.assertEqual(("ACTIVE", "lab-b"), (current["status"], current["OS-EXT-SRV-ATTR:host"]))
        self.assertEqual(["B"], self._running_on(name))
        # The driver's check before Nova's post-migration: lab-b's libvirt runs it.
        self.assertIn("qemu+tcp://lab-b/system runs the VM", self.stdlog.logger.output)
        lab_guest.wait_heartbeat(host="B")
        beats = lab_guest.heartbeat(since_ns=start_ns)
        self.assertEqual("B", beats.hosts[-1], beats.hosts)
        report = lab_guest.verify()
        self.assertEqual((0, 0), (report["bad"], report["lost"]), report)
        self.assertGreater(report["ok"], 0)
        seen = {
            "events": self._flexmig_events(server),
            "longest_gap_ms": round(beats.longest_gap_ms, 1),
            "verify": report,
        }
        print(f"nova e2e: {name} lab-a -> lab-b: {seen}")  # for the record (pytest -s)
        return name, migration, seen

    def _flexmig_events(self, server: dict[str, Any]) -> list[str]:
        actions = self.admin_api.get_instance_actions(server["id"])
        live = next(a for a in actions if a["action"] == "live-migration")
        detail = self.admin_api.get_instance_action_details(server["id"], live["request_id"])
        return [e["event"] for e in detail["events"] if e["event"].startswith("flexmig_")]

    def test_moderate_guest_goes_by_precopy(self) -> None:
        _name, _migration, seen = self._boot_and_migrate(MODERATE)
        self.assertEqual(["flexmig_precopy"], seen["events"])
        # lab-b's agent wrote the file-backed guest's memory back as pages arrived
        rounds = re.search(r"store writeback ended after (\d+) rounds", self.stdlog.logger.output)
        self.assertIsNotNone(rounds, "the destination never ended a store writeback")
        self.assertGreater(int(rounds.group(1)), 0)

    def test_nova_plans_from_the_agents_recent_samples(self) -> None:
        """The driver takes the samples the source's agent already has (here: its
        inventory's, as a drain's or the background sampler's) instead of sampling."""

        def inventory(_guest: Any) -> None:
            vms = self.lab.agent("A").post("/v1/inventory", {})["vms"]
            self.assertEqual(1, len([vm for vm in vms if vm["name"].startswith("instance-")]))

        name, _migration, seen = self._boot_and_migrate(MODERATE, before_migration=inventory)
        self.assertEqual(["flexmig_precopy"], seen["events"])
        self.assertIn(f"planning {name} from the host agent's", self.stdlog.logger.output)
        self.assertNotIn(f"sampling {name}'s dirty rate here", self.stdlog.logger.output)

    def test_hot_guest_goes_by_hybrid_postcopy(self) -> None:
        # Anonymous memory on both ends, and a 24 MiB/s stream (Nova's own cap): at 64
        # a loaded CI machine's TCG guest sampled slower than the stream (predicted to
        # converge in 29 rounds) and precopy was rightly chosen (tests/functional/
        # test_modes.py's HOT_LINK_MIB, for the same reason).
        self.flags(file_backed_memory=0, live_migration_bandwidth=HOT_LINK_MIB, group="libvirt")
        self.flags(stream_bandwidth_mib=HOT_LINK_MIB, group="migration")
        _name, _migration, seen = self._boot_and_migrate(HOT)
        self.assertEqual(["flexmig_postcopy"], seen["events"])

    def test_short_destination_goes_by_split_with_capped_residency(self) -> None:
        self.lab.set_budget("B", 400)  # less than the VM's 512 MiB plus QEMU's own
        self.addCleanup(self.lab.set_budget, "B", 4096)
        name, _migration, seen = self._boot_and_migrate(BIG)
        self.assertEqual(["flexmig_split"], seen["events"])
        group = CGROUP_ROOT / "lab-b" / name
        limit = int((group / "memory.limit_in_bytes").read_text())
        self.assertEqual((400 - 160) * MIB, limit)
        self.assertLessEqual(int((group / "memory.max_usage_in_bytes").read_text()), limit)
        # 300 MiB of verified working set lives on a host capped below it.
        self.assertGreater(seen["verify"]["pages"] * 4096, limit)
        # The source sampled the guest's hot chunks while the plan was made and
        # handed them to B's keeper before the job (nova_driver.driver).
        self.assertRegex(
            self.stdlog.logger.output, r"FlexMig: the guest wrote \d+ MiB in [\d.]+ s; kept"
        )

    def test_guest_goes_over_the_movers_with_parallel_connections(self) -> None:
        """The Nova path over the ``mover`` transport: the destination's agent starts
        receiving movers in pre_live_migration, the source's agent the sending ones,
        QEMU migrates over ``unix://`` through them, one pair per connection."""
        self.flags(transport="mover", group="migration")
        self.flags(live_migration_parallel_connections=2, group="libvirt")
        _name, _migration, seen = self._boot_and_migrate(MODERATE)
        self.assertEqual(["flexmig_precopy"], seen["events"])
        log = self.stdlog.logger.output
        for side in ("source", "destination"):
            moved = re.search(rf"{side} movers moved (\d+) bytes in (\d+) stream", log)
            self.assertIsNotNone(moved, f"the {side}'s movers never reported:\n{log[-3000:]}")
            # QEMU's main connection and its two multifd channels, each its own pair
            self.assertEqual(3, int(moved.group(2)))
            # at least the guest's 64 MiB working set went through them
            self.assertGreater(int(moved.group(1)), 64 * MIB)

    def test_guest_with_offloaded_flows_keeps_them_offloaded_on_the_destination(self) -> None:
        """The guest sends UDP through its tap, offloaded by the XDP eSwitch on lab-a;
        after Nova's live migration the flow is offloaded on lab-b with lab-a's counts."""
        if not all(offload.running(self.lab.host(h)) for h in ("A", "B")):
            self.skipTest("flexmig-offload is not running on the lab hosts (xdp provider)")
        services = {h: offload.LabOffload(self.lab.host(h)) for h in ("A", "B")}
        for service in services.values():
            service.start(OFFLOAD_POLICY)
            self.addCleanup(service.start)
        receiver = endpoints.add(self.lab, "B", "nr1")
        self.addCleanup(endpoints.delete, self.lab, "nr1")
        recv = traffic.Receiver(endpoints.exec_prefix(receiver), 7001, duration=120, idle_ms=5000)
        self.addCleanup(recv.proc.kill)

        def send_and_wait_offloaded(lab_guest: Any) -> None:
            lab_guest.udpgen_start(
                "nova",
                ["send", "--dst", receiver.ip, "--port", "7001", "--sport", "43001",
                 "--rate", "1000", "--count", "40000", "--size", "64", "--batch", "8"],
            )  # fmt: skip
            self._wait_tap_flow(services["A"], lambda f: f["state"] == "offloaded")

        name, _migration, _seen = self._boot_and_migrate(MODERATE, send_and_wait_offloaded)
        flow = self._wait_tap_flow(services["B"], lambda f: f["state"] == "offloaded")
        self.assertIn("re-offloaded after migration", flow["reason"])
        self.assertIsNone(_tap_flow(services["A"].status()))
        sent = lab_vm.LabVM(self.lab, name).udpgen_result("nova", timeout=90)["sent_packets"]
        received = recv.result()["received_packets"]
        time.sleep(1.5)
        total = _tap_flow(services["B"].status())["packets"]
        self.assertLessEqual(received, total)
        self.assertLessEqual(total, sent)
        if received == sent:
            self.assertEqual(sent, total)
        migrations = services["B"].status()["migrations"]
        self.assertEqual("settled", migrations[-1]["state"], migrations)

    def _wait_tap_flow(self, service: Any, predicate: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                flow = _tap_flow(service.status())
            except (OSError, ValueError):
                flow = None
            if flow is not None and predicate(flow):
                return flow
            time.sleep(0.1)
        self.fail(f"the guest's flow never got there: {service.status()['flows']}")


OFFLOAD_POLICY = """\
capacity: 64
header_rules:
  - {name: guest-udp, ip_proto: udp, tp_dst: 7001, action: offload}
statistics:
  window_s: 0.5
  promote_pps: 1000000
  demote_pps: 1
  demote_intervals: 10000
"""


def _tap_flow(status: dict[str, Any]) -> dict[str, Any] | None:
    for flow in status["flows"]:
        m = flow["match"]
        if (m["tp_src"], m["tp_dst"]) == (43001, 7001) and m["in_port"].startswith("tap"):
            return flow
    return None
