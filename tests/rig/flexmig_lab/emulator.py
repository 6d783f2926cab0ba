"""The lab's QEMU and libvirt: Debian 12's bookworm-backports builds, unpacked into the cache.

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

libvirt can come the same way (11.x; Debian 12 has 9.0) with
``FLEXMIG_LAB_LIBVIRT=backports``, because the knobs the migration plan is to
pick need it: postcopy-preempt (libvirt turns it on itself from 10.0), the switchover bandwidth
hint, multifd compression levels.  Each host then binds its daemons, driver
modules, data (cpu_map), virsh and the client libraries (its agent's
libvirt-python then speaks 11.x too) over the system's.  The default,
``system``, keeps Debian's 9.0 until the Nova path has been run on 11.x.

QEMU can also be Debian 13's current stable build (10.0.x, trixie) with
``FLEXMIG_LAB_QEMU=trixie``.  bookworm-backports still carries 10.0.2, which
lacks the upstream fix "migration: Don't sync volatile memory after migration
completes" (QEMU 10.0.3 and 10.1; 7.2.19 for Debian 12's own 7.2): its
destination msyncs all of a file-backed guest's RAM before it resumes the
guest, inside the downtime (strace in the lab: ``msync(.., 536870912,
MS_SYNC) <0.21 s>`` for a 512 MiB guest).  Compute hosts with a current QEMU
never pay that, so the file-backed benchmarks (split) are taken on both.
trixie's build needs trixie's C library, so its libraries are unpacked beside
it and a lab host's ``/usr/bin/qemu-system-x86_64`` is a two-line wrapper that
starts it through trixie's dynamic loader; libvirt runs it like any emulator.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from flexmig import exceptions, processutil

SUITE = "bookworm-backports"
MIRROR = "http://deb.debian.org/debian"
LIBVIRT_ENV = "FLEXMIG_LAB_LIBVIRT"
QEMU_ENV = "FLEXMIG_LAB_QEMU"
LIB = "usr/lib/x86_64-linux-gnu"
QEMU_BINARY = "usr/bin/qemu-system-x86_64"
BACKPORTS_SOURCES = (f"deb {MIRROR} {SUITE} main",)
TRIXIE_SOURCES = (
    f"deb {MIRROR} trixie main",
    f"deb {MIRROR} trixie-updates main",
    "deb http://deb.debian.org/debian-security trixie-security main",
)
# A trixie QEMU's own dependencies, resolved from the archive; what only
# package scripts or other programs need (PAM, debconf, terminal UIs) is left out.
_NOT_FOR_QEMU = re.compile(
    r"^lib(pam|semanage|sepol|debian-installer|debconfclient|newt|slang|textwrap|asound"
    r"|brlapi|readline|ncurses|tinfo)"
)


@dataclasses.dataclass(frozen=True)
class Backport:
    name: str  # the cache subdirectory
    packages: tuple[str, ...]
    versioned_by: str  # the package whose version is the build's
    min_version: tuple[int, int]
    # Lab-host paths bound to the same path under the unpacked root.
    host_paths: tuple[str, ...]
    # Shared libraries: the system's file (its soname link resolved) gets the
    # backport's, so every program in the host loads the backport's.
    libraries: tuple[str, ...] = ()
    sources: tuple[str, ...] = BACKPORTS_SOURCES
    # Built for another release: its libraries come too (resolved from the
    # archive), and QEMU_BINARY is started through that release's loader.
    foreign: bool = False


# ipxe's option ROMs stay the system's (not in backports; the ROM interface is stable).
QEMU = Backport(
    name="qemu",
    packages=("qemu-system-x86", "qemu-system-common", "qemu-system-data", "seabios"),
    versioned_by="qemu-system-x86_",
    min_version=(9, 0),  # the first release with the dirty-tracking fix
    host_paths=(
        "usr/bin/qemu-system-x86_64",
        f"{LIB}/qemu",
        "usr/share/qemu",
        "usr/share/seabios",
    ),
)
QEMU_TRIXIE = dataclasses.replace(
    QEMU,
    name="qemu-trixie",
    min_version=(10, 0),
    sources=TRIXIE_SOURCES,
    foreign=True,
)
LIBVIRT_DRIVERS = ("qemu", "network", "nodedev", "nwfilter", "secret", "storage")
LIBVIRT = Backport(
    name="libvirt",
    packages=(
        "libvirt0",
        "libvirt-common",
        "libvirt-clients",
        "libvirt-daemon",
        "libvirt-daemon-common",
        "libvirt-daemon-log",
        "libvirt-daemon-lock",
        *(f"libvirt-daemon-driver-{d}" for d in LIBVIRT_DRIVERS),
    ),
    versioned_by="libvirt-daemon_",
    min_version=(11, 1),  # the switchover bandwidth hint
    host_paths=(
        "usr/sbin/libvirtd",
        "usr/sbin/virtlogd",
        "usr/bin/virsh",
        f"{LIB}/libvirt",
        "usr/lib/libvirt",
        "usr/share/libvirt",
    ),
    libraries=(
        f"{LIB}/libvirt.so.0",
        f"{LIB}/libvirt-qemu.so.0",
        f"{LIB}/libvirt-lxc.so.0",
        f"{LIB}/libvirt-admin.so.0",
    ),
)


def backports() -> tuple[Backport, ...]:
    """What the lab hosts run instead of the system's: QEMU always, libvirt if asked."""
    choice = os.environ.get(LIBVIRT_ENV, "system")
    if choice not in ("backports", "system"):
        raise exceptions.InvalidInput(
            what=LIBVIRT_ENV, reason=f"{choice!r}: 'system' (default) or 'backports'"
        )
    qemu = lab_qemu()
    return (qemu, LIBVIRT) if choice == "backports" else (qemu,)


