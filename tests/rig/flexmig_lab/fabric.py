"""The fabric namespace: two Linux bridges joining the hosts' uplinks."""

from __future__ import annotations

from flexmig import processutil
from flexmig_lab import netns, topology
from flexmig_lab.topology import HostSpec


def _in_fabric(*cmd: str) -> None:
    processutil.run(["ip", "netns", "exec", topology.FABRIC_NETNS, *cmd])


def _in_host(spec: HostSpec, *cmd: str) -> None:
    processutil.run(["ip", "netns", "exec", spec.netns, *cmd])


def _link_exists(ns: str, ifname: str) -> bool:
    proc = processutil.run(["ip", "-n", ns, "link", "show", ifname], check=False)
    return proc.returncode == 0


def up_fabric() -> None:
    netns.add_netns(topology.FABRIC_NETNS)
    for bridge in (topology.MGMT_BRIDGE, topology.TENANT_BRIDGE):
        if not _link_exists(topology.FABRIC_NETNS, bridge):
            _in_fabric("ip", "link", "add", bridge, "type", "bridge")
        _in_fabric("ip", "link", "set", bridge, "up")
    probe = f"{topology.TENANT_PROBE_IP}/{topology.TENANT_NET.prefixlen}"
    _in_fabric("ip", "addr", "replace", probe, "dev", topology.TENANT_BRIDGE)


def connect_host(spec: HostSpec) -> None:
    """Give the host its management uplink (with an address) and tenant uplink."""
    links = (
        (spec.fabric_mgmt_if, topology.HOST_MGMT_IF, topology.MGMT_BRIDGE),
        (spec.fabric_tenant_if, topology.HOST_TENANT_IF, topology.TENANT_BRIDGE),
    )
    for fabric_if, host_if, bridge in links:
        if not _link_exists(spec.netns, host_if):
            processutil.run(
                [
                    "ip",
                    "link",
                    "add",
                    fabric_if,
                    "netns",
                    topology.FABRIC_NETNS,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    host_if,
                    "netns",
                    spec.netns,
                ]
            )
        _in_fabric("ip", "link", "set", fabric_if, "master", bridge, "up")
        _in_host(spec, "ip", "link", "set", host_if, "up")
        # The OVS userspace datapath does not complete checksums that veth
        # leaves to offload: without this, TCP across br-int stalls.
        _in_fabric("ethtool", "-K", fabric_if, "tx", "off")
        _in_host(spec, "ethtool", "-K", host_if, "tx", "off")
    addr = f"{spec.mgmt_ip}/{topology.MGMT_NET.prefixlen}"
    _in_host(spec, "ip", "addr", "replace", addr, "dev", topology.HOST_MGMT_IF)
    accept_xdp_redirects(spec)


def accept_xdp_redirects(spec: HostSpec) -> None:
    """Let frames the host's XDP fast path redirects out of phy0 reach the fabric.

    A veth hands a redirected frame to its peer's XDP ring, which exists only
    while the peer has an XDP program: the fabric side gets an XDP_PASS one.
    Skipped when the eSwitch is not built (the lab works without it).
    """
    from ovs_ext.providers.xdp import provider  # optional part of the lab

    if provider.RX_PASS_OBJECT.is_file():
        provider.attach_rx_pass(spec.fabric_tenant_if, topology.FABRIC_NETNS)
        # The fabric stands in for the physical network: its forwarding runs in
        # its own NAPI thread, so it is not charged to the hosts' softirq.
        processutil.run(
            [
                *("ip", "netns", "exec", topology.FABRIC_NETNS, "tee"),
                f"/sys/class/net/{spec.fabric_tenant_if}/threaded",
            ],
            input_text="1",
            check=False,
        )


def down_fabric() -> None:
    netns.delete_netns(topology.FABRIC_NETNS)


def set_mgmt_link(spec: HostSpec, up: bool) -> None:
    """Cut or restore a host's management/migration uplink (fault injection)."""
    _in_fabric("ip", "link", "set", spec.fabric_mgmt_if, "up" if up else "down")


# libvirt's default migration_port_min/max: QEMU's incoming stream listens there.
QEMU_MIGRATION_PORTS = "sport >= :49152 and sport <= :49215"


def reset_migration_streams(source: HostSpec, dest: HostSpec) -> None:
    """Reset QEMU's migration connections at both ends, as a fabric fault that
    outlasts TCP would: both QEMUs see the stream fail (fault injection)."""
    _in_host(dest, "ss", "-K", "-t", QEMU_MIGRATION_PORTS)
    _in_host(source, "ss", "-K", "-t", QEMU_MIGRATION_PORTS.replace("sport", "dport"))
