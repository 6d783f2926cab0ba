"""What Nova's functional harness lacks for FlexMig: an agent, and a migrating QEMU.

``InProcessAgent`` runs the real flexmig-agent service code (its router, HMAC
verifier, host facts and split store) on loopback with a test key; its
libvirt is libvirt's own ``test:///`` driver on an empty node, so its facts
are computed, not stubbed.

``GuestWorkloads`` extends Nova's fakelibvirt where it stops short of what
FlexMig reads and drives, the way Nova's own tests stub ``migrateToURI3``:
dirty-rate calculations answer from a per-guest dirty-page model (the
seed-000 curve the policy fits), a domain keeps its ``memoryBacking``, and a
migration runs in precopy rounds that publish job statistics, switch to
postcopy only when asked and only with the postcopy flag, and complete, or
fail when precopy cannot converge.  A source domain destroyed mid-migration
ends its migration as a killed QEMU does: the call fails, nothing reaches the
destination, and its job statistics answer as libvirt's do for an inactive
domain (which Nova reads as COMPLETED).

``RemoteLibvirt`` lets a libvirt URI naming a compute host (Nova's migration
URI, ``qemu+tcp://<host>/system``) reach that compute's fakelibvirt
connection, as a real client reaches that host's libvirtd.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import fixtures
import libvirt
from lxml import etree
from nova.tests.fixtures import libvirt as fakelibvirt
from oslo_config import cfg

from agents.agent import api, auth
from agents.agent import config as agent_config
from agents.agent.client import AgentClient
from agents.agent.service import Agent

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_PASTE = os.path.join(ROOT, ".cache", "nova", "api-paste.ini")
DRIVER = "flexmig.FlexMigLibvirtDriver"
MIB = 2**20
PAGE = 4096
TEST_KEY = b"flexmig-nova-functional-test-key"
ROUND_S = 0.6  # longer than the driver's 0.5 s poll: it sees every round
MAX_PRECOPY_ROUNDS = 10
STREAM_BPS = 64 * MIB  # the rate the emulated stream reports (memory_bps)


class FlexMigDriverMixin:
    """What every Nova test class here needs from Nova's harness: our driver, the API pipeline."""

    _testMethodName: str

    def _clear_attrs(self) -> None:
        # Nova frees test attributes at cleanup; pytest's unittest runner bound
        # the test method as one and deletes it afterwards itself.
        method = self.__dict__.get(self._testMethodName)
        super()._clear_attrs()  # type: ignore[misc]
        if method is not None:
            self.__dict__[self._testMethodName] = method

    def _setup_services(self) -> None:
        # Nova's harness reads the API pipeline from the sdist's api-paste.ini.
        self.flags(api_paste_config=API_PASTE, group="wsgi")  # type: ignore[attr-defined]
        super()._setup_services()  # type: ignore[misc]

    def _setup_compute_service(self) -> None:
        self.flags(compute_driver=DRIVER)  # type: ignore[attr-defined]


