"""The os-ken OpenFlow 1.3 application controlling one bridge (br-int).

Modelled on Neutron's native OpenFlow agent: pinned to OpenFlow 1.3, every rule
it installs carries a cookie under :data:`~ovs_ext.flows.COOKIE_MASK` so it
knows what it owns (and deletes exactly that at start and at exit).  It does
the OpenFlow I/O only; every decision is :class:`~ovs_ext.control.OffloadControl`'s.

Threads: os-ken's native hub runs this app's event loop (packet-ins, port
changes, stats replies) in one thread and the poller in another; both take
``runtime.lock`` before touching the control state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import CONFIG_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub
from os_ken.ofproto import ofproto_v1_3

from ovs_ext import flows, neutron, openflow, restore, stats_reader
from ovs_ext.control import OffloadControl
from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadError

LOG = logging.getLogger("flexmig.ovs_ext.app")
# A stats request unanswered this many intervals is given up and re-sent.
STATS_REPLY_PATIENCE = 20
# The status file is rewritten every poll up to this many flows, every
# STATUS_BIG_EVERY_S above: at 10k flows one write is ~0.2 s of the interpreter
# the packet-ins need (by time, not every nth poll: polls slow down with the
# switch, see poll_pause, and every 10th of them left it 40 s old).
STATUS_EVERY_POLL_UP_TO = 1000  # flows
STATUS_BIG_EVERY_S = 1.0
STATUS_INDENT_UP_TO = 1000  # flows
COUNTED_MEMO_MAX = 100_000  # counting rules' matches memoised (see _counted_match)
COUNTING_READ_EVERY_S = 1.0  # see _read_rules
PURGE_TIMEOUT = 5  # s, ovs-appctl revalidator/purge


@dataclasses.dataclass
class Runtime:
    """What the service hands the app: the control core and its settings."""

    control: OffloadControl
    bridge: str
    poll_interval: float
    status_file: str = ""
    datapath_id: int | None = None  # the bridge's; other switches are refused
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    connected: threading.Event = dataclasses.field(default_factory=threading.Event)
    app: OffloadApp | None = None
    # Beside Neutron's agent (ovs_ext/neutron.py); None: the app owns the bridge.
    pipeline: neutron.NeutronPipeline | None = None
    # Polls read through a connection of their own ([offload] stats_socket);
    # None: through os-ken's (stats_reader.py says why that is slow).
    stats_reader: stats_reader.FlowStatsReader | None = None


class OffloadApp(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_3.OFP_VERSION]

    def __init__(self, *args: Any, offload_runtime: Runtime, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rt = offload_runtime
        self.rt.app = self
        self.datapath: Any = None
        self.port_names: dict[int, str] = {}
        self.port_numbers: dict[str, int] = {}
        self.mac_ports: dict[str, str] = {}
        self._stats_parts: dict[int, FlowCounters] = {}
        self._learned_parts: dict[FlowMatch, FlowCounters] = {}
        self._counted: dict[bytes, FlowMatch | None] = {}
        self._counting_read_at = float("-inf")  # see _read_rules
        self._stats_sent_at: float | None = None
        self._handoffs_seen: set[int] = set()
        self.watched: dict[str, int] = {}
        self._barrier_done = threading.Event()
        self._final_read: tuple[int, list[Any], threading.Event] | None = None  # read_rules
        # Whether packet-ins are judged yet: not until the datapath's cached flows
        # from before this connection are purged (see _switch_features).
        self.judging = False
        self._rules_ready = False  # the old rules read back and replaced
        self._read_back: list[Any] | None = None  # flow-stats parts while reading back
        self._settle_xids: dict[int, Any] = {}
        self.rt.control.status_extras["bridge"] = lambda: {"judging": self.judging}
        self._polls = 0
        self._status_written_at = float("-inf")
        self._poller = hub.spawn(self._poll_loop)

    # -- switch connection ---------------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    def _switch_features(self, ev: Any) -> None:
        dp = ev.msg.datapath
        if self.rt.datapath_id is not None and dp.id != self.rt.datapath_id:
            LOG.warning("refusing switch %016x: not bridge %s", dp.id, self.rt.bridge)
            dp.close()
            return
        LOG.info("bridge %s connected (datapath %016x)", self.rt.bridge, dp.id)
        # Why the app does not judge at once: the datapath keeps the flows it
        # cached before this connection (another run's, or none of ours at all),
        # and once our rules are back they are re-translated to send to the app.
        # A packet reaching the app through such a cached flow is credited again
        # to the flow's rules by the revalidator's next push, so counting it as
        # the flow's first packet counted it twice (a flow seen before a bridge
        # reconnection showed 2 for 1 sent).  Only a datapath miss is credited
        # to the shared discovery rule alone: the app waits until its rules are
        # in, purges the cached flows, and judges from then on.
        self._forget_bridge_state()
        self.datapath = dp
        # The rules an earlier run or connection left are read back (their flows'
        # counters go on), then replaced: see _rules_read_back.
        self.send(dp.ofproto_parser.OFPPortDescStatsRequest(dp, 0))
        self.rt.connected.set()

    def _forget_bridge_state(self) -> None:
        """A (re)connection starts from nothing: the rules are read back and
        deleted, so every tracked flow and offload entry goes too (their counters
        kept for when they are seen again), and ports are relearnt."""
        with self.rt.lock:
            control = self.rt.control
            for port in sorted(
                control.dispatchers.fast_path_ports | set(control.dispatchers.by_port)
            ):
                restore.from_forgotten(control.flows, control.port_removed(port))
        self.port_names.clear()
        self.port_numbers.clear()
        self._counted.clear()
        self.watched.clear()
        self.mac_ports.clear()
        self._stats_sent_at = None
        self.judging = False
        self._rules_ready = False
        self._read_back: list[Any] | None = None
        self._settle_xids.clear()

    @set_ev_cls(ofp_event.EventOFPPortDescStatsReply, MAIN_DISPATCHER)
    def _port_desc(self, ev: Any) -> None:
        if ev.msg.datapath is not self.datapath:
            return
        for port in ev.msg.body:
            self._port_up(port.port_no, _name(port.name))
        more = ev.msg.flags & ev.msg.datapath.ofproto.OFPMPF_REPLY_MORE
        if not more and not self._rules_ready and self._read_back is None:
            self._read_back = []
            dp = self.datapath
            self.send(openflow.owned_stats_request(dp.ofproto_parser, dp.ofproto))

    def _rules_read_back(self) -> None:
        """The rules found at connection are read: keep their counts, replace them
        (the flows they were made for are forgotten), then settle and purge."""
        stats, self._read_back = self._read_back or [], None
        with self.rt.lock:
            found = restore.from_rules(self.rt.control.flows, stats, self.port_names.get)
        if found:
            LOG.info("counters of %d rules of an earlier run or connection kept", found)
        dp = self.datapath
        self.send(openflow.delete_owned(dp.ofproto_parser, dp.ofproto))
        if self.rt.pipeline is None:
            self.send(openflow.table_miss_rule(dp.ofproto_parser, dp.ofproto))
            self.send(openflow.judged_miss_rule(dp.ofproto_parser, dp.ofproto))
        else:  # Neutron's table-0 rules switch what the app does not judge
            self.send(self.rt.pipeline.set_controller_id(dp.ofproto_parser))
        self._rules_ready = True
        for ofport in sorted(self.watched.values()):
            for mod in self._port_rules(ofport):
                self.send(mod)
        self._settle(self._purge_cached_flows)

    def _settle(self, then: Any) -> None:
        """Run ``then`` once OVS has applied everything sent so far (a barrier)."""
        dp = self.datapath
        barrier = dp.ofproto_parser.OFPBarrierRequest(dp)
        dp.set_xid(barrier)
        self._settle_xids[barrier.xid] = then
        self.send(barrier)

    def _purge_cached_flows(self) -> None:
        try:
            proc = subprocess.run(
                ["ovs-appctl", f"--timeout={PURGE_TIMEOUT}", "revalidator/purge"],
                capture_output=True,
                text=True,
                timeout=PURGE_TIMEOUT + 1,
                check=False,
            )
            failed = proc.returncode != 0 and proc.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed = str(exc)
        if failed:
            # Judging anyway beats never offloading: a flow cached from before
            # may count its first packet twice.
            LOG.warning("could not purge the datapath's cached flows: %s", failed)
        # Packet-ins sent before the purge arrive before the barrier's reply.
        self._settle(self._start_judging)

    def _start_judging(self) -> None:
        self.judging = True
        LOG.info("judging new flows on bridge %s", self.rt.bridge)

    @set_ev_cls(ofp_event.EventOFPPortStatus, MAIN_DISPATCHER)
    def _port_status(self, ev: Any) -> None:
        msg = ev.msg
        if msg.datapath is not self.datapath:
            return
        ofproto = msg.datapath.ofproto
        name = _name(msg.desc.name)
        if msg.reason == ofproto.OFPPR_DELETE:
            self._port_down(msg.desc.port_no, name)
        else:
            self._port_up(msg.desc.port_no, name)

    def _port_up(self, ofport: int, name: str) -> None:
        if ofport >= ofproto_v1_3.OFPP_MAX or self.port_names.get(ofport) == name:
            return
        self.port_names[ofport] = name
        self.port_numbers[name] = ofport
        self._counted.clear()
        with self.rt.lock:
            dispatchers = self.rt.control.dispatchers
            if not dispatchers.watches(name):
                return
            self.rt.control.port_added(name)
        self.watched[name] = ofport
        if self._rules_ready:  # else installed once the old rules are read back
            for mod in self._port_rules(ofport):
                self.send(mod)
        LOG.info("watching port %s (ofport %d)", name, ofport)

    def _port_down(self, ofport: int, name: str) -> None:
        self._counted.clear()
        self.port_names.pop(ofport, None)
        self.port_numbers.pop(name, None)
        self.watched.pop(name, None)
        with self.rt.lock:
            gone = self.rt.control.port_removed(name)
        dp = self.datapath
        for flow in gone:
            self.send(openflow.delete_owned(dp.ofproto_parser, dp.ofproto, flow.cookie, 2**64 - 1))
        self.send(
            openflow.delete_counting_rules(
                dp.ofproto_parser, dp.ofproto, ofport, table=self._counting_table
            )
        )
        self.mac_ports = {mac: port for mac, port in self.mac_ports.items() if port != name}
        LOG.info("port %s left the bridge; %d flows dropped", name, len(gone))

    # -- flow setup: a copy of the first packet is judged here ---------------------------
    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    def _packet_in(self, ev: Any) -> None:
        msg = ev.msg
        dp = msg.datapath
        if dp is not self.datapath:
            return
        in_ofport = msg.match["in_port"]
        in_port = self.port_names.get(in_ofport)
        parsed = openflow.parse_packet(msg.data)
        if parsed is None or in_port is None:
            return
        self.mac_ports[parsed.eth_src] = in_port
        if parsed.eth_type == openflow.ETH_TYPE_ARP or not self.judging:
            # ARP: learnt, and the rule's NORMAL action already forwarded it.
            # Not judging yet: the bridge switched it and a rule counts it.
            return
        match = openflow.flow_match(in_port, parsed)
        if match is None:
            return
        out_port = self.mac_ports.get(parsed.eth_dst) or self._fdb_port(parsed.eth_dst)
        with self.rt.lock:
            flow, new = self.rt.control.flow_seen(match, out_port)
            if new:
                # The bridge switched it (the discovery rule's NORMAL); only the
                # first one is left uncounted by a per-flow rule: see openflow.py.
                self.rt.control.flows.count_packet_in(match, msg.total_len)
        if new:
            if self.rt.pipeline is None:
                rule = openflow.flow_rule(
                    dp.ofproto_parser, dp.ofproto, flow.cookie, in_ofport, match, msg.total_len
                )
            else:  # counts only (Neutron's pipeline forwards), first packet noted
                rule = self.rt.pipeline.flow_rule(
                    dp.ofproto_parser, dp.ofproto, flow.cookie, in_ofport, match, msg.total_len
                )
            self.send(rule)

    def _fdb_port(self, mac: str) -> str | None:
        """Where the bridge's own MAC learning put ``mac`` (hosts whose ARP
        entries predate the app never ARP through it)."""
        try:
            proc = subprocess.run(
                ["ovs-appctl", "--timeout=2", "fdb/show", self.rt.bridge],
                capture_output=True,
                text=True,
                timeout=3,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            LOG.warning("fdb/show %s: %s", self.rt.bridge, exc)
            return None
        for ofport, learned_mac in openflow.parse_fdb(proc.stdout):
            name = self.port_names.get(ofport)
            if name is not None:
                self.mac_ports.setdefault(learned_mac, name)
        return self.mac_ports.get(mac)

    # -- statistics ------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self.rt.stopping.is_set():
            started = time.monotonic()
            try:
                self._request_stats()
            except Exception:
                LOG.exception("statistics poll failed")
            self.rt.stopping.wait(poll_pause(self.rt.poll_interval, time.monotonic() - started))

    def _request_stats(self) -> None:
        dp = self.datapath
        if dp is None or not self.judging:
            return  # the reply would be taken for the read-back's
        if self.rt.stats_reader is not None:
            self._read_stats(dp, self.rt.stats_reader)
            return
        sent = self._stats_sent_at
        patience = STATS_REPLY_PATIENCE * self.rt.poll_interval
        if sent is not None and time.monotonic() - sent < patience:
            return  # the previous poll is still being answered
        self._stats_parts = {}
        self._learned_parts = {}
        self._handoffs_seen = set()
        self._stats_sent_at = time.monotonic()
        self.send(openflow.owned_stats_request(dp.ofproto_parser, dp.ofproto))

    @set_ev_cls(ofp_event.EventOFPFlowStatsReply, MAIN_DISPATCHER)
    def _flow_stats(self, ev: Any) -> None:
        msg = ev.msg
        if msg.datapath is not self.datapath:
            return
        final = self._final_read
        if final is not None and msg.xid == final[0]:
            final[1].extend(msg.body)
            if not msg.flags & msg.datapath.ofproto.OFPMPF_REPLY_MORE:
                final[2].set()
            return
        if self._read_back is not None:
            self._read_back.extend(msg.body)
            if not msg.flags & msg.datapath.ofproto.OFPMPF_REPLY_MORE:
                self._rules_read_back()
            return
        for stat in msg.body:
            self._collect(stat)
        if msg.flags & msg.datapath.ofproto.OFPMPF_REPLY_MORE:
            return
        rule_stats, self._stats_parts = self._stats_parts, {}
        learned_stats, self._learned_parts = self._learned_parts, {}
        self._stats_sent_at = None
        self._apply_poll(msg.datapath, rule_stats, learned_stats)

    def _read_stats(self, dp: Any, reader: stats_reader.FlowStatsReader) -> None:
        """One poll through the reader's own connection, in the poller's thread."""
        try:
            found = self._read_rules(reader)
        except stats_reader.StatsReadError as exc:
            LOG.warning("statistics poll: %s", exc)
            return
        self._stats_parts, self._learned_parts, self._handoffs_seen = {}, {}, set()
        for stat in found:
            self._collect(stat)
        rule_stats, self._stats_parts = self._stats_parts, {}
        learned_stats, self._learned_parts = self._learned_parts, {}
        if dp is self.datapath:  # not reconnected meanwhile
            self._apply_poll(dp, rule_stats, learned_stats)

    def _read_rules(self, reader: stats_reader.FlowStatsReader) -> list[Any]:
        """The flows' rules every poll; their counting rules at most every
        COUNTING_READ_EVERY_S (standalone).  OVS encodes every rule a poll asks
        for in its main thread, which also applies the app's flow-mods and the
        learnt rules: 20k rules every 50 ms starved it (new flows' packets were
        lost).  A counting rule only counts the packets a flow sends before its
        own rule is in (milliseconds), and counts never go down (see
        FlowManager.observe_learned_stats): read later, they are the same.
        Beside Neutron every owned rule is read (the hand-offs are checked)."""
        if self.rt.pipeline is not None:
            return reader.read(flows.COOKIE_PREFIX << 48, flows.COOKIE_MASK, _wants_match)
        kind_mask = flows.COOKIE_MASK | (0xFF << 40)
        found = reader.read(flows.flow_cookie(0), kind_mask, _wants_match)
        now = time.monotonic()
        if now - self._counting_read_at >= COUNTING_READ_EVERY_S:
            found += reader.read(flows.counting_cookie(), kind_mask, _wants_match)
            self._counting_read_at = now
        return found

    def _apply_poll(
        self,
        dp: Any,
        rule_stats: dict[int, FlowCounters],
        learned_stats: dict[FlowMatch, FlowCounters],
    ) -> None:
        self._restore_handoffs()
        with self.rt.lock:
            control = self.rt.control
            try:
                provider_stats = control.provider.stats()
            except OffloadError as exc:
                LOG.error("provider %s statistics: %s", control.provider_name, exc)
                provider_stats = {}
            report = control.poll(rule_stats, provider_stats, learned_stats)
            self._polls += 1
            now = time.monotonic()
            due = len(control.flows) <= STATUS_EVERY_POLL_UP_TO or (
                now - self._status_written_at >= STATUS_BIG_EVERY_S
            )
            status = control.status() if self.rt.status_file and due else None
        if status is not None:  # encoded and written without the lock packet-ins wait for
            self._status_written_at = now
            _write_json(self.rt.status_file, status)
        for flow in report.expired:
            exact = openflow.delete_owned(dp.ofproto_parser, dp.ofproto, flow.cookie, 2**64 - 1)
            self.send(exact)
            ofport = self.ofport_of(flow.match.in_port)
            if ofport is not None:
                self.send(
                    openflow.delete_counting_rules(
                        dp.ofproto_parser, dp.ofproto, ofport, flow.match, self._counting_table
                    )
                )

    def _collect(self, stat: Any) -> None:
        """One rule of a flow-stats reply: a flow's own rule (by the id in its
        cookie) or a counting rule (by its match)."""
        counters = FlowCounters(stat.packet_count, stat.byte_count)
        flow_id = flows.cookie_flow_id(stat.cookie)
        if stat.table_id == flows.FLOW_TABLE:
            self._handoffs_seen.add(stat.cookie)
        if flow_id is not None:
            self._stats_parts[flow_id] = counters
        elif flows.is_counting_cookie(stat.cookie):
            match = self._counted_match(stat)
            if match is not None:
                self._learned_parts[match] = counters

    def _counted_match(self, stat: Any) -> FlowMatch | None:
        """The flow a counting rule counts for, memoised by the rule's raw match
        (the reader's): building and validating 10k FlowMatches was a tenth of
        every poll.  Cleared whenever a port comes or goes."""
        key = getattr(stat, "match_key", b"")
        if key and key in self._counted:
            return self._counted[key]
        port = self.port_names.get(stat.match.get("in_port"))
        match = openflow.counted_match(stat.match, port)
        if key:
            if len(self._counted) > COUNTED_MEMO_MAX:
                self._counted.clear()
            self._counted[key] = match
        return match

    def _restore_handoffs(self) -> None:
        """Beside Neutron: re-add the hand-off rules Neutron's resync deleted (it
        cleans its tables of every cookie it did not reserve)."""
        if self.rt.pipeline is None or self.datapath is None:
            return
        for ofport in neutron.missing_handoffs(self.watched, self._handoffs_seen):
            LOG.warning("hand-off rule of ofport %d gone (Neutron resync?): re-added", ofport)
            for mod in self._port_rules(ofport):
                self.send(mod)

    # -- helpers ------------------------------------------------------------------------
    @property
    def _counting_table(self) -> int:
        pipeline = self.rt.pipeline
        return flows.COUNTING_TABLE if pipeline is None else pipeline.counting_table

    def _port_rules(self, ofport: int) -> list[Any]:
        dp = self.datapath
        if self.rt.pipeline is not None:
            return self.rt.pipeline.port_rules(dp.ofproto_parser, dp.ofproto, ofport)
        return openflow.discovery_rules(dp.ofproto_parser, dp.ofproto, ofport)

    def send(self, msg: Any) -> None:
        dp = self.datapath
        if dp is None:
            return
        msg.datapath = dp
        dp.send_msg(msg)

    def ofport_of(self, name: str | None) -> int | None:
        return None if name is None else self.port_numbers.get(name)

    def read_rules(self, timeout: float) -> list[Any] | None:
        """The statistics of every rule the app owns, read now (a clean stop's
        final counts; the poller is stopped); None if OVS did not answer in time."""
        dp = self.datapath
        if dp is None:
            return None
        request = openflow.owned_stats_request(dp.ofproto_parser, dp.ofproto)
        dp.set_xid(request)
        parts: list[Any] = []
        done = threading.Event()
        self._final_read = (request.xid, parts, done)
        self.send(request)
        answered = done.wait(timeout)
        self._final_read = None
        return parts if answered else None

    def remove_judging_rules(self, timeout: float) -> bool:
        """At exit: every flow back to the NORMAL table-miss rule; True once OVS confirmed."""
        dp = self.datapath
        if dp is None:
            return False
        self._barrier_done.clear()
        if self.rt.pipeline is not None:  # Neutron's rules switch everything
            self.send(openflow.delete_owned(dp.ofproto_parser, dp.ofproto))
        for mod in openflow.delete_judging_rules(dp.ofproto_parser, dp.ofproto):
            self.send(mod)
        self.send(dp.ofproto_parser.OFPBarrierRequest(dp))
        return self._barrier_done.wait(timeout)

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    def _barrier_reply(self, ev: Any) -> None:
        then = self._settle_xids.pop(ev.msg.xid, None)
        if then is not None:
            if ev.msg.datapath is self.datapath:
                then()
            return
        self._barrier_done.set()


def poll_pause(interval: float, took: float) -> float:
    """The pause before the next poll: what is left of the interval, but never
    less than the poll took.  A poll of a big table makes ovs-vswitchd's main
    thread encode every rule, and that thread also forwards (the userspace
    datapath) and applies flow-mods: polls back to back on a loaded host kept it
    from doing either (docs/benchmarks/offload-load.md).

    >>> poll_pause(0.1, 0.02), poll_pause(0.1, 0.4)
    (0.08, 0.4)
    """
    return max(interval - took, took)


def _wants_match(_table: int, cookie: int) -> bool:
    """A counting rule is known by its match; every other rule by its cookie."""
    return flows.is_counting_cookie(cookie)


def _name(raw: bytes | str) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw


# The poller writes the status file outside the control lock, the control
# interface (a migration's steps) too: one writer at a time, or one's rename
# takes the other's temporary file away (FileNotFoundError in a migration's
# finish, found by the fault campaign).
_WRITE_LOCK = threading.Lock()


def _write_json(path: str, data: object) -> None:
    target = Path(path)
    # Indented for a person while small; compact when big (3x faster to encode:
    # 10k flows took 0.3 s indented, with the interpreter lock held).
    big = isinstance(data, dict) and len(data.get("flows", ())) > STATUS_INDENT_UP_TO
    text = json.dumps(data, separators=(",", ":")) if big else json.dumps(data, indent=1)
    with _WRITE_LOCK:
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(target)


def write_status(path: str, data: object) -> None:
    """The status file, replaced whole (readers never see half of it)."""
    _write_json(path, data)
