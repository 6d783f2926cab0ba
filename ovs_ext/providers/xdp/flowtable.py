"""The eSwitch's flow table as bytes: packing keys and actions, no I/O.

The layout is ``bpf/eswitch.h``'s.  Addresses and ports are kept in network
byte order (as the program reads them off the wire); ifindexes are host
order.  Per-CPU values come back as one record per possible CPU, each padded
to 8 bytes; :func:`sum_counters` folds them.
"""

from __future__ import annotations

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


def unpack_key(raw: bytes, ifname_of: dict[int, str]) -> FlowMatch | None:
    """The match of a key, or None when its ingress port is no longer known."""
    in_ifindex, src, dst, sport, dport, proto = KEY.unpack(raw)
    in_port = ifname_of.get(in_ifindex)
    if in_port is None:
        return None
    return FlowMatch(
        in_port=in_port,
        ip_proto=proto,
        ipv4_src=socket.inet_ntoa(src),
        ipv4_dst=socket.inet_ntoa(dst),
        tp_src=int.from_bytes(sport, "big"),
        tp_dst=int.from_bytes(dport, "big"),
    )


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
    packets = total_bytes = 0
    stride = percpu_value_size(1)
    for cpu in range(cpus):
        _, _, cpu_packets, cpu_bytes = ACTION.unpack_from(value, cpu * stride)
        packets += cpu_packets
        total_bytes += cpu_bytes
    return FlowCounters(packets, total_bytes)


def split_records(blob: bytes, size: int, count: int) -> list[bytes]:
    """The ``count`` fixed-size records of a batch buffer."""
    return [blob[i * size : (i + 1) * size] for i in range(count)]


def join_records(records: Sequence[bytes]) -> bytes:
    return b"".join(records)
