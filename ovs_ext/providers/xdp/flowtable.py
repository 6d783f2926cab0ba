"""The eSwitch's flow table as bytes: packing keys and actions, no I/O.

The layout is ``bpf/eswitch.h``'s.  Addresses and ports are kept in network
byte order (as the program reads them off the wire); ifindexes are host
order.  Per-CPU values come back as one record per possible CPU, each padded
to 8 bytes; :func:`sum_counters` folds them.
"""

from __future__ import annotations

import operator
import socket
import struct
from collections.abc import Sequence

from ovs_ext.providers.base import FlowCounters, FlowMatch

# in_ifindex, saddr, daddr, sport, dport, proto, pad[3]
KEY = struct.Struct("=I4s4s2s2sB3x")
# out_ifindex, pad, packets, bytes
ACTION = struct.Struct("=IIQQ")
PORT = struct.Struct("=I")
# Sizes pinned by tests/unit against eswitch.h: key 20 bytes, action 24.


def pack_key(match: FlowMatch, in_ifindex: int) -> bytes:
    """The map key of a match whose in_port has ``in_ifindex``.

    >>> from ovs_ext.providers.base import FlowMatch
    >>> m = FlowMatch("veth0", 17, "10.0.0.1", "10.0.0.2", 1000, 53)
    >>> pack_key(m, 7).hex()
    '070000000a0000010a00000203e8003511000000'
    """
    return KEY.pack(
        in_ifindex,
        socket.inet_aton(match.ipv4_src),
        socket.inet_aton(match.ipv4_dst),
        match.tp_src.to_bytes(2, "big"),
        match.tp_dst.to_bytes(2, "big"),
        match.ip_proto,
    )


# in_ifindex, saddr, daddr, sport, dport, proto: ports read big-endian directly.
_KEY_FIELDS = struct.Struct("=I4s4s")
_KEY_PORTS = struct.Struct("!HHB")


def unpack_key(raw: bytes, ifname_of: dict[int, str]) -> FlowMatch | None:
    """The match of a key, or None when its ingress port is no longer known.

    Keys come back from the kernel exactly as :func:`pack_key` wrote them, so
    the match is built without FlowMatch's validation, which would cost more
    than the whole batch read for 100k flows.

    >>> unpack_key(bytes.fromhex("070000000a0000010a00000203e8003511000000"), {7: "veth0"})
    FlowMatch(in_port='veth0', ip_proto=17, ipv4_src='10.0.0.1', ipv4_dst='10.0.0.2', \
tp_src=1000, tp_dst=53)
    """
    in_ifindex, src, dst = _KEY_FIELDS.unpack_from(raw)
    in_port = ifname_of.get(in_ifindex)
    if in_port is None:
        return None
    sport, dport, proto = _KEY_PORTS.unpack_from(raw, _KEY_FIELDS.size)
    match = object.__new__(FlowMatch)
    # A frozen dataclass refuses setattr, not its __dict__: one update, no validation.
    match.__dict__.update(
        in_port=in_port,
        ip_proto=proto,
        ipv4_src=socket.inet_ntoa(src),
        ipv4_dst=socket.inet_ntoa(dst),
        tp_src=sport,
        tp_dst=dport,
    )
    return match


def split_keys(blob: bytes, count: int) -> list[bytes]:
    size = KEY.size
    return [blob[i : i + size] for i in range(0, count * size, size)]


def percpu_value_size(cpus: int) -> int:
    """Bytes of one per-CPU value as userspace reads and writes it."""
    return ((ACTION.size + 7) // 8) * 8 * cpus


def pack_new_action(out_ifindex: int, cpus: int) -> bytes:
    """A fresh entry: same egress on every CPU, counters at zero."""
    return ACTION.pack(out_ifindex, 0, 0, 0) * cpus


def out_ifindex(value: bytes) -> int:
    return ACTION.unpack_from(value, 0)[0]


def sum_counters(value: bytes, cpus: int) -> FlowCounters:
    """Fold a per-CPU value into one flow's totals.

    >>> v = ACTION.pack(3, 0, 10, 1000) + ACTION.pack(3, 0, 5, 500)
    >>> sum_counters(v, 2)
    FlowCounters(packets=15, bytes=1500)
    """
    return sum_all_counters(value, 1, cpus)[0]


def sum_all_counters(values: bytes, count: int, cpus: int) -> list[FlowCounters]:
    """Fold a batch of ``count`` per-CPU values, in order (strided views, no loop per entry).

    >>> v = ACTION.pack(3, 0, 1, 60) * 2 + ACTION.pack(4, 0, 2, 120) * 2
    >>> sum_all_counters(v, 2, 2)
    [FlowCounters(packets=2, bytes=120), FlowCounters(packets=4, bytes=240)]
    """
    words = memoryview(values).cast("Q")[: count * 3 * cpus]  # ACTION: three 8-byte words
    stride = 3 * cpus
    packets: list[int] = words[1::stride].tolist()
    total_bytes: list[int] = words[2::stride].tolist()
    for cpu in range(1, cpus):
        packets = list(map(operator.add, packets, words[3 * cpu + 1 :: stride].tolist()))
        total_bytes = list(map(operator.add, total_bytes, words[3 * cpu + 2 :: stride].tolist()))
    return list(map(FlowCounters, packets, total_bytes))


def split_records(blob: bytes, size: int, count: int) -> list[bytes]:
    """The ``count`` fixed-size records of a batch buffer."""
    return [blob[i * size : (i + 1) * size] for i in range(count)]


def join_records(records: Sequence[bytes]) -> bytes:
    return b"".join(records)
