"""The ``flexmig`` command line: ``explain``, ``migrate`` and ``drain``.

VMs and hosts are found through an inventory (entry point group
``flexmig.inventories``), ``--inventory`` or ``$FLEXMIG_INVENTORY``: ``host``
(the default) is a compute host running flexmig-agent, configured by the
agent's own file; the lab's rig adds ``lab``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any

from flexmig import exceptions, migrate_cli, tables
from flexmig.migration.request import MAX_PARALLEL
from flexmig.policy.decision import REQUESTABLE_MODES
from flexmig.policy.transport import TRANSPORTS

INVENTORY_GROUP = "flexmig.inventories"
DEFAULT_INVENTORY = "host"


def _print(data: object, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    elif isinstance(data, dict):
        for key, value in data.items():
            print(f"{key:>28}: {value}")
    else:
        print(data)


def load_inventory(name: str, config_files: list[str]) -> migrate_cli.Inventory:
    """The inventory registered under ``name``, built from the config files."""
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=INVENTORY_GROUP)}
    if name not in found:
        raise exceptions.InvalidInput(
            what="inventory",
            reason=f"{name!r} is not installed (installed: {', '.join(sorted(found)) or 'none'})",
        )
    return found[name].load()(config_files)


def _asked(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's part of a MigrationRequest."""
    asked = {
        "mode": args.mode,
        "max_downtime_ms": args.max_downtime_ms,
        "bandwidth_mib": args.bandwidth_mib,
        "transport": args.transport,
    }
    if "parallel" in args:
        asked["parallel"] = args.parallel
    return asked


def cmd_explain(args: argparse.Namespace) -> int:
    lab = load_inventory(args.inventory, args.config_file)
    plan = migrate_cli.explain(lab, args.vm, args.to, **_asked(args))
    if args.json:
        _print(plan, True)
        return 0
    print(plan["explanation"])
    tables.show_one(
        {"VM": args.vm, "to": args.to, "mode": plan["mode"], "pages moved by": plan["transfer"]}
    )
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    lab = load_inventory(args.inventory, args.config_file)
    result = migrate_cli.migrate(lab, args.vm, args.to, **_asked(args))
    if args.json:
        _print(result, True)
    else:
        _print_summary(result)
    return 0 if migration_ok(result) else 1


def migration_ok(result: dict[str, object]) -> bool:
    """Completed, the VM running, and every page good where the guest could be asked."""
    check = result.get("verify")
    clean = check is None or (check.get("bad") == 0 and check.get("lost") == 0)  # type: ignore[union-attr]
    return result["state"] == "completed" and result.get("running_on") is not None and clean


def cmd_drain(args: argparse.Namespace) -> int:
    if args.nova:
        return _drain_through_nova(args)
    from flexmig import drain_cli  # the drain's modules load only for this command

    lab = load_inventory(args.inventory, args.config_file)
    plan, inputs, backend = drain_cli.prepare(
        lab,
        args.host,
        args.max_concurrency,
        args.link_mib,
        args.max_downtime_ms,
        args.host_cpus,
        args.gap_floor_ms,
    )
    print(plan.explain())
    if args.dry_run:
        return 0
    report = drain_cli.execute(lab, plan, inputs, backend, args.max_concurrency)
    print(report.table())
    for name, measured in report.measured.items():
        if "bad" in measured:
            print(
                f"  {name}: runs on {measured['running_on']}, verify bad={measured['bad']} "
                f"lost={measured['lost']}"
            )
    if args.json:
        _print(
            {"counts": report.counts(), "total_s": report.total_s, "measured": report.measured},
            True,
        )
    moved = report.counts().get("completed", 0) == len(plan.moves)
    return 0 if moved and drain_cli.guests_ok(report) and not plan.unplaceable else 1


def _drain_through_nova(args: argparse.Namespace) -> int:
    """The same plan through Nova's API (openstacksdk: OS_CLOUD or OS_* variables)."""
    import openstack

    from agents.agent import auth
    from agents.agent import config as agent_config
    from nova_driver import drain as nova_drain

    port = args.agent_port or next(o.default for o in agent_config.agent_opts if o.name == "port")
    api = nova_drain.SdkNovaAPI(openstack.connect())
    agents = nova_drain.hypervisor_agents(api, port, auth.load_key(args.agent_key_file))
    plan, report = nova_drain.drain_host(
        api,
        args.host,
        agents,
        nova_limit=args.nova_max_concurrent,
        max_concurrency=args.max_concurrency,
        raise_limit=args.raise_nova_limit,
        dry_run=args.dry_run,
        link_mib=args.link_mib,
        cpus=args.host_cpus,
        floor_ms=args.gap_floor_ms,
    )
    if report is None:
        return 0
    print(report.table())
    return 0 if report.counts().get("completed", 0) == len(plan.moves) else 1


def _link_mib(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{value} MiB/s not in 0..1000000")
    return value


def _bounded_int(low: int, high: int):
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} not in {low}..{high}")
        return value

    return parse


