"""Lab traffic endpoints: a namespace with a veth in a host's br-int."""

from __future__ import annotations

import pytest

from flexmig import exceptions, processutil
from flexmig_lab import endpoints, netns, topology

pytestmark = pytest.mark.lab


def _offloads(ns: str, ifname: str) -> str:
    return processutil.run(["ip", "netns", "exec", ns, "ethtool", "-k", ifname]).stdout


def test_endpoint_lifecycle(lab):
    ep = endpoints.add(lab, "B", "web")
    assert ep.ip == endpoints.endpoint_ip(0)
    host = lab.host("B")
    assert ep.port in host.ovs_vsctl("list-ports", topology.INTEGRATION_BRIDGE).split()
    assert "tx-checksumming: off" in _offloads(host.spec.netns, ep.port)
    assert "tx-checksumming: off" in _offloads(ep.netns, endpoints.ENDPOINT_IF)
    # Reachable from the fabric's probe address: through B's br-int and uplink.
    ping = processutil.run(
        ["ip", "netns", "exec", topology.FABRIC_NETNS, "ping", "-c", "2", "-W", "2", ep.ip],
        check=False,
    )
    assert ping.returncode == 0, ping.stdout
    assert [e.name for e in endpoints.list_endpoints(lab)] == ["web"]

    endpoints.delete(lab, "web")
    assert not netns.netns_exists(ep.netns)
    assert ep.port not in host.ovs_vsctl("list-ports", topology.INTEGRATION_BRIDGE).split()
    assert endpoints.list_endpoints(lab) == []


def test_bad_input_changes_nothing(lab):
    endpoints.add(lab, "A", "one", ip="10.251.0.220")
    before = netns.list_netns(topology.NETNS_PREFIX)
    for kwargs in (
        {"host_name": "A", "name": "Bad Name"},
        {"host_name": "Z", "name": "two"},
        {"host_name": "A", "name": "one"},  # exists
        {"host_name": "A", "name": "two", "ip": "10.251.0.220"},  # address in use
        {"host_name": "A", "name": "two", "ip": "10.251.0.20"},  # a VM's range
    ):
        with pytest.raises(exceptions.InvalidInput):
            endpoints.add(lab, **kwargs)
    assert netns.list_netns(topology.NETNS_PREFIX) == before
    assert [e.name for e in endpoints.list_endpoints(lab)] == ["one"]
    # "one" is left for the fixture's lab down, which must remove it too.
