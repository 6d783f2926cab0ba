"""The Flow Manager: every flow of every VM, onloaded or offloaded, and its counters.

A flow's packets are counted in exactly one place at a time:

- ``packet_in``: the flow's first packet, the one the controller judged (the
  bridge switched it through the shared discovery rule, so no per-flow rule
  counts it);
- ``learned``: packets the bridge switched before the flow's own rule existed,
  from its counting rule (see :mod:`ovs_ext.openflow`, "Why a counting rule");
- ``rule``: the flow's own OpenFlow rule in ``br-int`` (onloaded traffic);
  the rule stays installed while the flow is offloaded, so these counters are
  never reset by a move;
- ``offload_live``: the provider's entry while the flow is offloaded;
- ``offload_done``: final counters of earlier offload entries, carried over when
  the provider removed them (demotion, eviction);
- ``carried_onloaded`` / ``carried_offloaded``: what earlier hosts counted, for
  a flow that arrived with its VM by live migration (``ovs_ext.migration``);
- ``restored_onloaded`` / ``restored_offloaded``: what an earlier run of the
  service (or this run before a bridge reconnection) counted, read back from
  the rules it left in the bridge and the entries it left pinned in the
  provider (:meth:`FlowManager.restore`), taken when the flow is seen again.

The total is the sum of them all: continuous across promotion and demotion,
never reset, never double-counted.  No I/O here: the OpenFlow app and the
provider feed observations in; :meth:`FlowManager.records` turns the state
into the :class:`~ovs_ext.flow_record.FlowRecord` list the statistics endpoint
serves.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time
from collections.abc import Callable, Iterable, Mapping

from ovs_ext import policy as policy_mod
from ovs_ext.flow_record import FlowRecord
from ovs_ext.providers.base import IPPROTO_TCP, FlowCounters, FlowMatch

ETH_TYPE_IPV4 = 0x0800
# The OpenFlow table and priorities of the rules the app owns.
FLOW_TABLE = 0
FLOW_PRIORITY = 100
DISCOVERY_PRIORITY = 10
# Offloaded flows are shown as their own entries in a table OVS never uses, so
# `ovs-ofctl dump-flows <endpoint> table=200` lists exactly what is offloaded.
OFFLOAD_TABLE = 200
# The table the discovery rules' learn action puts each flow's counting rule in
# (reached only by their resubmit, so it never decides where a packet goes).
COUNTING_TABLE = 1
# The table a new flow's first packet is copied to the app from (see
# openflow.discovery_rules): a learnt mark per flow keeps the copy to one.
JUDGED_TABLE = 2
# Cookies: the app owns every rule whose top 16 bits are COOKIE_PREFIX; the low
# 40 bits carry the flow's id, so a flow-stats reply maps back without a lookup.
COOKIE_PREFIX = 0xF1E0
COOKIE_MASK = 0xFFFF << 48
COOKIE_KIND_FLOW = 1
COOKIE_KIND_DISCOVERY = 2
COOKIE_KIND_TABLE_MISS = 3
COOKIE_KIND_COUNTING = 4
COOKIE_KIND_JUDGED = 5  # the judged table's marks and its copy-to-the-app rule
HISTORY_SAMPLES = 256


def flow_cookie(flow_id: int) -> int:
    return (COOKIE_PREFIX << 48) | (COOKIE_KIND_FLOW << 40) | flow_id


def discovery_cookie(ofport: int) -> int:
    return (COOKIE_PREFIX << 48) | (COOKIE_KIND_DISCOVERY << 40) | ofport


def table_miss_cookie() -> int:
    return (COOKIE_PREFIX << 48) | (COOKIE_KIND_TABLE_MISS << 40)


def counting_cookie() -> int:
    """One cookie for every counting rule: a learn action cannot vary it."""
    return (COOKIE_PREFIX << 48) | (COOKIE_KIND_COUNTING << 40)


def judged_cookie() -> int:
    return (COOKIE_PREFIX << 48) | (COOKIE_KIND_JUDGED << 40)


def is_counting_cookie(cookie: int) -> bool:
    return cookie >> 40 == counting_cookie() >> 40


def cookie_flow_id(cookie: int) -> int | None:
    """The flow id a cookie carries, or None for a cookie that is not a flow rule's."""
    if cookie >> 48 != COOKIE_PREFIX or (cookie >> 40) & 0xFF != COOKIE_KIND_FLOW:
        return None
    return cookie & ((1 << 40) - 1)


