"""Migrations run by the source host's agent: plan, prepare, execute, report.

The agent gathers the policy's inputs (the VM's memory facts and dirty-rate
samples here, the destination's facts from its agent), lets
``flexmig.policy`` decide, prepares the destination (split), runs the mode's
job and keeps progress and events for whoever polls.  On any failure the
destination is cleaned up and the VM is left running on the source.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from stevedore import driver

from agents.agent import auth, inventory, movers, privileged
from agents.agent.client import AgentClient
from agents.agent.offload_hook import OffloadHook
from flexmig import exceptions, hypervisor, vm_facts
from flexmig.modes.base import MigrationMode
from flexmig.modes.job import JobConfig, JobResult, MigrationJob
from flexmig.policy import dirty_model
from flexmig.policy.decision import Decision, MigrationInputs, decide
from flexmig.policy.transport import TransportChoice, choose_transport

EWMA_WEIGHT = 0.5
MAX_EVENTS = 200
PROBE_MIB = 64
PROBE_MAX_AGE_S = 600.0


@dataclasses.dataclass
class LinkEstimate:
    """What the agent has measured about migrating to one destination."""

    fabric_bps: float = 0.0  # raw path, by probe
    fabric_measured_at: float = 0.0
    stream_bps: float | None = None  # QEMU's migration stream (memory_bps), learned
    setup_s: float = 0.0  # job start until the first page moves
    switchover_s: float = 0.05

    def learn(self, stats: dict[str, int]) -> None:
        bps, elapsed_ms = stats.get("memory_bps", 0), stats.get("time_elapsed", 0)
        if bps <= 0 or elapsed_ms <= 0:
            return
        downtime_s = stats.get("downtime", 0) / 1000
        transfer_s = stats.get("memory_processed", 0) / bps
        setup = max(0.0, elapsed_ms / 1000 - transfer_s - downtime_s)
        if self.stream_bps is None:
            self.stream_bps, self.setup_s, self.switchover_s = bps, setup, downtime_s
            return
        self.stream_bps += EWMA_WEIGHT * (bps - self.stream_bps)
        self.setup_s += EWMA_WEIGHT * (setup - self.setup_s)
        self.switchover_s += EWMA_WEIGHT * (downtime_s - self.switchover_s)


@dataclasses.dataclass(frozen=True)
class Destination:
    agent: AgentClient
    libvirt_uri: str
    migration_uri: str


def load_mode(name: str) -> MigrationMode:
    try:
        return driver.DriverManager("flexmig.modes", name, invoke_on_load=True).driver
    except Exception as exc:
        raise exceptions.InvalidInput(what="migration mode", reason=f"{name}: {exc}") from exc


@dataclasses.dataclass
class MigrationRecord:
    id: str
    vm: str
    dest: str
    requested_mode: str
    bandwidth_mib: int = 0
    downtime_budget_ms: int = 0
    requested_transport: str = "auto"
    store_writeback: bool = True
    writeback_rounds: int | None = None
    parallel: int = 1  # libvirt parallel connections (QEMU multifd channels); 1: none
    transport: TransportChoice | None = None
    state: str = "planning"
    decision: Decision | None = None
    progress: dict[str, int] = dataclasses.field(default_factory=dict)
    phase: str = "planning"
    events: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)

    def event(self, text: str) -> None:
        self.events.append((time.time(), text))
        del self.events[:-MAX_EVENTS]

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "vm": self.vm,
            "dest": self.dest,
            "state": self.state,
            "phase": self.phase,
            "requested_mode": self.requested_mode,
            "mode": self.decision.mode if self.decision else None,
            "transport": dataclasses.asdict(self.transport) if self.transport else None,
            "explanation": self.decision.explain() if self.decision else None,
            "progress": self.progress,
            "events": self.events,
            "summary": self.summary,
            "error": self.error,
        }


class MigrationService:
    def __init__(
        self,
        host: str,
        conf: Any,
        sample_seconds: tuple[int, ...],
        offload: OffloadHook | None = None,
    ) -> None:
        self.host = host
        self.offload = offload
        self.conf = conf
        self.sample_seconds = sample_seconds
        self.records: dict[str, MigrationRecord] = {}
        self.links_file = Path(conf.agent.state_dir) / "links.json"
        self.links = self._load_links()
        self.lock = threading.Lock()
        # Samples a drain's inventory just took: its migrations decide on them.
        self.samples = inventory.SampleCache()

    def _load_links(self) -> dict[str, LinkEstimate]:
        """What earlier runs of this agent learned about each destination."""
        try:
            data = json.loads(self.links_file.read_text())
            return {peer: LinkEstimate(**fields) for peer, fields in data.items()}
        except (OSError, ValueError, TypeError):
            return {}

    def _save_links(self) -> None:
        self.links_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.links_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({p: dataclasses.asdict(v) for p, v in self.links.items()}))
        tmp.replace(self.links_file)

    # -- planning -------------------------------------------------------------
    def plan(
        self,
        vm: str,
        dest: Destination,
        mode: str = "auto",
        max_downtime_ms: int | None = None,
        bandwidth_mib: int = 0,
    ) -> Decision:
        with hypervisor.connect(self.conf.agent.libvirt_uri, self.host) as conn:
            dom = hypervisor.find_domain(conn, vm)
            if dom is None or not dom.isActive():
                raise exceptions.InvalidInput(what="VM", reason=f"{vm!r} is not running here")
            mem = vm_facts.memory_facts(dom, self.host, privileged.qemu_ram_mapping)
            samples = self.samples.take(vm) or vm_facts.sample_dirty_pages(
                conn, dom, self.host, self.sample_seconds
            )
        facts = dest.agent.get("/v1/facts")
        link = self.link(dest)
        initial = self.conf.agent.initial_stream_bandwidth_mib * 2**20
        bandwidth = link.stream_bps or min(initial, link.fabric_bps)
        if bandwidth_mib:
            bandwidth = min(bandwidth, bandwidth_mib * 2**20)
        inputs = MigrationInputs(
            vm=vm,
            ram_bytes=mem.ram_bytes,
            resident_bytes=mem.resident_bytes,
            dirty=dirty_model.fit(samples, max_pages=mem.ram_bytes / vm_facts.PAGE),
            bandwidth_bps=bandwidth,
            dest_free_bytes=int(facts["free_for_vms_bytes"]),
            dest_store_free_bytes=int(facts["store_free_bytes"]),
            file_backed=mem.file_backed,
            max_downtime_ms=max_downtime_ms or self.conf.agent.max_downtime_ms,
            postcopy_blocker=mem.postcopy_blocker,
            setup_s=link.setup_s,
            switchover_s=link.switchover_s,
            dest_store_write_bps=float(facts.get("store_write_bps") or 0.0),
            dest_memory_cgroup=str((facts.get("memory_cgroup") or {}).get("detail") or ""),
        )
        return decide(inputs, mode)

    def link(self, dest: Destination) -> LinkEstimate:
        """This host's estimate for ``dest``, with a fabric probe no older than 10 min."""
        link = self.links.setdefault(dest.agent.address, LinkEstimate())
        if time.time() - link.fabric_measured_at > PROBE_MAX_AGE_S:
            link.fabric_bps = dest.agent.probe_bandwidth(PROBE_MIB)
            link.fabric_measured_at = time.time()
            self._save_links()
        return link

    # -- execution ------------------------------------------------------------
    def start(
        self,
        vm: str,
        dest: Destination,
        mode: str = "auto",
        max_downtime_ms: int | None = None,
        bandwidth_mib: int = 0,
        transport: str = "auto",
        store_writeback: bool = True,
        parallel: int = 1,
    ) -> MigrationRecord:
        record = MigrationRecord(
            id=uuid.uuid4().hex[:12],
            vm=vm,
            dest=dest.agent.address,
            requested_mode=mode,
            bandwidth_mib=bandwidth_mib,
            requested_transport=transport,
            store_writeback=store_writeback,
            parallel=parallel,
        )
        with self.lock:
            if any(
                r.vm == vm and r.state in ("planning", "running") for r in self.records.values()
            ):
                raise exceptions.InvalidInput(what="VM", reason=f"{vm} is already migrating")
            self.records[record.id] = record
        threading.Thread(
            target=self._run,
            args=(record, dest, max_downtime_ms),
            name=f"migration-{record.id}",
            daemon=True,
        ).start()
        return record

    def _run(self, record: MigrationRecord, dest: Destination, max_downtime_ms: int | None) -> None:
        try:
            record.event("sampling the dirty rate and asking the destination for its facts")
            record.decision = self.plan(
                record.vm, dest, record.requested_mode, max_downtime_ms, record.bandwidth_mib
            )
            record.downtime_budget_ms = max_downtime_ms or self.conf.agent.max_downtime_ms
            record.event(f"decided: {record.decision.mode}")
            record.state = "running"
            self._execute(record, dest)
        except exceptions.FlexMigError as exc:
            record.state, record.error = "failed", str(exc)
            record.event(f"failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - a thread must report, never vanish
            record.state, record.error = "failed", f"internal error: {exc!r}"
            record.event(record.error)

    def _execute(self, record: MigrationRecord, dest: Destination) -> None:
        decision = record.decision
        assert decision is not None
        writeback = self._prepare_destination(record, dest)
        record.transport = choose_transport(
            record.requested_transport,
            movers.rdma_provider_present(),
            self.conf.agent.tcp_fabric_transport,
        )
        record.event(f"transport: {record.transport.transport} ({record.transport.reason})")
        sender = None
        migration_uri = dest.migration_uri
        if record.transport.transport == "mover":
            sender = self._start_movers(record, dest)
            migration_uri = "unix://" + movers.socket_path(self.conf.agent.state_dir, record.id)
        flows_moving = self._offload_depart(record, dest)
        try:
            result = self._run_job(record, dest, migration_uri)
        except Exception as exc:
            if flows_moving:
                self.offload.restore(record.id, str(exc), dest.agent, record.event)
            raise
        if flows_moving and result.state != "completed":
            self.offload.restore(record.id, result.error or result.state, dest.agent, record.event)
        mover_stats = self._finish_movers(record, dest, sender, result.state == "completed")
        if writeback:
            record.writeback_rounds = self._end_writeback(record, dest)
        if result.state != "completed":
            if decision.mode == "split" and not result.switched_to_postcopy:
                _quietly(lambda: dest.agent.post("/v1/split/cleanup", {"vm": record.vm}))
            record.state, record.error = "failed", result.error
            record.event(f"failed: {result.error}; the VM runs on {self.host}")
            return
        offload = self.offload.finish(record.id, dest.agent, record.event) if flows_moving else None
        record.summary = self._summary(record, dest, result) | {
            "offload": offload,
            "transport": record.transport.transport,
            "parallel": record.parallel,
            "movers": mover_stats,
            "store_writeback": record.store_writeback,
            "store_writeback_rounds": record.writeback_rounds,
        }
        record.state = "completed"
        record.event("completed")

    def _offload_depart(self, record: MigrationRecord, dest: Destination) -> bool:
        """The VM's offloaded flows back to the vSwitch, their records to the
        destination, before the job starts (so before its switchover)."""
        if self.offload is None:
            return False
        try:
            return self.offload.depart(record.id, record.vm, dest.agent, record.event)
        except exceptions.FlexMigError as exc:
            # The flows stay as they are: the VM migrates, its flows start again there.
            record.event(f"offload: flows not moved with the VM: {exc}")
            return False

    def _prepare_destination(self, record: MigrationRecord, dest: Destination) -> bool:
        """Reserve a split VM's budget or start the store writeback; True for the latter."""
        decision = record.decision
        assert decision is not None
        if decision.mode == "split":
            # A split VM's flusher is set up with its reservation and stays with the VM.
            dest.agent.post(
                "/v1/split/prepare",
                {
                    "vm": record.vm,
                    "ram_bytes": decision.ram_bytes,
                    "budget_bytes": decision.memory_budget_bytes,
                    "headroom_bytes": decision.headroom_bytes,
                },
            )
            record.event(
                f"destination reserved a {decision.memory_budget_bytes >> 20} MiB "
                "resident budget"
            )
            return False
        if record.store_writeback:
            self._request_writeback(record, dest)
        return record.store_writeback

    def _run_job(self, record: MigrationRecord, dest: Destination, migration_uri: str) -> JobResult:
        """Drive libvirt's migration to its end; the job reports progress into the record."""
        decision = record.decision
        assert decision is not None
        config = JobConfig(
            dest_libvirt_uri=dest.libvirt_uri,
            source_libvirt_uri=self.conf.agent.libvirt_uri,
            migration_uri=migration_uri,
            bandwidth_mib=record.bandwidth_mib,
            stall_timeout_s=self.conf.agent.stall_timeout,
            recovery_timeout_s=self.conf.agent.recovery_timeout,
            downtime_budget_ms=record.downtime_budget_ms,
            parallel=record.parallel,
        )

        def progress(phase: str, stats: dict[str, int]) -> None:
            record.phase, record.progress = phase, stats

        def dest_alive() -> bool:
            try:
                dest.agent.get("/v1/health", timeout=2.0)
                return True
            except exceptions.FlexMigError:
                return False

        with hypervisor.connect(self.conf.agent.libvirt_uri, self.host) as conn:
            job = MigrationJob(
                conn.lookupByName(record.vm),
                self.host,
                decision,
                load_mode(decision.mode),
                config,
                on_progress=progress,
                on_event=record.event,
                peer_alive=dest_alive,
            )
            return job.run()

    def _request_writeback(self, record: MigrationRecord, dest: Destination) -> None:
        """Destination QEMU msyncs a file-backed VM's RAM inside the downtime:
        keep what is dirty small by writing the file back as pages arrive."""
        try:
            dest.agent.post("/v1/incoming/writeback", {"vm": record.vm, "active": True})
        except exceptions.FlexMigError as exc:
            record.event(f"destination cannot write the memory file back early: {exc}")

    def _end_writeback(self, record: MigrationRecord, dest: Destination) -> int | None:
        try:
            body = {"vm": record.vm, "active": False}
            return int(dest.agent.post("/v1/incoming/writeback", body)["rounds"])
        except (exceptions.FlexMigError, KeyError, TypeError, ValueError):
            return None

    def _start_movers(self, record: MigrationRecord, dest: Destination) -> movers.MoverSet:
        # Scoped to this migration and never sent: the destination derives the
        # same token from the salt and the key this request is signed with.
        salt = movers.new_token_salt()
        token = auth.mover_token(dest.agent.key, record.id, salt)
        # QEMU's multifd opens the main connection and one per channel.
        streams = record.parallel + 1 if record.parallel > 1 else 1
        ports = dest.agent.post(
            "/v1/mover/receive",
            {"migration_id": record.id, "token_salt": salt, "streams": streams},
        )["ports"]
        try:
            return movers.start_senders(
                self.conf.agent.state_dir,
                self.conf.agent.listen_address,
                dest.agent.address,
                ports,
                record.id,
                token,
            )
        except exceptions.FlexMigError:
            _quietly(
                lambda: dest.agent.post(
                    "/v1/mover/finish", {"migration_id": record.id, "abort": True}
                )
            )
            raise

    def _finish_movers(
        self,
        record: MigrationRecord,
        dest: Destination,
        sender: movers.MoverSet | None,
        ok: bool,
    ) -> dict[str, Any] | None:
        if sender is None:
            return None
        Path(movers.socket_path(self.conf.agent.state_dir, record.id)).unlink(missing_ok=True)
        if not ok:
            sender.kill()
            _quietly(
                lambda: dest.agent.post(
                    "/v1/mover/finish", {"migration_id": record.id, "abort": True}
                )
            )
            return None
        stats = {"send": sender.wait(timeout=30)}
        stats["recv"] = dest.agent.post(
            "/v1/mover/finish", {"migration_id": record.id}, timeout=40
        )["stats"]
        return stats

    def _summary(self, record: MigrationRecord, dest: Destination, result: Any) -> dict[str, Any]:
        stats = dict(result.last_stats)
        with hypervisor.connect(dest.libvirt_uri, dest.agent.address) as conn:
            with hypervisor.wrap_errors(dest.agent.address, "read completed job statistics"):
                done = conn.lookupByName(record.vm).jobStats(
                    hypervisor.libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED
                )
        stats.update({k: v for k, v in done.items() if isinstance(v, int)})
        elapsed_ms = stats.get("time_elapsed", int(result.elapsed_s * 1000))
        moved = stats.get("memory_processed", 0)
        if not result.switched_to_postcopy and not record.bandwidth_mib:
            self.link(dest).learn(stats)
            self._save_links()
        pred = record.decision.prediction if record.decision else None
        return {
            "mode": record.decision.mode if record.decision else None,
            "transfer": record.decision.transfer if record.decision else None,
            "total_time_ms": elapsed_ms,
            "downtime_ms": stats.get("downtime"),
            # libvirt's memory_iteration counts dirty-bitmap syncs, one of which
            # happens before the first round.
            "bytes_moved": moved,
            "rounds": max(0, stats.get("memory_iteration", 1) - 1),
            "switched_to_postcopy": result.switched_to_postcopy,
            "recovered": result.recovered,
            "predicted_total_ms": round(pred.total_time_s * 1000) if pred else None,
            "predicted_downtime_ms": round(pred.downtime_s * 1000) if pred else None,
            "predicted_rounds": len(pred.rounds) if pred else None,
            "libvirt_stats": stats,
        }

    def get(self, migration_id: str) -> MigrationRecord:
        try:
            return self.records[migration_id]
        except KeyError:
            raise exceptions.InvalidInput(
                what="migration", reason=f"no migration {migration_id!r}"
            ) from None


def _quietly(fn: Any) -> None:
    try:
        fn()
    except exceptions.FlexMigError:
        pass
