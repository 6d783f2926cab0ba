"""The lab's QEMU: Debian 12's bookworm-backports build, unpacked into the cache.

Why not the system's QEMU 7.2: under TCG its migration dirty tracking loses
guest writes.  The fast path of ``cpu_physical_memory_sync_dirty_bitmap``
clears the migration dirty bits without resetting the TCG TLB's NOTDIRTY
flags, so a vCPU keeps writing through a TLB entry that no longer marks the
page dirty, and the page is never sent again (fixed upstream in QEMU 9.0,
"physmem: Fix migration dirty bitmap coherency with TCG memory access").  In
the lab this showed as stale pages found by the guest's ``verify`` and guest
kernels panicking on corrupted lists after switchover, in ~40% of long
precopy migrations on a loaded host.  KVM hosts never take that path.

The packages come from the Debian archive through apt itself (signatures and
checksums verified) with a private sources list and state directory, so the
machine's apt configuration and installed QEMU are left alone.  Each lab host
then sees it *installed*: its mount namespace binds the unpacked binary, its
modules and firmware over the system paths, so libvirt runs
``/usr/bin/qemu-system-x86_64`` as on any compute host, and QEMU never loads a
7.2 module (a module from another build makes QEMU 10 abort).
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from flexmig import exceptions, processutil

SUITE = "bookworm-backports"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("qemu-system-x86", "qemu-system-common", "qemu-system-data", "seabios")
MIN_VERSION = (9, 0)  # the first release with the dirty-tracking fix
# Lab-host path -> path under the unpacked root.  ipxe's option ROMs stay the
# system's (not in backports; the ROM interface is stable).
HOST_PATHS = (
    "usr/bin/qemu-system-x86_64",
    "usr/lib/x86_64-linux-gnu/qemu",
    "usr/share/qemu",
    "usr/share/seabios",
)


def _apt_options(base: Path) -> list[str]:
    return [
        "-o",
        f"Dir::Etc::SourceList={base / 'sources.list'}",
        "-o",
        "Dir::Etc::SourceParts=/nonexistent",
        "-o",
        f"Dir::State::Lists={base / 'lists'}",
        "-o",
        f"Dir::Cache={base / 'apt-cache'}",
        "-o",
        "APT::Get::List-Cleanup=0",
    ]


def upstream_version(deb_version: str) -> tuple[int, int]:
    """(major, minor) of a Debian QEMU version.

    >>> upstream_version("1:10.0.2+ds-2+deb13u1~bpo12+1")
    (10, 0)
    >>> upstream_version("1:7.2+dfsg-7+deb12u18")
    (7, 2)
    """
    match = re.match(r"^(?:\d+:)?(\d+)\.(\d+)", deb_version)
    if not match:
        raise exceptions.InvalidInput(what="QEMU version", reason=deb_version)
    return int(match.group(1)), int(match.group(2))


def _download(base: Path, workdir: Path) -> list[Path]:
    (base / "lists").mkdir(parents=True, exist_ok=True)
    (base / "apt-cache").mkdir(exist_ok=True)
    (base / "sources.list").write_text(f"deb {MIRROR} {SUITE} main\n")
    opts = _apt_options(base)
    processutil.run(["apt-get", *opts, "update", "-q"], timeout=600)
    processutil.run(["apt-get", *opts, "download", *PACKAGES], timeout=900, cwd=workdir)
    return [Path(p) for p in sorted(glob.glob(str(workdir / "*.deb")))]


def _deb_version(deb: Path) -> str:
    out = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def build(cache: Path) -> Path:
    """Fetch and unpack the lab QEMU if it is not there; return the unpacked root."""
    base = cache / "qemu"
    root = base / "root"
    done = base / "unpacked"
    if done.exists():
        return root
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        debs = _download(base, Path(tmp))
        qemu = [d for d in debs if d.name.startswith("qemu-system-x86_")]
        version = _deb_version(qemu[0]) if qemu else "none"
        if not qemu or upstream_version(version) < MIN_VERSION:
            raise exceptions.MissingPrerequisite(
                what=f"QEMU >= {MIN_VERSION[0]}.{MIN_VERSION[1]} in {SUITE}",
                hint="the archive no longer offers it; point MIRROR/SUITE at a newer build",
            )
        shutil.rmtree(root, ignore_errors=True)
        for deb in debs:
            processutil.run(["dpkg-deb", "-x", str(deb), str(root)], timeout=300)
    done.write_text(version + "\n")
    return root


def host_binds(cache: Path) -> dict[str, str]:
    """Bind mounts (target -> source) that install the lab QEMU in a lab host."""
    root = cache / "qemu" / "root"
    if not (cache / "qemu" / "unpacked").exists():
        raise exceptions.MissingPrerequisite(
            what=f"the lab QEMU in {root}", hint="run 'flexmig-lab image build' (setup does)"
        )
    return {"/" + rel: str(root / rel) for rel in HOST_PATHS}
