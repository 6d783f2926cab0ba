"""What a lab VM is: parsing its parameters and rendering its domain XML.

Pure functions: every user-supplied value is checked here, before anything
touches libvirt, so bad input changes nothing.
"""

from __future__ import annotations

import dataclasses
import os
import re
from xml.sax.saxutils import escape, quoteattr

from flexmig import exceptions
from flexmig_lab import topology

NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
MIN_RAM_MIB = 128
MAX_RAM_MIB = 16384
MAX_VCPUS = 4
# What the guest kernel and init need besides the working set (measured: the
# kernel + initramfs settle at ~60 MiB; the rest is headroom for page cache).
GUEST_OVERHEAD_MIB = 96
MEMORY_BACKINGS = ("file", "anonymous")
PATTERNS = ("random", "seq")
MAX_RATE = 10_000_000
GUEST_RUN_DIR = "/run/flexmig"


@dataclasses.dataclass(frozen=True)
class Workload:
    kind: str  # "idle" | "dirtier"
    wss_mib: int = 0
    rate: int = 0  # pages/s
    pattern: str = "random"
    # The first hot_mib of the working set are rewritten; the rest is written
    # once and left cold (seed 003's VM: all memory in use, a small hot set).
    # 0: the whole working set is hot.
    hot_mib: int = 0

    def cmdline(self) -> str:
        if self.kind == "idle":
            return "idle"
        text = f"dirtier:wss={self.wss_mib}M,rate={self.rate},pattern={self.pattern}"
        return f"{text},hot={self.hot_mib}M" if self.hot_mib else text


@dataclasses.dataclass(frozen=True)
class VMSpec:
    name: str
    ram_mib: int
    vcpus: int
    workload: Workload
    memory_backing: str
    index: int  # the VM's number in the lab: picks its MAC and tenant address

    @property
    def mac(self) -> str:
        return f"52:54:00:fe:{self.index // 256:02x}:{self.index % 256:02x}"

    @property
    def tenant_ip(self) -> str:
        return topology.tenant_ip(self.index)

    @property
    def ctl_socket(self) -> str:
        """The control serial port's socket, at the same path on every host."""
        return f"{GUEST_RUN_DIR}/{self.name}.ctl"

    @property
    def console_log(self) -> str:
        return f"{GUEST_RUN_DIR}/{self.name}.console"

    @property
    def port_name(self) -> str:
        return f"tap{self.index}"


def parse_size_mib(text: str, what: str) -> int:
    """'512M', '1G', '512' (MiB) → MiB.

    >>> parse_size_mib("1G", "RAM"), parse_size_mib("384M", "RAM"), parse_size_mib("64", "x")
    (1024, 384, 64)
    """
    m = re.fullmatch(r"\s*(\d+)\s*([MmGg]i?[Bb]?)?\s*", text)
    if not m:
        raise exceptions.InvalidInput(what=what, reason=f"{text!r} is not a size like 512M or 1G")
    value = int(m.group(1))
    unit = (m.group(2) or "M")[0].upper()
    return value * 1024 if unit == "G" else value