def _sum_counters(*parts: FlowCounters) -> FlowCounters:
    packets = octets = 0
    for part in parts:
        packets += part.packets
        octets += part.bytes
    return FlowCounters(packets, octets)


class FlowState(enum.Enum):
    ONLOADED = "onloaded"
    OFFLOADED = "offloaded"


@dataclasses.dataclass
class TrackedFlow:
    flow_id: int
    match: FlowMatch
    owner: str  # the VM port whose dispatcher owns the flow ("" for none)
    direction: policy_mod.Direction
    out_port: str | None  # where the flow leaves br-int, when known
    first_seen: float  # monotonic
    setup: policy_mod.SetupDecision
    state: FlowState = FlowState.ONLOADED
    reason: str = ""  # why it is where it is: the rule, the refusal, the eviction
    rule_installed: bool = False
    packet_in: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    learned: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    rule: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    offload_live: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    offload_done: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    quiet_polls: int = 0
    last_active: float = 0.0  # monotonic; when its total last grew
    offloaded_at: float | None = None  # wall clock: the latest promotion's install returned
    offload_requested_at: float | None = None  # wall clock: ... was decided and asked for
    moves: int = 0
    carried_onloaded: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    carried_offloaded: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    restored_onloaded: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    restored_offloaded: FlowCounters = dataclasses.field(default_factory=FlowCounters)
    # Set while a live migration holds the flow onloaded (why): statistics and
    # header rules leave it alone until the migration resumes or releases it.
    held: str = ""
    # Offload again as soon as it can be (it was offloaded before a migration).
    reoffload: bool = False
    # The app still has to install its OpenFlow rule (the flow arrived as a record).
    needs_rule: bool = False
    history: collections.deque[tuple[float, int, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=HISTORY_SAMPLES)
    )

    @property
    def cookie(self) -> int:
        return flow_cookie(self.flow_id)

    @property
    def onloaded_counters(self) -> FlowCounters:
        return _sum_counters(
            self.packet_in, self.learned, self.rule, self.carried_onloaded, self.restored_onloaded
        )

    @property
    def offloaded_counters(self) -> FlowCounters:
        return _sum_counters(
            self.offload_live, self.offload_done, self.carried_offloaded, self.restored_offloaded
        )

    @property
    def total(self) -> FlowCounters:
        # Summed in one go (not onloaded + offloaded): every poll and every dump
        # takes the total of every flow, and 8 intermediate FlowCounters each
        # made that a third of a poll at 10k flows.
        return _sum_counters(
            self.packet_in, self.learned, self.rule, self.carried_onloaded,
            self.restored_onloaded, self.offload_live, self.offload_done,
            self.carried_offloaded, self.restored_offloaded,
        )  # fmt: skip

    def rate(self, window_s: float) -> policy_mod.Rate:
        # Only the window's samples and the one before it decide the rate: every
        # flow's is taken each poll, and copying 256 samples of 10k flows made
        # that most of a poll's cost.
        history = self.history
        if len(history) < 2:
            return policy_mod.window_rate(list(history), window_s)
        cutoff = history[-1][0] - window_s - 1e-9
        tail = []
        for sample in reversed(history):
            tail.append(sample)
            if sample[0] < cutoff:
                break
        tail.reverse()
        return policy_mod.window_rate(tail, window_s)


