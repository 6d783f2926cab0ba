"""A VM's flows across a live migration: the offload extension's half of the hook.

The migration engine (through the hosts' agents) calls these steps; each host's
extension runs its own half:

source       ``depart``   demote the VM's offloaded flows to the vSwitch (their
                          provider counters carried over, as any demotion) and
                          hold them there; export their records.
destination  ``arrive``   take the records: the flows are known and judged
                          before their first packet, with the source's counters
                          carried, and marked for re-offload.
destination  ``resume``   the VM runs here: offload again what was offloaded
                          (this host's policy and capacity decide).
source       ``finish``   after fresh statistics, the final records; forget.
destination  ``settle``   the source's final counters replace the departure-time
                          ones, so the totals include every packet counted there.
source       ``restore``  the migration failed: re-offload on the source, reason
                          kept for the status file.
destination  ``abandon``  the migration failed: forget what arrived.
either       ``rekey``    an SR-IOV failover pair's flows change NIC (the VF
                          representor's become the virtio standby's while the
                          VF is unplugged, and back to a representor once a VF
                          is plugged again); totals carried.

Counting once: the source's counters come across as ``carried`` and the source
forgets the flow, so ``ovs-ofctl dump-flows`` shows each packet on one host.
No I/O here: the control API feeds it, the OpenFlow app deletes the rules of
the flows it returns.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any

from flexmig import exceptions
from ovs_ext import policy as policy_mod
from ovs_ext.control import OffloadControl
from ovs_ext.flows import FlowState, TrackedFlow
from ovs_ext.providers.base import FlowCounters, FlowMatch

RECORD_VERSION = 1
MAX_RECORDS = 4096
MAX_KEPT = 32  # finished migrations kept in the status file


class Role(enum.Enum):
    SOURCE = "source"
    DESTINATION = "destination"


@dataclasses.dataclass(frozen=True)
class FlowTransfer:
    """What a flow carries to its VM's next host."""

    match: FlowMatch
    owner: str
    direction: str
    was_offloaded: bool
    reason: str
    onloaded: FlowCounters
    offloaded: FlowCounters
    moves: int
    offloaded_at: float | None

    @property
    def total(self) -> FlowCounters:
        return self.onloaded + self.offloaded

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "match": dataclasses.asdict(self.match),
            "owner": self.owner,
            "direction": self.direction,
            "was_offloaded": self.was_offloaded,
            "reason": self.reason,
            "onloaded": [self.onloaded.packets, self.onloaded.bytes],
            "offloaded": [self.offloaded.packets, self.offloaded.bytes],
            "moves": self.moves,
            "offloaded_at": self.offloaded_at,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> FlowTransfer:
        """One record as another host sent it; anything malformed is refused whole."""
        try:
            if data["v"] != RECORD_VERSION:
                raise ValueError(f"record version {data['v']!r}, this host reads {RECORD_VERSION}")
            match = FlowMatch(**data["match"])
            direction = policy_mod.Direction(data["direction"]).value
            counters = [_counters(data[k]) for k in ("onloaded", "offloaded")]
            offloaded_at = data["offloaded_at"]
            if offloaded_at is not None and not isinstance(offloaded_at, int | float):
                raise ValueError("offloaded_at is not a time")
            moves = data["moves"]
            if not isinstance(moves, int) or moves < 0:
                raise ValueError("moves is not a count")
            return cls(
                match, str(data["owner"]), direction, bool(data["was_offloaded"]),
                str(data["reason"])[:200], counters[0], counters[1], moves, offloaded_at,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise exceptions.InvalidInput(what="flow record", reason=str(exc)) from exc


def rekey_records(records: list[FlowTransfer], old_port: str, new_port: str) -> list[FlowTransfer]:
    """Records of flows entering by (or owned by) ``old_port``, now by ``new_port``.

    Counters and history stay: the flow is the guest's, whichever NIC carries it.
    """
    out = []
    for record in records:
        match = record.match
        if match.in_port == old_port:
            match = dataclasses.replace(match, in_port=new_port)
        owner = new_port if record.owner == old_port else record.owner
        out.append(dataclasses.replace(record, match=match, owner=owner))
    return out


def _counters(value: Any) -> FlowCounters:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise ValueError(f"counters {value!r} are not [packets, bytes]")
    return FlowCounters(value[0], value[1])


def transfer_of(flow: TrackedFlow, was_offloaded: bool) -> FlowTransfer:
    return FlowTransfer(
        flow.match, flow.owner, flow.direction.value, was_offloaded, flow.reason,
        flow.onloaded_counters, flow.offloaded_counters, flow.moves, flow.offloaded_at,
    )  # fmt: skip


def kept_transfer(
    match: FlowMatch, onloaded: FlowCounters, offloaded: FlowCounters
) -> FlowTransfer:
    """A kept flow's record: it entered by the VM's port (so it is the VM's, going
    out), onloaded now (an earlier run's offload entries were read back)."""
    return FlowTransfer(
        match, match.in_port, policy_mod.Direction.EGRESS.value, False,
        "counted by an earlier run of the service, not seen again before the migration",
        onloaded, offloaded, 0, None,
    )  # fmt: skip


@dataclasses.dataclass
class FlowMigration:
    """One VM's migration as this host sees it (shown in the status file)."""

    migration_id: str
    role: Role
    ports: tuple[str, ...]
    peer: str
    state: str
    flows: dict[FlowMatch, TrackedFlow] = dataclasses.field(default_factory=dict)
    was_offloaded: set[FlowMatch] = dataclasses.field(default_factory=set)
    reason: str = ""
    events: dict[str, float] = dataclasses.field(default_factory=dict)  # step -> wall time
    # Ports whose flows were re-keyed here (old -> new): records from the peer
    # that still name the old port (the source's final counters) follow them.
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)
    # Source: flows of the VM an earlier run of the service counted and this one
    # has not seen again (kept counters): they move with the VM too.
    kept: set[FlowMatch] = dataclasses.field(default_factory=set)

    def reoffloaded(self) -> dict[str, float]:
        """Flows offloaded again since the migration began here, and when."""
        since = self.events.get("arrived", self.events.get("departing", 0.0))
        return {
            _key(m): f.offloaded_at
            for m, f in self.flows.items()
            if m in self.was_offloaded
            and f.state is FlowState.OFFLOADED
            and f.offloaded_at is not None
            and f.offloaded_at >= since
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.migration_id,
            "role": self.role.value,
            "ports": list(self.ports),
            "peer": self.peer,
            "state": self.state,
            "reason": self.reason,
            "flows": len(self.flows),
            "kept_flows": len(self.kept),
            "were_offloaded": len(self.was_offloaded),
            "events": dict(self.events),
            "reoffloaded": self.reoffloaded(),
        }