def parse_workload(text: str) -> Workload:
    """'idle' or 'dirtier:wss=128M,rate=20000[,pattern=random|seq][,hot=32M]'."""
    if text in ("", "idle"):
        return Workload(kind="idle")
    kind, _, opts = text.partition(":")
    if kind != "dirtier":
        raise exceptions.InvalidInput(
            what="workload", reason=f"unknown kind {kind!r} (expected idle or dirtier:...)"
        )
    values = {"wss": "64M", "rate": "1000", "pattern": "random", "hot": ""}
    for item in filter(None, opts.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in values:
            raise exceptions.InvalidInput(
                what="workload", reason=f"{item!r}: expected wss=, rate=, pattern= or hot="
            )
        values[key] = value
    if not values["rate"].isdigit() or not 0 <= int(values["rate"]) <= MAX_RATE:
        raise exceptions.InvalidInput(
            what="workload", reason=f"rate {values['rate']!r} not in 0..{MAX_RATE} pages/s"
        )
    if values["pattern"] not in PATTERNS:
        raise exceptions.InvalidInput(
            what="workload", reason=f"pattern {values['pattern']!r} not one of {PATTERNS}"
        )
    wss = parse_size_mib(values["wss"], "working set size")
    if wss < 1:
        raise exceptions.InvalidInput(what="workload", reason="working set must be >= 1M")
    hot = parse_size_mib(values["hot"], "hot set size") if values["hot"] else 0
    if values["hot"] and not 1 <= hot <= wss:
        raise exceptions.InvalidInput(
            what="workload", reason=f"hot set {hot}M not in 1M..the working set ({wss}M)"
        )
    return Workload(
        kind="dirtier",
        wss_mib=wss,
        rate=int(values["rate"]),
        pattern=values["pattern"],
        hot_mib=0 if hot == wss else hot,
    )


def make_spec(
    name: str, ram: str, vcpus: int, workload: str, memory_backing: str, index: int
) -> VMSpec:
    if not NAME_RE.match(name):
        raise exceptions.InvalidInput(
            what="VM name", reason=f"{name!r} must match {NAME_RE.pattern}"
        )
    ram_mib = parse_size_mib(ram, "RAM")
    if not MIN_RAM_MIB <= ram_mib <= MAX_RAM_MIB:
        raise exceptions.InvalidInput(
            what="RAM", reason=f"{ram_mib} MiB not in {MIN_RAM_MIB}..{MAX_RAM_MIB} MiB"
        )
    if not 1 <= vcpus <= MAX_VCPUS:
        raise exceptions.InvalidInput(what="vCPUs", reason=f"{vcpus} not in 1..{MAX_VCPUS}")
    if memory_backing not in MEMORY_BACKINGS:
        raise exceptions.InvalidInput(
            what="memory backing", reason=f"{memory_backing!r} not one of {MEMORY_BACKINGS}"
        )
    wl = parse_workload(workload)
    if wl.wss_mib + GUEST_OVERHEAD_MIB > ram_mib:
        raise exceptions.InvalidInput(
            what="workload",
            reason=(
                f"working set {wl.wss_mib} MiB + {GUEST_OVERHEAD_MIB} MiB guest overhead "
                f"exceeds the VM's {ram_mib} MiB"
            ),
        )
    return VMSpec(
        name=name,
        ram_mib=ram_mib,
        vcpus=vcpus,
        workload=wl,
        memory_backing=memory_backing,
        index=index,
    )


def kernel_cmdline(spec: VMSpec) -> str:
    return " ".join(
        [
            "console=ttyS0",
            "quiet",
            "panic=-1",
            "tsc=reliable",
            f"fm.vm={spec.name}",
            f"fm.workload={spec.workload.cmdline()}",
            f"fm.ip={spec.tenant_ip}/{topology.TENANT_NET.prefixlen}",
        ]
    )


def _qemu_trace_args() -> str:
    """QEMU trace events named in FLEXMIG_LAB_QEMU_TRACE, logged to the domain's log."""
    patterns = [p for p in os.environ.get("FLEXMIG_LAB_QEMU_TRACE", "").split(",") if p]
    args = "".join(f"<qemu:arg value='-trace'/><qemu:arg value={quoteattr(p)}/>" for p in patterns)
    return f"\n  <qemu:commandline>{args}</qemu:commandline>" if args else ""


def domain_xml(spec: VMSpec, kernel: str, initrd: str) -> str:
    backing = ""
    if spec.memory_backing == "file":
        # Shared file-backed memory in qemu.conf's memory_backing_dir (the
        # host's store): what split migration needs on every host from the start.
        backing = "<memoryBacking><source type='file'/><access mode='shared'/></memoryBacking>"
    return f"""<domain type='qemu' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>
  <name>{escape(spec.name)}</name>
  <memory unit='MiB'>{spec.ram_mib}</memory>
  <vcpu>{spec.vcpus}</vcpu>
  {backing}
  <os>
    <type arch='x86_64' machine='pc'>hvm</type>
    <kernel>{escape(kernel)}</kernel>
    <initrd>{escape(initrd)}</initrd>
    <cmdline>{escape(kernel_cmdline(spec))}</cmdline>
  </os>
  <features><acpi/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <serial type='file'>
      <source path={quoteattr(spec.console_log)}/>
      <target port='0'/>
    </serial>
    <serial type='unix'>
      <source mode='bind' path={quoteattr(spec.ctl_socket)}/>
      <target port='1'/>
    </serial>
    <interface type='bridge'>
      <source bridge='{topology.INTEGRATION_BRIDGE}'/>
      <virtualport type='openvswitch'/>
      <mac address='{spec.mac}'/>
      <target dev='{spec.port_name}'/>
      <model type='virtio'/>
      <driver>
        <!-- The guest computes its own checksums (as the lab's endpoints run
             with tx off): a frame a fast path redirects straight to another
             port is complete, with no checksum left for a host stack to finish. -->
        <host csum='off' tso4='off' tso6='off' ufo='off'/>
      </driver>
    </interface>
    <memballoon model='none'/>
  </devices>{_qemu_trace_args()}
</domain>
"""
