"""tc-flower provider against the real kernel.

On a switchdev SR-IOV NIC (set FLEXMIG_TC_FLOWER_REPRESENTORS=<rep_a>,<rep_b>
to two representors of it) a filter is installed in hardware, read back and
removed.  Without one the test skips, naming what the probe found missing.
The refusal path runs everywhere with root: in a throwaway namespace the
provider adds a real clsact qdisc through pyroute2 and, where the kernel
cannot offload (or has no flower), the flow stays onloaded with the kernel's
reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest
from oslo_config import cfg

from flexmig_lab import topology
from ovs_ext.providers.base import IPPROTO_TCP, FlowMatch, OffloadEntry
from ovs_ext.providers.tc_flower import TcFlowerProvider, probe
from ovs_ext.providers.tc_flower.provider import PyRoute2Netlink

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, tc)")


def conf_with(**opts) -> cfg.ConfigOpts:
    conf = cfg.ConfigOpts()
    conf([])
    provider = TcFlowerProvider(conf)  # registers [offload_tc_flower]
    del provider
    for name, value in opts.items():
        conf.set_override(name, value, group="offload_tc_flower")
    return conf


@needs_root
def test_offload_between_two_representors_in_hardware():
    facts = probe.gather()
    missing = probe.missing(facts)
    if missing:
        pytest.skip("tc-flower needs a switchdev SR-IOV NIC; probed: " + "; ".join(missing))
    wanted = os.environ.get("FLEXMIG_TC_FLOWER_REPRESENTORS", "")
    reps = [r for r in wanted.split(",") if r] or list(facts.representors[:2])
    if len(reps) < 2:
        pytest.skip(f"need two representors, found {facts.representors}")
    provider = TcFlowerProvider(conf_with(representors=reps))
    assert provider.describe().available
    for rep in reps:
        provider.attach_port(rep)
    flow = FlowMatch(reps[0], IPPROTO_TCP, "192.0.2.1", "192.0.2.2", 40000, 5201)
    result = provider.install([OffloadEntry(flow, reps[1])])
    assert result.installed == (flow,), result.failed
    shown = subprocess.run(
        ["tc", "-j", "-s", "filter", "show", "dev", reps[0], "ingress"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    ours = [f for f in json.loads(shown) if f.get("kind") == "flower" and "options" in f]
    assert any(f["options"].get("skip_sw") and f["options"].get("in_hw") for f in ours)
    assert flow in provider.stats()
    final = provider.remove([flow])
    assert flow in final and provider.stats() == {}
    for rep in reps:
        provider.detach_port(rep)


@pytest.fixture
def veth_netns():
    # Under this lab's prefix (FLEXMIG_LAB_NAME), never another lab's.
    name = f"{topology.NETNS_PREFIX}tcflower-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        for cmd in (
            ["link", "add", "ra", "type", "veth", "peer", "name", "rb"],
            ["link", "set", "ra", "up"],
            ["link", "set", "rb", "up"],
        ):
            subprocess.run(["ip", "-n", name, *cmd], check=True, timeout=10)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=10)


@needs_root
def test_a_kernel_refusal_leaves_the_flow_onloaded_with_the_reason(veth_netns):
    netlink = PyRoute2Netlink(netns=veth_netns)
    # veths stand in for representors (listed explicitly): they have no
    # hardware, so a skip_sw filter can never be accepted on them.
    provider = TcFlowerProvider(conf_with(representors=["ra", "rb"]), netlink=netlink)
    try:
        provider.attach_port("ra")
        provider.attach_port("rb")
        qdiscs = subprocess.run(
            ["tc", "-n", veth_netns, "-j", "qdisc", "show", "dev", "ra"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
        assert any(q.get("kind") == "clsact" for q in json.loads(qdiscs))
        flow = FlowMatch("ra", IPPROTO_TCP, "192.0.2.1", "192.0.2.2", 40000, 5201)
        result = provider.install([OffloadEntry(flow, "rb")])
        assert result.installed == ()
        assert result.failed[flow].startswith("the kernel refused the flower filter on ra: ")
        assert provider.stats() == {}
        filters = subprocess.run(
            ["tc", "-n", veth_netns, "filter", "show", "dev", "ra", "ingress"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
        assert "flower" not in filters
    finally:
        netlink.close()
