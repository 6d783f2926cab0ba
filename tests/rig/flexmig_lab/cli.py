"""``flexmig-lab``: the lab of namespaced hosts, its VMs, endpoints and the demo."""

from __future__ import annotations

import argparse
import json
import sys
import time

from flexmig import exceptions
from flexmig.progress import MigrationProgress
from flexmig_lab import endpoint_cli, image, vm
from flexmig_lab.lab import Lab


def _print(data: object, as_json: bool) -> None:
    if as_json:
        print(json.dumps(data, indent=2, default=str))
    elif isinstance(data, dict):
        for key, value in data.items():
            print(f"{key:>28}: {value}")
    else:
        print(data)


def cmd_lab_up(args: argparse.Namespace) -> int:
    hosts = Lab().up(args.hosts)
    for host in hosts:
        print(
            f"host {host.name}: netns {host.spec.netns}, {host.spec.mgmt_ip}, "
            f"libvirt {host.spec.libvirt_uri}"
        )
    return 0


def cmd_lab_status(args: argparse.Namespace) -> int:
    status = Lab().status()
    if args.json:
        _print(status, True)
        return 0
    if not status["up"]:
        print(
            "lab: down"
            + (
                f" (stray namespaces: {status['stray_namespaces']})"
                if status["stray_namespaces"]
                else ""
            )
        )
        return 0
    for host in status["hosts"]:  # type: ignore[union-attr]
        daemons = " ".join(f"{d}={'up' if ok else 'DOWN'}" for d, ok in host["daemons"].items())
        print(
            f"host {host['name']} ({host['hostname']}, {host['mgmt_ip']}): "
            f"namespace {host['namespace']}; {daemons}"
        )
    lab = Lab()
    for name in vm.list_vms(lab):
        print(f"vm {name}: on {vm.LabVM(lab, name).locate() or '(not running)'}")
    return 0


def cmd_lab_down(_args: argparse.Namespace) -> int:
    Lab().down()
    print("lab: down, nothing left behind")
    return 0


def cmd_image_build(_args: argparse.Namespace) -> int:
    built = image.build()
    print(f"kernel {built.kernel}\ninitrd {built.initrd}")
    return 0


def cmd_vm_create(args: argparse.Namespace) -> int:
    created = vm.create(
        Lab(),
        args.host,
        ram=args.ram,
        vcpus=args.vcpus,
        workload=args.workload,
        memory_backing=args.memory_backing,
        name=args.name,
    )
    spec = created.spec
    print(
        f"vm {spec.name}: running on {args.host.upper()}, {spec.ram_mib} MiB, "
        f"{spec.vcpus} vCPU, workload {spec.workload.cmdline()}, tenant {spec.tenant_ip}"
    )
    return 0


def cmd_vm_list(_args: argparse.Namespace) -> int:
    lab = Lab()
    for name in vm.list_vms(lab):
        print(f"{name}\t{vm.LabVM(lab, name).locate() or '-'}")
    return 0


def cmd_vm_verify(args: argparse.Namespace) -> int:
    result = vm.LabVM(Lab(), args.name).verify()
    _print(result, args.json)
    return 0 if result["bad"] == 0 and result["lost"] == 0 else 1


def cmd_vm_heartbeat(args: argparse.Namespace) -> int:
    _print(vm.LabVM(Lab(), args.name).heartbeat().as_dict(), args.json)
    return 0


def cmd_vm_destroy(args: argparse.Namespace) -> int:
    vm.destroy(Lab(), args.name)
    print(f"vm {args.name}: destroyed")
    return 0


