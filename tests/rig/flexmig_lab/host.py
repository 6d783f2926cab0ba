"""One lab host: its namespace, libvirtd + virtlogd, and OVS with br-int."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

from flexmig import exceptions, processutil
from flexmig_lab import daemon_config, emulator, image, netns, offload, topology
from flexmig_lab.topology import HostSpec

OVS_SCHEMA = "/usr/share/openvswitch/vswitch.ovsschema"
DAEMON_START_TIMEOUT = 30.0
# libvirtd answers once its QEMU driver has probed the emulator (see _libvirt_answers).
LIBVIRT_ANSWER_TIMEOUT = 90.0
AGENT_SOCKET = "/run/flexmig/agent.sock"

# Private directories bind-mounted over the system ones inside the host.
PRIVATE_DIRS = {
    "/etc/libvirt": "etc-libvirt",
    "/var/lib/libvirt": "lib-libvirt",
    "/var/log/libvirt": "log-libvirt",
    "/var/cache/libvirt": "cache-libvirt",
    "/etc/openvswitch": "etc-openvswitch",
    "/var/lib/openvswitch": "lib-openvswitch",
    "/var/log/openvswitch": "log-openvswitch",
}


STORE_ENV = "FLEXMIG_LAB_STORE"
OWN_STORE_FS_MB = 16384  # sparse: blocks are used only as guests write


STORE_CHOICES = ("shared", "own-fs", "own-fs-small-folios")
# The agents' [migration] dirty_sample_seconds (e.g. "1,5,15"; unset: the default).
DIRTY_SAMPLES_ENV = "FLEXMIG_LAB_DIRTY_SAMPLE_SECONDS"
DIRTY_REFRESH_ENV = "FLEXMIG_LAB_DIRTY_SAMPLE_REFRESH"


def store_choice() -> str:
    """``FLEXMIG_LAB_STORE``: ``shared`` (the lab directory's filesystem), ``own-fs``
    (each host's store on an ext4 of its own) or ``own-fs-small-folios`` (the same
    with the ``verity`` feature, which keeps ext4's page cache in 4 KiB folios on
    Linux >= 6.16, as every ext4 before it: tests/bench/store_folio_probe.py)."""
    choice = os.environ.get(STORE_ENV, "shared")
    if choice not in STORE_CHOICES:
        raise exceptions.InvalidInput(
            what=STORE_ENV, reason=f"{choice!r}: one of {', '.join(STORE_CHOICES)}"
        )
    return choice


def store_on_own_filesystem() -> bool:
    """Each host's store on its own filesystem (``FLEXMIG_LAB_STORE=own-fs*``)."""
    return store_choice() != "shared"


class LabHost:
    def __init__(self, spec: HostSpec, lab_dir: Path) -> None:
        self.spec = spec
        self.dir = lab_dir / "hosts" / spec.name
        self.ns = netns.HostNamespace(spec.netns, self.dir)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def store_dir(self) -> Path:
        """Where file-backed guest memory lives (qemu.conf memory_backing_dir)."""
        return self.dir / "store"

    @property
    def libvirt_socket(self) -> Path:
        return self.ns.root_path("/run/libvirt/libvirt-sock")

    @property
    def local_uri(self) -> str:
        """URI reaching this host's libvirtd from the machine's own namespace."""
        return f"qemu:///system?socket={self.libvirt_socket}"

    # -- bring-up ---------------------------------------------------------
    @property
    def agent_socket(self) -> Path:
        return self.ns.root_path(AGENT_SOCKET)

    def up(self, key_file: Path, memory_budget_mb: int) -> None:
        self._prepare_dirs()
        self.write_agent_conf(key_file, memory_budget_mb)
        binds = {target: str(self.dir / sub) for target, sub in PRIVATE_DIRS.items()}
        binds["/etc/hosts"] = str(self.dir / "hosts")
        binds.update(emulator.host_binds(image.cache_dir()))
        self.ns.start(self.spec.hostname, binds)
        if store_on_own_filesystem():
            self.mount_own_store(OWN_STORE_FS_MB)
        self._start_ovs()
        self._start_libvirt()
        self.start_agent()
        offload.start_if_available(self)

    def write_agent_conf(self, key_file: Path, memory_budget_mb: int) -> None:
        (self.dir / "agent.conf").write_text(
            daemon_config.agent_conf(
                self.spec,
                key_file=str(key_file),
                store_dir=str(self.store_dir),
                unix_socket=AGENT_SOCKET,
                memory_budget_mb=memory_budget_mb,
                cgroup_parent=topology.cgroup_parent(),
                dirty_sample_seconds=os.environ.get(DIRTY_SAMPLES_ENV, ""),
                dirty_sample_refresh=os.environ.get(DIRTY_REFRESH_ENV, ""),
            )
        )

    def start_agent(self) -> None:
        if self.agent_socket.exists():
            return
        self.ns.spawn(
            [
                sys.executable,
                "-m",
                "agents.agent.service",
                "--config-file",
                str(self.dir / "agent.conf"),
            ],
            self.dir / "agent.log",
        )
        processutil.wait_for(
            lambda: self.agent_socket.exists(),
            timeout=DAEMON_START_TIMEOUT,
            what=f"flexmig-agent on host {self.name} (see {self.dir}/agent.log)",
        )

    def stop_agent(self) -> None:
        self.ns.run(["pkill", "-f", "agents.agent.service"], check=False)
        processutil.wait_for(
            lambda: not self.ns.run(
                ["pgrep", "-f", "agents.agent.service"], check=False
            ).stdout.strip(),
            timeout=10,
            what=f"flexmig-agent on {self.name} to stop",
        )
        self.agent_socket.unlink(missing_ok=True)

    def mount_own_store(self, size_mb: int) -> None:
        """The store on a filesystem of its own (a sparse ext4 image of ``size_mb``),
        as a compute host with a dedicated memory_backing_dir has it: libvirt's fsync
        of its own files then never waits for guest memory's writeback (ext4
        data=ordered commits the whole filesystem's journal, with the data it
        orders).  The mount lives in the host's mount namespace and goes with it;
        a store already on its own filesystem is left as it is."""
        if f" {self.store_dir} " in self.ns.run(["cat", "/proc/self/mounts"]).stdout:
            return
        image = self.dir / "store.img"
        image.unlink(missing_ok=True)
        processutil.run(["truncate", "-s", f"{size_mb}M", str(image)])
        features = ["-O", "verity"] if store_choice() == "own-fs-small-folios" else []
        processutil.run(["mkfs.ext4", "-q", "-F", "-m", "0", *features, str(image)], timeout=120)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.ns.run(["mount", "-o", "loop", str(image), str(self.store_dir)])

    def _prepare_dirs(self) -> None:
        first_time = not (self.dir / "etc-libvirt").exists()
        for sub in PRIVATE_DIRS.values():
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        etc = self.dir / "etc-libvirt"
        if first_time:
            shutil.copytree("/etc/libvirt", etc, dirs_exist_ok=True, symlinks=True)
            # No libvirt default network (and its dnsmasq) inside lab hosts.
            shutil.rmtree(etc / "qemu" / "networks" / "autostart", ignore_errors=True)
            (etc / "host-uuid").write_text(str(uuid.uuid4()))
        host_uuid = (etc / "host-uuid").read_text().strip()
        (etc / "libvirtd.conf").write_text(daemon_config.libvirtd_conf(self.spec, host_uuid))
        (etc / "qemu.conf").write_text(daemon_config.qemu_conf(self.spec, str(self.store_dir)))
        hooks = etc / "hooks"
        hooks.mkdir(exist_ok=True)
        (hooks / "qemu").write_text(
            daemon_config.qemu_hook(sys.executable, str(self.store_dir), topology.cgroup_parent())
        )
        (hooks / "qemu").chmod(0o755)
        (self.dir / "hosts").write_text(topology.etc_hosts())
        for sub in ("qemu", "qemu/save", "qemu/snapshot", "qemu/dump", "qemu/ram", "images"):
            (self.dir / "lib-libvirt" / sub).mkdir(parents=True, exist_ok=True)

    def _start_ovs(self) -> None:
        db = self.dir / "etc-openvswitch" / "conf.db"
        if not db.exists():
            processutil.run(["ovsdb-tool", "create", str(db), OVS_SCHEMA])
        if not self._pid_alive("/run/openvswitch/ovsdb-server.pid"):
            self.ns.run(
                [
                    "ovsdb-server",
                    "/etc/openvswitch/conf.db",
                    "--remote=punix:/run/openvswitch/db.sock",
                    "--pidfile=/run/openvswitch/ovsdb-server.pid",
                    "--detach",
                    "--log-file=/var/log/openvswitch/ovsdb-server.log",
                ]
            )
            self.ns.run(["ovs-vsctl", "--timeout=10", "--no-wait", "init"])
        if not self._pid_alive("/run/openvswitch/ovs-vswitchd.pid"):
            self.ns.run(
                [
                    "ovs-vswitchd",
                    "unix:/run/openvswitch/db.sock",
                    "--pidfile=/run/openvswitch/ovs-vswitchd.pid",
                    "--detach",
                    "--log-file=/var/log/openvswitch/ovs-vswitchd.log",
                ]
            )
        br = topology.INTEGRATION_BRIDGE
        self.ovs_vsctl(
            "--may-exist",
            "add-br",
            br,
            "--",
            "set",
            "bridge",
            br,
            "datapath_type=netdev",
            "--",
            "--may-exist",
            "add-port",
            br,
            topology.HOST_TENANT_IF,
        )
        self.ns.run(["ip", "link", "set", br, "up"])

    def _start_libvirt(self) -> None:
        if not self._pid_alive("/run/virtlogd.pid"):
            self.ns.run(["virtlogd", "--daemon", "--pid-file", "/run/virtlogd.pid"])
        if not self._pid_alive("/run/libvirtd.pid"):
            self.ns.run(["libvirtd", "--daemon", "--listen", "--pid-file", "/run/libvirtd.pid"])
        processutil.wait_for(
            lambda: self.libvirt_socket.exists(),
            timeout=DAEMON_START_TIMEOUT,
            what=f"libvirtd socket on host {self.name} (see {self.dir}/log-libvirt)",
        )
        processutil.wait_for(
            self._libvirt_answers,
            timeout=LIBVIRT_ANSWER_TIMEOUT,
            interval=0.2,
            what=f"libvirtd on host {self.name} to answer",
        )

    def _libvirt_answers(self) -> bool:
        # A first connection waits for the QEMU driver to probe the emulator's
        # capabilities, seconds longer than one try on a busy machine.
        try:
            cmd = ["virsh", "-c", "qemu:///system", "version"]
            return self.ns.run(cmd, check=False, timeout=10).returncode == 0
        except exceptions.Timeout:
            return False

    def _pid_alive(self, pid_file: str) -> bool:
        try:
            pid = int(self.ns.root_path(pid_file).read_text())
        except (FileNotFoundError, ValueError):
            return False
        return self.ns.pid_alive(pid)

    # -- operations -------------------------------------------------------
    def ovs_vsctl(self, *args: str) -> str:
        return self.ns.run(["ovs-vsctl", "--timeout=10", *args]).stdout

    def status(self) -> dict[str, object]:
        daemons = {
            "libvirtd": "/run/libvirtd.pid",
            "virtlogd": "/run/virtlogd.pid",
            "ovsdb-server": "/run/openvswitch/ovsdb-server.pid",
            "ovs-vswitchd": "/run/openvswitch/ovs-vswitchd.pid",
        }
        alive = self.ns.holder_pid is not None
        agent = alive and self.agent_socket.exists()
        return {
            "name": self.name,
            "netns": self.spec.netns,
            "hostname": self.spec.hostname,
            "mgmt_ip": self.spec.mgmt_ip,
            "namespace": "up" if alive else "down",
            "daemons": {
                **{d: (alive and self._pid_alive(p)) for d, p in daemons.items()},
                "flexmig-agent": agent,
                "flexmig-offload": alive and offload.running(self),
            },
        }

    def down(self) -> None:
        self.ns.destroy()
        if self.dir.exists():
            shutil.rmtree(self.dir)


def check_prerequisites() -> None:
    for tool in (
        "ip",
        "nsenter",
        "unshare",
        "libvirtd",
        "virtlogd",
        "ovs-vswitchd",
        "ovsdb-server",
        "qemu-system-x86_64",
    ):
        if shutil.which(tool) is None:
            raise exceptions.MissingPrerequisite(
                what=tool, hint="run tools/setup.sh to install the lab's packages"
            )
