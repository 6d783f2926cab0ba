"""Where a lab guest's working set sits in its RAM, at the kernel's fault granule.

    FLEXMIG_LAB_NAME=<lab> .venv/bin/python -m tests.bench.wss_layout_probe [--wss 200M]

Boots the lab (two hosts) and the split benchmark's guest (512 MiB, file-backed,
``dirtier``), waits for its working set to be filled, then reads QEMU's
memory file on the host and finds the working set's pages by their content
(``workset.h``: word k = base + k * golden).  Reports how many 1 MiB chunks
and 2 MiB folios hold at least one working-set page, and the same for every
non-zero page: what a residency keeper (or the kernel's 2 MiB folios) must
keep resident for the guest's working set not to fault.
"""

from __future__ import annotations

import argparse
import array
import time
from pathlib import Path

from agents.agent import residency
from flexmig_lab import image, vm
from flexmig_lab.lab import Lab
from tests.bench.bench_split import RAM_MIB, wait_ready

GOLDEN = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1
PAGE = 4096


def _qemu_pid(name: str) -> int:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"guest={name}" in ",".join(args):
            return int(cmdline.parent.name)
    raise LookupError(f"no QEMU for {name}")


def classify(path: str, size: int) -> tuple[list[int], list[int]]:
    """Per page: working-set pages and non-zero pages (page indexes)."""
    wss, used = [], []
    with open(path, "rb") as f:
        for index in range(size // PAGE):
            page = f.read(PAGE)
            if page.count(0) == PAGE:
                continue
            used.append(index)
            w = array.array("Q", page[:24])
            if (w[1] - w[0]) & MASK == GOLDEN and (w[2] - w[1]) & MASK == GOLDEN:
                wss.append(index)
    return wss, used


def coverage(pages: list[int], granule_pages: int) -> int:
    return len({p // granule_pages for p in pages})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wss", default="200M")
    args = parser.parse_args()
    image.build()
    lab = Lab()
    lab.down()
    lab.up(2)
    name = "wss-probe"
    try:
        vm.create(
            lab,
            "A",
            name=name,
            ram=f"{RAM_MIB}M",
            workload=f"dirtier:wss={args.wss},rate=2000",
            memory_backing="file",
        )
        wait_ready(vm.LabVM(lab, name))
        time.sleep(5)
        path = residency.GuestRam.find(_qemu_pid(name), RAM_MIB << 20).path
        wss, used = classify(path, RAM_MIB << 20)
        for label, pages in (("working set", wss), ("non-zero", used)):
            mib = len(pages) * PAGE >> 20
            print(
                f"{label}: {len(pages)} pages ({mib} MiB); in 1 MiB chunks: "
                f"{coverage(pages, 256)} MiB; in 2 MiB folios: {2 * coverage(pages, 512)} MiB"
            )
    finally:
        lab.down()


if __name__ == "__main__":
    main()
