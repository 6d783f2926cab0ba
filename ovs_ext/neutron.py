"""Offload beside Neutron's OVS agent (``[offload] pipeline = neutron``).

Neutron's agent owns br-int: its controller, its tables (neutron-lib's
``INT_BR_ALL_TABLES``: 0, 23-25, 30-31, 58-62, 71-82, 91-94) and every rule in
them.  At start and after an OVS restart it deletes, table by table, every rule
whose cookie it did not reserve (``_dump_and_clean``), and it re-points the
bridge at its own controller only if its controller is missing from the list.
So, in this mode, the app:

- never installs a rule that forwards: one *hand-off* rule per watched port in
  table 0, above Neutron's per-port rules and below its 65535 ones, marks the
  packet in a register Neutron does not use, resubmits it to the app's own
  table (judging, counting: nothing there forwards) and then back to table 0,
  where the mark stops the hand-off and Neutron's pipeline runs exactly as
  without the app (Neutron's own DSCP rule uses the same re-entry with reg2).
  Every Neutron rule therefore sees every packet once, counters included;
- keeps its per-flow and counting rules in tables Neutron never cleans, and
  re-adds a hand-off rule that Neutron's resync deleted (the flows it tracks
  and their counters survive; packets during the gap are not seen);
- adds its controller *beside* Neutron's (never replacing or removing it),
  tags its packet-ins with a controller id of its own so Neutron's app never
  receives them, and re-adds itself if Neutron's resync reset the list;
- offloads a flow only when bypassing OVS skips nothing Neutron enforces on
  its ports: both ports known to Neutron, port security off on both, the same
  network, no QoS policy.  The XDP and tc fast paths bypass OVS and so the
  OVS firewall's conntrack: a port with security groups or anti-spoofing
  keeps all its flows in OVS, and the status says why.

The port facts come from Neutron's agent (``neutron_ports_file``: written by
``ovs_ext.neutron_agent_ext``, the L2 agent extension, from the port details
Neutron's RPC gives the agent).  A port not in the file is unknown, and so
never offloaded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import subprocess
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from flexmig import exceptions
from ovs_ext import flows
from ovs_ext.providers.base import IPPROTO_TCP, IPPROTO_UDP, FlowMatch

LOG = logging.getLogger(__name__)

# neutron-lib's ovs_constants.INT_BR_ALL_TABLES plus 94 (its accepted-egress
# NORMAL table, not in that list): tables the app must never put a rule in.
NEUTRON_TABLES = frozenset(
    {0, 1, 2, 3, 4, 23, 24, 25, 30, 31, 58, 59, 60, 61, 62, 71, 72, 73, 77, 78, 81, 82}
    | {91, 92, 93, 94}
)
# Registers Neutron's br-int pipeline uses (reg2: DSCP re-entry; 3-7: QoS,
# the OVS firewall's port, network and remote-group marks).
NEUTRON_REGISTERS = frozenset(range(2, 8))
# Below Neutron's 65535 rules (dead-VLAN drop, DSCP re-entry), above the rest.
HANDOFF_PRIORITY = 65000
NX_VENDOR_ID = 0x00002320
NXT_SET_CONTROLLER_ID = 20
OFPR_ACTION = 1
OVS_VSCTL_TIMEOUT = 10


class NeutronModeError(exceptions.FlexMigError):
    msg_fmt = "neutron pipeline: %(reason)s"


# -- the rules ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NeutronPipeline:
    """Where the app's rules go beside Neutron's, and how its packet-ins are tagged."""

    table: int  # the app's judging table (per-flow and discovery rules)
    counting_table: int
    register: int  # the hand-off mark (0: not yet handed to the app)
    controller_id: int

    def __post_init__(self) -> None:
        for name in ("table", "counting_table"):
            table = getattr(self, name)
            if table in NEUTRON_TABLES or not 0 < table < 254:
                raise NeutronModeError(reason=f"{name} {table} is one of Neutron's or invalid")
        if self.table == self.counting_table:
            raise NeutronModeError(reason="table and counting_table must differ")
        if self.register in NEUTRON_REGISTERS or not 0 <= self.register <= 15:
            raise NeutronModeError(reason=f"reg{self.register} is used by Neutron or invalid")
        if not 0 < self.controller_id < 0x10000:
            raise NeutronModeError(reason=f"controller id {self.controller_id} not in 1..65535")

    @property
    def reg(self) -> str:
        return f"reg{self.register}"

    def port_rules(self, parser: ModuleType, ofproto: ModuleType, ofport: int) -> list[Any]:
        """The hand-off in table 0 and, in the app's table, the port's discovery rules."""
        from ovs_ext import openflow

        cookie = flows.discovery_cookie(ofport)
        handoff = [
            parser.OFPActionSetField(**{self.reg: 1}),
            parser.NXActionResubmitTable(table_id=self.table),
            parser.NXActionResubmitTable(table_id=flows.FLOW_TABLE),
        ]
        mods = [
            self._mod(parser, ofproto, cookie, flows.FLOW_TABLE, HANDOFF_PRIORITY,
                      parser.OFPMatch(in_port=ofport, **{self.reg: 0}), handoff)
        ]  # fmt: skip
        for proto in (IPPROTO_TCP, IPPROTO_UDP):
            judge = [
                openflow.counting_learn(parser, proto, self.counting_table),
                parser.NXActionResubmitTable(table_id=self.counting_table),
                self._to_app(parser, openflow.JUDGE_MAX_LEN),
            ]
            match = parser.OFPMatch(in_port=ofport, eth_type=openflow.ETH_TYPE_IPV4, ip_proto=proto)
            mods.append(
                self._mod(parser, ofproto, cookie, self.table, flows.DISCOVERY_PRIORITY, match,
                          judge)
            )  # fmt: skip
        arp = parser.OFPMatch(in_port=ofport, eth_type=openflow.ETH_TYPE_ARP)
        learn_arp = [self._to_app(parser, openflow.ARP_LEARN_MAX_LEN)]
        mods.append(
            self._mod(parser, ofproto, cookie, self.table, flows.DISCOVERY_PRIORITY, arp,
                      learn_arp)
        )  # fmt: skip
        return mods

    def flow_rule(self, parser: ModuleType, ofproto: ModuleType, cookie: int, in_port: int,
                  match: FlowMatch, first_length: int = 0) -> Any:  # fmt: skip
        """The per-flow rule: it only counts (Neutron's pipeline forwards).

        Its one action is the first-packet note (``openflow.flow_rule``'s): the
        app counted that packet alone, and a run reading the rule back after a
        crash counts it from the note (without it such a flow was one short).
        A note does nothing to the packet, and the hand-off resubmits it back
        to table 0 whatever this rule does.
        """
        from ovs_ext import openflow

        fields: dict[str, Any] = dict(flows.openflow_match(match, in_port))
        note = parser.NXActionNote(note=list(openflow.FIRST_PACKET_NOTE.pack(first_length)))
        return self._mod(parser, ofproto, cookie, self.table, flows.FLOW_PRIORITY,
                         parser.OFPMatch(**fields), [note])  # fmt: skip

    def set_controller_id(self, parser: ModuleType) -> Any:
        """NXT_SET_CONTROLLER_ID: packet-ins of ``controller(id=...)`` come to this
        connection only, and Neutron's (id 0) never come here."""
        body = bytes(6) + struct.pack("!H", self.controller_id)
        return parser.OFPExperimenter(None, NX_VENDOR_ID, NXT_SET_CONTROLLER_ID, body)

    def _to_app(self, parser: ModuleType, max_len: int) -> Any:
        return parser.NXActionController(
            max_len=max_len, controller_id=self.controller_id, reason=OFPR_ACTION
        )

    @staticmethod
    def _mod(parser: ModuleType, ofproto: ModuleType, cookie: int, table: int, priority: int,
             match: Any, actions: list[Any]) -> Any:  # fmt: skip
        instructions = [parser.OFPInstructionActions(ofproto.OFPIT_APPLY_ACTIONS, actions)]
        return parser.OFPFlowMod(
            datapath=None,
            cookie=cookie,
            table_id=table,
            command=ofproto.OFPFC_ADD,
            priority=priority,
            buffer_id=0xFFFFFFFF,
            match=match,
            instructions=instructions if actions else [],
        )


def missing_handoffs(watched: Mapping[str, int], handoff_cookies: set[int]) -> list[int]:
    """Watched ports whose hand-off rule is gone (Neutron's resync deleted it).

    >>> missing_handoffs({"tap1": 3, "tap2": 4}, {flows.discovery_cookie(3)})
    [4]
    """
    return sorted(p for p in watched.values() if flows.discovery_cookie(p) not in handoff_cookies)


# -- what Neutron enforces on a port ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PortFacts:
    port_id: str
    network_id: str
    port_security: bool
    qos_policy_id: str | None = None


def parse_port_facts(data: object) -> dict[str, PortFacts]:
    """The ports file's ``{"ports": {device: {...}}}``; anything else is refused whole.

    >>> parse_port_facts({"ports": {"tapa": {"port_id": "a", "network_id": "n",
    ...                   "port_security": False}}})["tapa"].port_security
    False
    """
    ports = data.get("ports") if isinstance(data, dict) else None
    if not isinstance(ports, dict):
        raise NeutronModeError(reason="ports file: no 'ports' object")
    facts = {}
    for device, entry in ports.items():
        if not isinstance(entry, dict):
            raise NeutronModeError(reason=f"ports file: {device!r} is not an object")
        security = entry.get("port_security")
        qos = entry.get("qos_policy_id")
        ids = (entry.get("port_id"), entry.get("network_id"))
        if not isinstance(security, bool) or not all(isinstance(i, str) and i for i in ids):
            raise NeutronModeError(
                reason=f"ports file: {device!r} needs port_id, network_id and a boolean "
                "port_security"
            )
        if qos is not None and not isinstance(qos, str):
            raise NeutronModeError(reason=f"ports file: {device!r}: qos_policy_id not a string")
        facts[str(device)] = PortFacts(ids[0], ids[1], security, qos or None)
    return facts


def offload_block_reason(facts: Mapping[str, PortFacts], in_port: str,
                         out_port: str | None) -> str:  # fmt: skip
    """Empty when bypassing OVS skips nothing Neutron enforces on the flow's ports.

    >>> off = PortFacts("a", "net1", False)
    >>> offload_block_reason({"tapa": off, "tapb": off}, "tapa", "tapb")
    ''
    >>> offload_block_reason({"tapa": off}, "tapa", "tapb")
    'neutron: port tapb is not a Neutron port known to this host'
    """
    if out_port is None:
        return "neutron: destination port not learned yet"
    ends = []
    for port in (in_port, out_port):
        fact = facts.get(port)
        if fact is None:
            return f"neutron: port {port} is not a Neutron port known to this host"
        if fact.port_security:
            return (
                f"neutron: port {port} has port security (security groups, anti-spoofing) "
                "enforced in OVS, which the fast path would bypass"
            )
        if fact.qos_policy_id:
            return f"neutron: port {port} has QoS policy {fact.qos_policy_id} enforced in OVS"
        ends.append(fact)
    if ends[0].network_id != ends[1].network_id:
        return f"neutron: ports {in_port} and {out_port} are on different networks"
    return ""


class NeutronGuard:
    """Reads the agent extension's ports file (again when it changes) and vetoes
    offloads.  A file that cannot be read or parsed vetoes everything: the
    fast path must never run on facts it does not have."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._facts: dict[str, PortFacts] = {}
        self._error = "neutron: ports file not read yet"

    def facts(self) -> dict[str, PortFacts]:
        self._refresh()
        return dict(self._facts)

    def why_not(self, match: FlowMatch, out_port: str | None) -> str:
        self._refresh()
        if self._error:
            return self._error
        return offload_block_reason(self._facts, match.in_port, out_port)

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            self._set_error(f"neutron: ports file {self.path}: {exc.strerror}")
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            with open(self.path, encoding="utf-8") as handle:
                self._facts = parse_port_facts(json.load(handle))
        except (OSError, ValueError, NeutronModeError) as exc:
            self._set_error(f"neutron: ports file {self.path} unusable: {exc}")
            return
        self._error = ""

    def _set_error(self, error: str) -> None:
        if error != self._error:
            LOG.error("%s: no flow is offloaded until it is fixed", error)
        self._error, self._facts, self._stamp = error, {}, None


# -- the controller, beside Neutron's ------------------------------------------------------
def _vsctl(*args: str) -> str:
    cmd = ["ovs-vsctl", f"--timeout={OVS_VSCTL_TIMEOUT}", *args]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=OVS_VSCTL_TIMEOUT + 5, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NeutronModeError(reason=f"ovs-vsctl {' '.join(args)}: {exc}") from exc
    if proc.returncode != 0:
        raise NeutronModeError(reason=f"ovs-vsctl {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout


def controller_targets(bridge: str) -> list[str]:
    return _vsctl("get-controller", bridge).split()


def check_openflow13(bridge: str) -> None:
    """Neutron's agent enables OpenFlow 1.3; the app does not change the bridge's protocols."""
    protocols = _vsctl("get", "bridge", bridge, "protocols")
    if "OpenFlow13" not in protocols:
        raise NeutronModeError(
            reason=f"bridge {bridge} does not allow OpenFlow 1.3 ({protocols.strip()}); "
            "Neutron's OVS agent sets it: is the agent running?"
        )


def ensure_controller(bridge: str, target: str) -> bool:
    """Add ``target`` to the bridge's controllers, keeping every other one (Neutron's).

    True when it had to be (re-)added.
    """
    if target in controller_targets(bridge):
        return False
    _vsctl(
        "--", "--id=@flexmig", "create", "Controller", f'target="{target}"',
        "connection_mode=out-of-band",
        "--", "add", "Bridge", bridge, "controller", "@flexmig",
    )  # fmt: skip
    LOG.info("controller %s added to %s beside %s", target, bridge, "Neutron's")
    return True


def remove_controller(bridge: str, target: str) -> None:
    """Remove only the app's controller record (Neutron's stays)."""
    uuids = _vsctl("--bare", "--columns=_uuid", "find", "Controller", f'target="{target}"').split()
    for uuid in uuids:
        _vsctl("remove", "Bridge", bridge, "controller", uuid)
