"""Neutron's real OVS agent on a lab host, neutron-server stubbed at the RPC boundary.

Run inside a host (``python -m flexmig_lab.neutron_agent --config-file AGENT.ini
--server-state STATE.json``), this process is ``neutron-openvswitch-agent`` as
Neutron ships it (``neutron.cmd.agents.ovs_neutron_agent:main``): its config
parsing, the os-ken app that is br-int's OpenFlow controller (native
of_interface), ``OVSNeutronAgent`` with its integration-bridge setup, polling
loop, local VLANs, stale-flow cleanup, the OVS firewall driver and the L2
agent extensions manager (which loads FlexMig's ``flexmig_offload``).

What is not Neutron's: the other end of its RPC.  The oslo.messaging transport
is the in-process ``fake://`` driver, and on it this module serves, with
oslo.messaging RPC servers on the topics neutron-server listens on, the calls
the agent makes (``has_alive_neutron_server``, ``report_state``,
``update_device_list``, the resources ``pull``/``bulk_pull`` of the agent's
push-notification cache) from STATE.json: one network (type ``local``), its
ports and the security groups, built as Neutron's versioned objects.  When
STATE.json changes, the changed ports are pushed to the agent the way
neutron-server pushes them (``ResourcesPushRpcApi``).

STATE.json::

    {"host": "...", "network_id": "...", "subnet_id": "...",
     "ports": [{"id", "name", "mac", "ip", "port_security", "security_groups"}],
     "security_groups": [{"id", "rules": [{"direction", "protocol",
                          "port_range_min", "port_range_max"}]}]}

The lab imports nothing of this: it only starts it (Neutron's packages are a
test requirement, never FlexMig's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any

LOG = logging.getLogger(__name__)
PROJECT = "flexmig-lab"
STATE_POLL_S = 0.2


def _ovo_network(state: dict[str, Any]) -> Any:
    from neutron.objects import network

    segment = network.NetworkSegment(
        id=f"{state['network_id'][:-4]}5e91",
        network_id=state["network_id"],
        network_type="local",
        physical_network=None,
        segmentation_id=None,
        is_dynamic=False,
        segment_index=0,
        hosts=[state["host"]],
    )
    return network.Network(
        id=state["network_id"],
        project_id=PROJECT,
        name="lab-net",
        admin_state_up=True,
        status="ACTIVE",
        mtu=1500,
        segments=[segment],
        qos_policy_id=None,
        shared=False,
        revision_number=1,
    ), segment


def _ovo_port(state: dict[str, Any], port: dict[str, Any], segment: Any, revision: int) -> Any:
    import netaddr
    from neutron.objects import ports
    from neutron.objects.port.extensions import port_security

    binding = ports.PortBinding(
        port_id=port["id"],
        host=state["host"],
        vif_type="ovs",
        vnic_type="normal",
        profile={},
        vif_details={"port_filter": True, "ovs_hybrid_plug": False},
        status="ACTIVE",
    )
    level = ports.PortBindingLevel(
        port_id=port["id"],
        host=state["host"],
        level=0,
        driver="openvswitch",
        segment_id=segment.id,
        segment=segment,
    )
    ip = ports.IPAllocation(
        port_id=port["id"],
        subnet_id=state["subnet_id"],
        network_id=state["network_id"],
        ip_address=netaddr.IPAddress(port["ip"]),
    )
    return ports.Port(
        id=port["id"],
        project_id=PROJECT,
        name=port["name"],
        network_id=state["network_id"],
        mac_address=netaddr.EUI(port["mac"]),
        admin_state_up=True,
        device_id=f"vm-{port['name']}",
        device_owner="compute:nova",
        status="ACTIVE",
        revision_number=revision,
        fixed_ips=[ip],
        allowed_address_pairs=[],
        bindings=[binding],
        binding_levels=[level],
        distributed_bindings=[],
        security=port_security.PortSecurity(
            id=port["id"], port_security_enabled=port["port_security"]
        ),
        security_group_ids=set(port["security_groups"]),
        qos_policy_id=None,
        qos_network_policy_id=None,
        dhcp_options=[],
        dns=None,
        data_plane_status=None,
        hints=None,
        trusted=None,
    )


def _ovo_security_groups(state: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    from neutron.objects import securitygroup as sg

    groups, all_rules = [], []
    for group in state["security_groups"]:
        rules = []
        for n, rule in enumerate(group["rules"]):
            rules.append(
                sg.SecurityGroupRule(
                    id=f"{group['id'][:-4]}{n:04x}",
                    project_id=PROJECT,
                    security_group_id=group["id"],
                    direction=rule["direction"],
                    ethertype="IPv4",
                    protocol=rule.get("protocol"),
                    port_range_min=rule.get("port_range_min"),
                    port_range_max=rule.get("port_range_max"),
                    remote_ip_prefix=None,
                    remote_group_id=None,
                    remote_address_group_id=None,
                    belongs_to_default_sg=False,
                    revision_number=1,
                )
            )
        groups.append(
            sg.SecurityGroup(
                id=group["id"],
                project_id=PROJECT,
                name=group["id"],
                stateful=True,
                is_default=False,
                shared=False,
                rules=rules,
                revision_number=1,
            )
        )
        all_rules += rules
    return groups, all_rules


def _matches(obj: Any, filters: dict[str, Any] | None) -> bool:
    """neutron-server's bulk_pull filters: OR within a key, AND across keys.

    >>> class Port:
    ...     id, security_group_ids = "p1", {"sg1", "sg2"}
    ...     def obj_attr_is_set(self, name): return hasattr(self, name)
    >>> _matches(Port(), {"id": ("p1", "p2"), "security_group_ids": ("sg2",)})
    True
    >>> _matches(Port(), {"id": ("p3",)}), _matches(Port(), {"mtu": (1500,)})
    (False, False)
    """
    for key, values in (filters or {}).items():
        if not obj.obj_attr_is_set(key):
            return False
        attr = getattr(obj, key)
        many = isinstance(attr, list | tuple | set | frozenset)
        if not any((v in attr) if many else (v == attr) for v in values):
            return False
    return True


class FakeNeutronServer:
    """The RPC methods neutron-server answers an OVS agent, from STATE.json."""

    def __init__(self, state_file: str) -> None:
        self.state_file = state_file
        self._lock = threading.Lock()
        self._revision = 1
        self._objects: dict[str, list[Any]] = {}
        self._ports: dict[str, Any] = {}
        self.devices_up: set[str] = set()
        self._load()

    def _load(self) -> dict[str, Any]:
        with open(self.state_file, encoding="utf-8") as handle:
            state = json.load(handle)
        net, segment = _ovo_network(state)
        ports = {
            p["id"]: _ovo_port(state, p, segment, self._revision) for p in state["ports"]
        }  # fmt: skip
        groups, rules = _ovo_security_groups(state)
        with self._lock:
            self._ports = ports
            self._objects = {
                "Port": list(ports.values()),
                "Network": [net],
                "SecurityGroup": groups,
                "SecurityGroupRule": rules,
            }
        return ports

    # -- the RPC endpoints (oslo.messaging dispatches by method name) ---------------------
    def objects(self, resource_type: str, filters: dict[str, Any] | None) -> list[Any]:
        with self._lock:
            return [o for o in self._objects.get(resource_type, []) if _matches(o, filters)]

    def watch(self, stop: threading.Event) -> None:
        """Push the ports whose facts changed in STATE.json, as neutron-server does."""
        from neutron.api.rpc.callbacks import events
        from neutron.api.rpc.handlers import resources_rpc
        from neutron_lib import context

        pusher = resources_rpc.ResourcesPushRpcApi()
        stamp = os.stat(self.state_file).st_mtime_ns
        while not stop.wait(STATE_POLL_S):
            now = os.stat(self.state_file).st_mtime_ns
            if now == stamp:
                continue
            stamp = now
            before = dict(self._ports)
            self._revision += 1
            after = self._load()
            changed = [
                p for pid, p in after.items()
                if pid not in before or before[pid].security != p.security
                or before[pid].security_group_ids != p.security_group_ids
            ]  # fmt: skip
            if changed:
                LOG.info("stub neutron-server: pushing %d changed port(s)", len(changed))
                try:
                    _push(pusher, context.get_admin_context(), changed, events.UPDATED)
                except Exception:  # a stub's failure must show in the agent's log
                    LOG.exception("stub neutron-server: push failed")


def _push(pusher: Any, context: Any, ports: list[Any], event_type: str) -> None:
    """ResourcesPushRpcApi's fan-out cast, at the agent's own object version.

    neutron-server asks its version manager which versions the agents it
    knows consume (the core plugin's agents table); this stub has one agent,
    in this process, so the version is the local one.
    """
    version = ports[0].VERSION
    cctxt = pusher._prepare_object_fanout_context(ports[0], version, rpc_version="1.1")
    primitives = [p.obj_to_primitive(target_version=version) for p in ports]
    cctxt.cast(context, "push", event_type=event_type, resource_list=primitives)


class PluginEndpoint:
    """topics.PLUGIN, no namespace: the calls of agent_rpc.PluginApi."""

    def __init__(self, server: FakeNeutronServer) -> None:
        import oslo_messaging

        self.target = oslo_messaging.Target(version="1.9")
        self.server = server

    def update_device_list(self, context: Any, **kwargs: Any) -> dict[str, list[str]]:
        up, down = list(kwargs.get("devices_up", [])), list(kwargs.get("devices_down", []))
        self.server.devices_up.update(up)
        self.server.devices_up.difference_update(down)
        LOG.info("stub neutron-server: devices up %s down %s", up, down)
        return {"devices_up": up, "failed_devices_up": [], "devices_down": down,
                "failed_devices_down": []}  # fmt: skip

    def tunnel_sync(self, context: Any, **kwargs: Any) -> dict[str, list[Any]]:
        return {"tunnels": []}

    def get_network_details(self, context: Any, **kwargs: Any) -> dict[str, Any]:
        return {"id": kwargs.get("network"), "mtu": 1500}


class ResourcesEndpoint:
    """topics.PLUGIN, resources namespace: ResourcesPullRpcApi's pull/bulk_pull."""

    def __init__(self, server: FakeNeutronServer) -> None:
        import oslo_messaging

        self.target = oslo_messaging.Target(version="1.1")
        self.server = server

    def pull(self, context: Any, resource_type: str, version: str, resource_id: str) -> Any:
        found = self.server.objects(resource_type, {"id": (resource_id,)})
        return found[0].obj_to_primitive(target_version=version) if found else None

    def bulk_pull(self, context: Any, resource_type: str, version: str,
                  filter_kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        found = self.server.objects(resource_type, filter_kwargs)
        return [o.obj_to_primitive(target_version=version) for o in found]


class ReportsEndpoint:
    """topics.REPORTS: agent_rpc.PluginReportStateAPI."""

    def __init__(self) -> None:
        import oslo_messaging

        self.target = oslo_messaging.Target(version="1.4")

    def has_alive_neutron_server(self, context: Any, **kwargs: Any) -> bool:
        return True

    def report_state(self, context: Any, **kwargs: Any) -> str:
        return "alive"


def start_stub_server(server: FakeNeutronServer) -> list[Any]:
    import oslo_messaging
    from neutron_lib import rpc as n_rpc
    from neutron_lib.agent import topics

    rpc_servers = [
        n_rpc.get_server(
            oslo_messaging.Target(topic=topics.PLUGIN, server="neutron-server", fanout=False),
            [PluginEndpoint(server), ResourcesEndpoint(server)],
        ),
        n_rpc.get_server(
            oslo_messaging.Target(topic=topics.REPORTS, server="neutron-server", fanout=False),
            [ReportsEndpoint()],
        ),
    ]
    for rpc_server in rpc_servers:
        rpc_server.start()
    stop = threading.Event()
    threading.Thread(target=server.watch, args=(stop,), daemon=True).start()
    return rpc_servers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config-file", required=True, help="the agent's ini file")
    parser.add_argument("--server-state", required=True, help="STATE.json (module doc)")
    args = parser.parse_args(argv)
    # First: neutron.cmd.agents selects oslo.service's threading backend, which
    # must happen before anything else imports oslo.service.
    from neutron.cmd.agents import ovs_neutron_agent  # isort: skip
    from neutron_lib import rpc as n_rpc

    server = FakeNeutronServer(args.server_state)
    real_init = n_rpc.init

    def init_then_serve(conf: Any, rpc_ext_mods: Any = None) -> None:
        # The transport exists only once the agent has parsed its config: the
        # stub starts serving on it before the agent's first call.
        real_init(conf, rpc_ext_mods)
        start_stub_server(server)

    n_rpc.init = init_then_serve
    sys.argv = ["neutron-openvswitch-agent", "--config-file", args.config_file]
    started = time.monotonic()
    try:
        ovs_neutron_agent.main()
    finally:
        LOG.info("agent exited after %.1f s", time.monotonic() - started)


if __name__ == "__main__":
    main()