def lab_qemu() -> Backport:
    """Which QEMU build the lab hosts run (``FLEXMIG_LAB_QEMU``)."""
    choice = os.environ.get(QEMU_ENV, "backports")
    if choice not in ("backports", "trixie"):
        raise exceptions.InvalidInput(
            what=QEMU_ENV, reason=f"{choice!r}: 'backports' (default) or 'trixie'"
        )
    return QEMU_TRIXIE if choice == "trixie" else QEMU


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
    """(major, minor) of a Debian package version.

    >>> upstream_version("1:10.0.2+ds-2+deb13u1~bpo12+1")
    (10, 0)
    >>> upstream_version("1:7.2+dfsg-7+deb12u18")
    (7, 2)
    """
    match = re.match(r"^(?:\d+:)?(\d+)\.(\d+)", deb_version)
    if not match:
        raise exceptions.InvalidInput(what="package version", reason=deb_version)
    return int(match.group(1)), int(match.group(2))


def _download(base: Path, workdir: Path, backport: Backport) -> list[Path]:
    (base / "lists").mkdir(parents=True, exist_ok=True)
    (base / "apt-cache").mkdir(exist_ok=True)
    (base / "sources.list").write_text("\n".join(backport.sources) + "\n")
    opts = _apt_options(base)
    processutil.run(["apt-get", *opts, "update", "-q"], timeout=600)
    packages = _with_libraries(opts, backport.packages) if backport.foreign else backport.packages
    processutil.run(["apt-get", *opts, "download", *packages], timeout=900, cwd=workdir)
    return [Path(p) for p in sorted(glob.glob(str(workdir / "*.deb")))]


def _with_libraries(opts: list[str], packages: tuple[str, ...]) -> tuple[str, ...]:
    """``packages`` and every library package they need, recursively."""
    skip = ("recommends", "suggests", "conflicts", "breaks", "replaces", "enhances")
    flags = [f"--no-{k}" for k in skip]
    out = processutil.run(
        ["apt-cache", *opts, "depends", "--recurse", *flags, *packages], timeout=120
    ).stdout
    return tuple(sorted(set(packages) | set(libraries_of(out))))


def libraries_of(depends_output: str) -> list[str]:
    """Library packages named as top-level lines of ``apt-cache depends --recurse``.

    >>> libraries_of("qemu-system-x86\\n  Depends: libc6\\nlibc6\\nlibpam0g\\n<virt>\\nzlib1g\\n")
    ['libc6', 'zlib1g']
    """
    names = {line.strip() for line in depends_output.splitlines() if line and line[0] != " "}
    wanted = re.compile(r"^(lib|zlib1g$|gcc-\d+-base$)")
    return sorted(n for n in names if wanted.match(n) and not _NOT_FOR_QEMU.match(n))


def loader_wrapper(root: Path) -> str:
    """A lab host's qemu-system-x86_64 for a build of another release: its loader starts it."""
    lib = root / LIB
    return (
        "#!/bin/sh\n"
        f'exec {lib}/ld-linux-x86-64.so.2 --library-path {lib} --argv0 "$0" '
        f'{root / QEMU_BINARY} "$@"\n'
    )


def _deb_version(deb: Path) -> str:
    out = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def build(cache: Path) -> Path:
    """Fetch and unpack the lab's backports if they are not there; return QEMU's root."""
    for backport in backports():
        _build(cache, backport)
    return cache / lab_qemu().name / "root"


def _build(cache: Path, backport: Backport) -> Path:
    base = cache / backport.name
    root = base / "root"
    done = base / "unpacked"
    if done.exists():
        return root
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        debs = _download(base, Path(tmp), backport)
        main = [d for d in debs if d.name.startswith(backport.versioned_by)]
        version = _deb_version(main[0]) if main else "none"
        if not main or upstream_version(version) < backport.min_version:
            low = ".".join(map(str, backport.min_version))
            raise exceptions.MissingPrerequisite(
                what=f"{backport.name} >= {low} in {SUITE}",
                hint="the archive no longer offers it; point MIRROR/SUITE at a newer build",
            )
        shutil.rmtree(root, ignore_errors=True)
        for deb in debs:
            processutil.run(["dpkg-deb", "-x", str(deb), str(root)], timeout=300)
    if backport.foreign:
        wrapper = base / "qemu-system-x86_64"
        wrapper.write_text(loader_wrapper(root))
        wrapper.chmod(0o755)
    done.write_text(version + "\n")
    return root


def host_binds(cache: Path) -> dict[str, str]:
    """Bind mounts (target -> source) that install the lab's backports in a lab host."""
    binds: dict[str, str] = {}
    for backport in backports():
        root = cache / backport.name / "root"
        if not (cache / backport.name / "unpacked").exists():
            raise exceptions.MissingPrerequisite(
                what=f"the lab's {backport.name} in {root}",
                # setup builds what the environment asks for: FLEXMIG_LAB_QEMU and
                # FLEXMIG_LAB_LIBVIRT choose builds it does not fetch by default.
                hint=f"run 'flexmig-lab image build' with the same {QEMU_ENV} and "
                f"{LIBVIRT_ENV} (setup does, with them set)",
            )
        binds.update({"/" + rel: str(root / rel) for rel in backport.host_paths})
        if backport.foreign:
            binds["/" + QEMU_BINARY] = str(cache / backport.name / "qemu-system-x86_64")
        for lib in backport.libraries:
            # A bind follows the soname link: mount over the file it names.
            binds[os.path.realpath("/" + lib)] = os.path.realpath(root / lib)
    return binds


def installed_version(cache: Path, backport: Backport) -> str | None:
    """The Debian version unpacked for ``backport``, if any."""
    done = cache / backport.name / "unpacked"
    return done.read_text().strip() if done.exists() else None