def _concurrency(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 8:
        raise argparse.ArgumentTypeError(f"{value} not in 1..8")
    return value


def _add_drain_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("drain", help="move every VM off a host, planned to finish soonest")
    p.add_argument("host", help="the host to empty")
    p.add_argument("--dry-run", action="store_true", help="show the plan and why; move nothing")
    p.add_argument(
        "--max-concurrency",
        type=_concurrency,
        default=4,
        metavar="N",
        help="most migrations at once the planner may choose, 1..8 (default 4)",
    )
    p.add_argument(
        "--link-mib",
        type=_link_mib,
        default=0,
        help="the source uplink's bandwidth in MiB/s (default: the agents' probe)",
    )
    p.add_argument("--max-downtime-ms", type=int, help="downtime budget (default: agent's)")
    p.add_argument(
        "--host-cpus",
        type=_bounded_int(0, 4096),
        default=0,
        metavar="N",
        help="cores the source's guests and the drain's migrations share, 0..4096; with it the "
        "plan forecasts each guest's gap under CPU contention (default 0: not modelled)",
    )
    p.add_argument(
        "--gap-floor-ms",
        type=_bounded_int(0, 60_000),
        default=0,
        metavar="MS",
        help="the longest gap the source's guests see with no migration, 0..60000 ms "
        "(measured; default 0)",
    )
    p.add_argument("--json", action="store_true", help="also print the outcome as JSON")
    nova = p.add_argument_group("through Nova (a real cloud instead of the lab)")
    nova.add_argument(
        "--nova", action="store_true", help="drive Nova's live-migrate API (openstacksdk)"
    )
    nova.add_argument(
        "--nova-max-concurrent",
        type=_concurrency,
        default=1,
        metavar="N",
        help="the computes' [DEFAULT] max_concurrent_live_migrations, 1..8 (Nova's default 1)",
    )
    nova.add_argument(
        "--raise-nova-limit",
        action="store_true",
        help="plan beyond that limit (warned: raise it on the source compute first)",
    )
    nova.add_argument(
        "--agent-key-file",
        default="/etc/flexmig/agent.key",
        help="the deployment's agent key (default /etc/flexmig/agent.key)",
    )
    nova.add_argument(
        "--agent-port",
        type=int,
        default=None,
        help="the agents' API port (default: the agent's own default, [agent] port)",
    )
    p.set_defaults(func=cmd_drain)


def _print_summary(result: dict[str, object]) -> None:
    check = result.get("verify") or {}
    rows = {
        "result": result["state"] + (f" ({result['error']})" if result.get("error") else ""),
        "running on": result.get("running_on"),
        "mode": f"{result.get('mode')} (pages moved by {result.get('transfer')}, "
        f"over {result.get('transport')}"
        + (
            f", {result.get('parallel')} parallel connections"
            if (result.get("parallel") or 1) > 1
            else ""
        )
        + ")",
        "total time": f"{result.get('total_time_ms')} ms "
        f"(predicted {result.get('predicted_total_ms')} ms)",
        "guest-observed downtime": f"{result.get('guest_observed_downtime_ms')} ms "
        f"(QEMU's: {result.get('downtime_ms')} ms; predicted "
        f"{result.get('predicted_guest_downtime_ms')} ms for the guest, "
        f"{result.get('predicted_downtime_ms')} ms QEMU's)",
        "bytes moved": f"{(result.get('bytes_moved') or 0) / 2**20:.1f} MiB",
        "rounds": f"{result.get('rounds')} (predicted {result.get('predicted_rounds')})",
        "verify": f"{check.get('bad')} bad, {check.get('lost')} lost of {check.get('pages')} "
        "pages"
        if check
        else "not run (no probe inside this inventory's guests, or the VM is not running)",
    }
    if result.get("downtime_exceeded_ms") is not None:
        rows["downtime budget"] = (
            f"EXCEEDED by {result['downtime_exceeded_ms']} ms "
            f"(budget {result.get('downtime_budget_ms')} ms)"
        )
    if result.get("guest_observed_downtime_ms") is None:
        rows["guest-observed downtime"] = (
            f"not measured (libvirt: {result.get('downtime_ms')} ms, "
            f"predicted {result.get('predicted_downtime_ms')} ms)"
        )
    tables.show_one(rows)


def _parallel_connections(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 0 <= value <= MAX_PARALLEL or not text.strip().isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of connections in 0..{MAX_PARALLEL} (0: the plan's)"
        )
    return value


def _add_migration_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for name, func, text in (
        ("explain", cmd_explain, "the mode FlexMig would pick, and why"),
        ("migrate", cmd_migrate, "live-migrate a VM the FlexMig way"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("vm", help="libvirt domain name or Nova instance UUID")
        p.add_argument(
            "--to", required=True, help="destination host: name or address (lab: A, B, ...)"
        )
        p.add_argument("--mode", default="auto", choices=REQUESTABLE_MODES)
        p.add_argument("--max-downtime-ms", type=int, help="downtime budget (default: agent's)")
        p.add_argument(
            "--bandwidth-mib",
            type=int,
            default=0,
            help="cap the migration stream (MiB/s), e.g. to emulate a slower link",
        )
        p.add_argument(
            "--transport",
            default="auto",
            choices=TRANSPORTS,
            help="how the stream travels (auto: see flexmig explain)",
        )
        if name == "migrate":
            p.add_argument(
                "--parallel",
                type=_parallel_connections,
                default=0,
                metavar="N",
                help="parallel connections (libvirt/QEMU multifd), each its own mover "
                "stream with --transport mover; 1..8, default 0: the plan chooses "
                "(see flexmig explain)",
            )
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexmig", description=__doc__)
    parser.add_argument(
        "--inventory",
        default=os.environ.get("FLEXMIG_INVENTORY", DEFAULT_INVENTORY),
        help="where VMs and hosts are found (entry point group flexmig.inventories; "
        f"default $FLEXMIG_INVENTORY or {DEFAULT_INVENTORY})",
    )
    parser.add_argument(
        "--config-file",
        action="append",
        default=[],
        metavar="PATH",
        help="the agent's configuration ([agent] key, address, port, libvirt; [cli] "
        "peer URIs); repeatable; default /etc/flexmig/agent.conf (host inventory)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_migration_parsers(sub)
    _add_drain_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except exceptions.FlexMigError as exc:
        print(f"flexmig: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flexmig: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
