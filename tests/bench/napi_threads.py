"""The threaded-NAPI kthreads of given interfaces, asked of the kernel itself.

    python tests/bench/napi_threads.py IFNAME...   (inside the interfaces' netns)

prints {"ifname": [pid, ...]}.  Kthread names ("napi/<dev>-<id>") carry no
namespace, so on a machine where several labs have a ``phy0`` only the
kernel's netdev netlink family (NAPI_GET, Linux 6.8+) says which thread is
ours: it dumps the NAPI instances of an ifindex of the caller's namespace,
each with its thread's PID.
"""

from __future__ import annotations

import json
import socket
import struct
import sys

NETLINK_GENERIC = 16
GENL_ID_CTRL = 0x10
CTRL_CMD_GETFAMILY = 3
CTRL_ATTR_FAMILY_ID = 1
CTRL_ATTR_FAMILY_NAME = 2
NETDEV_CMD_NAPI_GET = 11
NETDEV_A_NAPI_IFINDEX = 1
NETDEV_A_NAPI_PID = 4
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
HEADER = struct.Struct("=IHHII")


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _attrs(buf: bytes) -> dict[int, bytes]:
    """
    >>> _attrs(_attr(4, b"\\x01\\x00\\x00\\x00"))
    {4: b'\\x01\\x00\\x00\\x00'}
    """
    found = {}
    while len(buf) >= 4:
        length, kind = struct.unpack_from("=HH", buf)
        found[kind & 0x3FFF] = buf[4:length]
        buf = buf[(length + 3) & ~3 :]
    return found


def _request(sock: socket.socket, family: int, cmd: int, payload: bytes, dump: bool) -> list:
    body = struct.pack("=BBH", cmd, 1, 0) + payload
    flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0)
    sock.send(HEADER.pack(HEADER.size + len(body), family, flags, 1, 0) + body)
    replies = []
    while True:
        data = sock.recv(65536)
        while data:
            length, kind = struct.unpack_from("=IH", data)
            message, data = data[HEADER.size : length], data[(length + 3) & ~3 :]
            if kind == NLMSG_DONE:
                return replies
            if kind == NLMSG_ERROR:
                err = struct.unpack_from("=i", message)[0]
                if err:
                    raise OSError(-err, f"netlink request {cmd} failed")
                return replies
            replies.append(_attrs(message[4:]))
        if not dump:
            return replies


def napi_pids(ifnames: list[str]) -> dict[str, list[int]]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC) as sock:
        sock.settimeout(5)
        sock.bind((0, 0))
        name = _attr(CTRL_ATTR_FAMILY_NAME, b"netdev\0")
        family = _request(sock, GENL_ID_CTRL, CTRL_CMD_GETFAMILY, name, dump=False)
        family_id = struct.unpack("=H", family[0][CTRL_ATTR_FAMILY_ID][:2])[0]
        pids = {}
        for ifname in ifnames:
            index = _attr(NETDEV_A_NAPI_IFINDEX, struct.pack("=I", socket.if_nametoindex(ifname)))
            napis = _request(sock, family_id, NETDEV_CMD_NAPI_GET, index, dump=True)
            pids[ifname] = [
                struct.unpack("=I", n[NETDEV_A_NAPI_PID][:4])[0]
                for n in napis
                if NETDEV_A_NAPI_PID in n
            ]
        return pids


if __name__ == "__main__":
    print(json.dumps(napi_pids(sys.argv[1:])))
