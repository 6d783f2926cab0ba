"""Which FlowRecords a flow-statistics request selects: a pure function.

OpenFlow's non-strict selection (spec 6.4, "modify and delete"; used by
OFPMP_FLOW and OFPMP_AGGREGATE): a flow is selected when it is at least as
specific as the request's match — every field the request matches on is
matched by the flow with a value that agrees under the request's mask — and
its table, cookie (under cookie_mask) and output port agree.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexmig import exceptions
from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import ofp13
from ovs_ext.openflow_stats.codec import (
    FIELD_NAMES,
    FlowStatsRequest,
    OxmTlv,
    match_fields,
)


def selects(request: FlowStatsRequest, record: FlowRecord) -> bool:
    if request.table_id not in (ofp13.OFPTT_ALL, record.table_id):
        return False
    if (record.cookie ^ request.cookie) & request.cookie_mask:
        return False
    if request.out_port != ofp13.OFPP_ANY:
        out_port = ofp13.OFPP_NORMAL if record.out_port is None else record.out_port
        if out_port != request.out_port:
            return False
    if request.out_group != ofp13.OFPG_ANY:
        return False  # these flows output to ports, never to groups
    if not request.match:
        return True
    try:
        values = match_fields(record.match)
    except exceptions.InvalidInput:
        return False  # a record that cannot be shown is left out later anyway
    return all(_field_agrees(tlv, values) for tlv in request.match)


def _field_agrees(tlv: OxmTlv, values: dict[str, int]) -> bool:
    name = FIELD_NAMES.get(tlv.field) if tlv.oxm_class == ofp13.OFPXMC_OPENFLOW_BASIC else None
    value = values.get(name) if name else None
    if value is None:
        # The flow wildcards this field (FlowRecords carry no others), so it
        # is less specific than the request: not selected.
        return False
    mask = tlv.mask if tlv.mask is not None else -1
    return (value ^ tlv.value) & mask == 0


def select(request: FlowStatsRequest, records: Iterable[FlowRecord]) -> list[FlowRecord]:
    if request == SELECT_ALL:  # what a plain dump-flows asks for
        return list(records)
    return [record for record in records if selects(request, record)]


SELECT_ALL = FlowStatsRequest()
