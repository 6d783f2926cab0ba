"""One OpenFlow connection's protocol logic: bytes in, reply bytes out, no I/O.

The server feeds received bytes and pulls replies when the socket can take
them; replies to a large flow dump are produced lazily, so a slow reader holds
a bounded amount of memory.  Read-only by construction: every message that
would change a switch is answered with an error and has no other effect.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from flexmig import exceptions
from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import codec, codec10, ofp13, selection
from ovs_ext.openflow_stats.codec import OpenFlowError
from ovs_ext.openflow_stats.dumps import SharedDumps
from ovs_ext.openflow_stats.ofp13 import BadRequestCode, ErrorType, MsgType, MultipartType

LOG = logging.getLogger("flexmig.ovs_ext.openflow_stats")

RecordSource = Callable[[], Iterable[FlowRecord]]
PortNameSource = Callable[[], Mapping[int, str]]

# OpenFlow 1.3 (what FlexMig's os-ken app speaks, "-O OpenFlow13") and 1.0
# (what ovs-ofctl uses when given no -O: it enables only 1.0 by default).
# With both, "-O OpenFlow10,OpenFlow13" or any list holding either negotiates;
# 1.1, 1.2, 1.4 and 1.5 alone fail negotiation with a message naming these.
OFP10 = codec10.OFP10_VERSION
SUPPORTED_VERSIONS = frozenset({OFP10, ofp13.OFP_VERSION})
VERSION_NAMES = {1: "1.0", 2: "1.1", 3: "1.2", 4: "1.3", 5: "1.4", 6: "1.5"}
MESSAGE_ERROR = 1  # OFPT_ERROR in every version

# What each served message type is, per version.
M10 = codec10.MsgType
MESSAGE_KINDS = {
    OFP10: {
        M10.HELLO: "ignore", M10.ERROR: "ignore", M10.ECHO_REPLY: "ignore",
        M10.ECHO_REQUEST: "echo", M10.BARRIER_REQUEST: "barrier",
        M10.FEATURES_REQUEST: "features", M10.GET_CONFIG_REQUEST: "get_config",
        M10.STATS_REQUEST: "stats",
    },
    ofp13.OFP_VERSION: {
        MsgType.HELLO: "ignore", MsgType.ERROR: "ignore", MsgType.ECHO_REPLY: "ignore",
        MsgType.ECHO_REQUEST: "echo", MsgType.BARRIER_REQUEST: "barrier",
        MsgType.FEATURES_REQUEST: "features", MsgType.GET_CONFIG_REQUEST: "get_config",
        MsgType.MULTIPART_REQUEST: "stats",
    },
}  # fmt: skip
REPLY_TYPES = {
    OFP10: {"echo": M10.ECHO_REPLY, "barrier": M10.BARRIER_REPLY,
            "get_config": M10.GET_CONFIG_REPLY},
    ofp13.OFP_VERSION: {"echo": MsgType.ECHO_REPLY, "barrier": MsgType.BARRIER_REPLY,
                        "get_config": MsgType.GET_CONFIG_REPLY},
}  # fmt: skip
BODYLESS = ("barrier", "features", "get_config")
STATS_KINDS_10 = {
    codec10.StatsType.DESC: "desc", codec10.StatsType.TABLE: "tables",
    codec10.StatsType.FLOW: "flow", codec10.StatsType.AGGREGATE: "aggregate",
}  # fmt: skip
STATS_KINDS_13 = {
    MultipartType.DESC: "desc", MultipartType.PORT_DESC: "ports",
    MultipartType.TABLE_FEATURES: "tables", MultipartType.FLOW: "flow",
    MultipartType.AGGREGATE: "aggregate",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EndpointInfo:
    """What the endpoint says about itself in FEATURES and DESC replies."""

    datapath_id: int = 0
    n_tables: int = 254
    descriptions: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: {
            "mfr": "FlexMig",
            "hw": "offload statistics endpoint",
            "sw": "flexmig ovs_ext.openflow_stats",
            "serial": "None",
            "dp": "offloaded and onloaded flows of br-int",
        }
    )


def _versions_text(versions: Iterable[int]) -> str:
    return ", ".join(f"OpenFlow {VERSION_NAMES.get(v, hex(v))}" for v in sorted(versions))


class Session:
    """The protocol state of one connection."""

    def __init__(
        self,
        records: RecordSource,
        port_names: PortNameSource | None = None,
        info: EndpointInfo | None = None,
        peer: str = "?",
        dumps: SharedDumps | None = None,
    ) -> None:
        self._records = records
        self._dumps = dumps  # answers shared with the other connections
        self._port_names = port_names
        self._info = info or EndpointInfo()
        self._peer = peer
        self._inbuf = bytearray()
        self._replies: collections.deque[Iterator[bytes]] = collections.deque()
        self._version = 0  # negotiated OpenFlow version; 0 until HELLO
        # Set after an error the connection cannot continue from (lost
        # framing, failed HELLO): queued output is sent, then it is closed.
        self.closing = False
        self._replies.append(iter([codec.encode_hello(SUPPORTED_VERSIONS)]))

    def feed(self, data: bytes) -> None:
        if not self.closing:
            self._inbuf += data

    def wants_input(self) -> bool:
        """True when every received message has been answered."""
        return not self.closing and not self._replies and not self._complete_message()

    def has_work(self) -> bool:
        return bool(self._replies) or (not self.closing and self._complete_message())

    def pull_output(self, limit: int) -> bytes:
        """Up to about ``limit`` bytes of replies (whole messages)."""
        out = bytearray()
        while len(out) < limit:
            if self._replies:
                message = next(self._replies[0], None)
                if message is None:
                    self._replies.popleft()
                else:
                    out += message
            elif self.closing or not self._handle_next_message():
                break
        return bytes(out)

    # ------------------------------------------------------------ parsing

    def _complete_message(self) -> bool:
        if len(self._inbuf) < ofp13.HEADER_LEN:
            return False
        header = codec.parse_header(self._inbuf)
        if not self._version and header.msg_type != MsgType.HELLO:
            return True  # refused on its header alone: no need to wait for a body
        return header.length < ofp13.HEADER_LEN or len(self._inbuf) >= header.length

    def _handle_next_message(self) -> bool:
        """Answer one complete message; False if none is complete yet."""
        if not self._complete_message():
            return False
        header = codec.parse_header(self._inbuf)
        if header.length < ofp13.HEADER_LEN:
            # No way to find the next message: report and hang up.
            self._fail(header, bytes(self._inbuf[: ofp13.HEADER_LEN]), ErrorType.BAD_REQUEST,
                       BadRequestCode.BAD_LEN, f"header length {header.length} < 8")  # fmt: skip
            return True
        message = bytes(self._inbuf[: header.length])
        del self._inbuf[: header.length]
        try:
            if self._version:
                self._dispatch(header, message)
            else:
                self._negotiate(header, message)
        except OpenFlowError as exc:
            LOG.info("OpenFlow stats: %s sent a bad message: %s", self._peer, exc)
            version = self._error_version(header.version)
            self._queue(codec.encode_error(exc.err_type, exc.code, header.xid, message, version))
        return True

    def _fail(
        self, header: codec.Header, data: bytes, err_type: int, code: int, reason: str
    ) -> None:
        LOG.info("OpenFlow stats: closing %s: %s", self._peer, reason)
        version = self._error_version(header.version)
        self._queue(codec.encode_error(err_type, code, header.xid, data, version))
        self.closing = True
        self._inbuf.clear()

    def _error_version(self, peer_version: int) -> int:
        """Errors go out in the negotiated version; before that, in one the
        peer can parse (its own, when we speak it)."""
        if self._version:
            return self._version
        return peer_version if peer_version in SUPPORTED_VERSIONS else ofp13.OFP_VERSION

    def _queue(self, *messages: bytes) -> None:
        self._replies.append(iter(messages))

    def _negotiate(self, header: codec.Header, message: bytes) -> None:
        if header.msg_type != MsgType.HELLO:
            reason = f"expected HELLO first, got message type {header.msg_type}"
            self._fail(header, reason.encode(), ErrorType.HELLO_FAILED,
                       ofp13.HelloFailedCode.INCOMPATIBLE, reason)  # fmt: skip
            return
        offered = codec.decode_hello_versions(message)
        if not offered & SUPPORTED_VERSIONS:
            reason = (
                f"We support {_versions_text(SUPPORTED_VERSIONS)}, you support "
                f"{_versions_text(offered)}, no common versions."
            )
            self._fail(header, reason.encode(), ErrorType.HELLO_FAILED,
                       ofp13.HelloFailedCode.INCOMPATIBLE, reason)  # fmt: skip
            return
        self._version = max(offered & SUPPORTED_VERSIONS)

    # ------------------------------------------------------------ dispatch

    def _dispatch(self, header: codec.Header, message: bytes) -> None:
        version = self._version
        if header.version != version:
            raise OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_VERSION,
                                f"version {header.version}, negotiated {version}")  # fmt: skip
        kind = MESSAGE_KINDS[version].get(header.msg_type)
        if kind is None:
            raise (codec10.refusal if version == OFP10 else _refusal13)(header.msg_type)
        if kind in BODYLESS and header.length != ofp13.HEADER_LEN:
            raise codec.bad_len(f"message type {header.msg_type} with a body")
        replies = REPLY_TYPES[version]
        if kind == "echo":
            self._queue(codec.encode_message(replies["echo"], header.xid, message[8:], version))
        elif kind == "barrier":
            self._queue(codec.encode_message(replies["barrier"], header.xid, b"", version))
        elif kind == "get_config":
            body = (0).to_bytes(2, "big") + ofp13.OFPCML_NO_BUFFER.to_bytes(2, "big")
            self._queue(codec.encode_message(replies["get_config"], header.xid, body, version))
        elif kind == "features":
            self._queue(self._features_reply(header.xid))
        elif kind == "stats":
            self._stats(header, message)
        elif header.msg_type == MESSAGE_ERROR:
            LOG.info("OpenFlow stats: %s sent an error", self._peer)

    def _features_reply(self, xid: int) -> bytes:
        info = self._info
        if self._version == OFP10:
            ports = self._port_names() if self._port_names else {}
            return codec10.encode_features_reply(xid, info.datapath_id, info.n_tables, ports)
        return codec.encode_features_reply(xid, info.datapath_id, info.n_tables)

    def _stats(self, header: codec.Header, message: bytes) -> None:
        if self._version == OFP10:
            stats_type, _flags = codec10.decode_stats_header(message)
            body_at, kinds = codec10.STATS_HEADER_LEN, STATS_KINDS_10
            decode_request = codec10.decode_flow_stats_request
            encode_entry = codec10.encode_flow_stats_entry
            encode_replies = codec10.encode_stats_replies
        else:
            stats_type, flags = codec.decode_multipart_header(message)
            if flags & ofp13.OFPMPF_REQ_MORE:
                # Every request this endpoint serves fits in one message.
                raise OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_MULTIPART,
                                    "multipart request continuation is not supported")  # fmt: skip
            body_at, kinds = ofp13.MULTIPART_HEADER_LEN, STATS_KINDS_13
            decode_request = codec.decode_flow_stats_request
            encode_entry = codec.encode_flow_stats_entry
            encode_replies = codec.encode_multipart_replies
        kind = kinds.get(stats_type)
        if kind is None:
            raise OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_MULTIPART,
                                f"statistics type {stats_type} is not served")  # fmt: skip
        if kind in ("desc", "ports", "tables") and header.length != body_at:
            raise codec.bad_len(f"statistics request type {stats_type} with a body")
        parts: Iterable[bytes]
        if kind == "desc":
            parts = [codec.encode_desc_body(self._info.descriptions)]
        elif kind == "ports":
            parts = self._port_parts()
        elif kind == "tables":
            parts = self._table_parts()
        else:  # flow or aggregate: decoded first, so a bad request is never kept
            request = decode_request(message)

            def answer() -> Iterable[bytes]:
                selected = selection.select(request, self._records())
                if kind == "aggregate":
                    return [_aggregate_body(selected)]
                return _encoded(selected, encode_entry)

            if self._dumps is not None:
                # The request without its header (xid): equal bodies, equal answers.
                key = (self._version, bytes(message[ofp13.HEADER_LEN :]))
                parts = self._dumps.answer(key, lambda: list(answer()))
            else:
                parts = answer()
        self._replies.append(encode_replies(stats_type, header.xid, parts))

    def _table_parts(self) -> list[bytes]:
        """Tables have no names or statistics here.  OpenFlow 1.0's table
        statistics reply may be empty; a 1.3 table-features reply needs an
        entry (OVS rejects an empty one), so each table in use gets one."""
        if self._version == OFP10:
            return []
        tables = sorted({record.table_id for record in self._records()} & set(range(255)))
        return [codec.encode_table_features(table_id) for table_id in tables or [0]]

    def _port_parts(self) -> list[bytes]:
        names = self._port_names() if self._port_names else {}
        return [
            codec.encode_port(port_no, name)
            for port_no, name in sorted(names.items())
            if 1 <= port_no <= 0xFEFF
        ]


def _refusal13(msg_type: int) -> OpenFlowError:
    if msg_type == MsgType.FLOW_MOD:
        return OpenFlowError(ErrorType.FLOW_MOD_FAILED, ofp13.FlowModFailedCode.EPERM,
                             "the statistics endpoint is read-only")  # fmt: skip
    if msg_type in ofp13.STATE_CHANGING:
        return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.EPERM,
                             f"message type {msg_type} would change state; read-only")  # fmt: skip
    if msg_type == MsgType.EXPERIMENTER:
        return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_EXPERIMENTER,
                             "no experimenter messages are served")  # fmt: skip
    return OpenFlowError(ErrorType.BAD_REQUEST, BadRequestCode.BAD_TYPE,
                         f"message type {msg_type} is not served")  # fmt: skip


def _valid(records: Iterable[FlowRecord]) -> Iterator[FlowRecord]:
    """Records that can be shown; a bad one is logged and left out so it
    cannot hide the others."""
    for record in records:
        try:
            codec.check_record(record)
        except exceptions.InvalidInput as exc:
            LOG.warning("OpenFlow stats: not showing %r: %s", record, exc)
            continue
        yield record


def _encoded(
    records: Iterable[FlowRecord], encode: Callable[[FlowRecord], bytes]
) -> Iterator[bytes]:
    """Each record's flow-stats entry; a bad record is logged and left out."""
    for record in records:
        try:
            yield encode(record)
        except exceptions.InvalidInput as exc:
            LOG.warning("OpenFlow stats: not showing %r: %s", record, exc)


def _aggregate_body(records: Iterable[FlowRecord]) -> bytes:
    packets = byte_count = flows = 0
    for record in _valid(records):
        packets += record.packets
        byte_count += record.bytes
        flows += 1
    return codec.encode_aggregate_body(packets, byte_count, flows)
