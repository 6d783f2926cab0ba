"""flexmig-offload options (oslo.config), group ``[offload]``.

``oslo-config-generator --namespace flexmig.offload`` prints them with their
help.  Providers carry their own options under ``[offload_<name>]``.
"""

from __future__ import annotations

import math

from oslo_config import cfg

GROUP = "offload"
STATS_SOCKET_AUTO = "auto"
PROVIDER_NAMESPACE = "flexmig.offload_providers"

offload_opts = [
    cfg.StrOpt(
        "provider",
        default="xdp",
        choices=[
            ("xdp", "XDP/eBPF eSwitch on the VM ports and uplink (any Linux host)"),
            ("tc-flower", "tc flower rules with skip_sw on switchdev VF representors"),
            ("noop", "reference provider: offloads nothing (every install refused)"),
        ],
        help="Offload provider (entry point in flexmig.offload_providers) that "
        "carries offloaded flows.",
    ),
    cfg.StrOpt(
        "policy_file",
        default="/etc/flexmig/offload-policy.yaml",
        help="YAML policy: header rules, statistics rule and offload capacity "
        "(see ovs_ext/policy.py). Re-read on SIGHUP; an invalid file is "
        "rejected whole and the running policy stays.",
    ),
    cfg.StrOpt(
        "bridge",
        default="br-int",
        regex=r"^[A-Za-z0-9_.-]{1,15}$",
        help="Integration bridge whose VM ports and uplinks the app controls.",
    ),
    cfg.FloatOpt(
        "poll_interval",
        default=0.1,
        min=0.02,
        max=60.0,
        help="Seconds between flow-statistics polls (OpenFlow rules and the "
        "provider). Bounds promotion latency and how stale shown counters are.",
    ),
    cfg.IPOpt(
        "controller_address",
        default="127.0.0.1",
        help="Address the OpenFlow controller listens on; the bridge connects "
        "to tcp:<address>:<port>. Keep it a loopback address: only the local "
        "bridge should reach it (connections from any other datapath id are "
        "refused). os-ken cannot serve a UNIX socket (it sets TCP_NODELAY).",
    ),
    cfg.PortOpt(
        "controller_port",
        default=6653,
        help="TCP port of the OpenFlow controller (6653: OpenFlow's IANA port; "
        "Neutron's native agent uses 6633).",
    ),
    cfg.StrOpt(
        "pipeline",
        default="standalone",
        choices=[
            (
                "standalone",
                "the app owns the bridge: its controller, a table-0 NORMAL "
                "rule and rules that forward (no Neutron on this host)",
            ),
            (
                "neutron",
                "beside Neutron's OVS agent, which owns br-int: the app adds its "
                "controller beside Neutron's, hands packets back to Neutron's table 0, keeps "
                "its rules in tables of its own and offloads only flows whose ports Neutron "
                "enforces nothing on in OVS (see ovs_ext/neutron.py)",
            ),
        ],
        help="Who owns the bridge's OpenFlow pipeline.",
    ),
    cfg.StrOpt(
        "neutron_ports_file",
        default="/run/flexmig/neutron-ports.json",
        help="With pipeline = neutron: the port facts (port security, network, QoS "
        "policy) FlexMig's L2 agent extension writes from inside Neutron's OVS agent. "
        "A port not in it is never offloaded; an unreadable file offloads nothing.",
    ),
    cfg.IntOpt(
        "neutron_table",
        default=210,
        min=100,
        max=253,
        help="With pipeline = neutron: the app's judging table (per-flow rules), "
        "outside Neutron's tables, which Neutron's resync cleans.",
    ),
    cfg.IntOpt(
        "neutron_counting_table",
        default=211,
        min=100,
        max=253,
        help="With pipeline = neutron: the table of the flows' counting rules.",
    ),
    cfg.IntOpt(
        "neutron_register",
        default=12,
        min=8,
        max=15,
        help="With pipeline = neutron: the register marking a packet already handed "
        "to the app (Neutron's br-int uses reg2 to reg7).",
    ),
    cfg.IntOpt(
        "neutron_controller_id",
        default=0xF1E0,
        min=1,
        max=65535,
        help="With pipeline = neutron: the app's OpenFlow controller id; its rules "
        "send packet-ins to this id only, so Neutron's controller never gets them.",
    ),
    cfg.BoolOpt(
        "configure_bridge",
        default=True,
        help="At start, point the bridge's controller at this app with "
        "fail-mode standalone (the bridge keeps switching if the app dies) and "
        "allow OpenFlow 1.0 and 1.3 (the app speaks 1.3 only). With pipeline = "
        "neutron: only add the app's controller beside Neutron's (and again "
        "whenever Neutron's agent reset the list); nothing else is changed.",
    ),
    cfg.FloatOpt(
        "flow_idle_timeout",
        default=300.0,
        min=0.0,
        max=86400.0,
        help="Seconds without a packet (onloaded or offloaded) after which a flow "
        "is forgotten: its OpenFlow rule and offload entry are removed and its "
        "next packet starts a new flow. 0: never.",
    ),
    cfg.IntOpt(
        "ovs_revalidator_ms",
        default=0,
        min=0,
        max=60_000,
        help="With configure_bridge, set ovs-vswitchd's other_config:max-revalidator "
        "(ms): how often OVS pushes datapath counters into OpenFlow rules, which "
        "bounds how soon a statistics rule sees an elephant (OVS's default 500 ms "
        "gives ~0.5 s; 100 ms meets a 200 ms promotion target at some vswitchd "
        "CPU). 0 leaves OVS's setting alone. It is switch-wide.",
    ),
    cfg.StrOpt(
        "stats_endpoint",
        default="/var/run/openvswitch/br-int-offload.mgmt",
        help="UNIX socket of the OpenFlow statistics endpoint. In OVS's rundir "
        "with a .mgmt suffix, 'ovs-ofctl dump-flows br-int-offload' finds it "
        "by name. Empty: no endpoint. Its other settings (socket mode, "
        "connections, idle timeout) are in [openflow_stats].",
    ),
    cfg.StrOpt(
        "status_file",
        default="/run/flexmig/offload-status.json",
        help="JSON written every poll: each flow's state, counters and the "
        "reason it is onloaded or offloaded. Empty: not written.",
    ),
    cfg.StrOpt(
        "stats_socket",
        default=STATS_SOCKET_AUTO,
        help="Where statistics polls read the app's rules: the bridge's management "
        "socket (ovs-ofctl's: OVS's rundir/<bridge>.mgmt), on a connection of "
        "their own, parsing only counters and cookies, in the poller's thread. "
        f"'{STATS_SOCKET_AUTO}' (default): $OVS_RUNDIR (else /var/run/openvswitch)"
        "/<bridge>.mgmt, or the controller connection if that socket is not "
        "there at start. A path: that socket. Empty: through the controller "
        "connection, whose full parse of every rule (1-2 s at 10k flows) runs in "
        "the thread that takes packet-ins and delays new flows.",
    ),
    cfg.StrOpt(
        "counters_file",
        default="/run/flexmig/offload-counters.json",
        help="Where a clean stop (SIGTERM) keeps every flow's counters, read back "
        "(and removed) at the next start, so a flow's count goes on instead of "
        "starting over. A crash needs no file: the rules left in the bridge and "
        "the entries pinned in the provider hold the counts. Packets sent while "
        "the service is stopped are switched by the bridge uncounted. Empty: "
        "counters start over after a clean stop.",
    ),
    cfg.StrOpt(
        "control_socket",
        default="/run/flexmig/offload-control.sock",
        help="UNIX socket (mode 0600) of the local control interface the host's "
        "agent uses to move a VM's flows with it across a live migration "
        "(ovs_ext/control_api.py). Requests are signed with control_key_file. "
        "Empty: no interface, and migrating VMs' flows are left to the policy.",
    ),
    cfg.StrOpt(
        "control_key_file",
        default="/etc/flexmig/agent.key",
        help="Key the control interface's requests are signed with: the "
        "deployment key the host's agent holds ([agent] key_file).",
    ),
    cfg.ListOpt(
        "vm_port_patterns",
        default=[r"tap[0-9a-f]{8}-[0-9a-f]{2}"],
        help="Regular expressions (whole name) of VM ports: each gets a "
        "dispatcher. Default: the taps Nova and Neutron's OVS plugging name "
        "'tap' + the first 11 characters of the Neutron port's UUID.",
    ),
    cfg.ListOpt(
        "uplinks",
        default=[],
        help="Uplink ports of the bridge (e.g. the physical NIC or bond): their "
        "flows towards VMs are the VMs' ingress flows. Default: none; a host's "
        "uplink name is the deployment's to give.",
    ),
]


def register_opts(conf: cfg.ConfigOpts) -> None:
    conf.register_opts(offload_opts, group=GROUP)


def validate(conf: cfg.ConfigOpts) -> None:
    """Read every option once: oslo.config checks types and bounds on access, and a
    bad value must stop the start before anything is touched."""
    for opt in offload_opts:
        value = getattr(conf[GROUP], opt.dest)
        # oslo.config's bounds compare false against NaN, so "nan" passes them.
        if isinstance(value, float) and not math.isfinite(value):
            raise cfg.ConfigFileValueError(f"[{GROUP}] {opt.name}: {value} is not a finite number")


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    return [(GROUP, offload_opts)]
