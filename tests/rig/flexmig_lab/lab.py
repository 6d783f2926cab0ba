"""The lab as a whole: bring-up, status and tear-down of hosts and fabric."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path

from agents.agent.client import AgentClient
from flexmig import exceptions
from flexmig_lab import errors, fabric, netns, recorder, topology
from flexmig_lab.host import LabHost, check_prerequisites

DEFAULT_LAB_DIR = Path(topology.default_state_dir())
DEFAULT_BUDGET_MB = 4096
# Split mode's memory groups, made by lab hosts' libvirt hooks.
CGROUP_ROOT = Path("/sys/fs/cgroup/memory") / topology.cgroup_parent()


def inventory(config_files: list[str]) -> Lab:
    """The ``lab`` inventory (entry point): the lab's state says everything."""
    del config_files  # the lab needs none
    return Lab()


def lab_dir() -> Path:
    return Path(os.environ.get("FLEXMIG_LAB_DIR", DEFAULT_LAB_DIR))


class Lab:
    def __init__(self, directory: Path | None = None) -> None:
        self.dir = directory or lab_dir()
        self.state_file = self.dir / "lab.json"

    # -- state --------------------------------------------------------------
    def _read_state(self) -> dict[str, object] | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _write_state(self, state: dict[str, object]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @property
    def specs(self) -> list[topology.HostSpec]:
        state = self._read_state()
        if state is None:
            raise errors.LabNotUp(reason=f"no lab state in {self.dir}")
        return topology.host_specs(int(state["hosts"]))  # type: ignore[arg-type]

    def hosts(self) -> list[LabHost]:
        return [LabHost(spec, self.dir) for spec in self.specs]

    def host(self, name: str) -> LabHost:
        return LabHost(topology.host_by_name(self.specs, name), self.dir)

    # -- lifecycle ------------------------------------------------------------
    @property
    def key_file(self) -> Path:
        """The lab deployment's shared agent key."""
        return self.dir / "agent.key"

    def key(self) -> bytes:
        return self.key_file.read_bytes().strip()

    def up(self, host_count: int = 2, memory_budget_mb: int = DEFAULT_BUDGET_MB) -> list[LabHost]:
        """Bring the lab up; calling it again on a running lab is a no-op check."""
        specs = topology.host_specs(host_count)
        check_prerequisites()
        state = self._read_state()
        if state is not None and int(state["hosts"]) != host_count:  # type: ignore[arg-type]
            raise errors.LabError(
                reason=(
                    f"a lab with {state['hosts']} hosts is already up; "
                    "run 'flexmig-lab down' before changing the host count"
                )
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.key_file.exists():
            self.key_file.write_text(secrets.token_hex(32))
            self.key_file.chmod(0o600)
        self._write_state({"hosts": host_count})
        fabric.up_fabric()
        hosts = []
        for spec in specs:
            netns.add_netns(spec.netns)
            fabric.connect_host(spec)
            host = LabHost(spec, self.dir)
            host.up(self.key_file, memory_budget_mb)
            hosts.append(host)
        return hosts

    def set_budget(self, name: str, memory_budget_mb: int) -> None:
        """Change how much RAM a host's agent offers VMs (restarts that agent)."""
        if not 0 <= memory_budget_mb <= 16 * 1024 * 1024:
            raise exceptions.InvalidInput(
                what="memory budget", reason=f"{memory_budget_mb} MiB out of range"
            )
        host = self.host(name)
        host.write_agent_conf(self.key_file, memory_budget_mb)
        host.stop_agent()
        host.start_agent()

    def agent(self, name: str) -> AgentClient:
        """A client for a host's agent, over its UNIX socket."""
        return AgentClient(str(self.host(name).agent_socket), 0, self.key(), timeout=60)

    # -- the inventory ``flexmig explain``/``migrate``/``drain`` use (flexmig.migrate_cli) --
    def host_names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    def domain(self, vm: str) -> str:
        return vm  # lab VMs are named by their domain name

    def vm_host(self, vm: str) -> str | None:
        from flexmig_lab.vm import LabVM  # vm builds on Lab

        return LabVM(self, vm).locate()

    def destination(self, to: str) -> tuple[str, dict[str, object]]:
        dest = topology.host_by_name(self.specs, to)
        return dest.name, {
            "address": dest.mgmt_ip,
            "port": topology.AGENT_PORT,
            "libvirt_uri": dest.libvirt_uri,
            "migration_uri": dest.migration_uri,
        }

    def guest(self, vm: str) -> object:
        from flexmig_lab.vm import LabVM

        return LabVM(self, vm)

    def status(self) -> dict[str, object]:
        state = self._read_state()
        if state is None:
            return {
                "up": False,
                "hosts": [],
                "stray_namespaces": netns.list_netns(topology.NETNS_PREFIX),
            }
        return {"up": True, "dir": str(self.dir), "hosts": [h.status() for h in self.hosts()]}

    def save_logs(self, dest: Path) -> Path | None:
        """Copy the hosts' daemon logs (libvirtd, QEMU, agents, offload) under ``dest``.

        Tear-down removes the lab's directory; test fixtures call this first
        when FLEXMIG_LAB_KEEP_LOGS names a directory, so a failure in CI can
        still be read afterwards.  Returns the copy's directory, or None if
        the lab had no hosts.
        """
        hosts = self.dir / "hosts"
        if not hosts.is_dir():
            return None
        target = dest / f"{self.dir.name}-{time.strftime('%Y%m%dT%H%M%S')}"
        for host in sorted(p for p in hosts.iterdir() if p.is_dir()):
            for log in [*host.glob("*.log"), host / "log-libvirt"]:
                if log.is_dir():
                    shutil.copytree(log, target / host.name / log.name, dirs_exist_ok=True)
                elif log.exists():
                    (target / host.name).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(log, target / host.name / log.name)
        return target

    def down(self) -> None:
        """Remove everything the lab made, whatever state a failed ``up`` left."""
        recorder.stop_all(self.dir / "vms")
        for name in netns.list_netns(topology.NETNS_PREFIX):
            netns.delete_netns(name)
        _remove_cgroups(CGROUP_ROOT)
        if self.dir.exists():
            shutil.rmtree(self.dir)


def _remove_cgroups(root: Path) -> None:
    """Remove the lab's (now empty) memory groups, deepest first."""
    if not root.is_dir():
        return
    for group in sorted(
        (p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
    ):
        group.rmdir()
    root.rmdir()
