"""Can tc-flower offload run here?  Facts gathered at the edge, judged purely.

It needs a NIC eswitch in devlink ``switchdev`` mode, the VF representor
netdevs that mode creates (a ``phys_switch_id`` and a ``pf<N>vf<M>``
``phys_port_name``), and the kernel's flower classifier.  :func:`gather`
reads sysfs and /proc/kallsyms and runs ``devlink`` (bounded); :func:`missing` says, from those
facts alone, what is missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess

SYS_NET = "/sys/class/net"
# VF representors ("pf0vf3", "c1pf0vf3" on multi-host NICs) and the uplink
# representor ("p0"), as switchdev drivers name them in phys_port_name.
REPRESENTOR_PORT_NAME = re.compile(r"^(?:c\d+)?(?:pf\d+vf\d+|p\d+)$")
DEVLINK_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class SystemFacts:
    netdevs: tuple[str, ...]
    representors: tuple[str, ...]  # netdevs that are VF representors
    eswitch_modes: dict[str, str]  # devlink device -> mode ("switchdev", "legacy")
    devlink_error: str  # why devlink could not be asked, or ""
    flower_source: str  # where cls_flower was found, or ""
    mirred_source: str  # where act_mirred was found, or ""
    kernel_release: str


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:  # includes EOPNOTSUPP from netdevs without the attribute
        return ""


def is_representor(ifname: str, sys_net: str = SYS_NET) -> bool:
    base = os.path.join(sys_net, ifname)
    port_name = _read(os.path.join(base, "phys_port_name"))
    return bool(_read(os.path.join(base, "phys_switch_id"))) and bool(
        REPRESENTOR_PORT_NAME.match(port_name)
    )


def eswitch_modes() -> tuple[dict[str, str], str]:
    """devlink devices' eswitch modes, or the reason they could not be read."""
    try:
        result = subprocess.run(
            ["devlink", "-j", "dev", "eswitch", "show"],
            capture_output=True,
            text=True,
            timeout=DEVLINK_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        return {}, "devlink (iproute2) is not installed"
    except subprocess.TimeoutExpired:
        return {}, f"devlink did not answer in {DEVLINK_TIMEOUT_S:.0f} s"
    if result.returncode != 0:
        return {}, f"devlink: {result.stderr.strip() or f'exit {result.returncode}'}"
    try:
        devices = json.loads(result.stdout or "{}").get("dev", {})
    except ValueError as exc:
        return {}, f"devlink printed unreadable JSON: {exc}"
    return {name: str(info.get("mode", "?")) for name, info in devices.items()}, ""


def kernel_symbols(wanted: set[str], kallsyms: str = "/proc/kallsyms") -> set[str]:
    """Which of ``wanted`` the running kernel has (built in or in a loaded module)."""
    found: set[str] = set()
    try:
        with open(kallsyms, encoding="ascii", errors="replace") as handle:
            for line in handle:
                parts = line.split()
                if len(parts) >= 3 and parts[2] in wanted:
                    found.add(parts[2])
    except OSError:
        pass
    return found


def module_source(module: str, symbol: str, kernel_release: str, symbols: set[str]) -> str:
    """Where a tc module's code is: in the running kernel (its ``symbol`` is
    in kallsyms: built in, or loaded), or a module file modprobe can load;
    "" if nowhere.  Built-in code without parameters has no /sys/module
    entry, hence kallsyms."""
    if symbol in symbols:
        return f"/proc/kallsyms ({symbol})"
    module_dir = f"/lib/modules/{kernel_release}/kernel/net/sched"
    try:
        for name in os.listdir(module_dir):
            if name.startswith(f"{module}.ko"):
                return os.path.join(module_dir, name)
    except OSError:
        pass
    return ""


def gather(sys_net: str = SYS_NET) -> SystemFacts:
    try:
        netdevs = tuple(sorted(os.listdir(sys_net)))
    except OSError:
        netdevs = ()
    modes, devlink_error = eswitch_modes()
    release = os.uname().release
    symbols = kernel_symbols({"fl_classify", "tcf_mirred_act"})
    return SystemFacts(
        netdevs=netdevs,
        representors=tuple(n for n in netdevs if is_representor(n, sys_net)),
        eswitch_modes=modes,
        devlink_error=devlink_error,
        flower_source=module_source("cls_flower", "fl_classify", release, symbols),
        mirred_source=module_source("act_mirred", "tcf_mirred_act", release, symbols),
        kernel_release=release,
    )


def missing(facts: SystemFacts) -> list[str]:
    """What tc-flower offload lacks on this machine; empty when it can run.

    >>> missing(SystemFacts(("eth0",), (), {}, "devlink: no devlink", "", "", "6.1"))[0]
    'no eswitch in switchdev mode (devlink: no devlink)'
    """
    reasons = []
    switchdev = [dev for dev, mode in facts.eswitch_modes.items() if mode == "switchdev"]
    if not switchdev:
        if facts.devlink_error:
            reasons.append(f"no eswitch in switchdev mode ({facts.devlink_error})")
        elif facts.eswitch_modes:
            modes = ", ".join(f"{d}: {m}" for d, m in sorted(facts.eswitch_modes.items()))
            reasons.append(f"no eswitch in switchdev mode ({modes})")
        else:
            reasons.append("no eswitch in switchdev mode (devlink lists no devices)")
    if not facts.representors:
        reasons.append(
            "no VF representors (no netdev with a phys_switch_id and a pf<N>vf<M> or "
            f"p<N> phys_port_name among {', '.join(facts.netdevs) or 'none'})"
        )
    if not facts.flower_source:
        reasons.append(
            "no tc flower classifier (no fl_classify in /proc/kallsyms, no cls_flower "
            f"module under /lib/modules/{facts.kernel_release})"
        )
    if not facts.mirred_source:
        reasons.append(
            "no tc mirred action (no tcf_mirred_act in /proc/kallsyms, no act_mirred "
            f"module under /lib/modules/{facts.kernel_release})"
        )
    return reasons
