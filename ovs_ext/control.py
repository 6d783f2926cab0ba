"""The offload control loop: setup decisions, statistics polls, moves.

It joins the Policy Manager (pure decisions), the Flow Manager (state and
counters) and the per-VM dispatchers (provider calls).  The OpenFlow app calls
it from its event handlers with plain data — a new flow, the counters of the
rules it owns — and does the OpenFlow I/O itself, so this runs unchanged in
unit tests against a fake provider.  Callers serialise calls (one lock).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from ovs_ext import policy as policy_mod
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.flows import FlowManager, FlowState, TrackedFlow
from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadEntry, OffloadProvider

LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PollReport:
    promoted: tuple[FlowMatch, ...] = ()
    demoted: tuple[FlowMatch, ...] = ()
    evicted: tuple[FlowMatch, ...] = ()
    refused: Mapping[FlowMatch, str] = dataclasses.field(default_factory=dict)
    expired: tuple[TrackedFlow, ...] = ()  # forgotten: the app deletes their rules


class OffloadControl:
    def __init__(
        self,
        policy: policy_mod.Policy,
        provider: OffloadProvider,
        provider_name: str,
        dispatchers: Dispatchers,
        flows: FlowManager | None = None,
        wall_clock: Callable[[], float] = time.time,
        idle_timeout: float = 0.0,
        offload_guard: Callable[[FlowMatch, str | None], str] | None = None,
    ) -> None:
        self.policy = policy
        self.provider = provider
        self.provider_name = provider_name
        self.dispatchers = dispatchers
        self.flows = flows if flows is not None else FlowManager()
        self.wall_clock = wall_clock
        self.idle_timeout = idle_timeout  # 0: flows are never forgotten
        # Why a flow must not bypass the vSwitch whatever the policy says (beside
        # Neutron: what its ports enforce in OVS); empty when it may.
        self.offload_guard = offload_guard
        self.provider_capacity = provider.describe().capacity
        self.polls = 0  # statistics polls done: a migration waits for fresh counters
        # More sections of the status file (name -> producer), e.g. migrations.
        self.status_extras: dict[str, Callable[[], object]] = {}

    @property
    def capacity(self) -> int:
        return min(self.policy.capacity, self.provider_capacity)

    # -- policy -------------------------------------------------------------------
    def replace_policy(self, policy: policy_mod.Policy) -> PollReport:
        """Switch to an already-validated policy and apply it to the flows there are.

        Header rules are re-judged for every tracked flow (a new offload rule
        takes its flows, a removed or onload rule gives them back); a smaller
        capacity evicts the slowest.
        """
        self.policy = policy
        to_offload: list[tuple[TrackedFlow, float, bool]] = []
        to_onload: list[FlowMatch] = []
        for flow in self.flows:
            if not flow.owner or flow.held:
                continue
            was = flow.setup
            flow.setup = policy_mod.decide_at_setup(policy, flow.match, flow.owner, flow.direction)
            offloaded = flow.state is FlowState.OFFLOADED
            if flow.setup.offload and not offloaded:
                to_offload.append((flow, float("inf"), True))
            elif offloaded and (
                flow.setup.pinned_onload or (was.offload and not flow.setup.offload)
            ):
                to_onload.append(flow.match)
            elif flow.setup.pinned_onload:
                flow.reason = f"header rule {flow.setup.rule!r}: onload"
        self._onload(tuple(to_onload), "policy reload: no header rule offloads it")
        window = policy.statistics.window_s
        excess = len(self.flows.offloaded()) + len(to_offload) - self.capacity
        evicted: tuple[FlowMatch, ...] = ()
        if excess > 0 and not to_offload:
            slowest = sorted(self.flows.offloaded(), key=lambda f: f.rate(window).pps)[:excess]
            evicted = tuple(f.match for f in slowest)
            self._onload(evicted, "evicted: policy capacity lowered")
        admitted, more_evicted, refused = self._admit(to_offload, "header rule (policy reload)")
        return PollReport(tuple(admitted), tuple(to_onload), evicted + tuple(more_evicted), refused)

    # -- ports --------------------------------------------------------------------
    def port_added(self, name: str) -> None:
        self.dispatchers.port_added(name)

    def port_removed(self, name: str) -> list[TrackedFlow]:
        """A port left the bridge (VM stopped or migrated away): drop its flows."""
        gone = self.flows.flows_of_port(name)
        self._onload(
            tuple(f.match for f in gone if f.state is FlowState.OFFLOADED), f"port {name} removed"
        )
        for flow in gone:
            self.flows.forget(flow.match)
        self.dispatchers.port_removed(name)
        return gone

    # -- flow setup ------------------------------------------------------------------
    def flow_seen(self, match: FlowMatch, out_port: str | None) -> tuple[TrackedFlow, bool]:
        """A new flow's first packet: track it and apply header rules.

        Returns the flow and whether it is new (the app then installs its rule).
        """
        existing = self.flows.get(match)
        if existing is not None:
            if existing.out_port is None and out_port is not None:
                existing.out_port = out_port
            if existing.reoffload and not existing.held:
                # It arrived by migration, offloaded before: its first packet
                # here taught the egress port, so it can go back to the fast path.
                self.reoffload([existing], f"re-offloaded after migration ({existing.reason})")
            needs_rule, existing.needs_rule = existing.needs_rule, False
            return existing, needs_rule
        owners = self.dispatchers.owners(match, out_port)
        if not owners:
            setup = policy_mod.SetupDecision(None)
            flow = self.flows.add(
                match, owner="", direction=policy_mod.Direction.ANY, out_port=out_port, setup=setup
            )
            flow.reason = "no VM port: stays in the vSwitch"
            return flow, True
        # Each dispatcher judges by its own VM's rules; the first with a verdict
        # owns the flow, else the sender's (or the only) one.
        port, direction = owners[0]
        setup = policy_mod.SetupDecision(None)
        for candidate, candidate_direction in owners:
            verdict = policy_mod.decide_at_setup(self.policy, match, candidate, candidate_direction)
            if verdict.action is not None:
                port, direction, setup = candidate, candidate_direction, verdict
                break
        flow = self.flows.add(
            match, owner=port, direction=direction, out_port=out_port, setup=setup
        )
        if setup.offload:
            self._admit([(flow, float("inf"), True)], f"header rule {setup.rule!r}")
        elif setup.pinned_onload:
            flow.reason = f"header rule {setup.rule!r}: onload"
        else:
            flow.reason = "onloaded at setup: no header rule matched"
        return flow, True

    # -- statistics --------------------------------------------------------------------
    def poll(
        self,
        rule_stats: Mapping[int, FlowCounters],
        provider_stats: Mapping[FlowMatch, FlowCounters],
        learned_stats: Mapping[FlowMatch, FlowCounters] | None = None,
    ) -> PollReport:
        """One statistics interval: update counters, then promote and demote."""
        self.flows.observe_learned_stats(learned_stats or {})
        self.flows.observe_rule_stats(rule_stats)
        self.flows.observe_provider_stats(provider_stats)
        self.flows.sample()
        self.polls += 1
        expired = self._expire_idle()
        guarded = self._enforce_guard()
        rule = self.policy.statistics
        if not rule.enabled:
            return PollReport(demoted=guarded, expired=expired)
        demote: list[FlowMatch] = []
        candidates: list[tuple[TrackedFlow, float, bool]] = []
        for flow in self.flows:
            if flow.held:
                continue  # a live migration decides where it goes
            rate = flow.rate(rule.window_s)
            if flow.state is FlowState.OFFLOADED:
                flow.quiet_polls = policy_mod.next_quiet_count(rule, rate, flow.quiet_polls)
                if policy_mod.should_demote(rule, flow.quiet_polls):
                    demote.append(flow.match)
            elif flow.owner and not flow.setup.pinned_onload:
                if policy_mod.should_promote(rule, rate):
                    candidates.append((flow, rate.pps, False))
        self._onload(tuple(demote), "demoted: below the lower marks")
        admitted, evicted, refused = self._admit(candidates, "promoted by statistics")
        demoted = guarded + tuple(demote)
        return PollReport(tuple(admitted), demoted, tuple(evicted), refused, expired)

    def onload_now(self, matches: tuple[FlowMatch, ...], reason: str) -> None:
        """Back to the vSwitch now (a migration's demotion), counters carried over."""
        self._onload(matches, reason)

    def forget(self, match: FlowMatch) -> TrackedFlow | None:
        """Stop tracking a flow (its VM left); the app deletes its rule."""
        flow = self.flows.get(match)
        if flow is not None and flow.state is FlowState.OFFLOADED:
            self._onload((match,), "forgotten")
        self.flows.forget(match)
        for dispatcher in self.dispatchers.by_port.values():
            dispatcher.forget(match)
        return flow

    def reoffload(self, flows: list[TrackedFlow], reason: str) -> list[FlowMatch]:
        """Offload flows that were offloaded before a migration moved them, subject
        to this host's policy and capacity; a refusal keeps its reason.

        They take free room only (rate 0: never evicting this host's flows);
        statistics promote them later like any flow if the table is full.
        """
        candidates = []
        for flow in flows:
            if flow.state is FlowState.OFFLOADED or flow.setup.pinned_onload:
                flow.reoffload = False
            elif flow.out_port is not None:
                candidates.append((flow, 0.0, False))
        admitted, _evicted, refused = self._admit(candidates, reason)
        for flow, _rate, _forced in candidates:
            flow.reoffload = False
        if refused:
            LOG.warning("%d flows not re-offloaded: %s", len(refused), sorted(refused.values()))
        return admitted

    def _enforce_guard(self) -> tuple[FlowMatch, ...]:
        """Offloaded flows the guard now forbids (e.g. port security turned on
        for a port) go back to the vSwitch at once, whatever their rate."""
        if self.offload_guard is None:
            return ()
        back = []
        for flow in self.flows.offloaded():
            why = self.offload_guard(flow.match, flow.out_port)
            if why:
                self._onload((flow.match,), f"onloaded: {why}")
                back.append(flow.match)
        return tuple(back)

    def _expire_idle(self) -> tuple[TrackedFlow, ...]:
        """Forget flows idle for idle_timeout (an OpenFlow idle timeout cannot be
        used: an offloaded flow's rule sees no packets while it is busy)."""
        if self.idle_timeout <= 0:
            return ()
        self.flows.expire_kept(self.idle_timeout)
        idle = tuple(f for f in self.flows.idle_since(self.idle_timeout) if not f.held)
        self._onload(
            tuple(f.match for f in idle if f.state is FlowState.OFFLOADED), "idle: expired"
        )
        for flow in idle:
            self.flows.forget(flow.match)
            for dispatcher in self.dispatchers.by_port.values():
                dispatcher.forget(flow.match)
        return idle

    def _admit(
        self, candidates: list[tuple[TrackedFlow, float, bool]], reason: str
    ) -> tuple[list[FlowMatch], list[FlowMatch], dict[FlowMatch, str]]:
        """Offload what fits (evicting the slowest); refusals stay onloaded, with why."""
        refused: dict[FlowMatch, str] = {}
        eligible = []
        for flow, rate, forced in candidates:
            why_not = self.dispatchers.can_offload(flow.match, flow.out_port)
            if not why_not and self.offload_guard is not None:
                why_not = self.offload_guard(flow.match, flow.out_port)
            if why_not:
                refused[flow.match] = why_not
            else:
                eligible.append((flow.match, rate, forced))
        window = self.policy.statistics.window_s
        table = {f.match: f.rate(window).pps for f in self.flows.offloaded()}
        plan = policy_mod.plan_admission(self.capacity, table, eligible)
        refused.update(plan.refused)
        self._onload(plan.evicted, "evicted: slowest flow when the offload table was full")
        installed = self._install(plan.admitted, reason, refused)
        for match, why in refused.items():
            flow = self.flows.get(match)
            if flow is not None and flow.state is FlowState.ONLOADED:
                if flow.reason != f"offload refused: {why}":
                    LOG.warning("flow %s stays onloaded: %s", _fmt(match), why)
                flow.reason = f"offload refused: {why}"
        return installed, list(plan.evicted), refused

    def _install(
        self, matches: tuple[FlowMatch, ...], reason: str, refused: dict[FlowMatch, str]
    ) -> list[FlowMatch]:
        by_owner: dict[str, list[OffloadEntry]] = {}
        for match in matches:
            flow = self.flows.get(match)
            if flow is None or flow.out_port is None:
                continue
            by_owner.setdefault(flow.owner, []).append(OffloadEntry(match, flow.out_port))
        installed: list[FlowMatch] = []
        requested = self.wall_clock()
        for owner, entries in by_owner.items():
            result = self.dispatchers.by_port[owner].offload(entries)
            # Offloaded once the provider says so, not when asked: what a latency
            # measured from this stamp includes is the whole path.
            done = self.wall_clock()
            for match in result.installed:
                self.flows.mark_offloaded(match, reason, done, requested)
                LOG.info("flow %s offloaded (%s)", _fmt(match), reason)
                installed.append(match)
            for match, why in result.failed.items():
                refused[match] = f"provider {self.provider_name}: {why}"
        return installed

    def _onload(self, matches: tuple[FlowMatch, ...], reason: str) -> None:
        by_owner: dict[str, list[FlowMatch]] = {}
        for match in matches:
            flow = self.flows.get(match)
            if flow is not None and flow.state is FlowState.OFFLOADED:
                by_owner.setdefault(flow.owner, []).append(match)
        for owner, owned in by_owner.items():
            dispatcher = self.dispatchers.by_port.get(owner)
            finals = dispatcher.onload(owned) if dispatcher else {}
            for match in owned:
                if dispatcher is not None and match in dispatcher.filter_table:
                    continue  # the provider could not remove it: still offloaded
                self.flows.mark_onloaded(match, finals.get(match), reason)
                LOG.info("flow %s onloaded (%s)", _fmt(match), reason)

    # -- what operators see ---------------------------------------------------------------
    def status(self) -> dict[str, object]:
        window = self.policy.statistics.window_s
        flows = []
        for flow in sorted(self.flows, key=lambda f: f.flow_id):
            total, off = flow.total, flow.offloaded_counters
            flows.append(
                {
                    "id": flow.flow_id,
                    "match": _match_fields(flow.match),
                    "owner": flow.owner,
                    "direction": flow.direction.value,
                    "out_port": flow.out_port,
                    "state": flow.state.value,
                    "reason": flow.reason,
                    "packets": total.packets,
                    "bytes": total.bytes,
                    "offloaded_packets": off.packets,
                    "offloaded_bytes": off.bytes,
                    "pps": round(flow.rate(window).pps, 1),
                    "offloaded_at": flow.offloaded_at,
                    "offload_requested_at": flow.offload_requested_at,
                    "moves": flow.moves,
                }
            )
        return {
            "provider": self.provider_name,
            "policy": self.policy.source,
            "header_rules": [rule.name for rule in self.policy.header_rules],
            "capacity": self.capacity,
            "offloaded": len(self.flows.offloaded()),
            "ports": sorted(self.dispatchers.by_port),
            "fast_path_ports": sorted(self.dispatchers.fast_path_ports),
            "flows": flows,
        } | {name: produce() for name, produce in self.status_extras.items()}


def _match_fields(match: FlowMatch) -> dict[str, object]:
    """``dataclasses.asdict(match)``, spelt out: it recurses and copies, 10x
    slower, and the status file takes it for every flow."""
    return {
        "in_port": match.in_port, "ip_proto": match.ip_proto, "ipv4_src": match.ipv4_src,
        "ipv4_dst": match.ipv4_dst, "tp_src": match.tp_src, "tp_dst": match.tp_dst,
    }  # fmt: skip


def _fmt(match: FlowMatch) -> str:
    proto = "tcp" if match.ip_proto == 6 else "udp"
    return (
        f"{proto} {match.ipv4_src}:{match.tp_src}->{match.ipv4_dst}:{match.tp_dst} "
        f"in {match.in_port}"
    )
