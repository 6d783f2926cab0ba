"""The app's rule counters read straight from the bridge, parsed only as far as needed.

A statistics poll of 10k flows is a 20k-entry flow-stats reply (each flow's
rule and its counting rule).  os-ken parses every entry into objects (match,
instructions: ~60 us each), 1.2 s per poll on the development machine, in the
thread that also takes packet-ins: promotion was detected seconds late and new
flows waited (docs/benchmarks/offload-load.md).  This reader asks the bridge's
management socket (the one ``ovs-ofctl`` uses) for the same statistics on a
connection of its own and reads, per entry, only the table, cookie, counters
and the few match fields a counting rule is known by.  The read-back at
connection and the final read at a clean stop still go through os-ken: they
need the rules' instructions (the first-packet note).
"""

from __future__ import annotations

import socket
import struct
from typing import Any, NamedTuple

OFP_VERSION = 4  # OpenFlow 1.3
OFPT_HELLO, OFPT_ERROR, OFPT_ECHO_REQUEST, OFPT_ECHO_REPLY = 0, 1, 2, 3
OFPT_MULTIPART_REQUEST, OFPT_MULTIPART_REPLY = 18, 19
OFPMP_FLOW = 1
OFPMPF_REPLY_MORE = 1
OFPTT_ALL, OFPP_ANY, OFPG_ANY = 0xFF, 0xFFFFFFFF, 0xFFFFFFFF
OFPXMC_OPENFLOW_BASIC = 0x8000
HEADER = struct.Struct("!BBHI")
MULTIPART = struct.Struct("!HH4x")
FLOW_REQUEST = struct.Struct("!B3xII4xQQ")
EMPTY_MATCH = struct.pack("!HH4x", 1, 4)  # OFPMT_OXM, no fields, padded to 8
ENTRY = struct.Struct("!HBxIIHHHH4xQQQ")  # ofp_flow_stats up to its match
MATCH_HEAD = struct.Struct("!HH")
OXM_HEAD = struct.Struct("!HBB")
# OXM basic fields a counting rule is matched on, by os-ken's names.
OXM_FIELDS = {0: "in_port", 5: "eth_type", 10: "ip_proto", 11: "ipv4_src", 12: "ipv4_dst",
              13: "tcp_src", 14: "tcp_dst", 15: "udp_src", 16: "udp_dst"}  # fmt: skip
MAX_MESSAGE = 65535
MAX_DECODED = 100_000  # matches memoised between polls (a few per tracked flow)


class StatsReadError(OSError):
    """The bridge could not be asked or answered something else."""


class RuleStats(NamedTuple):
    """One rule of a flow-stats reply, as the app's ``_collect`` reads it (a
    tuple: a poll builds 20k of them, and a frozen dataclass's init was a third
    of the parse)."""

    table_id: int
    cookie: int
    packet_count: int
    byte_count: int
    match: dict[str, Any]
    # The match's raw OXM bytes when decoded (b"" otherwise): the same rule has
    # the same bytes every poll, so callers can memoise what they make of it.
    match_key: bytes = b""


def flow_stats_request(xid: int, cookie: int, cookie_mask: int) -> bytes:
    """OFPMP_FLOW for every table, any port, rules whose cookie matches."""
    body = MULTIPART.pack(OFPMP_FLOW, 0)
    body += FLOW_REQUEST.pack(OFPTT_ALL, OFPP_ANY, OFPG_ANY, cookie, cookie_mask) + EMPTY_MATCH
    return HEADER.pack(OFP_VERSION, OFPT_MULTIPART_REQUEST, HEADER.size + len(body), xid) + body


def match_fields(raw: bytes, offset: int, length: int) -> dict[str, Any]:
    """The exact (unmasked) OXM basic fields of an ofp_match this reader knows."""
    fields: dict[str, Any] = {}
    end, at = offset + length, offset + MATCH_HEAD.size
    while at + OXM_HEAD.size <= end:
        oxm_class, field_mask, size = OXM_HEAD.unpack_from(raw, at)
        value = raw[at + OXM_HEAD.size : at + OXM_HEAD.size + size]
        at += OXM_HEAD.size + size
        name = OXM_FIELDS.get(field_mask >> 1)
        if oxm_class != OFPXMC_OPENFLOW_BASIC or field_mask & 1 or name is None:
            continue
        if size == 4 and name.startswith("ipv4"):
            fields[name] = socket.inet_ntoa(value)
        else:
            fields[name] = int.from_bytes(value, "big")
    return fields


