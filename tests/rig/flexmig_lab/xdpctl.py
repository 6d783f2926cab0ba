"""The XDP provider of a lab host, driven from outside the host.

The provider must run in the host's namespaces (ifindexes, device map,
bpffs); tests and benchmarks run in the machine's.  This runs
``ovs_ext.providers.xdp.ctl`` inside the host per call; the pinned maps carry
the state between calls, as they carry it across provider restarts.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

from flexmig_lab import errors
from flexmig_lab.host import LabHost
from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadEntry

PROTO_NAMES = {6: "tcp", 17: "udp"}


class HostXdp:
    def __init__(self, host: LabHost) -> None:
        self.host = host

    def _ctl(self, *args: str, check: bool = True, stdin: str | None = None) -> dict:
        proc = self.host.ns.run(
            [sys.executable, "-m", "ovs_ext.providers.xdp.ctl", *args],
            check=False,
            timeout=120,
            input_text=stdin,
        )
        if check and proc.returncode != 0:
            raise errors.LabError(
                reason=f"xdp ctl {' '.join(args)} on host {self.host.name}: {proc.stderr.strip()}"
            )
        return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr}

    def describe(self) -> dict:
        return self._ctl("describe")

    def attach(self, *ports: str) -> dict[str, int]:
        return self._ctl("attach", *ports)["ports"]

    def detach(self, *ports: str) -> dict[str, int]:
        return self._ctl("detach", *ports)["ports"]

    def install(self, match: FlowMatch, out_port: str) -> dict:
        """{"installed": [...], "failed": [{"match", "reason"}]}"""
        return self._ctl("install", *_match_args(match), out_port)

    def install_batch(self, entries: list[OffloadEntry]) -> dict:
        rows = [{"match": dataclasses.asdict(e.match), "out_port": e.out_port} for e in entries]
        return self._ctl("install-batch", stdin=json.dumps(rows))

    def remove_batch(self, matches: list[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        rows = [dataclasses.asdict(m) for m in matches]
        return _counters(self._ctl("remove-batch", stdin=json.dumps(rows))["removed"])

    def remove(self, match: FlowMatch) -> dict[FlowMatch, FlowCounters]:
        return _counters(self._ctl("remove", *_match_args(match))["removed"])

    def stats(self) -> dict[FlowMatch, FlowCounters]:
        return _counters(self._ctl("stats")["flows"])


def _match_args(match: FlowMatch) -> list[str]:
    return [
        match.in_port,
        PROTO_NAMES[match.ip_proto],
        match.ipv4_src,
        match.ipv4_dst,
        str(match.tp_src),
        str(match.tp_dst),
    ]


def _counters(rows: list[dict]) -> dict[FlowMatch, FlowCounters]:
    return {FlowMatch(**row["match"]): FlowCounters(row["packets"], row["bytes"]) for row in rows}


def ovs_switched_packets(host: LabHost) -> int:
    """Packets OVS itself switched on br-int (all OpenFlow rules' counters).

    Port statistics would not do: for netdev ports OVS reports the kernel's
    device counters, which include frames the eSwitch redirected.
    """
    out = host.ns.run(["ovs-ofctl", "dump-aggregate", "br-int"]).stdout
    match = re.search(r"packet_count=(\d+)", out)
    if match is None:
        raise errors.LabError(reason=f"unexpected ovs-ofctl dump-aggregate output: {out!r}")
    return int(match.group(1))