class InProcessAgent(fixtures.Fixture):
    """A flexmig-agent serving on 127.0.0.1 with ``memory_budget_mb`` for VMs."""

    def __init__(self, memory_budget_mb: int) -> None:
        super().__init__()
        self.memory_budget_mb = memory_budget_mb

    def _setUp(self) -> None:
        root = self.useFixture(fixtures.TempDir()).path
        self.key_file = os.path.join(root, "agent.key")
        with open(self.key_file, "wb") as f:
            f.write(TEST_KEY)
        node = os.path.join(root, "node.xml")
        with open(node, "w", encoding="ascii") as f:
            f.write("<node>\n</node>\n")
        self.store_dir = os.path.join(root, "store")
        os.mkdir(self.store_dir)
        settings = {
            "listen_address": "127.0.0.1",
            "key_file": self.key_file,
            "store_dir": self.store_dir,
            "state_dir": os.path.join(root, "state"),
            "libvirt_uri": f"test://{node}",
            "memory_budget_mb": self.memory_budget_mb,
            "cgroup_parent": f"flexmig-nova-test-{os.getpid()}",
        }
        conf_file = os.path.join(root, "flexmig-agent.conf")
        with open(conf_file, "w", encoding="ascii") as f:
            f.write("[agent]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
        conf = cfg.ConfigOpts()
        agent_config.register_opts(conf)
        conf(["--config-file", conf_file], project="flexmig-test", default_config_files=[])
        self.agent = Agent(conf)
        server = api.make_servers(
            "127.0.0.1", 0, None, auth.Verifier(self.agent.key), self.agent.router
        )[0]
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.addCleanup(thread.join, 10)
        self.addCleanup(server.server_close)
        self.addCleanup(server.shutdown)

    def client(self) -> AgentClient:
        return AgentClient("127.0.0.1", self.port, TEST_KEY)

    def reservation(self, vm: str) -> dict[str, int] | None:
        return self.client().get(f"/v1/split/{vm}")["reservation"]


class RemoteLibvirt(fixtures.Fixture):
    """``openAuth`` of a URI whose host ``connection_of`` knows: that host's
    connection; any other URI opens as fakelibvirt opens it."""

    def __init__(self, connection_of: Callable[[str], Any | None]) -> None:
        super().__init__()
        self.connection_of = connection_of

    def _setUp(self) -> None:
        original = fakelibvirt.openAuth

        def open_auth(uri: str, auth: Any, flags: int = 0) -> Any:
            host = urllib.parse.urlsplit(uri).hostname
            found = self.connection_of(host) if host else None
            return found if found is not None else original(uri, auth, flags)

        self.useFixture(fixtures.MonkeyPatch(f"{fakelibvirt.__name__}.openAuth", open_auth))
        # libvirt's virConnect.close(), which fakelibvirt lacks; closing a
        # client's connection leaves the host's daemon, here its compute's, as it is.
        self.useFixture(
            fixtures.MonkeyPatch(f"{fakelibvirt.__name__}.Connection.close", lambda conn: 0)
        )


@dataclasses.dataclass
class Workload:
    """A guest's writable working set (pages) and its half-life: D(t) = M(1 - 2^(-t/tau))."""

    m_pages: float = 0.0
    tau_s: float = 1.0
    converges: bool = True  # whether precopy alone can finish

    def mib_per_s(self, seconds: int) -> int:
        pages = self.m_pages * (1 - 0.5 ** (seconds / self.tau_s))
        return round(pages * PAGE / MIB / seconds)


IDLE = Workload()
# 200 MiB rewritten with a 0.5 s half-life: far above what the stream moves.
HOT = Workload(m_pages=200 * MIB / PAGE, tau_s=0.5, converges=False)


@dataclasses.dataclass
class MigrationSeen:
    """What the emulated QEMU was asked to do for one migration."""

    vm: str
    flags: int
    params: dict[str, Any]
    max_downtime_ms: list[int] = dataclasses.field(default_factory=list)
    dirty_periods: list[int] = dataclasses.field(default_factory=list)
    postcopy_after_round: int | None = None
    paused_at_round: int | None = None  # stop-and-copy: the guest paused mid-precopy
    rounds: int = 0
    outcome: str = "not started"
    resumes: int = 0  # POSTCOPY_RESUME calls after a postcopy broke


class GuestWorkloads(fixtures.Fixture):
    """Per-guest workloads and migration behaviour for Nova's fakelibvirt."""

    def __init__(self, dest_connection: Any, by_uri: bool = False) -> None:
        super().__init__()
        # ``dest_connection()``, or with ``by_uri`` ``dest_connection(dconnuri)``
        # when there are several destinations.
        self.dest_connection = dest_connection
        self.by_uri = by_uri
        self.workloads: dict[str, Workload] = {}
        self.fail: set[str] = set()
        # Guests whose postcopy stream breaks once (QEMU pauses postcopy on
        # both hosts); a later POSTCOPY_RESUME completes it.
        self.break_postcopy: set[str] = set()
        # Guests whose source libvirtd restarts as QEMU completes the move:
        # the call ends with 'End of file', the handles taken before the
        # restart answer 'client socket is closed' until looked up again.
        self.restart_source_libvirtd: set[str] = set()
        self.seen: dict[str, MigrationSeen] = {}
        self.hold = threading.Event()  # set: rounds run freely
        self.hold.set()

    def _setUp(self) -> None:
        harness = self
        domain = fakelibvirt.Domain
        parse = domain._parse_definition
        xml_desc = domain.XMLDesc

        def parse_keeping_backing(dom: Any, xml: str) -> dict[str, Any]:
            definition = parse(dom, xml)
            backing = etree.fromstring(xml).find("./memoryBacking")
            definition["memory_backing"] = (
                etree.tostring(backing, encoding="unicode") if backing is not None else ""
            )
            return definition

        def xml_with_backing(dom: Any, flags: int) -> str:
            xml = xml_desc(dom, flags)
            backing = dom._def.get("memory_backing", "")
            return xml.replace("</domain>", backing + "</domain>", 1) if backing else xml

        def start_dirty_rate_calc(dom: Any, seconds: int, flags: int = 0) -> None:
            dom._dirty_period = seconds
            harness.record(dom.name()).dirty_periods.append(seconds)

        def job_stats(dom: Any, flags: int = 0) -> dict[str, int]:
            if getattr(dom, "_handle_died", False):
                raise _libvirt_error(
                    "internal error: client socket is closed", fakelibvirt.VIR_ERR_INTERNAL_ERROR
                )
            if dom._state == fakelibvirt.VIR_DOMAIN_SHUTOFF:
                # libvirt's answer for an inactive domain (virDomainGetJobStats).
                raise _not_running(dom)
            return dict(getattr(dom, "_flexmig_job", None) or {"type": dom._job_type})

        def set_max_downtime(dom: Any, ms: int) -> None:
            harness.record(dom.name()).max_downtime_ms.append(ms)

        def start_postcopy(dom: Any, flags: int = 0) -> None:
            record = harness.record(dom.name())
            if not record.flags & fakelibvirt.VIR_MIGRATE_POSTCOPY:
                raise fakelibvirt.make_libvirtError(
                    fakelibvirt.libvirtError,
                    "Requested operation is not valid: postcopy migration was not enabled",
                    error_code=fakelibvirt.VIR_ERR_OPERATION_INVALID,
                    error_domain=fakelibvirt.VIR_FROM_QEMU,
                )
            record.postcopy_after_round = record.rounds

        def list_stats(conn: Any, doms: list[Any], stats: int, flags: int = 0) -> list[Any]:
            out = []
            for dom in doms:
                period = getattr(dom, "_dirty_period", 1)
                load = harness.workloads.get(dom.name(), IDLE)
                out.append(
                    (
                        dom,
                        {
                            "dirtyrate.calc_status": 2,  # VIR_DOMAIN_DIRTYRATE_MEASURED
                            "dirtyrate.calc_period": period,
                            "dirtyrate.megabytes_per_second": load.mib_per_s(period),
                        },
                    )
                )
            return out

        for name, value in {
            "_parse_definition": parse_keeping_backing,
            "XMLDesc": xml_with_backing,
            "startDirtyRateCalc": start_dirty_rate_calc,
            "jobStats": job_stats,
            "migrateSetMaxDowntime": set_max_downtime,
            "migrateStartPostCopy": start_postcopy,
            "migrateToURI3": self._migrate,
            # libvirt's virDomain.state(), which the engine's recovery reads.
            "state": lambda dom, flags=0: [dom._state, 0],
        }.items():
            self.useFixture(fixtures.MonkeyPatch(f"{domain.__module__}.Domain.{name}", value))
        self.useFixture(
            fixtures.MonkeyPatch(f"{domain.__module__}.Connection.domainListGetStats", list_stats)
        )
        lookup_by_uuid = fakelibvirt.Connection.lookupByUUIDString

        def fresh_lookup(conn: Any, uuid: str) -> Any:
            dom = lookup_by_uuid(conn, uuid)
            dom._handle_died = False  # a handle from the restarted daemon
            return dom

        self.useFixture(
            fixtures.MonkeyPatch(f"{domain.__module__}.Connection.lookupByUUIDString", fresh_lookup)
        )
        # libvirt's virConnect.lookupByName, which Nova's fake lacks: the
        # engine's postcopy recovery reads the source on Nova's connection.
        self.useFixture(
            fixtures.MonkeyPatch(f"{domain.__module__}.Connection.lookupByName", _lookup_by_name)
        )

    def _resume(self, dom: Any, dconnuri: str) -> None:
        """libvirt's POSTCOPY_RESUME: only a postcopy that broke can be resumed."""
        record = self.record(dom.name())
        if record.outcome != "postcopy-paused":
            raise fakelibvirt.make_libvirtError(
                fakelibvirt.libvirtError,
                f"Requested operation is not valid: domain '{dom.name()}' is not being migrated",
                error_code=fakelibvirt.VIR_ERR_OPERATION_INVALID,
                error_domain=fakelibvirt.VIR_FROM_QEMU,
            )
        record.resumes += 1
        dest = self.dest_connection(dconnuri) if self.by_uri else self.dest_connection()
        dest.createXML(record.params["destination_xml"], 0)
        record.outcome = "completed"
        dom.complete_job()

    def record(self, vm: str) -> MigrationSeen:
        return self.seen.setdefault(vm, MigrationSeen(vm, 0, {}))

    def _migrate(self, dom: Any, dconnuri: str, params: dict[str, Any], flags: int) -> None:
        """QEMU's precopy rounds, as job statistics the driver's monitor reads."""
        if flags & libvirt.VIR_MIGRATE_POSTCOPY_RESUME:
            self._resume(dom, dconnuri)
            return
        record = self.record(dom.name())
        record.flags, record.params, record.outcome = flags, params, "running"
        load = self.workloads.get(dom.name(), IDLE)
        total = dom.maxMemory() * 1024
        processed = 0
        for index in range(1, MAX_PRECOPY_ROUNDS + 1):
            record.rounds = index
            sent = total if index == 1 else min(total, round(load.m_pages * PAGE) or total // 64)
            processed += sent
            dirty = round(load.m_pages * PAGE) if not load.converges else total // (64 * index)
            dom._flexmig_job = {
                "type": fakelibvirt.VIR_DOMAIN_JOB_UNBOUNDED,
                "memory_total": total,
                "memory_processed": processed,
                "memory_remaining": dirty,
                "memory_iteration": index,
                "memory_bps": STREAM_BPS,
            }
            time.sleep(ROUND_S)
            if index == 1:
                self.hold.wait(30)
            if dom._state == fakelibvirt.VIR_DOMAIN_SHUTOFF:
                # Destroyed mid-migration: its QEMU is gone, and the stream with it.
                record.outcome = "source stopped"
                dom._flexmig_job = None
                raise _not_running(dom)
            if record.postcopy_after_round is not None:
                break
            if dom._state == fakelibvirt.VIR_DOMAIN_PAUSED:
                # A paused guest dirties nothing: the remainder moves and QEMU completes.
                record.paused_at_round = index
                break
            if load.converges and index >= 2:
                break
        converged = load.converges or (
            record.postcopy_after_round is not None or record.paused_at_round is not None
        )
        if record.postcopy_after_round is not None and dom.name() in self.break_postcopy:
            # The VM runs on the destination, its memory split: both sides pause.
            self.break_postcopy.discard(dom.name())
            record.outcome = "postcopy-paused"
            dom._flexmig_job = None
            dom._state = fakelibvirt.VIR_DOMAIN_PAUSED
            dom.fail_job()
            raise fakelibvirt.make_libvirtError(
                fakelibvirt.libvirtError,
                "operation failed: job 'migration out' failed in post-copy phase",
                error_code=fakelibvirt.VIR_ERR_OPERATION_FAILED,
                error_domain=fakelibvirt.VIR_FROM_QEMU,
            )
        if dom.name() in self.fail or not converged:
            record.outcome = "failed"
            dom._flexmig_job = None
            dom.fail_job()
            raise fakelibvirt.make_libvirtError(
                fakelibvirt.libvirtError,
                "operation failed: migration out of job: "
                + ("injected failure" if dom.name() in self.fail else "precopy never converged"),
                error_code=fakelibvirt.VIR_ERR_OPERATION_FAILED,
                error_domain=fakelibvirt.VIR_FROM_QEMU,
            )
        dest = self.dest_connection(dconnuri) if self.by_uri else self.dest_connection()
        dest.createXML(params["destination_xml"], 0)
        record.outcome = "completed"
        dom._flexmig_job = None
        if dom.name() in self.restart_source_libvirtd:
            # QEMU completed; the restarted daemon finds it gone (shut off).
            self.restart_source_libvirtd.discard(dom.name())
            record.outcome = "completed across a source libvirtd restart"
            dom._state, dom._handle_died = fakelibvirt.VIR_DOMAIN_SHUTOFF, True
            raise _libvirt_error(
                "End of file while reading data: Input/output error",
                fakelibvirt.VIR_ERR_SYSTEM_ERROR,
            )
        dom.complete_job()


def _lookup_by_name(conn: Any, name: str) -> Any:
    if name in conn._vms:
        return conn._vms[name]
    raise fakelibvirt.make_libvirtError(
        fakelibvirt.libvirtError,
        f"Domain not found: no domain with matching name '{name}'",
        error_code=fakelibvirt.VIR_ERR_NO_DOMAIN,
        error_domain=fakelibvirt.VIR_FROM_QEMU,
    )


def _not_running(dom: Any) -> Exception:
    return fakelibvirt.make_libvirtError(
        fakelibvirt.libvirtError,
        f"Requested operation is not valid: domain '{dom.name()}' is not running",
        error_code=fakelibvirt.VIR_ERR_OPERATION_INVALID,
        error_domain=fakelibvirt.VIR_FROM_QEMU,
    )


def _libvirt_error(message: str, code: int) -> Exception:
    return fakelibvirt.make_libvirtError(
        fakelibvirt.libvirtError, message, error_code=code, error_domain=fakelibvirt.VIR_FROM_RPC
    )
