"""flexmig-agent: wiring of config, API routes, split store and migrations."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

from oslo_config import cfg
from oslo_log import log
from oslo_privsep import daemon as privsep_daemon

from agents.agent import (
    admission,
    api,
    auth,
    config,
    facts,
    hot_chunks,
    inventory,
    listener,
    mover_files,
    movers,
    offload_hook,
    privileged,
    split_store,
    sriov_failover,
)
from agents.agent.client import AgentClient
from agents.agent.link_estimate import describe_learnt
from agents.agent.migrations import Destination, MigrationService
from agents.agent.split_store import ChunkFlusher, ResidencyKeeper, SplitStore, check_name
from flexmig import exceptions
from flexmig.migration import options as migration_options
from flexmig.migration.request import MigrationRequest

LOG = logging.getLogger("flexmig.agent")
DEST_FIELDS = {"address": str, "port": int, "libvirt_uri": str, "migration_uri": str}
MIGRATE_FIELDS = {"vm": str, "dest": dict}
# Everything else a migrate/plan body holds is the engine's request (MigrationRequest).
MIGRATE_OPTIONAL = {
    "mode": str,
    "max_downtime_ms": int,
    "bandwidth_mib": int,
    "transport": str,
    "store_writeback": bool,
    "parallel": int,
}
MAX_PROBE_MIB = 256
MAX_INVENTORY_PEERS = 64
# A guest heartbeat gap longer than this is no migration's (an hour: the CLI waits 30 min).
MAX_GUEST_GAP_MS = 3_600_000
# An incoming migration's writeback ends when the source says so; this bounds
# it should the source never say (its agent died).
INCOMING_WRITEBACK_MAX_S = 3600.0
STORE_PROBE_MAX_AGE_S = 600.0


class Agent:
    def __init__(self, conf: cfg.ConfigOpts) -> None:
        self.conf = conf
        self.host = socket.gethostname()
        self.key = auth.load_key(conf.agent.key_file)
        self.store = SplitStore(
            conf.agent.state_dir, conf.agent.store_dir, conf.agent.cgroup_parent
        )
        self.offload = offload_hook.OffloadHook(
            conf.agent.offload_control_socket, self.key, self.host, conf.agent.libvirt_uri,
            failover_vfs=conf.agent.sriov_failover_vfs,
        )  # fmt: skip
        self.migrations = MigrationService(
            self.host, conf, migration_options.read(conf), self.offload
        )
        self.flush_stops: dict[str, threading.Event] = {}
        self.flushers: dict[str, ChunkFlusher] = {}
        self.keepers: dict[str, ResidencyKeeper] = {}
        self._store_probe: tuple[float, facts.StoreProbe | None] = (0.0, None)
        # Plans and inventories share one gate: both sample dirty rates for seconds.
        self.gate = admission.Gate(
            "plan or inventory",
            admission.Bounds(conf.agent.expensive_workers, conf.agent.expensive_queued),
            # A queued request must still be answered before its client's own timeout.
            wait_limit_s=conf.agent.socket_timeout,
        )
        self.router = api.Router()
        r = self.router
        r.add("GET", "/v1/health", lambda b, m: (200, {"ok": True, "host": self.host}))
        r.add("GET", "/v1/facts", self.get_facts)
        r.add("GET", r"/v1/probe/(?P<mib>[0-9]{1,3})", self.probe)
        r.add("POST", "/v1/split/prepare", self.split_prepare)
        r.add("POST", "/v1/split/cleanup", self.split_cleanup)
        r.add("POST", "/v1/split/hot", self.split_hot)
        r.add("POST", "/v1/split/sample-hot", self.split_sample_hot)
        r.add("GET", r"/v1/split/(?P<vm>[^/]+)", self.split_status)
        r.add("POST", "/v1/incoming/writeback", self.incoming_writeback)
        # Read-only: Nova's drain (nova_driver.drain) asks it too.
        r.add("POST", "/v1/inventory", self.expensive(self.inventory))
        r.add("POST", r"/v1/samples/(?P<vm>[^/]+)/take", self.take_samples)
        # Movers: the agents' own migrations and Nova's driver (which drives
        # libvirt itself and asks both agents for movers by migration id) use
        # them, so they stay open when orchestration is off.
        r.add("POST", "/v1/mover/receive", self.mover_receive)
        r.add("POST", "/v1/mover/send", self.mover_send)
        r.add("POST", "/v1/mover/finish", self.mover_finish)
        self.receivers: dict[str, movers.MoverSet] = {}
        self.senders: dict[str, movers.MoverSet] = {}
        # A migrating VM's offloaded flows: the destination's side (from the peer
        # agent) and the source's (from this host's Nova driver).
        r.add("POST", "/v1/offload/arrive", self.offload_arrive)
        r.add("POST", "/v1/offload/records", self.offload_records)
        r.add("POST", "/v1/offload/settle", self.offload_settle)
        r.add("POST", "/v1/offload/abandon", self.offload_abandon)
        r.add("POST", "/v1/offload/depart", self.offload_depart)
        r.add("POST", "/v1/offload/finish", self.offload_finish)
        r.add("POST", "/v1/offload/restore", self.offload_restore)
        # Routes that plan or move VMs on the agents' own initiative.
        orchestrate = self._orchestration
        r.add("POST", "/v1/plan", orchestrate(self.expensive(self.plan)))
        r.add("POST", "/v1/migrations", orchestrate(self.migrate))
        r.add("GET", r"/v1/migrations/(?P<id>[0-9a-f]+)", orchestrate(self.migration_status))
        r.add("GET", "/v1/migrations", orchestrate(self.list_migrations))
        r.add("POST", r"/v1/migrations/(?P<id>[0-9a-f]+)/guest-gap", orchestrate(self.guest_gap))

    def expensive(self, handler: api.Handler) -> api.Handler:
        def gated(body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
            with self.gate.slot():
                return handler(body, m)

        return gated

    def _orchestration(self, handler: api.Handler) -> api.Handler:
        if self.conf.agent.allow_orchestration:
            return handler

        def refuse(_body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
            raise api.Forbidden(
                reason="this host's migrations are driven by Nova; the agent's own "
                "orchestration is disabled ([agent] allow_orchestration = false)"
            )

        return refuse

    def list_migrations(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        return 200, {"migrations": [rec.as_dict() for rec in self.migrations.records.values()]}

    def peer(self, address: str, port: int) -> AgentClient:
        """A client for another agent: TLS against the deployment's CA when this one serves TLS."""
        return AgentClient(address, port, self.key, ca_file=self.conf.agent.tls_ca_file)

    def get_facts(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        return 200, facts.host_facts(
            self.host,
            self.conf.agent.libvirt_uri,
            self.conf.agent.memory_budget_mb,
            self.conf.agent.store_dir,
            self._memory_cgroup(),
            self.migrations.links_snapshot(),
            self._probe_store(),
        ) | {
            "rdma_provider": self.migrations.rdma,
            # Where other agents reach this one (a caller may have come another
            # way, e.g. a local UNIX socket): the offload hook's agent-to-agent hand-off.
            "agent": {"address": str(self.conf.agent.listen_address), "port": self.conf.agent.port},
        }

    def _probe_store(self) -> facts.StoreProbe | None:
        """The store's write rate and fault time, probed at most every STORE_PROBE_MAX_AGE_S."""
        measured_at, probe = self._store_probe
        if time.monotonic() - measured_at > STORE_PROBE_MAX_AGE_S or probe is None:
            try:
                probe = facts.probe_store(self.conf.agent.store_dir)
            except OSError as exc:
                LOG.warning("cannot probe the store: %s", exc)
                return None
            self._store_probe = (time.monotonic(), probe)
        return probe

    def _memory_cgroup(self) -> dict[str, Any]:
        try:
            hierarchy = self.store.hierarchy
        except exceptions.MissingPrerequisite as exc:
            return {"version": None, "detail": str(exc)}
        return {"version": hierarchy.version, "detail": hierarchy.describe()}

    def sample_running_vms(self, background: bool = False) -> list[dict[str, Any]]:
        """Facts and fresh samples of every running VM not migrating (kept for plans).

        ``background``: not VMs this host holds under a split budget either
        (libvirt's sampling reads pages spread over all of guest RAM, faulting
        the store's into the cap 4 MiB at a time), nor paused ones (a VM still
        arriving is paused, and its libvirt job would hold the sampling).
        """
        busy = {
            r.vm for r in self.migrations.records.values() if r.state in ("planning", "running")
        }

        def skip(vm: str) -> bool:
            return vm in busy or (background and self._split_here(vm))

        return inventory.running_vms(
            self.conf.agent.libvirt_uri,
            self.host,
            self.migrations.options.dirty_sample_seconds,
            self.migrations.ram_mapping,
            self.migrations.samples,
            skip=skip,
            running_only=background,
        )

    def _split_here(self, vm: str) -> bool:
        try:
            return self.store.reservation(vm) is not None
        except exceptions.FlexMigError:  # a name the store refuses holds no reservation
            return False

    def take_samples(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """A VM's fresh background samplings, handed over once, as the agent's own
        plan takes them: Nova's driver plans from these instead of sampling anew
        for the samples' length (none: [agent] dirty_sample_refresh is off, or
        nothing fresh)."""
        api.check_fields(body, {})
        vm = m.group("vm")
        check_name(vm)
        samples = self.migrations.samples.take(vm) or ()
        return 200, {"vm": vm, "samples": [list(s) for s in samples]}

    def inventory(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """Every running VM's facts and dirty model, and the links to ``probe`` peers."""
        api.check_fields(body, {}, {"probe": list})
        peers = body.get("probe", [])
        if len(peers) > MAX_INVENTORY_PEERS:
            raise api.BadRequest(reason=f"at most {MAX_INVENTORY_PEERS} peers to probe")
        links = {}
        for peer in peers:
            if not isinstance(peer, dict):
                raise api.BadRequest(reason="each peer is an object with address and port")
            api.check_fields(peer, {"address": str, "port": int})
            client = self.peer(peer["address"], peer["port"])
            dest = Destination(agent=client, libvirt_uri="", migration_uri="")
            links[peer["address"]] = dataclasses.asdict(self.migrations.link(dest))
        vms = self.sample_running_vms()
        options = self.migrations.options
        return 200, {
            "host": self.host,
            "vms": vms,
            "links": links,
            "initial_stream_bps": options.stream_bandwidth_mib * 2**20,
            "max_downtime_ms": options.max_downtime_ms,
            "allowed_modes": list(options.allowed_modes),
        }

    def probe(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, bytes]:
        api.check_fields(body, {})
        mib = int(m.group("mib"))
        if not 1 <= mib <= MAX_PROBE_MIB:
            raise api.BadRequest(reason=f"probe size must be 1..{MAX_PROBE_MIB} MiB")
        return 200, bytes(mib << 20)

    def split_prepare(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(
            body, {"vm": str, "ram_bytes": int, "budget_bytes": int}, {"headroom_bytes": int}
        )
        vm = body["vm"]
        result = self.store.prepare(
            vm, body["ram_bytes"], body["budget_bytes"], body.get("headroom_bytes")
        )
        self._stop_flusher(vm)
        # The keeper writes the VM's file back and keeps its residency under the budget;
        # the chunks it keeps less often where QEMU does not sync them in the downtime.
        syncs = facts.qemu_syncs_incoming_ram(self.conf.agent.libvirt_uri, self.host)
        stop = threading.Event()
        self.flush_stops[vm] = stop
        self.keepers[vm] = ResidencyKeeper(
            self.store, vm, stop, 1 if syncs else split_store.KEPT_WRITEBACK_LOOKS
        )
        self.keepers[vm].start()
        return 200, result

    def split_hot(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """The chunks the source saw the guest write (hot_chunks.py), for the
        VM's keeper to keep resident; checked whole before anything changes."""
        api.check_fields(body, {"vm": str, "chunks": list})
        vm = body["vm"]
        reservation = self.store.reservation(vm)
        keeper = self.keepers.get(vm)
        if reservation is None or keeper is None:
            raise exceptions.NotFound(what="split reservation", name=vm)
        runs = hot_chunks.check_ranges(body["chunks"], reservation["ram_bytes"])
        keeper.hint(hot_chunks.chunks_of(runs))
        return 200, {"vm": vm, "hinted_chunks": keeper.stats["hinted_chunks"]}

    def split_sample_hot(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        """On the source: which chunks a VM's guest writes now (hot_chunks.py),
        for Nova's driver to hand to the destination; ``chunks`` is None where
        the VM's memory cannot say, or sampling is off."""
        api.check_fields(body, {"vm": str, "ram_bytes": int})
        check_name(body["vm"])
        runs, why = self.migrations.sample_hot_chunks(body["vm"], body["ram_bytes"])
        return 200, {
            "vm": body["vm"],
            "chunks": runs,
            "seconds": self.conf.agent.split_hot_sample_seconds,
            "why": why or None,
        }

    def _start_flusher(self, vm: str, lifetime_s: float | None = None) -> None:
        """Flush the VM's memory file in 1 MiB ranges once the incoming QEMU made it."""
        self._stop_flusher(vm)
        stop = threading.Event()
        self.flush_stops[vm] = stop
        deadline = None if lifetime_s is None else time.monotonic() + lifetime_s

        def wait_and_flush() -> None:
            path = None
            while path is None and not stop.wait(0.05):
                if deadline is not None and time.monotonic() > deadline:
                    return
                path = self.store.memory_file(vm)
            if path:
                self.flushers[vm] = ChunkFlusher(path, stop, deadline)
                self.flushers[vm].run()

        threading.Thread(target=wait_and_flush, name=f"flush-wait-{vm}", daemon=True).start()

    def _stop_flusher(self, vm: str) -> int:
        """Stop the VM's flusher, if any: how often it wrote the whole file back."""
        stop = self.flush_stops.pop(vm, None)
        if stop:
            stop.set()
        flusher = self.flushers.pop(vm, None)
        keeper = self.keepers.pop(vm, None)
        if keeper:
            return keeper.stats["rounds"]
        return flusher.rounds if flusher else 0

    def incoming_writeback(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        """Keep an incoming VM's memory file written back while it migrates here.

        A split VM's residency keeper runs for the VM's whole stay and is left alone.
        """
        api.check_fields(body, {"vm": str, "active": bool})
        vm = body["vm"]
        privileged.check_name("VM name", vm)
        if self.store.reservation(vm) is not None:
            return 200, {"vm": vm, "writeback": "split"}
        if body["active"]:
            self._start_flusher(vm, INCOMING_WRITEBACK_MAX_S)
            return 200, {"vm": vm, "writeback": "on"}
        # rounds: how often the whole file was written back (0: no memory file appeared)
        return 200, {"vm": vm, "writeback": "off", "rounds": self._stop_flusher(vm)}

    def mover_receive(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "token_salt": str}, {"streams": int})
        mid, salt, streams = body["migration_id"], body["token_salt"], body.get("streams", 1)
        if not re.fullmatch(r"[0-9a-f]{6,36}", mid) or not re.fullmatch(r"[0-9a-f]{32,64}", salt):
            raise api.BadRequest(reason="migration_id must be 6..36 hex digits, token_salt 32..64")
        # The token itself never crosses the network: both ends derive it.
        token = auth.mover_token(self.key, mid, salt)
        if not 1 <= streams <= movers.MAX_STREAMS:
            raise api.BadRequest(reason=f"streams must be 1..{movers.MAX_STREAMS}")
        if mid in self.receivers:
            raise api.BadRequest(reason=f"movers for {mid} are already receiving")
        receivers, ports = movers.start_receivers(
            self.conf.agent.state_dir, self.conf.agent.listen_address, mid, token, streams
        )
        self.receivers[mid] = receivers
        # address: where the receivers listen, for a sender that knows this
        # agent by another name (the Nova driver may reach it on a UNIX socket).
        return 200, {"port": ports[0], "ports": ports, "address": self.conf.agent.listen_address}

    def mover_send(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """Sending movers towards a destination's receivers; QEMU is pointed at the
        returned URI by whoever drives libvirt (the Nova driver)."""
        api.check_fields(body, {"migration_id": str, "token_salt": str, "peer": str, "ports": list})
        mid, salt, ports = body["migration_id"], body["token_salt"], body["ports"]
        if not re.fullmatch(r"[0-9a-f]{6,36}", mid) or not re.fullmatch(r"[0-9a-f]{32,64}", salt):
            raise api.BadRequest(reason="migration_id must be 6..36 hex digits, token_salt 32..64")
        if not ports or not all(isinstance(p, int) and p in movers.PORT_RANGE for p in ports):
            raise api.BadRequest(reason=f"ports must be in {movers.PORT_RANGE}")
        if mid in self.senders:
            raise api.BadRequest(reason=f"movers for {mid} are already sending")
        self.senders[mid] = movers.start_senders(
            self.conf.agent.state_dir,
            self.conf.agent.listen_address,
            body["peer"],
            ports,
            mid,
            # The same token the destination derived for its receivers.
            auth.mover_token(self.key, mid, salt),
        )
        return 200, {"uri": "unix://" + movers.socket_path(self.conf.agent.state_dir, mid)}

    def mover_finish(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str}, {"abort": bool})
        mid = body["migration_id"]
        mover = self.receivers.pop(mid, None) or self.senders.pop(mid, None)
        if mover is None:
            raise exceptions.NotFound(what="mover of migration", name=mid)
        Path(movers.socket_path(self.conf.agent.state_dir, mid)).unlink(missing_ok=True)
        if body.get("abort"):
            mover.kill()
            return 200, {"aborted": True}
        return 200, {"stats": mover.wait(timeout=30)}

    def split_cleanup(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"vm": str})
        self._stop_flusher(body["vm"])
        self.store.cleanup(body["vm"], privileged.remove_split_cgroup)
        return 200, {"vm": body["vm"], "cleaned": True}

    def split_status(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        vm = m.group("vm")
        return 200, {
            "vm": vm,
            "reservation": self.store.reservation(vm),
            "cgroup": self.store.usage(vm),
            "cgroup_version": self.store.hierarchy.version,
            "residency": dict(self.keepers[vm].stats) if vm in self.keepers else None,
        }

    # -- offloaded flows across a migration (offload_hook.py) ---------------------
    def offload_arrive(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        fields = {"migration_id": str, "vm": str, "ports": list, "peer": str, "flows": list}
        api.check_fields(body, fields, {"failover": list})
        note = self.offload.arrive(
            body["migration_id"], body["vm"], body["ports"], body["peer"], body["flows"],
            failover=body.get("failover"),
        )  # fmt: skip
        return 200, {"note": note}

    def offload_records(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "flows": list})
        return 200, self.offload.records(body["migration_id"], body["flows"])

    def offload_settle(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "flows": list})
        return 200, self.offload.settle(body["migration_id"], body["flows"])

    def offload_abandon(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "reason": str})
        return 200, self.offload.abandon(body["migration_id"], body["reason"])

    def _offload_peer(self, body: dict[str, Any]) -> AgentClient:
        peer = body["dest"]
        api.check_fields(peer, {"address": str, "port": int})
        return self.peer(peer["address"], peer["port"])

    def offload_depart(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "vm": str, "dest": dict}, {"nova_vfs": dict})
        nova_vfs = body.get("nova_vfs")
        if nova_vfs is not None:
            for mac, vf in nova_vfs.items():
                if not sriov_failover.MAC.match(mac) or not isinstance(vf, str):
                    raise api.BadRequest(reason=f"nova_vfs: {mac!r} -> {vf!r}"[:200])
                sriov_failover.check_pci(vf)
        events: list[str] = []
        handled = self.offload.depart(
            body["migration_id"], body["vm"], self._offload_peer(body), events.append,
            nova_vfs=nova_vfs,
        )  # fmt: skip
        return 200, {"handled": handled, "events": events}

    def offload_finish(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "dest": dict})
        events: list[str] = []
        summary = self.offload.finish(body["migration_id"], self._offload_peer(body), events.append)
        return 200, {"summary": summary, "events": events}

    def offload_restore(
        self, body: dict[str, Any], _m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "reason": str, "dest": dict})
        events: list[str] = []
        peer = self._offload_peer(body)
        self.offload.restore(body["migration_id"], body["reason"], peer, events.append)
        return 200, {"events": events}

    def _destination(self, body: dict[str, Any]) -> Destination:
        api.check_fields(body, DEST_FIELDS)
        client = self.peer(body["address"], body["port"])
        return Destination(
            agent=client, libvirt_uri=body["libvirt_uri"], migration_uri=body["migration_uri"]
        )

    def _request(self, body: dict[str, Any]) -> tuple[MigrationRequest, Destination]:
        api.check_fields(body, MIGRATE_FIELDS, MIGRATE_OPTIONAL)
        request = MigrationRequest.from_body({k: v for k, v in body.items() if k != "dest"})
        return request, self._destination(body["dest"])

    def plan(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        request, dest = self._request(body)
        plan = self.migrations.plan(request, dest)
        link = self.migrations.link(dest)
        learned = describe_learnt(link)
        try:
            flows = self.offload.explain(request.vm)
        except exceptions.FlexMigError as exc:
            flows = f"offloaded flows: unknown ({exc})"
        text = (
            f"{plan.explain()}\n  fabric to {dest.agent.address}: probed "
            f"{link.fabric_bps / 2**20:.0f} MiB/s; {learned}\n  {flows}"
        )
        return 200, {
            "mode": plan.mode,
            "transfer": plan.decision.transfer,
            "transport": plan.transport.transport,
            "parallel": plan.parallel,
            "knobs": dataclasses.asdict(plan.knobs),
            "features": plan.features,
            "predicted_guest_downtime_ms": round(plan.guest_downtime.total_ms),
            "over_budget": plan.over_budget,
            "explanation": text,
        }

    def migrate(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        request, dest = self._request(body)
        record = self.migrations.start(request, dest)
        return 202, {"id": record.id}

    def migration_status(
        self, body: dict[str, Any], m: re.Match[str]
    ) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        return 200, self.migrations.get(m.group("id")).as_dict()

    def guest_gap(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """A guest probe's longest heartbeat gap across a completed migration."""
        api.check_fields(body, {"gap_ms": (int, float)})
        if isinstance(body["gap_ms"], bool):
            raise api.BadRequest(reason="field 'gap_ms' has the wrong type")
        gap = float(body["gap_ms"])
        if not 0 <= gap <= MAX_GUEST_GAP_MS:  # NaN fails this too
            raise api.BadRequest(reason=f"gap_ms must be 0-{MAX_GUEST_GAP_MS} ms, not {gap}")
        why = self.migrations.report_guest_gap(m.group("id"), gap)
        return 200, {"learnt": why is None, "why": why}


def limits(conf: cfg.ConfigOpts) -> listener.Limits:
    return listener.Limits(
        socket_timeout=conf.agent.socket_timeout,
        workers=conf.agent.workers,
        max_queued=conf.agent.max_queued,
        max_idle_connections=conf.agent.max_idle_connections,
    )


def tls(conf: cfg.ConfigOpts) -> ssl.SSLContext | None:
    if not conf.agent.tls_cert_file:
        return None
    return listener.server_tls(conf.agent.tls_cert_file, conf.agent.tls_key_file)


def refresh_samples(agent: Agent) -> inventory.SampleRefresher | None:
    """Sample every running VM in the background ([agent] dirty_sample_refresh)."""
    interval = agent.conf.agent.dirty_sample_refresh
    inventory.check_refresh(interval, agent.migrations.options.dirty_sample_seconds)
    if not interval:
        return None
    refresher = inventory.SampleRefresher(
        interval, lambda: agent.sample_running_vms(background=True)
    )
    threading.Thread(target=refresher.run, name="sample-refresher", daemon=True).start()
    return refresher


def tend_movers(agent: Agent, interval_s: float = 5.0) -> None:
    """Movers nobody will finish: a previous agent's (retired when they end)
    and this agent's whose migration's other agent died (``reap_unclaimed``)."""
    state_dir = agent.conf.agent.state_dir
    orphans = mover_files.Orphans(mover_files.sweep(Path(state_dir)))
    if orphans.found:
        LOG.warning("%d mover(s) of a previous agent still run", len(orphans.found))

    def tend() -> None:
        while True:
            time.sleep(interval_s)
            try:
                orphans.reap()
                for sets in (agent.receivers, agent.senders):
                    for mid in movers.reap_unclaimed(sets, state_dir):
                        LOG.warning("movers %s ended unclaimed: their migration is gone", mid)
            except Exception:  # the next round tries again; the agent serves on
                LOG.exception("tending movers")

    threading.Thread(target=tend, name="mover-tender", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    conf = config.CONF
    try:
        args = sys.argv[1:] if argv is None else argv
        conf(args, project="flexmig", prog="flexmig-agent")
        # oslo.privsep reads its [privsep_agent] group from the global object.
        cfg.CONF(args, project="flexmig", prog="flexmig-agent", default_config_files=[])
        config.check_tls(conf)
        config.check_workers(conf)
        agent = Agent(conf)
        inventory.check_refresh(
            conf.agent.dirty_sample_refresh, agent.migrations.options.dirty_sample_seconds
        )
        tend_movers(agent)
        # Migrations the previous agent left running: libvirt's job outlived it.
        agent.migrations.reconcile_unended(agent.peer)
        privileged.start()
        refresh_samples(agent)
        servers = api.make_servers(
            conf.agent.listen_address,
            conf.agent.port,
            conf.agent.unix_socket,
            auth.Verifier(agent.key),
            agent.router,
            limits(conf),
            tls(conf),
        )
    except (
        cfg.Error,
        exceptions.FlexMigError,
        OSError,  # ssl.SSLError too: an unreadable certificate or key
        privsep_daemon.FailedToDropPrivileges,
    ) as exc:
        print(f"flexmig-agent: {exc}", file=sys.stderr)
        return 2
    log.setup(conf, "flexmig-agent")
    LOG.info(
        "listening on %s:%d (%s)%s",
        conf.agent.listen_address,
        conf.agent.port,
        "TLS" if conf.agent.tls_cert_file else "plain HTTP",
        f" and {conf.agent.unix_socket}" if conf.agent.unix_socket else "",
    )
    for server in servers[1:]:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    servers[0].serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
