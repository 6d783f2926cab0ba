"""flowgen: many short UDP flows, new ones arriving at a steady rate.

    python -m flexmig_lab.traffic.flowgen --src IP --dst IP --port N
        --first-sport N --flows N --per-flow K --flows-per-s R

Flow i is the 5-tuple (src, first_sport + i, dst, port): it starts with a burst
of K datagrams back to back (as real flows start), and a new flow starts every
1/R s.  udpgen sends one flow per socket; a raw IP socket lets one process
start thousands of flows a second with any source port.  Prints one JSON
object: flows, packets, seconds, and how late the last flow started (behind
its schedule: the generator could not keep the rate).
"""

from __future__ import annotations

import argparse
import errno
import json
import socket
import struct
import sys
import time

PAYLOAD = b"\0" * 18  # 64-byte Ethernet frames, as udpgen's default


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def datagram(src: str, dst: str, sport: int, dport: int) -> bytes:
    """An IPv4 + UDP datagram (UDP checksum 0: optional over IPv4)."""
    udp = struct.pack("!HHHH", sport, dport, 8 + len(PAYLOAD), 0) + PAYLOAD
    header = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), sport, 0x4000, 64, socket.IPPROTO_UDP, 0,
        socket.inet_aton(src), socket.inet_aton(dst),
    )  # fmt: skip
    header = header[:10] + struct.pack("!H", _checksum(header)) + header[12:]
    return header + udp


def run(args: argparse.Namespace) -> dict[str, float]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    start = time.monotonic()
    packets, late = 0, 0.0
    for i in range(args.flows):
        due = start + i / args.flows_per_s
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        else:
            late = -wait
        frame = datagram(args.src, args.dst, args.first_sport + i, args.port)
        for _ in range(args.per_flow):
            while True:
                try:
                    sock.sendto(frame, (args.dst, 0))
                    break
                except OSError as exc:  # ENOBUFS/EAGAIN: the datagram did not leave
                    if exc.errno not in (errno.ENOBUFS, errno.EAGAIN):
                        raise
                    time.sleep(0.0005)
            packets += 1
    return {
        "flows": args.flows,
        "packets": packets,
        "seconds": round(time.monotonic() - start, 3),
        "last_flow_late_s": round(late, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowgen", description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True)
    parser.add_argument("--dst", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-sport", type=int, default=20000)
    parser.add_argument("--flows", type=int, required=True)
    parser.add_argument("--per-flow", type=int, default=3)
    parser.add_argument("--flows-per-s", type=float, default=1000.0)
    args = parser.parse_args(argv)
    if not 0 < args.first_sport <= args.first_sport + args.flows - 1 <= 0xFFFF:
        parser.error("first-sport + flows must stay within source ports 1..65535")
    if args.per_flow < 1 or args.flows_per_s <= 0:
        parser.error("per-flow >= 1 and flows-per-s > 0")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
