"""Counters that outlive the app's view of a flow: a bridge reconnection, a restart.

The app forgets its flows when the bridge (re)connects: their rules are read
back, deleted and made again, and the datapath's cached flows purged (see
:mod:`ovs_ext.app`).  What the flows had counted is not forgotten with them:
:func:`from_rules` reads it from the rules left in the bridge (a flow rule's
counters plus the first packet its note records, a counting rule's counters),
:func:`from_forgotten` from the flows this run tracked (what no rule holds: the
offloaded part, the counters carried from earlier hosts or runs), and the
provider's pinned entries are taken at start (``ovs_ext.service``).  A flow
seen again goes on from there (:meth:`~ovs_ext.flows.FlowManager.restore`), so
a restart or reconnection never resets a counter nor counts a packet twice.
Pure: the app feeds in what it read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ovs_ext import flows, openflow
from ovs_ext.flows import FlowManager, TrackedFlow
from ovs_ext.providers.base import FlowCounters, FlowMatch


def from_rules(
    manager: FlowManager, stats: Iterable[Any], port_name: Callable[[int], str | None]
) -> int:
    """Restore from a flow-stats reply of the rules the app owns; returns for how
    many flows (discovery and table-miss rules count for none)."""
    ruled: dict[FlowMatch, FlowCounters] = {}
    for stat in stats:
        is_flow_rule = flows.cookie_flow_id(stat.cookie) is not None
        if not is_flow_rule and not flows.is_counting_cookie(stat.cookie):
            continue
        match = openflow.counted_match(stat.match, port_name(stat.match.get("in_port")))
        if match is None:
            continue
        counted = FlowCounters(stat.packet_count, stat.byte_count)
        if is_flow_rule:
            counted = counted + openflow.first_packet(stat.instructions)
        ruled[match] = ruled.get(match, FlowCounters()) + counted
    for match, counted in ruled.items():
        manager.restore(match, ruled=counted)
    return len(ruled)


def from_forgotten(manager: FlowManager, gone: Iterable[TrackedFlow]) -> None:
    """Flows this run forgets: their offloaded counters (the provider's final
    ones, taken when the flows were onloaded), the counters carried from earlier
    hosts or runs, and their rules' part as last polled (a reconnection may have
    flushed the rules: OVS flushes a bridge's flows when its controllers go)."""
    for flow in gone:
        manager.restore(
            flow.match,
            ruled=flow.packet_in + flow.learned + flow.rule,
            onloaded=flow.carried_onloaded + flow.restored_onloaded,
            offloaded=flow.offloaded_counters,
        )
