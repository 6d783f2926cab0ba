"""The libvirt qemu hook: caps an incoming split VM before its pages arrive.

libvirt runs ``/etc/libvirt/hooks/qemu <vm> <op> <subop> ...`` synchronously;
``started`` comes after the QEMU process exists and before the incoming
migration stream is opened.  A failure to cap exits non-zero, which makes
libvirt abort the incoming start: the migration fails and the VM stays on its
source rather than running uncapped on a host without the RAM for it.
"""

from __future__ import annotations

import os
import sys

from agents.agent.split_store import SplitStore


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        return 0
    vm, op = args[0], args[1]
    sys.stdin.read()  # libvirt writes the domain XML; drain it
    store = SplitStore(
        os.environ.get("FLEXMIG_STATE_DIR", "/run/flexmig"),
        os.environ.get("FLEXMIG_STORE_DIR", "/var/lib/flexmig/store"),
        os.environ.get("FLEXMIG_CGROUP_PARENT", "flexmig"),
    )
    try:
        if op == "started":
            pid = int(open(f"/run/libvirt/qemu/{vm}.pid", encoding="ascii").read())
            store.cap_process(vm, pid)
        elif op == "release":
            store.cleanup(vm)
    except Exception as exc:  # noqa: BLE001 - any failure must reach libvirt as exit 1
        print(f"flexmig hook: {vm} {op}: {exc}", file=sys.stderr)
        return 1 if op == "started" else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
