"""What one fault on a dropped page of a split VM's memory file reads back.

    .venv/bin/python -m tests.bench.store_folio_probe [--dir DIR] [--out FILE]

Maps a 64 MiB file shared, as QEMU maps file-backed guest RAM, with each
advice QEMU's mapping could carry (none; ``MADV_HUGEPAGE``, which QEMU gives
every RAM block; ``MADV_RANDOM``), writes every page, writes the file back,
drops it (``MADV_PAGEOUT`` and ``POSIX_FADV_DONTNEED``, as the residency
keeper does), touches one page and counts the pages resident again
(``mincore``) and how much of the mapping the kernel mapped in 2 MiB
folios after the writes (``FilePmdMapped`` in ``/proc/self/smaps``).
No root, no lab: the filesystem of ``--dir`` is the one measured (put it on the
store's: the lab's is the root filesystem).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import platform
import subprocess
import tempfile
from pathlib import Path

SIZE = 64 << 20
PAGE = 4096
ADVICE = {"none": None, "MADV_HUGEPAGE": 14, "MADV_RANDOM": 1}
MADV_PAGEOUT = 21
_LIBC = ctypes.CDLL(None, use_errno=True)


def _pmd_mapped_kib(addr: int) -> int:
    """This mapping's file memory mapped by huge (2 MiB) page-table entries."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            inside = int(head.split("-")[0], 16) == addr
        elif inside and head == "FilePmdMapped:":
            return int(line.split()[1])
    return 0


def _resident(addr: int) -> int:
    vec = (ctypes.c_ubyte * (SIZE // PAGE))()
    if _LIBC.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(SIZE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec)


def probe(directory: Path, advice: int | None) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(dir=directory) as tmp:
        fd = tmp.fileno()
        os.ftruncate(fd, SIZE)
        with mmap.mmap(fd, SIZE, mmap.MAP_SHARED) as ram:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(ram))
            size = ctypes.c_size_t(SIZE)
            if advice is not None and _LIBC.madvise(ctypes.c_void_p(addr), size, advice):
                raise OSError(ctypes.get_errno(), "madvise")
            for offset in range(0, SIZE, PAGE):
                ram[offset] = 1
            written_huge = _pmd_mapped_kib(addr)
            ram.flush()
            _LIBC.madvise(ctypes.c_void_p(addr), size, MADV_PAGEOUT)
            os.posix_fadvise(fd, 0, SIZE, os.POSIX_FADV_DONTNEED)
            dropped = _resident(addr)
            _ = ram[(10 << 20) + 7 * PAGE]  # one page, inside the file
            row = {"written_huge_kib": written_huge, "left_after_drop": dropped}
            row |= {"read_by_one_fault": _resident(addr)}
            os.posix_fadvise(fd, 0, SIZE, os.POSIX_FADV_DONTNEED)
            return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", str(args.dir)], capture_output=True, text=True, check=True
    ).stdout.strip()
    lines = [
        f"Linux {platform.release()}, {args.dir} on {fs}; "
        f"THP: {Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()}",
        "",
        "| advice on the mapping | mapped in 2 MiB folios after writing (KiB) | pages left after "
        "the drop | pages read by one fault |",
        "|---|---|---|---|",
    ]
    for name, advice in ADVICE.items():
        row = probe(args.dir, advice)
        lines.append(
            f"| {name} | {row['written_huge_kib']} | {row['left_after_drop']} "
            f"| {row['read_by_one_fault']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
