"""FlexMigLibvirtDriver: Nova's libvirt driver with FlexMig's live-migration modes.

Enabled by ``compute_driver = flexmig.FlexMigLibvirtDriver``.  Only
the live-migration seams are overridden; everything else is Nova's driver.

Destination, ``pre_live_migration``: after Nova's own preparation, ask the
local flexmig-agent for its facts; when the VM will not fit in its free
memory, reserve a split budget there (``flexmig.policy.decision.split_budget``);
hand back the agent's endpoint, a migration-scoped credential and those facts
in the migrate data (``FlexMigLiveMigrateData``).

Destination, movers: where the ``[migration] transport`` resolves to the
mover, the local agent starts receiving movers and the offer names them
(``nova_driver.mover_streams``: both sides' movers, through the agents).

Source, ``_live_migration``: read the VM's facts, probe the fabric through the
destination agent and let the engine plan (``nova_driver.planning`` over
``flexmig.migration``, the same plan the agent path makes), start the local
agent's sending movers when the offer has receivers, then let Nova's own
operation build the destination XML and start the migration with the plan's
flags, parallel connections and URI, watched by ``nova_driver.monitor`` (the
engine's controller) instead of Nova's timer-driven monitor.  A migration the
policy refuses, asked with bad input, or whose facts cannot be read rolls back
through Nova's own rollback: the VM stays ACTIVE on its source.  A bug is not
taken for a refusal: it raises, and Nova records the migration as an error.

Cleanup: a failed migration's split reservation is released at the
destination; after a VM leaves a host, any reservation it held there goes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from nova import conf as nova_conf
from nova import exception
from nova.compute import utils as compute_utils
from nova.virt.libvirt import driver as libvirt_driver
from oslo_log import log as logging

from agents.agent import auth, hot_chunks
from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig.migration import knobs
from flexmig.migration import options as migration_options
from flexmig.migration.libvirt_job import JobConfig
from flexmig.migration.planner import Plan
from flexmig.policy.decision import split_budget
from nova_driver import conf as flexmig_conf
from nova_driver import monitor, mover_streams, planning, postcopy
from nova_driver.migrate_data import DestinationOffer, FlexMigLiveMigrateData, offer_of

LOG = logging.getLogger(__name__)
CONF = nova_conf.CONF
flexmig_conf.register_opts(CONF)
MIB = 2**20
# The agent refuses smaller split budgets (agents/agent/split_store.py).
MIN_SPLIT_BUDGET = 64 * MIB
# What makes planning refuse a migration and Nova roll it back; anything else is a bug.
NOT_MIGRATABLE = (
    exceptions.InvalidInput,
    exceptions.PolicyRefused,
    exceptions.BackendError,
    exceptions.MissingPrerequisite,
)


def _libvirt() -> Any:
    """Nova's libvirt binding, looked up at call time (tests swap in fakelibvirt)."""
    return libvirt_driver.libvirt


class PlannedGuest:
    """Nova's Guest, whose ``migrate`` uses the plan's flags, parallel connections and
    (over the movers) URI instead of Nova's."""

    def __init__(self, guest: Any, plan: Plan, migrate_uri: str | None) -> None:
        self._guest = guest
        self._plan = plan
        self._migrate_uri = migrate_uri
        self.flags_used: int | None = None  # what a postcopy resume repeats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._guest, name)

    def migrate(self, destination: str, **kwargs: Any) -> None:
        kwargs["flags"] = self._plan.merged_flags(kwargs.get("flags", 0), _libvirt())
        self.flags_used = kwargs["flags"]
        kwargs["parallel"] = self._plan.parallel
        if self._migrate_uri:
            kwargs["migrate_uri"] = self._migrate_uri
        if self._plan.mode == "split" and kwargs.get("destination_xml"):
            kwargs["destination_xml"] = planning.split_destination_xml(kwargs["destination_xml"])
        # Nova's Guest.migrate builds the typed parameters it knows (and keeps
        # its quirk handling); the plan's other knobs join them on the way out.
        extra = {
            k: v for k, v in self._plan.params().items() if k != knobs.PARAM_PARALLEL_CONNECTIONS
        }
        guest = self._guest
        if extra:
            guest = type(guest)(PlannedDomain(guest._domain, extra))
        LOG.debug("FlexMig: migrating with libvirt flags %#x, %s", kwargs["flags"], extra)
        guest.migrate(destination, **kwargs)


