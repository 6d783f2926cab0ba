"""Migrations run by the source host's agent: an adapter over ``flexmig.migration``.

The agent reads the engine's facts (the VM's here, through its privileged
reader of QEMU's map; the destination's from its agent; the link it probed
and learned), lets the engine plan, prepares the destination (split, store
writeback, movers), runs the engine's libvirt job and keeps progress and
events for whoever polls.  On any failure the destination is cleaned up and
the VM is left running on the source.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.agent import hot_chunks, inventory, movers, privileged, residency
from agents.agent.client import AgentClient
from agents.agent.link_estimate import LinkEstimate, teaches_the_link
from agents.agent.migration_records import (
    ACTIVE,
    Destination,
    MigrationRecord,
    Reconciler,
    RecordStore,
    beyond_kept,
    end_writeback,
    release_split,
)
from agents.agent.mover_pairs import MoverPairs
from agents.agent.offload_hook import OffloadHook
from flexmig import exceptions, hypervisor
from flexmig.migration import downtime, facts, planner
from flexmig.migration.libvirt_job import JobConfig, JobResult, MigrationJob
from flexmig.migration.options import EngineOptions
from flexmig.migration.planner import Plan
from flexmig.migration.request import MigrationRequest

LOG = logging.getLogger("flexmig.agent.migrations")
PROBE_MAX_AGE_S = 600.0


class MigrationService:
    def __init__(
        self, host: str, conf: Any, options: EngineOptions, offload: OffloadHook | None = None
    ) -> None:
        self.host = host
        self.offload = offload
        self.conf = conf
        self.options = options
        # Kept on disk so a restarted agent still answers for them (migration_records).
        self.store = RecordStore(conf.agent.state_dir, conf.agent.migration_records_kept)
        self.records: dict[str, MigrationRecord] = {r.id: r for r in self.store.load()}
        self.links_file = Path(conf.agent.state_dir) / "links.json"
        self.links = self._load_links()
        # Plans run in parallel (agent_load's 100 at once): one writer of the
        # estimates at a time (two saves racing on the same temporary file failed a
        # plan with FileNotFoundError), and one fabric probe at a time, outside it.
        self.links_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self.lock = threading.Lock()
        # Reads QEMU's map of guest RAM; the privileged daemon's by default.
        self.ram_mapping: facts.RamMappingReader = privileged.qemu_ram_mapping
        # Which chunks the guest writes now (hot_chunks.py); privileged likewise.
        self.hot_chunks: Callable[[str, int, float], list[list[int]] | None] = (
            privileged.guest_hot_chunks
        )
        # Hot-chunk samples taken while their migrations are planned, by migration id.
        self.hot_ahead: dict[str, hot_chunks.SampleAhead[hot_chunks.HotAnswer]] = {}
        self.rdma = movers.rdma_provider_present()
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
        """Write the estimates (the caller holds ``links_lock``)."""
        self.links_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.links_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({p: dataclasses.asdict(v) for p, v in self.links.items()}))
        tmp.replace(self.links_file)

    # -- planning -------------------------------------------------------------
    def plan(
        self,
        request: MigrationRequest,
        dest: Destination,
        on_ram_bytes: Callable[[int], None] | None = None,
    ) -> Plan:
        """The migration's plan; ``on_ram_bytes`` hears the VM's RAM size as
        soon as it is known, before the dirty-rate samples."""
        with hypervisor.connect(self.conf.agent.libvirt_uri, self.host) as conn:
            with hypervisor.wrap_errors(self.host, f"find {request.vm}"):
                dom = hypervisor.find_domain(conn, request.vm)
            if dom is None:
                raise exceptions.InvalidInput(what="VM", reason=f"{request.vm!r} is not here")
            if on_ram_bytes is not None:
                with hypervisor.wrap_errors(self.host, f"read {request.vm}'s RAM size"):
                    on_ram_bytes(dom.maxMemory() * 1024)
            vm = facts.read_vm(
                conn,
                dom,
                self.host,
                self.options.dirty_sample_seconds,
                self.ram_mapping,
                samples=self.samples.take(request.vm),
            )
            source = planner.SourceFacts(facts.host_software(conn, self.host), facts.idle_cpus())
        link = self.link(dest)
        dest_facts = dest.agent.get("/v1/facts")
        return planner.plan(
            request,
            vm,
            planner.DestinationFacts.from_agent(dest_facts),
            planner.LinkFacts(
                fabric_bps=link.fabric_bps,
                stream_bps=link.stream_bps,
                setup_s=link.setup_s,
                switchover_s=link.switchover_s,
                switchover_learned=link.learnt_timings,
                learnt=link.learnt_side,
            ),
            self.options,
            rdma_both_ends=self.rdma and dest_facts.get("rdma_provider") is True,
            source=source,
        )

    def link(self, dest: Destination) -> LinkEstimate:
        """This host's estimate for ``dest``, with a fabric probe no older than 10 min.

        Plans asked together wait for one probe and share it (two probes at once
        would each measure half the path)."""
        with self._probe_lock:
            with self.links_lock:
                link = self.links.setdefault(dest.agent.address, LinkEstimate())
                stale = time.time() - link.fabric_measured_at > PROBE_MAX_AGE_S
            if stale:
                fabric_bps = dest.agent.probe_bandwidth(max(1, self.options.bandwidth_probe_mib))
                with self.links_lock:
                    link.fabric_bps, link.fabric_measured_at = fabric_bps, time.time()
                    self._save_links()
            return link

    def links_snapshot(self) -> dict[str, dict[str, Any]]:
        """Every destination's estimate as plain values (the facts' ``links``)."""
        with self.links_lock:
            return {peer: dataclasses.asdict(link) for peer, link in self.links.items()}

    def _learn(
        self, dest: Destination, stats: dict[str, int], cap_mib: int | None, plan: Plan
    ) -> None:
        """Teach the link one completed job (``cap_mib``: its bandwidth cap, if any)."""
        cap_bps = cap_mib * 2**20 if cap_mib else None
        with self.links_lock:
            link = self.links.setdefault(dest.agent.address, LinkEstimate())
            link.learn(stats, cap_bps, plan.guest_downtime)
            self._save_links()

    def _learn_split_side(self, dest: Destination, stats: dict[str, int], plan: Plan) -> None:
        """Teach the link one completed split job's QEMU side."""
        final_round_s = downtime.final_round_faults_s(
            plan.decision.prediction, plan.decision.store_faults
        )
        with self.links_lock:
            link = self.links.setdefault(dest.agent.address, LinkEstimate())
            link.learn_split_side(stats, plan.guest_downtime, final_round_s)
            self._save_links()

    # -- execution ------------------------------------------------------------
    def reconcile_unended(self, peer: Callable[[str, int], AgentClient]) -> list[MigrationRecord]:
        """Follow to their end the migrations a previous agent left unended
        (``peer`` makes a client for their destination's agent)."""
        reconciler = Reconciler(
            self.host,
            self.conf.agent.libvirt_uri,
            self.store,
            peer,
            timeout_s=float(self.conf.agent.reconcile_timeout),
            converge_timeout_s=self.options.converge_timeout_s,
        )
        unended = [r for r in self.records.values() if r.state in ACTIVE]
        for record in unended:
            LOG.warning("migration %s of %s was %s when the agent stopped", record.id, record.vm,
                        record.state)  # fmt: skip
            reconciler.start(record)
        return unended

    def start(self, request: MigrationRequest, dest: Destination) -> MigrationRecord:
        record = MigrationRecord(
            id=uuid.uuid4().hex[:12],
            request=request,
            dest=dest.agent.address,
            dest_access={
                "port": dest.agent.port,
                "libvirt_uri": dest.libvirt_uri,
                "migration_uri": dest.migration_uri,
            },
        )
        with self.lock:
            if any(r.vm == request.vm and r.state in ACTIVE for r in self.records.values()):
                raise exceptions.InvalidInput(
                    what="VM", reason=f"{request.vm} is already migrating"
                )
            self.records[record.id] = record
        self.store.save(record)
        threading.Thread(
            target=self._run, args=(record, dest), name=f"migration-{record.id}", daemon=True
        ).start()
        return record

    def _run(self, record: MigrationRecord, dest: Destination) -> None:
        try:
            record.event("sampling the dirty rate and asking the destination for its facts")
            record.plan = self.plan(record.request, dest, self._hot_sampler(record))
            record.event(f"decided: {record.plan.mode}")
            record.state = "running"
            self.store.save(record)
            self._execute(record, record.plan, dest)
        except exceptions.FlexMigError as exc:
            record.state, record.error = "failed", str(exc)
            record.event(f"failed: {exc}")
        except Exception as exc:
            error = exceptions.InternalError(action=f"migrating {record.vm}", error=repr(exc))
            LOG.exception("%s", error)
            record.state, record.error = "failed", str(error)
            record.event(record.error)
        finally:
            self.hot_ahead.pop(record.id, None)
            record.ended = time.time() if record.state not in ACTIVE else None
            self.store.save(record)
            self._forget_old_records()

    def _forget_old_records(self) -> None:
        """Keep in memory the ended records the files keep (the newest
        migration_records_kept): an agent that runs for months must not hold
        every migration it ever made."""
        with self.lock:
            ended = {r.id: r.ended for r in self.records.values() if r.ended is not None}
            for migration_id in beyond_kept(ended, self.conf.agent.migration_records_kept):
                del self.records[migration_id]

    def _execute(self, record: MigrationRecord, plan: Plan, dest: Destination) -> None:
        writeback = self._prepare_destination(record, plan, dest)
        record.event(f"transport: {plan.transport.transport} ({plan.transport.reason})")
        for note in plan.notes:
            record.event(note)
        pairs = None
        migration_uri = dest.migration_uri
        if plan.transport.transport == "mover":
            pairs = self._mover_pairs(record, plan, dest)
            migration_uri = pairs.open()
        flows_moving = self._offload_depart(record, dest)
        try:
            result = self._run_job(record, plan, dest, migration_uri, pairs)
        except Exception as exc:
            if flows_moving:
                self.offload.restore(record.id, str(exc), dest.agent, record.event)
            if pairs is not None:
                pairs.finish(ok=False)
            raise
        if flows_moving and result.state != "completed":
            self.offload.restore(record.id, result.error or result.state, dest.agent, record.event)
        mover_stats = self._finish_movers(record, pairs, result.state == "completed")
        if writeback:
            record.writeback_rounds = end_writeback(record, dest)
        if result.state != "completed":
            if plan.mode == "split" and not result.switched_to_postcopy:
                release_split(record, dest)
            record.state, record.error = "failed", result.error
            record.event(f"failed: {result.error}; the VM runs on {self.host}")
            return
        offload = self.offload.finish(record.id, dest.agent, record.event) if flows_moving else None
        record.summary = self._summary(record, plan, dest, result) | {
            "offload": offload,
            "transport": plan.transport.transport,
            "parallel": plan.parallel,
            "movers": mover_stats,
            "store_writeback": record.request.store_writeback,
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

    def _prepare_destination(self, record: MigrationRecord, plan: Plan, dest: Destination) -> bool:
        """Reserve a split VM's budget or start the store writeback; True for the latter."""
        decision = plan.decision
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
            self._hint_hot_chunks(record, decision.ram_bytes, dest)
            return False
        if record.request.store_writeback:
            self._request_writeback(record, dest)
        return record.request.store_writeback

    def sample_hot_chunks(self, vm: str, ram_bytes: int) -> tuple[list[list[int]] | None, str]:
        """Which chunks the guest writes now, as runs, or None and why not.

        Both the agent's own flow and Nova's driver (through the source's
        ``/v1/split/sample-hot``) ask here, so they say the same things.
        """
        seconds = self.conf.agent.split_hot_sample_seconds
        if not seconds:
            return None, "sampling is off"
        try:
            runs = self.hot_chunks(vm, ram_bytes, seconds)
        except (OSError, exceptions.FlexMigError) as exc:  # the VM or its file is gone
            return None, str(exc)
        if runs is None:
            return None, "its memory file has no writeback"
        return runs, ""

    def _hint_hot_chunks(self, record: MigrationRecord, ram_bytes: int, dest: Destination) -> None:
        """Tell the destination's keeper which chunks the guest writes now.

        A hint that cannot be had costs nothing but the hint: the keeper then
        goes by what the stream sends again, as before (the event says why).
        """
        seconds = self.conf.agent.split_hot_sample_seconds
        if not seconds:
            return
        started = time.monotonic()
        ahead = self.hot_ahead.pop(record.id, None)
        if ahead is None:
            runs, why = self.sample_hot_chunks(record.vm, ram_bytes)
        else:
            runs, why = ahead.answer(
                hot_chunks.WRITEBACK_TIMEOUT_S + seconds + hot_chunks.ANSWER_SLACK_S
            )
        if runs is not None:
            try:
                dest.agent.post("/v1/split/hot", {"vm": record.vm, "chunks": runs})
            except exceptions.FlexMigError as exc:
                runs, why = None, str(exc)
        if runs is None:
            record.event(f"hot chunks: not sent, the keeper goes by the stream: {why}")
            return
        mib = sum(count for _first, count in runs) * residency.CHUNK_BYTES >> 20
        waited = time.monotonic() - started
        when = "sampled while planning" if ahead is not None else "sampled now"
        record.event(
            f"hot chunks: the guest wrote {mib} MiB in {seconds:g} s; the destination "
            f"keeps them resident ({when}; the job waited {waited:.1f} s for it)"
        )

    def _hot_sampler(self, record: MigrationRecord) -> Callable[[int], None] | None:
        """What starts the hot-chunk sample once the plan knows the VM's RAM,
        where the migration may end up split (asked for, or left to the plan)."""
        if record.request.mode not in ("split", "auto"):
            return None
        if not self.conf.agent.split_hot_sample_seconds:
            return None

        def start(ram_bytes: int) -> None:
            self.hot_ahead[record.id] = hot_chunks.SampleAhead(
                lambda: self.sample_hot_chunks(record.vm, ram_bytes),
                hot_chunks.no_runs,
                f"hot-{record.id}",
            )

        return start

    def _run_job(
        self,
        record: MigrationRecord,
        plan: Plan,
        dest: Destination,
        migration_uri: str,
        pairs: MoverPairs | None,
    ) -> JobResult:
        """Drive libvirt's migration to its end; the job reports progress into the record."""
        config = JobConfig(
            # A postcopy resume over the movers needs a fresh pair (the old one
            # died with the stream), started the way the first one was.
            reopen_transport=pairs.reopen if pairs is not None else None,
            dest_libvirt_uri=dest.libvirt_uri,
            source_libvirt_uri=self.conf.agent.libvirt_uri,
            migration_uri=migration_uri,
            stall_timeout_s=self.options.stall_timeout_s,
            setup_timeout_s=self.options.setup_timeout_s,
            converge_timeout_s=self.options.converge_timeout_s,
            recovery_timeout_s=self.options.recovery_timeout_s,
        )

        def progress(phase: str, stats: dict[str, int]) -> None:
            # Saved when the phase changes, not per sample (several a second).
            changed = phase != record.phase
            record.phase, record.progress = phase, stats
            if changed:
                self.store.save(record)

        def dest_alive() -> bool:
            try:
                dest.agent.get("/v1/health", timeout=2.0)
                return True
            except exceptions.FlexMigError:
                return False

        with hypervisor.connect(self.conf.agent.libvirt_uri, self.host) as conn:
            with hypervisor.wrap_errors(self.host, f"find {record.vm}"):
                dom = conn.lookupByName(record.vm)
            job = MigrationJob(
                dom, self.host, plan, config, progress, record.event, peer_alive=dest_alive
            )
            return job.run()

    def _request_writeback(self, record: MigrationRecord, dest: Destination) -> None:
        """Destination QEMU msyncs a file-backed VM's RAM inside the downtime:
        keep what is dirty small by writing the file back as pages arrive."""
        try:
            dest.agent.post("/v1/incoming/writeback", {"vm": record.vm, "active": True})
        except exceptions.FlexMigError as exc:
            record.event(f"destination cannot write the memory file back early: {exc}")

    def _mover_pairs(self, record: MigrationRecord, plan: Plan, dest: Destination) -> MoverPairs:
        # QEMU's multifd opens the main connection and one per channel.
        streams = plan.parallel + 1 if plan.parallel > 1 else 1
        return MoverPairs(
            self.conf.agent.state_dir,
            self.conf.agent.listen_address,
            record.id,
            dest.agent,
            streams,
        )

    def _finish_movers(
        self, record: MigrationRecord, pairs: MoverPairs | None, ok: bool
    ) -> dict[str, Any] | None:
        """The movers' statistics; a mover that fails to report them is no
        failed migration (the VM has landed: libvirt's job decides that)."""
        if pairs is None:
            return None
        try:
            return pairs.finish(ok)
        except exceptions.FlexMigError as exc:
            record.event(f"the movers' statistics are lost: {exc}")
            return None

    def _summary(
        self, record: MigrationRecord, plan: Plan, dest: Destination, result: Any
    ) -> dict[str, Any]:
        stats = dict(result.last_stats)
        with hypervisor.connect(dest.libvirt_uri, dest.agent.address) as conn:
            with hypervisor.wrap_errors(dest.agent.address, "read completed job statistics"):
                done = conn.lookupByName(record.vm).jobStats(
                    hypervisor.libvirt.VIR_DOMAIN_JOB_STATS_COMPLETED
                )
        stats.update({k: v for k, v in done.items() if isinstance(v, int)})
        elapsed_ms = stats.get("time_elapsed", int(result.elapsed_s * 1000))
        moved = stats.get("memory_processed", 0)
        if teaches_the_link(plan.mode, result.switched_to_postcopy):
            self._learn(dest, stats, record.request.bandwidth_mib, plan)
        elif plan.mode == "split" and not result.switched_to_postcopy:
            self._learn_split_side(dest, stats, plan)
        pred = plan.decision.prediction
        return {
            "mode": plan.mode,
            "transfer": plan.decision.transfer,
            "total_time_ms": elapsed_ms,
            "downtime_ms": stats.get("downtime"),
            # libvirt's memory_iteration counts dirty-bitmap syncs, one of which
            # happens before the first round.
            "bytes_moved": moved,
            "rounds": max(0, stats.get("memory_iteration", 1) - 1),
            "switched_to_postcopy": result.switched_to_postcopy,
            "recovered": result.recovered,
            "predicted_total_ms": round(pred.total_time_s * 1000),
            "predicted_downtime_ms": round(pred.downtime_s * 1000),
            "predicted_rounds": len(pred.rounds),
            "knobs": dataclasses.asdict(plan.knobs) | {"reasons": None},
            "downtime_budget_ms": plan.downtime_budget_ms,
            "downtime_limit_ms": plan.decision.max_downtime_ms,  # QEMU's, as first set
            "predicted_guest_downtime_ms": round(plan.guest_downtime.total_ms),
            "predicted_downtime_parts_ms": plan.guest_downtime.parts_ms,
            # What a split guest's first run is learnt beside (report_guest_gap).
            "predicted_faults_after_resume_ms": (
                round(plan.decision.store_faults.first_heartbeat_s * 1000, 1)
                if plan.mode == "split"
                else None
            ),
            "predicted_stored_share": (
                plan.decision.store_faults.stored_share if plan.mode == "split" else None
            ),
            "downtime_parts_ms": downtime.measured(stats),
            # QEMU's own downtime is a floor of what the guest noticed: a
            # budget it alone exceeds is reported here (the guest's view, where
            # someone measures it, in migrate_cli).
            "downtime_exceeded_ms": downtime.excess(plan.downtime_budget_ms, stats.get("downtime")),
            "libvirt_stats": stats,
        }

    def get(self, migration_id: str) -> MigrationRecord:
        try:
            return self.records[migration_id]
        except KeyError:
            raise exceptions.NotFound(what="migration", name=migration_id) from None

    def report_guest_gap(self, migration_id: str, gap_ms: float) -> str | None:
        """A probe inside the guest measured its longest heartbeat gap across a
        completed migration: kept in its summary and, from a plain precopy or a
        split job, taught to the link as that kind of guest's first run.
        Returns why it taught nothing, or None."""
        record = self.get(migration_id)
        with self.lock:
            if record.state != "completed":
                raise exceptions.InvalidInput(
                    what="guest gap", reason=f"migration {migration_id} is {record.state}"
                )
            if "guest_observed_downtime_ms" in record.summary:
                raise exceptions.InvalidInput(
                    what="guest gap", reason=f"migration {migration_id}'s was reported already"
                )
            record.summary["guest_observed_downtime_ms"] = gap_ms
        self.store.save(record)
        summary = record.summary
        # Only a split job's summary has it (_summary).
        split_faults_ms = summary.get("predicted_faults_after_resume_ms")
        is_split = split_faults_ms is not None
        if not is_split and not teaches_the_link(
            summary.get("mode", ""), summary.get("switched_to_postcopy", True)
        ):
            return f"a {summary.get('mode')} job's gap holds more than the link's first run"
        if summary.get("downtime_ms") is None:
            return "libvirt reported no downtime for it"
        with self.links_lock:
            link = self.links.setdefault(record.dest, LinkEstimate())
            link.learn_first_run(
                gap_ms / 1000,
                summary["downtime_ms"] / 1000,
                split_faults_ms / 1000 if is_split else None,
                summary.get("predicted_stored_share"),
            )
            self._save_links()
        return None
