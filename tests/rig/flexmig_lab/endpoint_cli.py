"""``flexmig-lab endpoint add|list|del``: light traffic endpoints on lab hosts."""

from __future__ import annotations

import argparse
import dataclasses
import json

from flexmig_lab import endpoints
from flexmig_lab.lab import Lab


def cmd_add(args: argparse.Namespace) -> int:
    endpoint = endpoints.add(Lab(), args.host, args.name, args.ip)
    print(
        f"endpoint {endpoint.name}: host {endpoint.host}, {endpoint.ip}, "
        f"netns {endpoint.netns}, br-int port {endpoint.port}"
    )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    found = endpoints.list_endpoints(Lab())
    if args.json:
        print(
            json.dumps([dataclasses.asdict(e) | {"netns": e.netns, "port": e.port} for e in found])
        )
        return 0
    for e in found:
        print(f"{e.name}\t{e.host}\t{e.ip}\t{e.netns}\t{e.port}")
    return 0


def cmd_del(args: argparse.Namespace) -> int:
    endpoints.delete(Lab(), args.name)
    print(f"endpoint {args.name}: deleted")
    return 0


def add_parser(lab: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    eps = lab.add_parser(
        "endpoint", help="traffic endpoints (a namespace with a veth in a host's br-int)"
    ).add_subparsers(dest="endpoint_command", required=True)
    add = eps.add_parser("add", help="create an endpoint on a host")
    add.add_argument("--host", required=True, help="lab host, e.g. A")
    add.add_argument("name", help="1-12 lowercase letters/digits")
    add.add_argument("--ip", help="tenant address (default: the next free one from .210)")
    add.set_defaults(func=cmd_add)
    listing = eps.add_parser("list", help="endpoints, hosts, addresses")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_list)
    delete = eps.add_parser("del", help="remove an endpoint")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_del)
