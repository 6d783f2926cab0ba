"""The eSwitch's privileged side, behind oslo.privsep.

Everything that needs CAP_BPF/CAP_SYS_ADMIN (bpffs mount, program load, map
access) or CAP_NET_ADMIN (XDP attach) is here, as functions of plain data:
pin directory, interface names and indexes, packed keys and values.  In a
long-running service these run in a privsep daemon forked at start with only
those capabilities; one-shot root tools may run them inline.

File descriptors never cross the privsep channel: the daemon opens the pins
once and keeps the fds (``_fds``).  Errors cross it as ``OSError(errno,
text)``, which privsep rebuilds faithfully on the caller's side.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from pathlib import Path

from oslo_privsep import capabilities, priv_context

from ovs_ext.providers.xdp import bpffs, flowtable, libbpf

FLOWS_PIN = "flows"
PORTS_PIN = "tx_ports"
PROG_PIN = "eswitch_prog"
PORT_KEY_SIZE = flowtable.PORT.size

eswitch = priv_context.PrivContext(
    "ovs_ext",
    cfg_section="offload_xdp_privsep",
    pypath=__name__ + ".eswitch",
    capabilities=[capabilities.CAP_SYS_ADMIN, capabilities.CAP_NET_ADMIN, capabilities.CAP_BPF],
)

_fds: dict[str, int] = {}
_lock = threading.Lock()  # the daemon serves calls from a thread pool


def _as_oserror(exc: Exception) -> OSError:
    err = exc.errno if isinstance(exc, libbpf.BpfError) else 0
    return OSError(err, str(exc))


def _fd(pin_dir: str, name: str) -> int:
    path = os.path.join(pin_dir, name)
    with _lock:
        if path not in _fds:
            _fds[path] = libbpf.obj_get(path)
        return _fds[path]


@eswitch.entrypoint
def load_eswitch(pin_dir: str, bpf_object: str, capacity: int) -> int:
    """Mount bpffs, load and pin the eSwitch unless pinned; returns the possible CPUs."""
    try:
        bpffs.ensure(pin_dir)
        if not os.path.exists(os.path.join(pin_dir, PROG_PIN)):
            libbpf.load_object(
                bpf_object,
                max_entries={FLOWS_PIN: capacity},
                pins={name: os.path.join(pin_dir, name) for name in (FLOWS_PIN, PORTS_PIN)},
                program="eswitch",
                prog_pin=os.path.join(pin_dir, PROG_PIN),
            )
        for name in (FLOWS_PIN, PORTS_PIN, PROG_PIN):
            _fd(pin_dir, name)
        return libbpf.possible_cpus()
    except Exception as exc:  # libbpf, mount, a missing object alike
        raise _as_oserror(exc) from exc


@eswitch.entrypoint
def attach_port(pin_dir: str, ifname: str, flags: int, threaded_napi: bool) -> int:
    """Put a port in the devmap and attach the program to it; returns its ifindex."""
    try:
        ifindex = socket.if_nametoindex(ifname)
    except OSError as exc:
        raise OSError(exc.errno, f"no interface {ifname}") from exc
    port_key = ifindex.to_bytes(PORT_KEY_SIZE, "little")
    try:
        libbpf.update_elem(_fd(pin_dir, PORTS_PIN), port_key, port_key)
        libbpf.xdp_attach(ifindex, _fd(pin_dir, PROG_PIN), flags)
    except libbpf.BpfError as exc:
        libbpf.delete_elem(_fd(pin_dir, PORTS_PIN), port_key)
        raise _as_oserror(exc) from exc
    if threaded_napi:
        _set_threaded_napi(ifname)
    return ifindex


def _set_threaded_napi(ifname: str) -> None:
    """Best effort: a device without NAPI (or an old kernel) keeps softirq polling."""
    try:
        Path(f"/sys/class/net/{ifname}/threaded").write_text("1")
    except OSError:
        pass


@eswitch.entrypoint
def detach_port(pin_dir: str, ifindex: int, flags: int) -> None:
    """Leave the devmap and detach the program; a port already gone is not an error."""
    try:
        libbpf.delete_elem(_fd(pin_dir, PORTS_PIN), ifindex.to_bytes(PORT_KEY_SIZE, "little"))
        libbpf.xdp_detach(ifindex, flags)
    except libbpf.BpfError as exc:
        if exc.errno != errno.ENODEV:
            raise _as_oserror(exc) from exc


@eswitch.entrypoint
def port_ifindexes(pin_dir: str) -> list[int]:
    """The devmap's ports, forgetting those whose interface has vanished."""
    fd = _fd(pin_dir, PORTS_PIN)
    alive = []
    try:
        for raw in libbpf.keys(fd, PORT_KEY_SIZE):
            ifindex = int.from_bytes(raw, "little")
            try:
                socket.if_indextoname(ifindex)
                alive.append(ifindex)
            except OSError:
                libbpf.delete_elem(fd, raw)
    except libbpf.BpfError as exc:
        raise _as_oserror(exc) from exc
    return alive


@eswitch.entrypoint
def write_flows(pin_dir: str, keys: bytes, values: bytes, count: int) -> tuple[int, int]:
    """One BPF_MAP_UPDATE_BATCH: (entries written, errno of the refused one or 0)."""
    return libbpf.update_batch(_fd(pin_dir, FLOWS_PIN), keys, values, count)


@eswitch.entrypoint
def read_flows(pin_dir: str, value_size: int, capacity: int) -> tuple[bytes, bytes, int]:
    """The whole flow table: packed keys, packed per-CPU values, count."""
    try:
        return libbpf.lookup_all(_fd(pin_dir, FLOWS_PIN), flowtable.KEY.size, value_size, capacity)
    except libbpf.BpfError as exc:
        raise _as_oserror(exc) from exc


@eswitch.entrypoint
def take_flows(pin_dir: str, keys: list[bytes], value_size: int) -> list[bytes | None]:
    """Lookup-and-delete each key: its final value, or None if it was not there."""
    fd = _fd(pin_dir, FLOWS_PIN)
    try:
        return [libbpf.lookup_and_delete_elem(fd, key, value_size) for key in keys]
    except libbpf.BpfError as exc:
        raise _as_oserror(exc) from exc


def start(mode: str) -> None:
    """``fork``: a daemon forked now (we are root); ``helper``: privsep's helper
    command on first use; ``inline``: no daemon, this process does it."""
    if mode == "inline":
        eswitch.set_client_mode(False)
    elif mode == "fork" and eswitch.channel is None:
        eswitch.start(priv_context.Method.FORK)
