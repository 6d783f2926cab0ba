"""``python -m ovs_ext.providers.xdp.ctl``: the XDP provider from a shell.

For operators and the lab's tests: run it inside a host (the provider's
namespaces), e.g. ``nsenter -t <holder> -m -u -n -p -- python -m ...``.  State
lives in the pinned maps, so separate invocations see each other's flows.
Output is JSON; errors go to stderr with exit status 1.

    ctl describe
    ctl attach IF [IF...]          ctl detach IF [IF...]
    ctl install IN_PORT PROTO SRC DST SPORT DPORT OUT_PORT
    ctl remove IN_PORT PROTO SRC DST SPORT DPORT
    ctl stats
    ctl install-batch < [{"match": {...FlowMatch fields}, "out_port": IF}, ...]
    ctl remove-batch < [{...FlowMatch fields}, ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from oslo_config import cfg

from flexmig import exceptions
from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadEntry
from ovs_ext.providers.xdp.provider import XdpProvider

PROTOS = {"tcp": 6, "udp": 17}


def _match(args: argparse.Namespace) -> FlowMatch:
    return FlowMatch(
        in_port=args.in_port,
        ip_proto=PROTOS[args.proto],
        ipv4_src=args.src,
        ipv4_dst=args.dst,
        tp_src=args.sport,
        tp_dst=args.dport,
    )


def _flows(counters: dict[FlowMatch, FlowCounters]) -> list[dict[str, object]]:
    return [
        {"match": dataclasses.asdict(m), "packets": c.packets, "bytes": c.bytes}
        for m, c in sorted(counters.items())
    ]


def _install_result(provider: XdpProvider, batch: list[OffloadEntry]) -> dict[str, object]:
    result = provider.install(batch)
    return {
        "installed": [dataclasses.asdict(m) for m in result.installed],
        "failed": [{"match": dataclasses.asdict(m), "reason": r} for m, r in result.failed.items()],
    }


def _run(provider: XdpProvider, args: argparse.Namespace) -> object:
    if args.command == "describe":
        return dataclasses.asdict(provider.describe())
    if args.command in ("attach", "detach"):
        for ifname in args.ports:
            (provider.attach_port if args.command == "attach" else provider.detach_port)(ifname)
        return {"ports": provider.attached_ports()}
    if args.command == "install":
        return _install_result(provider, [OffloadEntry(_match(args), args.out_port)])
    if args.command == "install-batch":
        batch = [OffloadEntry(FlowMatch(**e["match"]), e["out_port"]) for e in json.load(sys.stdin)]
        return _install_result(provider, batch)
    if args.command == "remove":
        return {"removed": _flows(provider.remove([_match(args)]))}
    if args.command == "remove-batch":
        return {"removed": _flows(provider.remove(FlowMatch(**m) for m in json.load(sys.stdin)))}
    return {"flows": _flows(provider.stats()), "ports": provider.attached_ports()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xdp-ctl", description=__doc__)
    parser.add_argument("--config-file", action="append", default=[])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("describe")
    sub.add_parser("stats")
    sub.add_parser("install-batch", help="JSON list of entries on stdin")
    sub.add_parser("remove-batch", help="JSON list of matches on stdin")
    for name in ("attach", "detach"):
        sub.add_parser(name).add_argument("ports", nargs="+")
    for name in ("install", "remove"):
        p = sub.add_parser(name)
        p.add_argument("in_port")
        p.add_argument("proto", choices=sorted(PROTOS))
        p.add_argument("src")
        p.add_argument("dst")
        p.add_argument("sport", type=int)
        p.add_argument("dport", type=int)
        if name == "install":
            p.add_argument("out_port")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    conf = cfg.ConfigOpts()
    try:
        provider = XdpProvider(conf)
        conf([], project="flexmig", default_config_files=args.config_file)
        print(json.dumps(_run(provider, args), indent=1))
    except (exceptions.FlexMigError, cfg.Error, ValueError, KeyError, TypeError) as exc:
        print(f"xdp-ctl: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
