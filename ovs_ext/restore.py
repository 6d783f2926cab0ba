"""Counters that outlive the app's view of a flow: a bridge reconnection, a restart.

The app forgets its flows when the bridge (re)connects: their rules are read
back, deleted and made again, and the datapath's cached flows purged (see
:mod:`ovs_ext.app`).  What the flows had counted is not forgotten with them:
:func:`from_rules` reads it from the rules left in the bridge (a flow rule's
counters plus the first packet its note records, a counting rule's counters),
:func:`from_forgotten` from the flows this run tracked (what no rule holds: the
offloaded part, the counters carried from earlier hosts or runs), and the
provider's pinned entries are taken at start (``ovs_ext.service``); a clean
stop writes them all to the counters file (:func:`kept_at_stop`).  A flow
seen again goes on from there (:meth:`~ovs_ext.flows.FlowManager.restore`), so
a restart or reconnection never resets a counter nor counts a packet twice.
Pure: the app feeds in what it read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from flexmig import exceptions
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


# -- a clean stop (SIGTERM) ----------------------------------------------------------
# A clean stop gives every flow back to the bridge and deletes the app's rules, so
# neither the rules nor pinned entries hold the counts for the next run: they are
# written to the counters file instead, and read back (once) at the next start.
COUNTERS_FILE_VERSION = 1


def kept_at_stop(
    manager: FlowManager,
    gone: Iterable[TrackedFlow],
    rule_stats: Iterable[Any],
    port_name: Callable[[int], str | None],
) -> dict[FlowMatch, tuple[FlowCounters, FlowCounters, FlowCounters]]:
    """Every flow's counters at a clean stop, as (ruled, onloaded, offloaded):
    what earlier runs left that this one never saw again, the flows tracked
    now and those ``gone`` (the fast path's, onloaded by the stop), and the
    rules' final read (``rule_stats``: fresher than the last poll, so it wins)."""
    keep = FlowManager()
    for match, (ruled, onloaded, offloaded) in manager.restored().items():
        keep.restore(match, ruled=ruled, onloaded=onloaded, offloaded=offloaded)
    from_forgotten(keep, [*gone, *manager])
    from_rules(keep, rule_stats, port_name)
    return keep.restored()


def counters_document(
    kept: dict[FlowMatch, tuple[FlowCounters, FlowCounters, FlowCounters]],
) -> dict[str, Any]:
    """The counters file's JSON.

    >>> m = FlowMatch("tap0", 17, "10.0.0.1", "10.0.0.2", 4000, 5000)
    >>> doc = counters_document({m: (FlowCounters(3, 180), FlowCounters(), FlowCounters(9, 540))})
    >>> doc["flows"][0]["ruled"], doc["flows"][0]["offloaded"]
    ([3, 180], [9, 540])
    """
    return {
        "version": COUNTERS_FILE_VERSION,
        "flows": [
            {
                "match": dataclasses.asdict(match),
                **{
                    part: [counters.packets, counters.bytes]
                    for part, counters in zip(PARTS, parts, strict=True)
                },
            }
            for match, parts in kept.items()
        ],
    }


PARTS = ("ruled", "onloaded", "offloaded")


def from_document(manager: FlowManager, doc: Any) -> int:
    """Restore what a clean stop kept; the whole document is checked first, so a
    malformed one restores nothing (ValueError naming what is wrong)."""
    if not isinstance(doc, dict) or doc.get("version") != COUNTERS_FILE_VERSION:
        raise ValueError(f"not a version-{COUNTERS_FILE_VERSION} counters file")
    entries = doc.get("flows")
    if not isinstance(entries, list):
        raise ValueError("'flows' must be a list")
    parsed = [_entry(i, entry) for i, entry in enumerate(entries)]
    for match, ruled, onloaded, offloaded in parsed:
        manager.restore(match, ruled=ruled, onloaded=onloaded, offloaded=offloaded)
    return len(parsed)


def _entry(index: int, entry: Any) -> tuple[FlowMatch, FlowCounters, FlowCounters, FlowCounters]:
    try:
        match = FlowMatch(**entry["match"])
        parts = []
        for part in PARTS:
            packets, nbytes = entry[part]
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                       for v in (packets, nbytes)):  # fmt: skip
                raise ValueError(f"{part} must be two counts >= 0")
            parts.append(FlowCounters(packets, nbytes))
    except (KeyError, TypeError, ValueError, exceptions.FlexMigError) as exc:
        raise ValueError(f"flow {index}: {exc}") from None
    return (match, *parts)  # type: ignore[return-value]