class PlannedDomain:
    """A libvirt domain whose migrateToURI3 adds the plan's typed parameters."""

    def __init__(self, domain: Any, extra: dict[str, object]) -> None:
        self._domain = domain
        self._extra = extra

    def __getattr__(self, name: str) -> Any:
        return getattr(self._domain, name)

    def migrateToURI3(self, dconnuri: str, params: dict[str, object], flags: int = 0) -> Any:
        return self._domain.migrateToURI3(dconnuri, params=params | self._extra, flags=flags)


class FlexMigLibvirtDriver(libvirt_driver.LibvirtDriver):
    def __init__(self, virtapi: Any, read_only: bool = False) -> None:
        flexmig_conf.validate(CONF)
        try:
            self._flexmig_key = auth.load_key(CONF.flexmig.agent_key_file)
        except exceptions.FlexMigError as exc:
            raise flexmig_conf.InvalidConfig(option="agent_key_file", reason=str(exc)) from exc
        # This host's agent, fixed at start like the rest of this host's config.
        self._agent_endpoint = (CONF.flexmig.agent_address or CONF.my_ip, CONF.flexmig.agent_port)
        super().__init__(virtapi, read_only)
        self._flexmig_plans: dict[str, Plan] = {}
        self._flexmig_uris: dict[str, str] = {}  # instance: the movers' URI
        self._flexmig_guests: dict[str, PlannedGuest] = {}  # instance: its migrating guest
        # Instances whose offloaded flows the local agent is moving: the body
        # that names the migration and its destination agent.
        self._flexmig_flows: dict[str, dict[str, Any]] = {}
        # Instances whose completed migration did not land: the destination's answers.
        self._flexmig_lost: dict[str, str] = {}

    # -- agents ---------------------------------------------------------------
    def _local_agent(self) -> AgentClient:
        return AgentClient(
            *self._agent_endpoint,
            self._flexmig_key,
            timeout=CONF.flexmig.agent_timeout,
            ca_file=CONF.flexmig.agent_ca_file,
        )

    def _destination_agent(self, offer: DestinationOffer) -> AgentClient:
        """The destination's agent, with the credential it issued for this migration."""
        return planning.destination_agent(
            offer, CONF.flexmig.agent_timeout, CONF.flexmig.agent_ca_file
        )

    # -- destination ----------------------------------------------------------
    def pre_live_migration(
        self,
        context: Any,
        instance: Any,
        block_device_info: Any,
        network_info: Any,
        disk_info: Any,
        migrate_data: Any,
    ) -> Any:
        data = super().pre_live_migration(
            context, instance, block_device_info, network_info, disk_info, migrate_data
        )
        try:
            offer = self._offer(instance, data)
        except (exceptions.FlexMigError, KeyError, TypeError, ValueError) as exc:
            # KeyError/TypeError/ValueError: facts not in the agent API's shape.
            raise exception.MigrationPreCheckError(
                reason=f"FlexMig destination could not prepare: {exc}"
            ) from exc
        LOG.info(
            "FlexMig destination: %d MiB free for VMs%s",
            offer.free_for_vms_bytes // MIB,
            f"; reserved a {offer.split_budget_bytes // MIB} MiB split budget"
            if offer.split_budget_bytes is not None
            else "",
            instance=instance,
        )
        return FlexMigLiveMigrateData.extend(data, offer)

    def _offer(self, instance: Any, data: Any) -> DestinationOffer:
        agent = self._local_agent()
        facts = agent.get("/v1/facts")
        ram = instance.flavor.memory_mb * MIB
        budget = split_budget(ram, int(facts["free_for_vms_bytes"]))
        reserved = None
        if (
            budget is not None
            and budget >= MIN_SPLIT_BUDGET
            and "split" in CONF.migration.allowed_modes
            and CONF.libvirt.file_backed_memory
        ):
            agent.post(
                "/v1/split/prepare",
                {"vm": instance.name, "ram_bytes": ram, "budget_bytes": budget},
            )
            reserved = budget
        if reserved is None and CONF.libvirt.file_backed_memory:
            self._writeback(instance, active=True)
        migration_id = data.migration.uuid if "migration" in data else instance.uuid
        mover = mover_streams.start_receivers(
            agent,
            facts,
            migration_id,
            migration_options.read(CONF),
            CONF.libvirt.live_migration_parallel_connections,
        )
        scope, key = planning.scoped_credential(
            self._flexmig_key,
            migration_id,
            instance.name,
            time.time() + CONF.flexmig.credential_ttl,
        )
        return DestinationOffer(
            agent_address=agent.address,
            agent_port=agent.port,
            scope=scope,
            scoped_key=key,
            free_for_vms_bytes=int(facts["free_for_vms_bytes"]),
            store_free_bytes=int(facts["store_free_bytes"]),
            split_budget_bytes=reserved,
            mover=mover,
        )

    def rollback_live_migration_at_destination(
        self,
        context: Any,
        instance: Any,
        network_info: Any,
        block_device_info: Any,
        destroy_disks: bool = True,
        migrate_data: Any = None,
    ) -> None:
        try:
            super().rollback_live_migration_at_destination(
                context, instance, network_info, block_device_info, destroy_disks, migrate_data
            )
        finally:
            offer = offer_of(migrate_data)
            if offer is not None and offer.split_budget_bytes is not None:
                self._release_split(instance)
            elif CONF.libvirt.file_backed_memory:
                self._writeback(instance, active=False)

    def post_live_migration_at_destination(
        self,
        context: Any,
        instance: Any,
        network_info: Any,
        block_migration: bool = False,
        block_device_info: Any = None,
    ) -> None:
        try:
            super().post_live_migration_at_destination(
                context, instance, network_info, block_migration, block_device_info
            )
        finally:
            if CONF.libvirt.file_backed_memory:
                self._writeback(instance, active=False)

    def _writeback(self, instance: Any, active: bool) -> None:
        """The local agent writes the incoming VM's memory file back while pages
        arrive: QEMU msyncs file-backed guest RAM inside the downtime."""
        body = {"vm": instance.name, "active": active}
        try:
            reply = self._local_agent().post("/v1/incoming/writeback", body)
        except exceptions.FlexMigError as exc:
            LOG.warning(
                "FlexMig: store writeback not %s: %s", "started" if active else "ended", exc
            )
            return
        if not active:
            LOG.info(
                "FlexMig: store writeback ended after %s rounds",
                reply.get("rounds"),
                instance=instance,
            )

    def _release_split(self, instance: Any) -> None:
        try:
            self._local_agent().post("/v1/split/cleanup", {"vm": instance.name})
            LOG.info("FlexMig: released the split reservation", instance=instance)
        except exceptions.FlexMigError as exc:
            # The libvirt hook releases it too when the domain goes away.
            LOG.warning("FlexMig: could not release the split reservation: %s", exc)

    # -- source ---------------------------------------------------------------
    def _live_migration(
        self,
        context: Any,
        instance: Any,
        dest: str,
        post_method: Any,
        recover_method: Any,
        block_migration: bool,
        migrate_data: Any,
    ) -> None:
        offer = offer_of(migrate_data)
        if offer is None:
            LOG.info("FlexMig: %s offered no FlexMig data; Nova's own migration", dest)
            super()._live_migration(
                context, instance, dest, post_method, recover_method, block_migration, migrate_data
            )
            return
        hint = self._hint_while_planning(instance, offer)
        try:
            plan = self._plan(instance, offer)
            offer = self._drop_unused_receivers(instance, offer, plan, migrate_data)
            uri = mover_streams.start_senders(self._local_agent(), plan, offer)
        except NOT_MIGRATABLE as exc:
            LOG.error("FlexMig: %s; the VM stays on this host", exc, instance=instance)
            self._record_event(context, instance, "flexmig_refused")
            recover_method(context, instance, dest, migrate_data)
            return
        LOG.info("FlexMig chose %s:\n%s", plan.mode, plan.explain(), instance=instance)
        if plan.mode == "split" and hint is not None:
            # Before the job starts: the keeper must have it for its first drop.
            LOG.info(hint.answer(2 * CONF.flexmig.agent_timeout), instance=instance)
        self._record_event(context, instance, f"flexmig_{plan.mode}")
        self._flexmig_plans[instance.uuid] = plan
        if uri:
            self._flexmig_uris[instance.uuid] = uri
        self._offload_depart(instance, offer, migrate_data)
        try:
            super()._live_migration(
                context, instance, dest, post_method, recover_method, block_migration, migrate_data
            )
        finally:
            self._flexmig_plans.pop(instance.uuid, None)
            self._flexmig_uris.pop(instance.uuid, None)
            answers = self._flexmig_lost.pop(instance.uuid, None)
        if answers is not None:
            self._not_landed(context, instance, dest, answers)

    def _not_landed(self, context: Any, instance: Any, dest: str, answers: str) -> None:
        """Rolled back already (the monitor's ``lost``): raised to Nova's compute
        manager, which records the migration as an error and the instance in
        ERROR, still on this host; the reason goes in the instance's fault
        (``openstack server show``), which that path of Nova's leaves empty."""
        error = monitor.VMNotOnDestination(
            vm=instance.name, dest=dest, source=instance.host, answers=answers
        )
        try:
            compute_utils.add_instance_fault_from_exc(
                context, instance, error, fault_message=error.message
            )
        except Exception as exc:  # noqa: BLE001 - the error below must reach Nova regardless
            LOG.warning("FlexMig: could not record the instance fault: %s", exc)
        raise error

    def _hint_while_planning(
        self, instance: Any, offer: DestinationOffer
    ) -> hot_chunks.SampleAhead[str] | None:
        """A split VM's hot-chunk sample and hint, taken beside the plan's
        dirty-rate samples rather than ahead of the job (agents/agent/hot_chunks.py).

        Split needs the destination's reservation, so only an offer with a
        budget starts one; a plan that is then refused leaves a hint the
        released reservation ignores.
        """
        if offer.split_budget_bytes is None:
            return None
        local, dest = self._local_agent(), self._destination_agent(offer)
        ram = instance.flavor.memory_mb * MIB
        return hot_chunks.SampleAhead(
            lambda: planning.hint_hot_chunks(local, dest, instance.name, ram),
            planning.no_hint,
            f"hot-{instance.name}",
        )

    def _plan(self, instance: Any, offer: DestinationOffer) -> Plan:
        guest = self._host.get_guest(instance)
        return planning.plan(
            self._host.get_connection(),
            guest._domain,
            CONF.host,
            offer,
            CONF,
            migration_options.read(CONF),
            self._local_agent(),
            _libvirt().libvirtError,
        )

    def _drop_unused_receivers(
        self, instance: Any, offer: DestinationOffer, plan: Plan, migrate_data: Any
    ) -> DestinationOffer:
        """The destination's receiving movers, aborted where the plan does not use them.

        The destination starts them before there is a plan; a postcopy plan
        between hosts whose libvirt turns postcopy-preempt on goes over QEMU's
        own TCP instead (``flexmig.policy.transport.preempt_conflict``).  The
        offer then names no movers, so the job's end does not wait 30 s on
        receivers that never saw a connection and a postcopy recovery does not
        reopen a pair the stream never used.
        """
        if not mover_streams.unused(offer, plan):
            return offer
        try:
            self._destination_agent(offer).post(
                "/v1/mover/finish", {"migration_id": offer.mover.migration_id, "abort": True}
            )
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: unused destination movers: %s", exc, instance=instance)
        migrate_data.flexmig_offer.mover = None
        return dataclasses.replace(offer, mover=None)

    def _finish_movers(self, offer: DestinationOffer | None, ok: bool) -> None:
        """Both sides' movers once the job ended: statistics, or killed after a failure."""
        if offer is None or offer.mover is None:
            return
        sides = (("source", self._local_agent()), ("destination", self._destination_agent(offer)))
        mover_streams.finish(sides, offer.mover, ok)

    # -- offloaded flows follow the VM (through the agents: agents/agent/offload_hook.py)
    def _offload_depart(self, instance: Any, offer: DestinationOffer, migrate_data: Any) -> None:
        """Before the job (so before switchover): the local agent demotes the VM's
        offloaded flows and hands their records to the destination's agent."""
        migration = getattr(migrate_data, "migration", None)
        try:
            facts = self._destination_agent(offer).get("/v1/facts")
            ends = {
                "migration_id": str(getattr(migration, "uuid", None) or instance.uuid),
                "dest": planning.peer_endpoint(offer, facts),
            }
            # SR-IOV ports: Nova swaps the VFs itself; the agents move their flows
            # to the standby and on to the VF Nova claimed on the destination.
            vifs = (
                migrate_data.vifs
                if getattr(migrate_data, "obj_attr_is_set", lambda _f: False)("vifs")
                else None
            )  # an unset field of a Nova object raises, it has no default
            vfs = planning.destination_vfs(vifs)
            body = ends | {"vm": instance.name} | ({"nova_vfs": vfs} if vfs else {})
            reply = self._local_agent().post("/v1/offload/depart", body)
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: offloaded flows stay put: %s", exc, instance=instance)
            return
        for text in reply.get("events", []):
            LOG.info("FlexMig %s", text, instance=instance)
        if reply.get("handled"):
            self._flexmig_flows[instance.uuid] = ends

    def _offload_end(self, instance: Any, failure: str | None) -> None:
        """Success: final counters to the destination, forgotten here.  Failure:
        re-offloaded here, with the reason in the extension's status file."""
        body = self._flexmig_flows.pop(instance.uuid, None)
        if body is None:
            return
        path = "/v1/offload/finish" if failure is None else "/v1/offload/restore"
        if failure is not None:
            body = body | {"reason": failure}
        try:
            reply = self._local_agent().post(path, body)
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: %s of offloaded flows failed: %s", path, exc, instance=instance)
            return
        for text in reply.get("events", []):
            LOG.info("FlexMig %s", text, instance=instance)

    def _record_event(self, context: Any, instance: Any, name: str) -> None:
        """The choice, as an event of the server's live-migration action (os-instance-actions)."""
        try:
            with compute_utils.EventReporter(
                context, name, CONF.host, instance.uuid, graceful_exit=True
            ):
                pass
        except Exception as exc:  # noqa: BLE001 - a report must never fail the migration
            LOG.warning("FlexMig: could not record event %s: %s", name, exc)

    def _live_migration_operation(
        self,
        context: Any,
        instance: Any,
        dest: str,
        block_migration: bool,
        migrate_data: Any,
        guest: Any,
        device_names: Any,
    ) -> None:
        plan = self._flexmig_plans.get(instance.uuid)
        if plan is None:
            super()._live_migration_operation(
                context, instance, dest, block_migration, migrate_data, guest, device_names
            )
            return
        planned = PlannedGuest(guest, plan, self._flexmig_uris.get(instance.uuid))
        self._flexmig_guests[instance.uuid] = planned
        try:
            super()._live_migration_operation(
                context, instance, dest, block_migration, migrate_data, planned, device_names
            )
        except Exception as exc:  # noqa: BLE001 - the job's state decides, not the call
            # As Nova's own comment there says, what migrateToURI3 raises is
            # taken with a pinch of salt: the monitor reads the job's outcome
            # and has Nova roll back (the VM stays ACTIVE on this host).
            # Re-raising would make Nova put the instance in ERROR after the
            # rollback.
            LOG.warning("FlexMig: migration call ended with %s", exc, instance=instance)

    def _live_migration_monitor(
        self,
        context: Any,
        instance: Any,
        guest: Any,
        dest: str,
        post_method: Any,
        recover_method: Any,
        block_migration: bool,
        migrate_data: Any,
        future: Any,
        disk_paths: Any,
    ) -> None:
        plan = self._flexmig_plans.get(instance.uuid)
        if plan is None:
            super()._live_migration_monitor(
                context,
                instance,
                guest,
                dest,
                post_method,
                recover_method,
                block_migration,
                migrate_data,
                future,
                disk_paths,
            )
            return
        self._set_downtime(guest, plan, instance)
        watch = self._plan_monitor(plan, dest, migrate_data)
        outcome = {"ok": False}

        def done(_info: Any) -> None:
            outcome["ok"] = True
            self._finish_movers(offer_of(migrate_data), ok=True)
            post_method(context, instance, dest, block_migration, migrate_data)

        def failed(_info: Any, status: str | None) -> None:
            outcome["ok"] = None  # finished already
            if watch.control.switched:
                # Nova's rollback would destroy the destination's half of the VM.
                self._resume_postcopy(instance, guest, dest, plan, migrate_data)
                outcome["ok"] = True
                post_method(context, instance, dest, block_migration, migrate_data)
                return
            self._finish_movers(offer_of(migrate_data), ok=False)
            extra = {"migration_status": status} if status else {}
            recover_method(context, instance, dest, migrate_data, **extra)

        def lost(answers: str) -> None:
            # libvirt said completed, the destination does not run the VM: Nova's
            # rollback cleans the destination and leaves the instance on this
            # host, with the migration in error; _live_migration then raises so
            # that Nova puts the instance in ERROR (it runs nowhere).
            outcome["ok"] = None
            self._finish_movers(offer_of(migrate_data), ok=False)
            self._flexmig_lost[instance.uuid] = answers
            recover_method(context, instance, dest, migrate_data, migration_status="error")

        try:
            watch.run(instance, guest, future, done, failed, lost)
        finally:
            if outcome["ok"] is False:  # the watch itself raised
                self._finish_movers(offer_of(migrate_data), ok=False)
            self._flexmig_guests.pop(instance.uuid, None)
            self._clear_empty_migration(instance)

    def _plan_monitor(self, plan: Plan, dest: str, migrate_data: Any) -> monitor.PlanMonitor:
        opts = migration_options.read(CONF)
        return monitor.PlanMonitor(
            _libvirt(),
            self._host,
            plan,
            migrate_data.migration,
            opts.stall_timeout_s,
            CONF.libvirt.live_migration_monitor_interval,
            self.active_migrations,
            opts.setup_timeout_s,
            opts.converge_timeout_s,
            # The URI Nova's own operation hands libvirt for the destination,
            # opened the way Nova opens its own connection (here read-only).
            monitor.Destination(
                self._live_migration_uri(dest), lambda uri: self._host._connect(uri, True)
            ),
        )

    def _resume_postcopy(
        self, instance: Any, guest: Any, dest: str, plan: Plan, migrate_data: Any
    ) -> None:
        """The engine's postcopy recovery (nova_driver/postcopy.py); raises
        PostcopyNotRecovered when out of time (Nova: ERROR, no rollback)."""
        opts = migration_options.read(CONF)
        offer = offer_of(migrate_data)
        # Where Nova's own migration pointed QEMU (its _live_migration_operation).
        is_set = getattr(migrate_data, "obj_attr_is_set", lambda _f: False)
        connect = migrate_data.target_connect_addr if is_set("target_connect_addr") else None
        pairs = None
        if offer is not None and offer.mover is not None:
            pairs = postcopy.AgentMoverPairs(
                self._local_agent(), self._destination_agent(offer), offer.mover.migration_id
            )
        planned = self._flexmig_guests.get(instance.uuid)
        config = JobConfig(
            dest_libvirt_uri=self._live_migration_uri(dest),
            migration_uri=self._flexmig_uris.get(instance.uuid)
            or self._migrate_uri(connect or dest)
            or "",
            stall_timeout_s=opts.stall_timeout_s,
            setup_timeout_s=opts.setup_timeout_s,
            recovery_timeout_s=opts.recovery_timeout_s,
            reopen_transport=pairs.reopen if pairs is not None else None,
            flags=planned.flags_used if planned is not None else None,
            source_connection=self._source_connection,
        )
        LOG.warning("FlexMig: postcopy broke; resuming it", instance=instance)
        result = postcopy.resume(
            guest._domain,
            CONF.host,
            plan,
            config,
            lambda text: LOG.info("FlexMig postcopy recovery: %s", text, instance=instance),
        )
        if pairs is not None:
            pairs.finish(ok=result.state == "completed")
        if result.state != "completed":
            raise postcopy.PostcopyNotRecovered(vm=instance.name, reason=result.error)
        LOG.info("FlexMig: postcopy resumed and completed", instance=instance)

    def _source_connection(self) -> Any:
        """This host's libvirt on Nova's own connection, which Nova reopens once
        libvirtd restarted: the guest's domain handle dies with the old daemon,
        and a postcopy that completed across a source libvirtd restart must not
        be reported paused on both hosts (fault campaign)."""
        try:
            return self._host.get_connection()
        except exception.HypervisorUnavailable as exc:
            raise exceptions.BackendError(
                backend="libvirt", reason=f"no connection to this host's libvirt: {exc}"
            ) from exc

    def _set_downtime(self, guest: Any, plan: Plan, instance: Any) -> None:
        """The decision's downtime limit, once, instead of Nova's stepped increase."""
        deadline = time.monotonic() + CONF.flexmig.agent_timeout
        while True:
            try:
                guest.migrate_configure_max_downtime(plan.decision.max_downtime_ms)
                return
            except _libvirt().libvirtError as exc:
                # Before QEMU has the job, libvirt may refuse; retry briefly.
                if time.monotonic() > deadline:
                    LOG.warning("FlexMig: could not set the downtime limit: %s", exc)
                    return
                time.sleep(0.2)

    def rollback_live_migration_at_source(
        self, context: Any, instance: Any, migrate_data: Any
    ) -> None:
        super().rollback_live_migration_at_source(context, instance, migrate_data)
        self._offload_end(instance, "the live migration was rolled back")
        offer = offer_of(migrate_data)
        if offer is None or offer.split_budget_bytes is None:
            return
        # Nova calls the destination's rollback only when it has files to
        # clean (no shared instance path): release the reservation from here,
        # with the credential the destination issued for this VM's migration.
        try:
            self._destination_agent(offer).post("/v1/split/cleanup", {"vm": instance.name})
            LOG.info("FlexMig: released the destination's split reservation", instance=instance)
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: could not release the destination's split reservation: %s", exc)

    def post_live_migration_at_source(self, context: Any, instance: Any, network_info: Any) -> None:
        super().post_live_migration_at_source(context, instance, network_info)
        self._offload_end(instance, None)
        self._release_leftover_split(instance)

    def _release_leftover_split(self, instance: Any) -> None:
        """A VM that arrived here by split leaves its reservation behind when it goes."""
        try:
            status = self._local_agent().get(f"/v1/split/{instance.name}")
        except exceptions.FlexMigError as exc:
            LOG.warning("FlexMig: could not ask the local agent about %s: %s", instance.name, exc)
            return
        if status.get("reservation"):
            self._release_split(instance)
