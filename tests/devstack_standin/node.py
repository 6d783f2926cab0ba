"""A temporary DevStack node on which the FlexMig plugin's phases run for real under bash.

``functions`` beside this file stands in for DevStack's functions; ``make_stack``
builds the tree they act on (DEST with the plugin's checkout, nova.conf,
qemu.conf, ...) and the environment stackrc would give, and ``Stack.run`` runs
plugin phases in a bash process as stack.sh/unstack.sh/clean.sh source them.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().with_name("functions")

NOVA_CONF = """[DEFAULT]
compute_driver = libvirt.LibvirtDriver
my_ip = 10.0.0.11

[libvirt]
virt_type = qemu
live_migration_uri = qemu+ssh://stack@%s/system
"""
QEMU_CONF = """# qemu.conf as DevStack leaves it
cgroup_device_acl = [ "/dev/null", "/dev/net/tun" ]
vnc_tls = 1
"""
# A compute node with OVS but no Neutron L2 agent on br-int (see
# _flexmig_check_offload_bridge), flexmig-offload enabled as local.conf would.
SERVICES = "key,n-api,n-cond,n-sch,n-cpu,placement-api,ovs-vswitchd,ovsdb-server,flexmig-offload"
MOVER_MAKEFILE = "all:\n\tmkdir -p build && touch build/flexmig-mover\nclean:\n\trm -rf build\n"
SYSCTL_STUB = """#!/bin/bash
# sysctl for the stand-in: one key, its value kept in STANDIN_STATE.
state=$STANDIN_STATE/vm.unprivileged_userfaultfd
case "$1" in
    -n) [[ $2 == vm.unprivileged_userfaultfd ]] || exit 255; cat "$state" ;;
    -w) [[ $2 == vm.unprivileged_userfaultfd=* ]] || exit 255; echo "${2#*=}" >"$state" ;;
    *) exit 2 ;;
esac
"""
SYSTEMCTL_STUB = """#!/bin/bash
# systemctl for the stand-in: the calls the plugin makes succeed (sudo logs them).
case "$1" in
    daemon-reload) exit 0 ;;
    restart) [[ $2 == *.slice || $2 == *.service ]] || exit 1 ;;
    *) exit 2 ;;
esac
"""
DRIVER = """set -o errexit -o nounset
source "$STANDIN_FUNCTIONS"
eval "$STANDIN_LOCALRC"
enable_plugin flexmig
load_plugin_settings
for step in "$@"; do
    run_plugins "${step%%:*}" "${step#*:}"
done
"""


@dataclasses.dataclass
class Stack:
    """A temporary DevStack node: its tree, environment and command log."""

    root: Path
    env: dict[str, str]

    def path(self, name: str) -> Path:
        return Path(self.env[name])

    def run(self, *steps: str, localrc: str = "", check: bool = True):
        env = dict(self.env, STANDIN_LOCALRC=localrc)
        proc = subprocess.run(
            ["bash", "-c", DRIVER, "driver", *steps],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{steps} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def log(self) -> list[list[str]]:
        log = self.path("STANDIN_LOG")
        if not log.exists():
            return []
        return [line.split("\t") for line in log.read_text().splitlines()]

    def calls(self, name: str) -> list[list[str]]:
        return [entry[1:] for entry in self.log() if entry[0] == name]

    def snapshot(self) -> dict[str, bytes]:
        """Every file under the tree except the plugin's own checkout and the log."""
        files = {}
        for path in sorted(self.root.rglob("*")):
            rel = str(path.relative_to(self.root))
            if path.is_file() and not rel.startswith(("opt/stack/flexmig/devstack", "log")):
                files[rel] = path.read_bytes()
        return files


def ini(path: Path) -> configparser.RawConfigParser:
    # DEFAULT as a section like any other: its options must not show up in others.
    parser = configparser.RawConfigParser(strict=False, default_section="no default section")
    parser.read_string(path.read_text())
    return parser


def make_stack(tmp_path: Path) -> Stack:
    dest = tmp_path / "opt" / "stack"
    checkout = dest / "flexmig"
    shutil.copytree(REPO / "devstack", checkout / "devstack")
    (checkout / "agents" / "mover").mkdir(parents=True)
    (checkout / "agents" / "mover" / "Makefile").write_text(MOVER_MAKEFILE)
    (dest / "data").mkdir()
    nova_conf = tmp_path / "etc" / "nova" / "nova.conf"
    nova_conf.parent.mkdir(parents=True)
    nova_conf.write_text(NOVA_CONF)
    qemu_conf = tmp_path / "etc" / "libvirt" / "qemu.conf"
    qemu_conf.parent.mkdir(parents=True)
    qemu_conf.write_text(QEMU_CONF)
    qemu_conf.chmod(0o600)
    (tmp_path / "etc" / "sysctl.d").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sysctl").write_text(SYSCTL_STUB)
    (bin_dir / "sysctl").chmod(0o755)
    (bin_dir / "systemctl").write_text(SYSTEMCTL_STUB)
    (bin_dir / "systemctl").chmod(0o755)
    (tmp_path / "sys" / "fs" / "cgroup").mkdir(parents=True)  # v1 layout: no cgroup.controllers
    state = tmp_path / "state"
    state.mkdir()
    (state / "vm.unprivileged_userfaultfd").write_text("0\n")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "STANDIN_FUNCTIONS": str(STANDIN),
        "STANDIN_LOG": str(tmp_path / "log"),
        "STANDIN_STATE": str(state),
        "DEST": str(dest),
        "DATA_DIR": str(dest / "data"),
        "STACK_USER": os.environ.get("USER") or subprocess.getoutput("id -un"),
        "HOST_IP": "10.0.0.11",
        "NOVA_CONF": str(nova_conf),
        "QEMU_CONF": str(qemu_conf),
        "SYSTEMD_DIR": str(tmp_path / "systemd"),
        "PYTHON": sys.executable,
        "GLOBAL_VENV": "True",
        "DEVSTACK_VENV": str(dest / "data" / "venv"),
        "ENABLED_SERVICES": SERVICES,
        "VERBOSE": "False",
        "FLEXMIG_CONF_DIR": str(tmp_path / "etc" / "flexmig"),
        "FLEXMIG_STATE_DIR": str(tmp_path / "run" / "flexmig"),
        "FLEXMIG_STORE_DIR": str(tmp_path / "var" / "lib" / "libvirt" / "qemu" / "ram"),
        "FLEXMIG_LIBVIRT_HOOK": str(
            tmp_path / "etc" / "libvirt" / "hooks" / "qemu.d" / "50-flexmig"
        ),
        "FLEXMIG_SYSCTL_FILE": str(tmp_path / "etc" / "sysctl.d" / "60-flexmig.conf"),
        "FLEXMIG_CGROUP_ROOT": str(tmp_path / "sys" / "fs" / "cgroup"),
        "FLEXMIG_MACHINE_SLICE_DROPIN": str(
            tmp_path / "etc" / "systemd" / "system" / "machine.slice.d" / "50-flexmig.conf"
        ),
    }
    return Stack(tmp_path, env)
