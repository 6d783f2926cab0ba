"""Seeing a migrated VM's announcements: RARP / gratuitous ARP frames in a namespace.

After a live migration QEMU announces the VM's MAC from the destination (RARP
frames, ``announce-rounds`` of them, the first as the VM resumes) so the
physical network moves its MAC entry; until one reaches the fabric, traffic
towards the VM still goes to the host it left.  :class:`AnnounceCapture` runs
in a host's namespace (an ``AF_PACKET`` socket on every interface there, a
classic BPF filter keeping only ARP and RARP, so the migration stream costs
nothing) and reports each frame: when, on which interface, in which direction,
from which MAC.  All lab namespaces share the machine's clock, so the times
compare with the agents' and the senders' (udpgen's send stamps).
"""

from __future__ import annotations

import dataclasses
import json
import select
import subprocess
import sys

from flexmig import exceptions
from flexmig_lab import errors

READY_TIMEOUT = 10.0
MAX_FRAMES = 4000
PACKET_OUTGOING = 4  # linux/if_packet.h: a frame this namespace sent
ETH_P_RARP = 0x8035
ETH_P_ARP = 0x0806

_SCRIPT = r"""
import ctypes, json, socket, struct, sys, time
seconds, cap = float(sys.argv[1]), int(sys.argv[2])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
# ldh [12]; jeq 0x8035 -> keep; jeq 0x0806 -> keep; ret 0; keep: ret 0xffff
code = [(0x28, 0, 0, 12), (0x15, 2, 0, 0x8035), (0x15, 1, 0, 0x0806),
        (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFF)]
insns = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in code))
s.setsockopt(socket.SOL_SOCKET, 26, struct.pack("HL", len(code), ctypes.addressof(insns)))
s.settimeout(0.2)
frames, end = [], time.time() + seconds
print("listening", file=sys.stderr, flush=True)
while time.time() < end and len(frames) < cap:
    try:
        data, addr = s.recvfrom(128)
    except socket.timeout:
        continue
    etype = struct.unpack("!H", data[12:14])[0]
    garp = etype == 0x0806 and len(data) >= 42 and data[28:32] == data[38:42]
    mac = ":".join(f"{b:02x}" for b in data[6:12])
    frames.append([time.time(), addr[0], addr[2], etype, mac, garp])
print(json.dumps(frames))
"""


@dataclasses.dataclass(frozen=True)
class Frame:
    at: float  # wall clock, s
    ifname: str
    outgoing: bool  # sent by this namespace (e.g. the bridge forwarding it on)
    ethertype: int
    src_mac: str
    gratuitous: bool  # an ARP whose sender and target address are the same

    @property
    def announces(self) -> bool:
        return self.ethertype == ETH_P_RARP or self.gratuitous


class AnnounceCapture:
    """ARP/RARP frames seen in ``prefix``'s namespace for ``seconds``."""

    def __init__(self, prefix: list[str], seconds: float) -> None:
        if not 0 < seconds <= 3600:
            raise exceptions.InvalidInput(what="capture length", reason=f"{seconds} s")
        self.timeout = seconds + 10
        cmd = [*prefix, sys.executable, "-c", _SCRIPT, str(seconds), str(MAX_FRAMES)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stderr], [], [], READY_TIMEOUT)
        line = self.proc.stderr.readline() if ready else ""
        if "listening" not in line:
            self.proc.kill()
            raise errors.LabError(reason=f"announcement capture did not start: {line.strip()!r}")

    def frames(self) -> list[Frame]:
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired as exc:
            self.proc.kill()
            self.proc.communicate()
            raise exceptions.Timeout(seconds=self.timeout, what="announcement capture") from exc
        if self.proc.returncode != 0:
            raise errors.LabError(reason=f"announcement capture failed: {err.strip()}")
        return [
            Frame(at, ifname, pkttype == PACKET_OUTGOING, etype, mac, garp)
            for at, ifname, pkttype, etype, mac, garp in json.loads(out)
        ]


def first_announcement(
    frames: list[Frame], mac: str, since: float, *, ifname: str | None = None,
    outgoing: bool | None = None,
) -> Frame | None:  # fmt: skip
    """The first RARP/gratuitous ARP from ``mac`` at or after ``since`` (optionally
    on one interface, in one direction).

    >>> f = [Frame(1.0, "tap3", False, ETH_P_RARP, "52:54:00:00:00:03", False),
    ...      Frame(1.1, "phy0", True, ETH_P_RARP, "52:54:00:00:00:03", False),
    ...      Frame(1.2, "phy0", True, ETH_P_ARP, "52:54:00:00:00:03", False)]
    >>> first_announcement(f, "52:54:00:00:00:03", 0.5, ifname="phy0").at
    1.1
    >>> first_announcement(f, "52:54:00:00:00:03", 1.15) is None
    True
    """
    for frame in sorted(frames, key=lambda f: f.at):
        if frame.at < since or frame.src_mac != mac.lower() or not frame.announces:
            continue
        if ifname is not None and frame.ifname != ifname:
            continue
        if outgoing is not None and frame.outgoing != outgoing:
            continue
        return frame
    return None