def migrate_and_measure(lab: Lab, name: str, to: str) -> dict[str, object]:
    """Plain libvirt precopy with progress; then the guest's own measurements."""
    guest = vm.LabVM(lab, name)
    source = guest.locate()
    start_ns = time.monotonic_ns()
    bar = MigrationProgress(f"{name} {source}->{to.upper()}")
    stats = vm.migrate_plain(lab, name, to, progress=bar)
    bar.finish()
    guest.wait_heartbeat(host=to.upper())
    beats = guest.heartbeat(since_ns=start_ns)
    check = guest.verify()
    return {
        "vm": name,
        "from": source,
        "to": to.upper(),
        "mode": "precopy (libvirt default)",
        "total_time_ms": stats.get("time_elapsed"),
        "libvirt_downtime_ms": stats.get("downtime"),
        "guest_observed_downtime_ms": round(beats.longest_gap_ms, 1),
        "bytes_moved": stats.get("memory_processed"),
        "rounds": stats.get("memory_iteration"),
        "heartbeat_hosts": "->".join(beats.hosts),
        "verify": f"{check['bad']} bad, {check['lost']} lost of {check['pages']} pages",
    }


def cmd_vm_migrate(args: argparse.Namespace) -> int:
    _print(migrate_and_measure(Lab(), args.name, args.to), args.json)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: three VMs, three modes, one table (flexmig_lab.demo)."""
    from flexmig_lab import demo

    return demo.run(keep=args.keep)


def cmd_host_budget(args: argparse.Namespace) -> int:
    from flexmig_lab.vmspec import parse_size_mib

    Lab().set_budget(args.host, parse_size_mib(args.size, "memory budget"))
    print(f"host {args.host.upper()}: agent offers VMs {args.size}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexmig-lab", description=__doc__)
    lab = parser.add_subparsers(dest="command", required=True)
    demo = lab.add_parser(
        "demo", help="lab up; three VMs, each migrated A->B in the mode FlexMig picks; lab down"
    )
    demo.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    demo.set_defaults(func=cmd_demo)
    up = lab.add_parser("up", help="bring the lab up (idempotent)")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts, 2..8")
    up.set_defaults(func=cmd_lab_up)
    status = lab.add_parser("status", help="hosts, daemons and VMs")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_lab_status)
    lab.add_parser("down", help="remove everything the lab made").set_defaults(func=cmd_lab_down)
    img = lab.add_parser("image", help="the guest image").add_subparsers(required=True)
    img.add_parser("build", help="fetch the kernel, build the initramfs").set_defaults(
        func=cmd_image_build
    )
    _add_vm_parser(lab)
    endpoint_cli.add_parser(lab)
    host = lab.add_parser("host", help="lab hosts").add_subparsers(required=True)
    budget = host.add_parser("budget", help="RAM a host's agent offers VMs")
    budget.add_argument("host")
    budget.add_argument("size", help="e.g. 300M, 4G")
    budget.set_defaults(func=cmd_host_budget)
    return parser


def _add_vm_parser(lab: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    vms = lab.add_parser("vm", help="lab VMs").add_subparsers(dest="vm_command", required=True)
    create = vms.add_parser("create", help="boot a VM on a host")
    create.add_argument("--host", required=True)
    create.add_argument("--name")
    create.add_argument("--ram", default="256M", help="e.g. 512M, 1G")
    create.add_argument("--vcpus", type=int, default=1)
    create.add_argument(
        "--workload",
        default="idle",
        help="idle | dirtier:wss=128M,rate=20000[,pattern=random|seq][,hot=32M] (hot: only "
        "the first 32M of the working set are rewritten, the rest written once)",
    )
    create.add_argument("--memory-backing", default="file", choices=("file", "anonymous"))
    create.set_defaults(func=cmd_vm_create)
    vms.add_parser("list", help="VMs and where they run").set_defaults(func=cmd_vm_list)
    for name, func, text in (
        ("verify", cmd_vm_verify, "run the guest's page verifier"),
        ("heartbeat", cmd_vm_heartbeat, "guest-observed downtime so far"),
        ("destroy", cmd_vm_destroy, "stop and forget a VM"),
    ):
        p = vms.add_parser(name, help=text)
        p.add_argument("name")
        p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)
    migrate = vms.add_parser("migrate", help="plain libvirt precopy live migration")
    migrate.add_argument("name")
    migrate.add_argument("--to", required=True)
    migrate.add_argument("--json", action="store_true")
    migrate.set_defaults(func=cmd_vm_migrate)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except exceptions.FlexMigError as exc:
        print(f"flexmig-lab: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("flexmig-lab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