class FlowMigrations:
    """Every migration of this host's VMs' flows, over one OffloadControl.

    Callers hold the control's lock around every call, as for the app's events.
    """

    def __init__(self, control: OffloadControl) -> None:
        self.control = control
        self.wall_clock = control.wall_clock  # one clock: offloaded_at is stamped by it
        self.by_id: dict[str, FlowMigration] = {}
        control.status_extras["migrations"] = self.status

    def _new(self, migration_id: str, role: Role, ports: Iterable[str], peer: str) -> FlowMigration:
        current = self.by_id.get(migration_id)
        if current is not None and current.state not in ("restored", "abandoned", "finished"):
            raise exceptions.InvalidInput(
                what="migration", reason=f"{migration_id} is already {current.state} here"
            )
        mig = FlowMigration(migration_id, role, tuple(sorted(ports)), peer, "new")
        self.by_id[migration_id] = mig
        for old in list(self.by_id)[:-MAX_KEPT]:
            del self.by_id[old]
        return mig

    def get(self, migration_id: str, role: Role) -> FlowMigration:
        mig = self.by_id.get(migration_id)
        if mig is None or mig.role is not role:
            raise exceptions.InvalidInput(
                what="migration", reason=f"no {role.value} migration {migration_id!r} here"
            )
        return mig

    def _stamp(self, mig: FlowMigration, state: str) -> None:
        mig.state = state
        mig.events[state] = self.wall_clock()

    # -- source -------------------------------------------------------------------
    def depart(self, migration_id: str, ports: Iterable[str], peer: str) -> list[FlowTransfer]:
        """Demote the VM's offloaded flows and hold them onloaded; their records."""
        mig = self._new(migration_id, Role.SOURCE, ports, peer)
        flows = {f.match: f for f in self._flows_moving_with(mig.ports)}
        mig.flows = flows
        mig.was_offloaded = {m for m, f in flows.items() if f.state is FlowState.OFFLOADED}
        why = f"migrating to {peer}: onloaded before switchover"
        self.control.onload_now(tuple(mig.was_offloaded), why)
        for flow in flows.values():
            flow.held = why
            if flow.state is FlowState.OFFLOADED:  # the provider kept it: say so, still hold
                flow.reason = f"{why} (the provider could not remove it)"
        mig.kept = set(self.control.flows.kept_entering_by(mig.ports))
        self._stamp(mig, "departing")
        return self.records(migration_id)

    def records(self, migration_id: str) -> list[FlowTransfer]:
        """The records of a departing migration's flows as they are now."""
        mig = self.get(migration_id, Role.SOURCE)
        tracked = [transfer_of(f, m in mig.was_offloaded) for m, f in mig.flows.items()]
        return tracked + self._kept_records(mig)

    def _kept_records(self, mig: FlowMigration) -> list[FlowTransfer]:
        """Records of the VM's kept flows: from the kept counters, or from the flow
        they became when seen again during the migration."""
        kept = self.control.flows.kept_entering_by(mig.ports)
        records = []
        for match in sorted(mig.kept, key=_key):
            flow = self.control.flows.get(match)
            if flow is not None and match not in mig.flows:
                records.append(transfer_of(flow, False))
            elif match in kept:
                onloaded, offloaded = kept[match]
                records.append(kept_transfer(match, onloaded, offloaded))
        return records

    def _flows_moving_with(self, ports: tuple[str, ...]) -> list[TrackedFlow]:
        """The VM's own flows (entering by its ports) and those reaching it from an
        uplink: they look the same on the destination.  A flow from another port of
        this host stays here (its sender does); the port's removal onloads it."""
        uplinks = self.control.dispatchers.uplinks
        return [
            f
            for p in ports
            for f in self.control.flows.flows_of_port(p)
            if f.match.in_port in ports or f.match.in_port in uplinks
        ]

    def finish(self, migration_id: str) -> tuple[list[FlowTransfer], list[TrackedFlow]]:
        """The VM runs on the destination: final records; the flows are forgotten
        here (returned so the app deletes their rules)."""
        mig = self.get(migration_id, Role.SOURCE)
        final = self.records(migration_id)
        gone = []
        for match, flow in mig.flows.items():
            if self.control.flows.get(match) is flow:
                self.control.forget(match)
                gone.append(flow)
        for match in mig.kept - set(mig.flows):
            flow = self.control.flows.get(match)
            if flow is not None:  # seen again during the migration: it left too
                self.control.forget(match)
                gone.append(flow)
            self.control.flows.drop_kept(match)
        self._stamp(mig, "finished")
        return final, gone

    def restore(self, migration_id: str, reason: str) -> list[FlowMatch]:
        """The migration failed: the flows stay here, re-offloaded as they were."""
        mig = self.get(migration_id, Role.SOURCE)
        mig.reason = f"migration to {mig.peer} failed: {reason}"[:300]
        back = []
        for match, flow in mig.flows.items():
            if self.control.flows.get(match) is not flow:
                continue  # the port left meanwhile (VM stopped): nothing to restore
            flow.held = ""
            flow.reason = mig.reason
            if match in mig.was_offloaded:
                flow.reoffload = True
                back.append(flow)
        done = self.control.reoffload(back, f"{mig.reason}; re-offloaded on the source")
        self._stamp(mig, "restored")
        return done

    # -- destination --------------------------------------------------------------
    def arrive(
        self, migration_id: str, ports: Iterable[str], peer: str, records: list[FlowTransfer]
    ) -> FlowMigration:
        """Know and judge the VM's flows before their first packet here."""
        ports = tuple(sorted(ports))
        _check_records(ports, 0, records)
        mig = self._new(migration_id, Role.DESTINATION, ports, peer)
        self._take(mig, records)
        self._stamp(mig, "arrived")
        return mig

    def add_records(self, migration_id: str, records: list[FlowTransfer]) -> FlowMigration:
        """More of an arrived migration's records: a VM with more flows than one
        request carries sends them in parts, all before switchover."""
        mig = self.get(migration_id, Role.DESTINATION)
        if mig.state != "arrived":
            raise exceptions.InvalidInput(
                what="flow records", reason=f"migration {migration_id} is {mig.state} here"
            )
        _check_records(mig.ports, len(mig.flows), records)
        self._take(mig, records)
        return mig

    def _take(self, mig: FlowMigration, records: list[FlowTransfer]) -> None:
        held = f"arriving from {mig.peer}: waiting for the VM to resume here"
        for record in records:
            mig.flows[record.match] = self._adopt(record, held)
            if record.was_offloaded:
                mig.was_offloaded.add(record.match)

    def rekey(self, migration_id: str, old_port: str, new_port: str) -> list[TrackedFlow]:
        """A failover pair's flows move from ``old_port`` to ``new_port`` (source:
        VF representor -> standby before the job, or back when the migration
        failed; destination: standby -> the plugged VF's representor before the
        flows are re-offloaded).  The flows keyed by the old port are forgotten
        (returned: the app deletes their rules) and taken under the new key with
        their totals carried and their offload history kept."""
        mig = self.by_id.get(migration_id)
        if mig is None or mig.state not in ("departing", "arrived"):
            raise exceptions.InvalidInput(
                what="re-key",
                reason=f"no migration {migration_id!r} departing or arriving here",
            )
        moving = [m for m, f in mig.flows.items() if old_port in (m.in_port, f.owner)]
        records = [transfer_of(mig.flows[m], m in mig.was_offloaded) for m in moving]
        # Where each flow leaves the bridge, as this host learned it (the new
        # port where it was the old one): a re-offload need not wait for a packet.
        exits = [_renamed(mig.flows[m].out_port, old_port, new_port) for m in moving]
        gone = []
        for match in moving:
            flow = mig.flows.pop(match)
            mig.was_offloaded.discard(match)
            if self.control.flows.get(match) is flow:
                self.control.forget(match)
                gone.append(flow)
        mig.ports = tuple(sorted({*mig.ports, new_port}))
        mig.renamed = {k: _renamed(v, old_port, new_port) or v for k, v in mig.renamed.items()}
        mig.renamed[old_port] = new_port
        mig.renamed.pop(new_port, None)  # keyed back where it was
        held = flow_held(mig)
        for record, out_port in zip(rekey_records(records, old_port, new_port), exits, strict=True):
            flow = self._adopt(record, held, add=True)
            flow.out_port = flow.out_port or out_port
            mig.flows[record.match] = flow
            if record.was_offloaded:
                mig.was_offloaded.add(record.match)
        return gone

    def _adopt(self, record: FlowTransfer, held: str, add: bool = False) -> TrackedFlow:
        """Track a flow from its record, its counters carried (``add``: on top of
        what a flow already tracked under that key carried)."""
        direction = policy_mod.Direction(record.direction)
        out_port = record.owner if direction is policy_mod.Direction.INGRESS else None
        flow = self.control.flows.get(record.match)
        if flow is None:
            setup = policy_mod.decide_at_setup(
                self.control.policy, record.match, record.owner, direction
            )
            flow = self.control.flows.add(
                record.match, owner=record.owner, direction=direction, out_port=out_port,
                setup=setup,
            )  # fmt: skip
            flow.needs_rule = True
        if add:
            flow.carried_onloaded = flow.carried_onloaded + record.onloaded
            flow.carried_offloaded = flow.carried_offloaded + record.offloaded
        else:
            flow.carried_onloaded, flow.carried_offloaded = record.onloaded, record.offloaded
        flow.moves += record.moves
        flow.held = held
        flow.reason = flow.held
        flow.reoffload = record.was_offloaded
        return flow

    def resume(self, migration_id: str) -> list[FlowMatch]:
        """The VM runs here: offload again what was offloaded."""
        mig = self.get(migration_id, Role.DESTINATION)
        if mig.state != "arrived":
            return []  # resumed already (the watcher and settle both say so), or abandoned
        self._stamp(mig, "resumed")
        for flow in mig.flows.values():
            flow.held = ""
            if flow.reason.startswith("arriving from"):
                flow.reason = f"arrived from {mig.peer}"
        ready = [f for f in mig.flows.values() if f.reoffload and f.out_port is not None]
        return self.control.reoffload(ready, f"re-offloaded after migration from {mig.peer}")

    def settle(self, migration_id: str, final: list[FlowTransfer]) -> FlowMigration:
        """The source's final counters replace what arrived with the records."""
        mig = self.get(migration_id, Role.DESTINATION)
        for old, new in mig.renamed.items():
            final = rekey_records(final, old, new)
        for record in final:
            flow = mig.flows.get(record.match)
            if flow is not None and self.control.flows.get(record.match) is flow:
                flow.carried_onloaded, flow.carried_offloaded = record.onloaded, record.offloaded
        self._stamp(mig, "settled")
        return mig

    def abandon(self, migration_id: str, reason: str) -> list[TrackedFlow]:
        """The migration failed: what arrived is forgotten (the source keeps it)."""
        mig = self.get(migration_id, Role.DESTINATION)
        mig.reason = f"migration from {mig.peer} abandoned: {reason}"[:300]
        gone = []
        for match, flow in mig.flows.items():
            if self.control.flows.get(match) is flow:
                self.control.forget(match)
                gone.append(flow)
        self._stamp(mig, "abandoned")
        return gone

    def status(self) -> list[dict[str, Any]]:
        return [mig.as_dict() for mig in self.by_id.values()]


def _renamed(port: str | None, old: str, new: str) -> str | None:
    return new if port == old else port


def flow_held(mig: FlowMigration) -> str:
    """Why a migration holds its flows onloaded, as the status file says it."""
    if mig.role is Role.SOURCE:
        return f"migrating to {mig.peer}: onloaded before switchover"
    return f"arriving from {mig.peer}: waiting for the VM to resume here"


def _check_records(ports: tuple[str, ...], held: int, records: list[FlowTransfer]) -> None:
    """Refuse the whole part if any record is not the VM's or the total is too many."""
    if held + len(records) > MAX_RECORDS:
        raise exceptions.InvalidInput(
            what="flow records", reason=f"{held + len(records)} > {MAX_RECORDS}"
        )
    for record in records:
        if ports and not {record.match.in_port, record.owner} & set(ports):
            raise exceptions.InvalidInput(
                what="flow record", reason=f"flow of port {record.owner} is not the VM's"
            )


def _key(match: FlowMatch) -> str:
    proto = "tcp" if match.ip_proto == 6 else "udp"
    return (
        f"{proto} {match.ipv4_src}:{match.tp_src}->{match.ipv4_dst}:{match.tp_dst} "
        f"in {match.in_port}"
    )
