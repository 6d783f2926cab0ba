"""``[openflow_stats]`` options: where the statistics endpoint listens."""

from __future__ import annotations

from oslo_config import cfg

GROUP = "openflow_stats"

openflow_stats_opts = [
    cfg.StrOpt(
        "unix_socket",
        default="/var/run/openvswitch/br-int-offload.mgmt",
        help="UNIX socket the OpenFlow statistics endpoint listens on. Inside "
        "OVS's run directory and named <name>.mgmt, 'ovs-ofctl dump-flows <name>' "
        "finds it by name, as it finds a bridge. Empty: no UNIX socket.",
    ),
    cfg.StrOpt(
        "unix_socket_mode",
        default="0600",
        regex=r"^0?[0-7]{3}$",
        help="Permissions of the UNIX socket (octal). The default lets only its "
        "owner (root, like ovs-vswitchd's own mgmt sockets) read statistics.",
    ),
    cfg.IPOpt(
        "tcp_address",
        help="Also listen for OpenFlow over TCP on this address (ovs-ofctl "
        "target tcp:<address>:<tcp_port>). Unset: no TCP listener.",
    ),
    cfg.PortOpt(
        "tcp_port",
        default=6655,
        help="TCP port of the endpoint when tcp_address is set (6653 is the "
        "controller port, so another one by default).",
    ),
    cfg.IntOpt(
        "max_connections",
        default=64,
        min=1,
        max=1024,
        help="Connections served at once, and as many more may wait to be accepted "
        "while a dump is being encoded; more are accepted and closed at once. "
        "Each waiting connection costs one socket; the table is served one "
        "request at a time, so 20 monitoring clients dumping beside an "
        "operator's ovs-ofctl hold 21 connections at once.",
    ),
    cfg.FloatOpt(
        "idle_timeout",
        default=60.0,
        min=1.0,
        max=3600.0,
        help="Seconds a connection may stay silent (or leave a message half "
        "sent) before it is closed.",
    ),
    cfg.FloatOpt(
        "dump_reuse_s",
        default=0.25,
        min=0.0,
        max=5.0,
        help="Seconds an encoded answer to a flow dump (or aggregate) is served "
        "again to every client asking for the same flows. Monitoring clients "
        "polling the whole table then cost one encoding per interval, not one "
        "each (20 clients dumping 10k flows kept the service's one interpreter "
        "busy encoding). Counters only move at each statistics poll; a dump may "
        "show them this much older than the last poll. 0: every request is "
        "encoded anew.",
    ),
    cfg.IntOpt(
        "datapath_id",
        default=0,
        min=0,
        max=2**64 - 1,
        help="Datapath id the endpoint reports in its FEATURES reply.",
    ),
]


def register_opts(conf: cfg.ConfigOpts) -> None:
    conf.register_opts(openflow_stats_opts, group=GROUP)


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator."""
    return [(GROUP, openflow_stats_opts)]
