"""An OpenFlow 1.3 endpoint that real ``ovs-ofctl`` reads offloaded-flow statistics from.

OVS has no hook for an external fast path's counters, so FlexMig serves the
flows it manages (onloaded and offloaded, counters merged) on its own
read-only OpenFlow endpoint: ``codec`` is the wire format, ``selection`` the
request filters, ``session`` one connection's protocol, ``server`` the sockets.
"""

from ovs_ext.openflow_stats.server import EndpointError, OpenFlowStatsServer
from ovs_ext.openflow_stats.session import EndpointInfo

__all__ = ["EndpointError", "EndpointInfo", "OpenFlowStatsServer"]
