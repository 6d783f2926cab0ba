"""What the OpenFlow statistics endpoint shows for one rule: plain data.

The Flow Manager produces these (one per OpenFlow rule it owns and one per
offloaded flow, counters already merged so a rule includes its offloaded
flows' traffic, as OVS's own hardware offload reports it); the endpoint turns
them into OFPMP_FLOW replies that real ``ovs-ofctl dump-flows`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

# Match fields by their OXM names as ovs-ofctl prints them: "in_port" (OpenFlow
# port number), "eth_type", "ip_proto", "ipv4_src", "ipv4_dst" (dotted quads),
# "tcp_src", "tcp_dst", "udp_src", "udp_dst" (ints).
MATCH_FIELDS = (
    "in_port",
    "eth_type",
    "ip_proto",
    "ipv4_src",
    "ipv4_dst",
    "tcp_src",
    "tcp_dst",
    "udp_src",
    "udp_dst",
)


@dataclasses.dataclass(frozen=True)
class FlowRecord:
    table_id: int
    priority: int
    cookie: int
    match: Mapping[str, int | str]
    packets: int
    bytes: int
    duration_s: float  # since the flow was first seen, across promotions
    # Output action: an OpenFlow port number, or None for the NORMAL action.
    out_port: int | None = None
    offloaded: bool = False  # currently carried by the offload provider