def parse_flow_stats(
    body: bytes,
    wants_match: Any = lambda table, cookie: True,
    decoded: dict[bytes, dict[str, Any]] | None = None,
) -> list[RuleStats]:
    """The entries of one OFPMP_FLOW reply body; matches decoded only where
    ``wants_match(table, cookie)`` (a flow's rule is known by its cookie alone).
    ``decoded`` memoises matches by their raw bytes across replies (callers
    bound its size); the dicts it holds are shared: read them only."""
    found, offset, end = [], 0, len(body)
    memo = {} if decoded is None else decoded
    unpack_entry, unpack_match = ENTRY.unpack_from, MATCH_HEAD.unpack_from
    while offset + ENTRY.size <= end:
        length, table, _sec, _nsec, _prio, _idle, _hard, _flags, cookie, packets, nbytes = (
            unpack_entry(body, offset)
        )
        if length < ENTRY.size or offset + length > end:
            raise StatsReadError(f"flow-stats entry of {length} bytes at {offset}")
        if wants_match(table, cookie):
            at = offset + ENTRY.size
            raw = body[at : at + unpack_match(body, at)[1]]
            fields = memo.get(raw)
            if fields is None:
                fields = memo[raw] = match_fields(raw, 0, len(raw))
            found.append(RuleStats(table, cookie, packets, nbytes, fields, raw))
        else:
            found.append(RuleStats(table, cookie, packets, nbytes, {}))
        offset += length
    return found


class FlowStatsReader:
    """One connection to the bridge's management socket, kept between polls."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._xid = 0
        self._decoded: dict[bytes, dict[str, Any]] = {}

    def read(self, cookie: int, cookie_mask: int, wants_match: Any) -> list[RuleStats]:
        """Every rule whose cookie matches; StatsReadError (connection closed) on failure."""
        try:
            sock = self._connected()
            self._xid = (self._xid + 1) & 0xFFFFFFFF
            sock.sendall(flow_stats_request(self._xid, cookie, cookie_mask))
            if len(self._decoded) > MAX_DECODED:  # rules come and go: start over
                self._decoded = {}
            found: list[RuleStats] = []
            while True:
                kind, xid, body = self._message(sock)
                if kind == OFPT_ECHO_REQUEST:
                    reply = HEADER.pack(OFP_VERSION, OFPT_ECHO_REPLY, HEADER.size + len(body), xid)
                    sock.sendall(reply + body)
                    continue
                if kind == OFPT_ERROR:
                    raise StatsReadError(f"the bridge refused the request: {body[:8].hex()}")
                if kind != OFPT_MULTIPART_REPLY or xid != self._xid:
                    continue  # nothing else is asked on this connection
                part, flags = MULTIPART.unpack_from(body)[:2]
                if part == OFPMP_FLOW:
                    found += parse_flow_stats(body[MULTIPART.size :], wants_match, self._decoded)
                if not flags & OFPMPF_REPLY_MORE:
                    return found
        except (OSError, struct.error) as exc:
            self.close()
            raise StatsReadError(f"flow statistics from {self.path}: {exc}") from exc

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connected(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
                sock.sendall(HEADER.pack(OFP_VERSION, OFPT_HELLO, HEADER.size, 0))
                kind, _xid, _body = self._message(sock)
            except OSError:
                sock.close()
                raise
            if kind != OFPT_HELLO:
                sock.close()
                raise StatsReadError(f"{self.path} answered {kind}, not a hello")
            self._sock = sock
        return self._sock

    @staticmethod
    def _message(sock: socket.socket) -> tuple[int, int, bytes]:
        head = _read_exactly(sock, HEADER.size)
        _version, kind, length, xid = HEADER.unpack(head)
        if length < HEADER.size:
            raise StatsReadError(f"message of {length} bytes")
        return kind, xid, _read_exactly(sock, length - HEADER.size)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, MAX_MESSAGE))
        if not chunk:
            raise StatsReadError("the bridge closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
