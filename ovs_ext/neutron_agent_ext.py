"""FlexMig's L2 agent extension: what Neutron enforces on each port, for flexmig-offload.

Loaded by Neutron's OVS agent (``[agent] extensions = flexmig_offload`` in its
ml2 / openvswitch_agent.ini; entry point ``neutron.agent.l2.extensions``).  The
agent calls :meth:`handle_port` with the port details its RPC returns
(``port_security_enabled``, ``network_id``, the port's and the network's QoS
policy) and the OVS port (``vif_port``), and :meth:`delete_port` when a port
goes.  The extension writes those facts, by OVS port name, to
``[flexmig_offload] ports_file``, replaced whole, which flexmig-offload
(``[offload] pipeline = neutron``) reads to decide what may bypass OVS.  It
installs no rule and never touches the bridge.

neutron-lib is needed only where Neutron's agent runs; without it (FlexMig's
own hosts, unit tests) the class has no base.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

from oslo_config import cfg

try:
    from neutron_lib.agent import l2_extension

    _Base: type = l2_extension.L2AgentExtension
except ImportError:  # not on a Neutron agent's host
    _Base = object

LOG = logging.getLogger(__name__)
GROUP = "flexmig_offload"

opts = [
    cfg.StrOpt(
        "ports_file",
        default="/run/flexmig/neutron-ports.json",
        help="Where the extension writes each port's port security, network and "
        "QoS policy for flexmig-offload ([offload] neutron_ports_file).",
    ),
]


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    return [(GROUP, opts)]


def port_entry(details: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(OVS port name, facts) of one port's details; None without an OVS port.

    >>> class Vif: port_name = "tap1"
    >>> port_entry({"port_id": "p", "network_id": "n", "port_security_enabled": False,
    ...             "qos_policy_id": None, "network_qos_policy_id": "q", "vif_port": Vif()})
    ('tap1', {'port_id': 'p', 'network_id': 'n', 'port_security': False, 'qos_policy_id': 'q'})
    """
    vif = details.get("vif_port")
    name = getattr(vif, "port_name", None)
    if not name or not details.get("port_id") or not details.get("network_id"):
        return None
    # Neutron's default when the extension is not loaded is "secured".
    security = details.get("port_security_enabled", True)
    qos = details.get("qos_policy_id") or details.get("network_qos_policy_id")
    facts = {
        "port_id": details["port_id"],
        "network_id": details["network_id"],
        "port_security": security is not False,
        "qos_policy_id": qos or None,
    }
    return name, facts


class FlexMigOffloadExtension(_Base):  # type: ignore[misc, valid-type]
    def __init__(self, conf: cfg.ConfigOpts | None = None) -> None:
        self.conf = conf if conf is not None else cfg.CONF
        self.conf.register_opts(opts, group=GROUP)
        self._lock = threading.Lock()
        self._ports: dict[str, tuple[str, dict[str, Any]]] = {}  # port_id -> (name, facts)

    # -- neutron_lib's L2AgentExtension ---------------------------------------------------
    def initialize(self, connection: object, driver_type: str) -> None:
        """Start from an empty file: facts of a previous run may be stale."""
        self._write()

    def consume_api(self, agent_api: object) -> None:
        """Nothing from the agent's API: the extension installs no rules."""

    def handle_port(self, context: object, details: dict[str, Any]) -> None:
        entry = port_entry(details)
        if entry is None:
            return
        with self._lock:
            self._ports[details["port_id"]] = entry
        self._write()

    def delete_port(self, context: object, details: dict[str, Any]) -> None:
        with self._lock:
            gone = self._ports.pop(details.get("port_id", ""), None)
        if gone is not None:
            self._write()

    def handle_switch_restart(self) -> None:
        """Neutron re-handles every port after it; the facts stay valid meanwhile."""

    # -- the file -----------------------------------------------------------------------
    def _write(self) -> None:
        path = self.conf[GROUP].ports_file
        with self._lock:
            ports = {name: facts for name, facts in self._ports.values()}
            text = json.dumps({"ports": ports}, sort_keys=True)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as handle:
                    handle.write(text)
                os.replace(tmp, path)
            except OSError as exc:
                # Stale facts must not stay: without the file flexmig-offload
                # offloads nothing (safe), and this is loud.
                LOG.error("flexmig_offload: cannot write %s: %s", path, exc)
                for stale in (tmp, path):
                    try:
                        os.unlink(stale)
                    except OSError:
                        pass