class FlowManager:
    """State of every flow; all times come from the injected clock (tests drive it)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._flows: dict[FlowMatch, TrackedFlow] = {}
        self._by_id: dict[int, TrackedFlow] = {}
        self._next_id = 1
        # Counters of flows no longer tracked, by match: (in rules, other onloaded,
        # offloaded).  Bounded by the flows the bridge and the provider held.
        self._restored: dict[FlowMatch, tuple[FlowCounters, FlowCounters, FlowCounters]] = {}
        # The flow id (so the cookie) each of those is shown under until it is seen
        # again, and since when: an operator's dump right after a restart or a
        # reconnection still lists every flow with what it counted, and the flow
        # keeps that cookie once it is tracked again.
        self._kept_ids: dict[FlowMatch, int] = {}
        self._kept_since: dict[FlowMatch, float] = {}

    # -- membership -----------------------------------------------------------
    def get(self, match: FlowMatch) -> TrackedFlow | None:
        return self._flows.get(match)

    def by_id(self, flow_id: int) -> TrackedFlow | None:
        return self._by_id.get(flow_id)

    def __iter__(self):
        return iter(list(self._flows.values()))

    def __len__(self) -> int:
        return len(self._flows)

    def add(
        self,
        match: FlowMatch,
        *,
        owner: str,
        direction: policy_mod.Direction,
        out_port: str | None,
        setup: policy_mod.SetupDecision,
    ) -> TrackedFlow:
        """Start tracking a flow seen for the first time (idempotent)."""
        flow = self._flows.get(match)
        if flow is not None:
            return flow
        flow_id = self._kept_ids.pop(match, None)
        self._kept_since.pop(match, None)
        if flow_id is None:
            flow_id = self._take_id()
        flow = TrackedFlow(
            flow_id=flow_id,
            match=match,
            owner=owner,
            direction=direction,
            out_port=out_port,
            first_seen=self.clock(),
            setup=setup,
        )
        ruled, other, offloaded = self._restored.pop(match, (FlowCounters(),) * 3)
        flow.restored_onloaded, flow.restored_offloaded = ruled + other, offloaded
        self._flows[match] = flow
        self._by_id[flow.flow_id] = flow
        return flow

    def restore(
        self,
        match: FlowMatch,
        onloaded: FlowCounters | None = None,
        offloaded: FlowCounters | None = None,
        ruled: FlowCounters | None = None,
    ) -> None:
        """Counters an earlier run (or connection) counted for a flow not tracked
        now: added to what the flow counts when it is seen again, so its counters
        go on from there instead of starting over.

        ``ruled`` is what the flow's bridge rules held (first packet, counting
        rule, flow rule), known twice when a connection drops: from this run's
        last poll and, if the rules survived, read back from them (later, so
        larger).  The larger is kept, never both.
        """
        was_ruled, was_on, was_off = self._restored.get(match, (FlowCounters(),) * 3)
        if match not in self._kept_ids and match not in self._flows:
            self._kept_ids[match] = self._take_id()
            self._kept_since[match] = self.clock()
        if ruled is not None and ruled.packets > was_ruled.packets:
            was_ruled = ruled
        self._restored[match] = (
            was_ruled,
            was_on + (onloaded or FlowCounters()),
            was_off + (offloaded or FlowCounters()),
        )

    def expire_kept(self, seconds: float) -> list[FlowMatch]:
        """Forget kept counters not claimed by a flow seen again within ``seconds``
        of their restore, as an idle flow is forgotten (its counters with it)."""
        cutoff = self.clock() - seconds
        expired = [m for m, since in self._kept_since.items() if since < cutoff]
        for match in expired:
            self.drop_kept(match)
        return expired

    def kept_entering_by(self, ports: Iterable[str]) -> dict[FlowMatch, tuple[FlowCounters, ...]]:
        """Kept counters, (onloaded, offloaded), of flows entering by ``ports`` that
        have not been seen again: a VM leaving takes them with it."""
        wanted = set(ports)
        kept = {}
        for match in self._kept_ids:
            if match.in_port not in wanted or match in self._flows:
                continue
            onloaded, offloaded = self._kept_counters(match)
            if (onloaded + offloaded).packets:
                kept[match] = (onloaded, offloaded)
        return kept

    def _kept_counters(self, match: FlowMatch) -> tuple[FlowCounters, FlowCounters]:
        """A kept flow's (onloaded, offloaded) counters: its rules' and the rest."""
        ruled, onloaded, offloaded = self._restored.get(match, (FlowCounters(),) * 3)
        return ruled + onloaded, offloaded

    def drop_kept(self, match: FlowMatch) -> None:
        """Forget a kept flow's counters (expired, or gone with its VM)."""
        self._kept_since.pop(match, None)
        self._kept_ids.pop(match, None)
        self._restored.pop(match, None)

    def _take_id(self) -> int:
        flow_id = self._next_id
        self._next_id += 1
        return flow_id

    def restored(self) -> dict[FlowMatch, tuple[FlowCounters, FlowCounters, FlowCounters]]:
        return dict(self._restored)

    def forget(self, match: FlowMatch) -> TrackedFlow | None:
        flow = self._flows.pop(match, None)
        if flow is not None:
            self._by_id.pop(flow.flow_id, None)
        return flow

    def flows_of_port(self, port: str) -> list[TrackedFlow]:
        return [f for f in self._flows.values() if port in (f.match.in_port, f.out_port)]

    # -- observations -----------------------------------------------------------
    def count_packet_in(self, match: FlowMatch, length: int) -> None:
        """The flow's first packet, judged by the controller."""
        flow = self._flows[match]
        flow.packet_in = flow.packet_in + FlowCounters(1, length)

    def observe_rule_stats(self, stats: Mapping[int, FlowCounters]) -> None:
        """OpenFlow rule counters by flow id (from a flow-stats reply)."""
        for flow_id, counters in stats.items():
            flow = self._by_id.get(flow_id)
            if flow is not None:
                flow.rule = counters
                flow.rule_installed = True

    def observe_learned_stats(self, stats: Mapping[FlowMatch, FlowCounters]) -> None:
        """Counting-rule counters by flow.  They only grow while the flow has no
        rule of its own and then idle out: a missing or smaller reading (a rule
        learnt anew) never lowers what was counted."""
        for match, counters in stats.items():
            flow = self._flows.get(match)
            if flow is not None and counters.packets >= flow.learned.packets:
                flow.learned = counters

    def observe_provider_stats(self, stats: Mapping[FlowMatch, FlowCounters]) -> None:
        """Live counters of the provider's entries (only offloaded flows have one)."""
        for match, counters in stats.items():
            flow = self._flows.get(match)
            if flow is not None and flow.state is FlowState.OFFLOADED:
                flow.offload_live = counters

    def sample(self) -> None:
        """Append every flow's current total to its rate history."""
        now = self.clock()
        for flow in self._flows.values():
            total = flow.total
            if not flow.history or flow.history[-1][1] != total.packets:
                flow.last_active = now
            flow.history.append((now, total.packets, total.bytes))

    def idle_since(self, seconds: float) -> list[TrackedFlow]:
        """Flows whose counters have not moved for ``seconds``."""
        cutoff = self.clock() - seconds
        return [f for f in self._flows.values() if max(f.last_active, f.first_seen) < cutoff]

    # -- moves ------------------------------------------------------------------
    def mark_offloaded(
        self, match: FlowMatch, reason: str, wall_time: float, requested_at: float | None = None
    ) -> None:
        """Offloaded at ``wall_time`` (install returned), asked for at ``requested_at``."""
        flow = self._flows[match]
        flow.state = FlowState.OFFLOADED
        flow.offload_live = FlowCounters()
        flow.reason = reason
        flow.quiet_polls = 0
        flow.offloaded_at = wall_time
        flow.offload_requested_at = wall_time if requested_at is None else requested_at
        flow.moves += 1

    def mark_onloaded(self, match: FlowMatch, final: FlowCounters | None, reason: str) -> None:
        """Back to the vSwitch: the provider entry's final counters are carried over."""
        flow = self._flows[match]
        if flow.state is FlowState.OFFLOADED:
            # The provider's final count supersedes the last live sample.
            carried = final if final is not None else flow.offload_live
            flow.offload_done = flow.offload_done + carried
            flow.offload_live = FlowCounters()
            flow.moves += 1
        flow.state = FlowState.ONLOADED
        flow.reason = reason
        flow.quiet_polls = 0

    def offloaded(self) -> list[TrackedFlow]:
        return [f for f in self._flows.values() if f.state is FlowState.OFFLOADED]

    # -- what ovs-ofctl shows -------------------------------------------------------
    def records(self, ofport_of: Callable[[str], int | None]) -> list[FlowRecord]:
        """One record per flow rule (total counters) and one per offloaded flow.

        The rule's counters include its offloaded traffic, as OVS reports a
        hardware-offloaded flow; the table-200 entry shows the offloaded part
        alone, so onloaded = rule - offloaded.
        """
        now = self.clock()
        records: list[FlowRecord] = []
        for flow in sorted(self._flows.values(), key=lambda f: f.flow_id):
            in_port = ofport_of(flow.match.in_port)
            if in_port is None:
                continue
            match = openflow_match(flow.match, in_port)
            out = ofport_of(flow.out_port) if flow.out_port else None
            total = flow.total
            duration = now - flow.first_seen
            offloaded = flow.state is FlowState.OFFLOADED
            records.append(
                FlowRecord(
                    FLOW_TABLE, FLOW_PRIORITY, flow.cookie, match, total.packets,
                    total.bytes, duration, out, offloaded,
                )
            )  # fmt: skip
            part = flow.offloaded_counters
            if offloaded or part.packets:
                records.append(
                    FlowRecord(
                        OFFLOAD_TABLE, FLOW_PRIORITY, flow.cookie, match, part.packets,
                        part.bytes, duration, out, offloaded,
                    )
                )  # fmt: skip
        records.extend(self._kept_records(ofport_of, now))
        return records

    def _kept_records(self, ofport_of: Callable[[str], int | None], now: float) -> list[FlowRecord]:
        """Flows an earlier run (or connection) counted and this one has not seen
        again: shown with what they counted, so a restart never makes a flow's
        counters vanish from a dump (nor a quiet flow's, which may never return).
        Where they leave the bridge is not known until they are seen again."""
        records: list[FlowRecord] = []
        for match, flow_id in sorted(self._kept_ids.items(), key=lambda item: item[1]):
            in_port = ofport_of(match.in_port)
            onloaded, offloaded = self._kept_counters(match)
            total = onloaded + offloaded
            if in_port is None or match in self._flows or not total.packets:
                continue
            fields = openflow_match(match, in_port)
            duration = now - self._kept_since.get(match, now)
            cookie = flow_cookie(flow_id)
            records.append(
                FlowRecord(FLOW_TABLE, FLOW_PRIORITY, cookie, fields, total.packets,
                           total.bytes, duration)
            )  # fmt: skip
            if offloaded.packets:
                records.append(
                    FlowRecord(OFFLOAD_TABLE, FLOW_PRIORITY, cookie, fields, offloaded.packets,
                               offloaded.bytes, duration)
                )  # fmt: skip
        return records


def openflow_match(match: FlowMatch, in_port: int) -> dict[str, int | str]:
    """The OXM fields of a flow's rule, by the names ``ovs-ofctl`` prints."""
    l4 = "tcp" if match.ip_proto == IPPROTO_TCP else "udp"
    return {
        "in_port": in_port,
        "eth_type": ETH_TYPE_IPV4,
        "ip_proto": match.ip_proto,
        "ipv4_src": match.ipv4_src,
        "ipv4_dst": match.ipv4_dst,
        f"{l4}_src": match.tp_src,
        f"{l4}_dst": match.tp_dst,
    }


def offloaded_total(flows: Iterable[TrackedFlow]) -> FlowCounters:
    total = FlowCounters()
    for flow in flows:
        total = total + flow.offloaded_counters
    return total
