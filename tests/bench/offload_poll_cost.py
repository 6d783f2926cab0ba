"""Where one statistics poll of a big flow table goes (no lab: CPU only).

    .venv/bin/python -m tests.bench.offload_poll_cost [--flows 10000]

The offload app polls every rule it owns: each flow has its own rule and a
counting rule, so 10k flows are a 20k-entry flow-stats reply.  This times,
in this process, the parts of one poll: parsing the reply (entries built as OVS
sends them: the rule's match and instructions) by os-ken and by the app's own
reader ([offload] stats_socket; first poll, and any later one, whose counting
rules' matches it decoded already), the control's poll over the flows (a
second one: histories started), and the status file (every second above 1,000
flows).  Printed as one JSON object, seconds.
"""

from __future__ import annotations

import argparse
import json
import struct
import time

import yaml
from os_ken.ofproto import ofproto_v1_3 as ofp
from os_ken.ofproto import ofproto_v1_3_parser as parser

from ovs_ext import flows, openflow, policy, stats_reader
from ovs_ext.control import OffloadControl
from ovs_ext.dispatcher import Dispatchers
from ovs_ext.providers.base import FlowCounters, FlowMatch
from tests.unit.offload_fakes import FakeProvider

POLICY = "capacity: 1024\nstatistics:\n  window_s: 0.2\n  promote_pps: 2000\n"
ENTRY = struct.Struct("!HBxIIHHHH4xQQQ")  # ofp_flow_stats up to the match


def _entry(table: int, cookie: int, match: object, instructions: list[object]) -> bytes:
    mbuf, ibuf = bytearray(), bytearray()
    match.serialize(mbuf, 0)  # type: ignore[attr-defined]
    for instruction in instructions:
        instruction.serialize(ibuf, len(ibuf))  # type: ignore[attr-defined]
    head = ENTRY.pack(ENTRY.size + len(mbuf) + len(ibuf), table, 1, 0, 100, 0, 0, 0,
                      cookie, 3, 180)  # fmt: skip
    return head + bytes(mbuf) + bytes(ibuf)


def measure(count: int) -> dict[str, float]:
    provider = FakeProvider(capacity=1024)
    control = OffloadControl(
        policy.parse_policy(yaml.safe_load(POLICY)), provider, "fake",
        Dispatchers(provider, "fake", ["ep-*"], []), idle_timeout=10,
    )  # fmt: skip
    control.port_added("ep-s2")
    control.port_added("ep-r1")
    body = bytearray()
    for i in range(count):
        match = FlowMatch("ep-s2", 17, "10.0.0.1", "10.0.0.2", 2000 + i, 9100)
        flow, _new = control.flow_seen(match, "ep-r1")
        rule = openflow.flow_rule(parser, ofp, flow.cookie, 3, match, 60)
        body += _entry(flows.FLOW_TABLE, flow.cookie, rule.match, rule.instructions)
        counting = parser.OFPMatch(**flows.openflow_match(match, 3))
        body += _entry(flows.COUNTING_TABLE, flows.counting_cookie(), counting, [])
    raw = bytes(body)
    started, offset, entries = time.perf_counter(), 0, 0
    while offset < len(raw):
        offset += parser.OFPFlowStats.parser(raw, offset).length
        entries += 1
    parse_s = time.perf_counter() - started
    wants, decoded = (lambda _t, cookie: flows.is_counting_cookie(cookie)), {}
    started = time.perf_counter()
    read = stats_reader.parse_flow_stats(raw, wants, decoded)
    reader_s = time.perf_counter() - started
    # Every later poll: the counting rules' matches are decoded already.
    started = time.perf_counter()
    stats_reader.parse_flow_stats(raw, wants, decoded)
    reader_again_s = time.perf_counter() - started
    rules = {f.flow_id: FlowCounters(3, 180) for f in control.flows}
    control.poll(rules, {}, {})  # the first: every flow's history starts
    started = time.perf_counter()
    control.poll({k: FlowCounters(4, 240) for k in rules}, {}, {})
    poll_s = time.perf_counter() - started
    started = time.perf_counter()
    json.dumps(control.status(), indent=1)
    status_s = time.perf_counter() - started
    return {"flows": count, "entries": entries, "reply_mb": round(len(raw) / 1e6, 2),
            "osken_parse_s": round(parse_s, 3), "stats_reader_parse_s": round(reader_s, 3),
            "stats_reader_parse_again_s": round(reader_again_s, 3),
            "stats_reader_entries": len(read), "control_poll_s": round(poll_s, 3),
            "status_file_s": round(status_s, 3)}  # fmt: skip


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--flows", type=int, default=10_000)
    print(json.dumps(measure(args.parse_args().flows)))


if __name__ == "__main__":
    main()
