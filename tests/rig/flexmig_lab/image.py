"""The measuring guest image: Debian's cloud kernel plus our own initramfs.

The kernel package is downloaded from the Debian archive and unpacked into the
project's cache (never installed on the host).  The initramfs holds
busybox-static, the guest programs built statically from ``guest/`` and the
virtio network modules in dependency order.  Builds are keyed by a hash of
their inputs, so re-running setup is cheap.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from flexmig import exceptions, processutil
from flexmig_lab import emulator

KERNEL_METAPACKAGE = "linux-image-cloud-amd64"
GUEST_SRC = Path(__file__).parent / "guest"
GUEST_PROGRAMS = ("dirtier", "verify", "heartbeat")
# The project's traffic generator, static in the guest: a migrating VM carries
# live flows through its own tap port.
GUEST_TRAFFIC = (Path(__file__).parent / "traffic" / "udpgen.c",)
GUEST_MODULES = ("virtio_pci", "virtio_net")
BUSYBOX = "/bin/busybox"


@dataclasses.dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path


def cache_dir() -> Path:
    default = Path(__file__).resolve().parents[3] / ".cache" / "flexmig"
    return Path(os.environ.get("FLEXMIG_CACHE_DIR", default))


def module_load_order(modules_dep: str, wanted: tuple[str, ...]) -> list[str]:
    """Module paths (as in modules.dep) to insmod, dependencies first.

    >>> dep = "k/virtio_net.ko: k/net_failover.ko k/virtio.ko\\n" \\
    ...       "k/net_failover.ko: k/failover.ko\\nk/failover.ko:\\nk/virtio.ko:\\n"
    >>> module_load_order(dep, ("virtio_net",))
    ['k/virtio.ko', 'k/failover.ko', 'k/net_failover.ko', 'k/virtio_net.ko']
    """
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        if ":" not in line:
            continue
        path, rest = line.split(":", 1)
        deps[path] = rest.split()
        by_name[Path(path).name.split(".ko")[0]] = path
    order: list[str] = []

    def visit(path: str) -> None:
        if path in order:
            return
        # modules.dep lists every transitive dependency; load them deepest first.
        for dep in reversed(deps.get(path, [])):
            visit(dep)
        order.append(path)

    for name in wanted:
        if name not in by_name:
            raise exceptions.MissingPrerequisite(
                what=f"kernel module {name}", hint="the guest kernel package lacks it"
            )
        visit(by_name[name])
    return order


def _kernel_package() -> str:
    out = processutil.run(["apt-cache", "depends", KERNEL_METAPACKAGE]).stdout
    for raw in out.splitlines():
        line = raw.strip()
        if line.startswith("Depends:") and "linux-image-" in line:
            return line.split()[1]
    raise exceptions.MissingPrerequisite(
        what=f"the package behind {KERNEL_METAPACKAGE}", hint="run 'apt-get update' first"
    )


def fetch_kernel(cache: Path) -> tuple[Path, Path]:
    """Return (vmlinuz, modules dir) from the unpacked cloud kernel package."""
    root = cache / "kernel"
    found = sorted(glob.glob(str(root / "boot" / "vmlinuz-*")))
    if not found:
        package = _kernel_package()
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            processutil.run(["apt-get", "download", package], timeout=600, cwd=tmp)
            debs = glob.glob(os.path.join(tmp, "*.deb"))
            if not debs:
                raise exceptions.MissingPrerequisite(what=package, hint="apt-get download failed")
            root.mkdir(parents=True, exist_ok=True)
            processutil.run(["dpkg-deb", "-x", debs[0], str(root)], timeout=300)
        found = sorted(glob.glob(str(root / "boot" / "vmlinuz-*")))
    vmlinuz = Path(found[-1])
    version = vmlinuz.name.removeprefix("vmlinuz-")
    modules_dir = root / "lib" / "modules" / version
    if not (modules_dir / "modules.dep").exists():
        # The package leaves modules.dep to its postinst; make it here.
        processutil.run(["depmod", "-b", str(root), version], timeout=300)
    return vmlinuz, modules_dir


def _inputs_digest(modules_dir: Path) -> str:
    h = hashlib.sha256()
    for path in [*sorted(GUEST_SRC.iterdir()), *GUEST_TRAFFIC]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(str(modules_dir).encode())
    h.update(Path(BUSYBOX).read_bytes())
    return h.hexdigest()[:16]


def _compile_programs(out_dir: Path) -> None:
    sources = [GUEST_SRC / f"{prog}.c" for prog in GUEST_PROGRAMS] + list(GUEST_TRAFFIC)
    for source in sources:
        processutil.run(
            [
                "gcc",
                "-static",
                "-O2",
                "-std=gnu11",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-o",
                str(out_dir / source.stem),
                str(source),
            ],
            timeout=120,
        )


def _stage_initramfs(stage: Path, modules_dir: Path) -> None:
    for sub in ("bin", "proc", "sys", "dev", "etc", "lib/modules", "tmp"):
        (stage / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, stage / "bin" / "busybox")
    _compile_programs(stage / "bin")
    shutil.copy2(GUEST_SRC / "init", stage / "init")
    order = module_load_order((modules_dir / "modules.dep").read_text(), GUEST_MODULES)
    for rel in order:
        dest = stage / "lib" / "modules" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(modules_dir / rel, dest)
    (stage / "etc" / "modules-order").write_text("\n".join(order) + "\n")


def _pack_cpio(stage: Path, out: Path) -> None:
    files = subprocess.run(["find", "."], cwd=stage, capture_output=True, check=True).stdout
    cpio = subprocess.run(
        ["cpio", "--quiet", "-o", "-H", "newc"],
        cwd=stage,
        input=files,
        capture_output=True,
        check=True,
    ).stdout
    tmp = out.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(cpio, compresslevel=6))
    tmp.replace(out)


def build(cache: Path | None = None) -> GuestImage:
    """Fetch the kernel and build the initramfs if their inputs changed."""
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    vmlinuz, modules_dir = fetch_kernel(cache)
    initrd = cache / f"initrd-{_inputs_digest(modules_dir)}.cpio.gz"
    if not initrd.exists():
        for old in cache.glob("initrd-*.cpio.gz"):
            old.unlink()
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            _stage_initramfs(Path(tmp), modules_dir)
            _pack_cpio(Path(tmp), initrd)
    emulator.build(cache)
    return GuestImage(kernel=vmlinuz, initrd=initrd)


def existing() -> GuestImage:
    """The built image, or a clear error saying how to build it."""
    cache = cache_dir()
    kernels = sorted(glob.glob(str(cache / "kernel" / "boot" / "vmlinuz-*")))
    initrds = sorted(glob.glob(str(cache / "initrd-*.cpio.gz")))
    if not kernels or not initrds:
        raise exceptions.MissingPrerequisite(
            what=f"guest image in {cache}", hint="run 'flexmig-lab image build' (setup does)"
        )
    emulator.host_binds(cache)  # raises the same way when the lab QEMU is missing
    return GuestImage(kernel=Path(kernels[-1]), initrd=Path(initrds[-1]))
