"""``XdpProvider``: br-int's member ports get an XDP eSwitch in front of OVS.

Model: one provider process per host (the os-ken app's) owns the tables; it
runs in the host's network and mount namespaces, because ifindexes and
device-map entries are per network namespace and pins are per bpffs.  All
state lives in pinned maps, so a restarted provider picks up the flows and
ports it left (its in-memory indexes are rebuilt from the maps).

Kernel access (bpffs mount, load, attach, map reads and writes) is the
provider's privileged side, ``privileged.py``, run by an oslo.privsep daemon
that holds only CAP_SYS_ADMIN, CAP_NET_ADMIN and CAP_BPF.

Writes are batched: ``install`` writes a whole batch with one
``BPF_MAP_UPDATE_BATCH`` (continuing past a refused entry), ``stats`` reads
the table with ``BPF_MAP_LOOKUP_BATCH``.  ``remove`` uses lookup-and-delete
per entry so each flow's final counters are read in the same step that stops
the fast path from counting it.

Not done here: a frame redirected into a veth is received only if the peer
has an XDP program (``rx_pass``): the code that creates the veth (lab
endpoints, the fabric) attaches it, since the peer is in another namespace.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from oslo_config import cfg

from flexmig import processutil
from ovs_ext.providers import base
from ovs_ext.providers.base import (
    FlowCounters,
    FlowMatch,
    InstallResult,
    OffloadEntry,
    OffloadError,
    ProviderDescription,
)
from ovs_ext.providers.xdp import bpffs, flowtable, libbpf, privileged

T = TypeVar("T")
BUILD_DIR = Path(__file__).parent / "build"
ESWITCH_OBJECT = BUILD_DIR / "eswitch.bpf.o"
RX_PASS_OBJECT = BUILD_DIR / "rx_pass.bpf.o"
MODE_FLAGS = {"native": libbpf.XDP_FLAGS_DRV_MODE, "generic": libbpf.XDP_FLAGS_SKB_MODE}

CONFIG_OPTS = [
    cfg.IntOpt(
        "capacity",
        default=131072,
        min=16,
        max=16 * 1024 * 1024,
        help="Offload-table size (flows), as a NIC's eSwitch has one. Fixed when the "
        "table is first created; changing it needs the pins removed.",
    ),
    cfg.StrOpt(
        "attach_mode",
        default="native",
        choices=[("native", "driver XDP (veth, tun/tap)"), ("generic", "skb-mode XDP, any NIC")],
        help="How the eSwitch program is attached to ports.",
    ),
    cfg.StrOpt(
        "bpffs_dir",
        default="/sys/fs/bpf/flexmig",
        help="Directory on a bpffs where the eSwitch's maps and program are pinned; "
        "a bpffs is mounted on its parent if none is there.",
    ),
    cfg.BoolOpt(
        "threaded_napi",
        default=True,
        help="Run each attached port's NAPI poll (where the eSwitch program runs) in its "
        "own kernel thread, so the scheduler can put the forwarding on another core than the "
        "process that sent the packet; without it a veth sender pays for the fast path too. "
        "Trade-off measured on veth (docs/benchmarks/offload-napi-modes.md): threads carry "
        "more packets/s across cores, softirq polling costs ~15-20% less CPU per packet for "
        "paced UDP and TCP (no thread to wake) and more for unpaced UDP. Native mode only.",
    ),
    cfg.StrOpt(
        "privsep",
        default="fork",
        choices=[
            ("fork", "fork a privsep daemon holding only CAP_SYS_ADMIN/NET_ADMIN/BPF (as root)"),
            ("helper", "start it with [offload_xdp_privsep] helper_command (e.g. sudo)"),
            ("inline", "no daemon: this process does it (one-shot root tools, tests)"),
        ],
        help="Where loading, attaching and map access run: the privileged side of the "
        "provider, through oslo.privsep.",
    ),
    cfg.StrOpt(
        "bpf_object",
        default=str(ESWITCH_OBJECT),
        # The default is where this installation built it: say so in samples
        # instead of writing one machine's path into them.
        sample_default="<the installed ovs_ext package>/providers/xdp/build/eswitch.bpf.o",
        help="The compiled eSwitch (built by tools/setup.sh).",
    ),
]

# Errors the kernel gives for one entry of a batch (the others may still fit).
PER_ENTRY_ERRORS = (errno.E2BIG, errno.ENOMEM, errno.EEXIST, errno.EINVAL)


def _serialized(method: Callable[..., T]) -> Callable[..., T]:
    """One table operation at a time: the app's stats poller and its policy share us."""

    @functools.wraps(method)
    def locked(self: XdpProvider, *args: object, **kwargs: object) -> T:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class XdpProvider(base.OffloadProvider):
    CONFIG_OPTS = CONFIG_OPTS
    NAME = "xdp"

    def __init__(self, conf: cfg.ConfigOpts) -> None:
        super().__init__(conf)
        conf.register_opts(CONFIG_OPTS, group="offload_xdp")
        self.opts = conf.offload_xdp
        self._cpus = 0
        self._ports: dict[str, int] = {}  # attached ifname -> ifindex
        self._table: dict[bytes, int] = {}  # key -> out ifindex, mirrors the map
        self._matches: dict[bytes, FlowMatch] = {}
        self._lock = threading.RLock()

    # -- availability and set-up ------------------------------------------
    def describe(self) -> ProviderDescription:
        reason = self._unavailable_reason()
        return ProviderDescription(
            name=self.NAME,
            capacity=self.opts.capacity,
            summary=f"XDP/eBPF eSwitch on br-int ports ({self.opts.attach_mode} mode), "
            "per-flow per-CPU counters, XDP_REDIRECT through a devmap",
            available=reason == "",
            unavailable_reason=reason,
        )

    def _unavailable_reason(self) -> str:
        if os.geteuid() != 0:
            return "loading XDP programs needs root (CAP_BPF and CAP_NET_ADMIN)"
        if not Path(self.opts.bpf_object).is_file():
            return f"{self.opts.bpf_object} is not built (run tools/setup.sh)"
        try:
            libbpf.possible_cpus()
        except Exception as exc:  # noqa: BLE001 (any loader failure means unavailable)
            return f"libbpf unusable: {exc}"
        mount_root = os.path.dirname(self.opts.bpffs_dir.rstrip("/")) or "/"
        mounts = Path("/proc/self/mounts").read_text()
        if bpffs.bpffs_mount_of(self.opts.bpffs_dir, mounts) is None and not os.path.isdir(
            mount_root
        ):
            return f"no bpffs at {self.opts.bpffs_dir} and no {mount_root} to mount one on"
        return ""

    def _ready(self) -> str:
        """The pin directory, once the eSwitch is loaded (on first use)."""
        if self._cpus:
            return self.opts.bpffs_dir
        try:
            privileged.start(self.opts.privsep)
            self._cpus = privileged.load_eswitch(
                self.opts.bpffs_dir, self.opts.bpf_object, self.opts.capacity
            )
            self._rebuild_indexes()
        except Exception as exc:  # privsep, libbpf, mount alike: the step failed
            self._cpus = 0
            raise OffloadError(
                provider=self.NAME, action="load the eSwitch", reason=str(exc)
            ) from exc
        return self.opts.bpffs_dir

    def _rebuild_indexes(self) -> None:
        """Ports and flows from the pinned maps (a restart must not forget them)."""
        self._ports = {}
        for ifindex in privileged.port_ifindexes(self.opts.bpffs_dir):
            try:
                self._ports[socket.if_indextoname(ifindex)] = ifindex
            except OSError:
                continue  # vanished since the daemon looked: the next rebuild drops it
        keys_blob, values_blob, count = self._read_table()
        value_size = flowtable.percpu_value_size(self._cpus)
        self._table = {
            key: flowtable.out_ifindex(values_blob[i * value_size : (i + 1) * value_size])
            for i, key in enumerate(flowtable.split_keys(keys_blob, count))
        }
        self._matches = {}

    def _read_table(self) -> tuple[bytes, bytes, int]:
        return privileged.read_flows(
            self.opts.bpffs_dir, flowtable.percpu_value_size(self._cpus), self.opts.capacity
        )

    # -- ports --------------------------------------------------------------
    @_serialized
    def attach_port(self, ifname: str) -> None:
        pin_dir = self._ready()
        threaded = self.opts.threaded_napi and self.opts.attach_mode == "native"
        try:
            ifindex = privileged.attach_port(
                pin_dir, ifname, MODE_FLAGS[self.opts.attach_mode], threaded
            )
        except OSError as exc:
            raise OffloadError(
                provider=self.NAME, action=f"attach port {ifname}", reason=exc.strerror or str(exc)
            ) from exc
        self._ports[ifname] = ifindex

    @_serialized
    def detach_port(self, ifname: str) -> None:
        pin_dir = self._ready()
        ifindex = self._ports.get(ifname)
        if ifindex is None:
            return
        using = [
            key
            for key, out in self._table.items()
            if out == ifindex or flowtable.KEY.unpack(key)[0] == ifindex
        ]
        self._remove_keys(using)
        try:
            privileged.detach_port(pin_dir, ifindex, MODE_FLAGS[self.opts.attach_mode])
        except OSError as exc:
            raise OffloadError(
                provider=self.NAME, action=f"detach port {ifname}", reason=str(exc)
            ) from exc
        del self._ports[ifname]

    @_serialized
    def attached_ports(self) -> dict[str, int]:
        self._ready()
        return dict(self._ports)

    # -- flows -----------------------------------------------------------------
    @_serialized
    def install(self, entries: Iterable[OffloadEntry]) -> InstallResult:
        pin_dir = self._ready()
        failed: dict[FlowMatch, str] = {}
        installed: list[FlowMatch] = []
        batch: list[tuple[FlowMatch, bytes, int]] = []
        room = self.opts.capacity - len(self._table)
        seen: set[FlowMatch] = set()
        for entry in entries:
            if entry.match in seen:
                continue  # a match is answered once: the batch's first entry for it wins
            seen.add(entry.match)
            verdict = self._plan_entry(entry)
            if isinstance(verdict, str):
                failed[entry.match] = verdict
            elif verdict is None:
                installed.append(entry.match)  # already offloaded, same egress
            elif len(batch) >= room:
                failed[entry.match] = f"offload table full (capacity {self.opts.capacity})"
            else:
                batch.append((entry.match, *verdict))
        installed += self._write_batch(pin_dir, batch, failed)
        return InstallResult(installed=tuple(installed), failed=failed)

    def _plan_entry(self, entry: OffloadEntry) -> str | tuple[bytes, int] | None:
        """(key, out ifindex) to write, None if already there, or why not."""
        in_ifindex = self._ports.get(entry.match.in_port)
        out_ifindex = self._ports.get(entry.out_port)
        for role, name, index in (
            ("in_port", entry.match.in_port, in_ifindex),
            ("out_port", entry.out_port, out_ifindex),
        ):
            if index is None:
                return f"{role} {name} is not attached to the XDP fast path"
        if in_ifindex == out_ifindex:
            return "in_port and out_port are the same port (hairpin is not offloaded)"
        assert in_ifindex is not None and out_ifindex is not None
        key = flowtable.pack_key(entry.match, in_ifindex)
        current = self._table.get(key)
        if current is None:
            return key, out_ifindex
        if current == out_ifindex:
            return None
        return f"already offloaded to another port (ifindex {current}); remove it first"

    def _write_batch(
        self, pin_dir: str, batch: list[tuple[FlowMatch, bytes, int]], failed: dict
    ) -> list[FlowMatch]:
        """One BPF_MAP_UPDATE_BATCH per run of accepted entries.

        The kernel stops at an entry it refuses; that entry is named in
        ``failed`` and the batch goes on after it.  An error that is not about
        one entry fails the rest of the batch with the same reason.
        """
        written: list[FlowMatch] = []
        start = 0
        while start < len(batch):
            rest = batch[start:]
            keys = b"".join(key for _, key, _ in rest)
            values = b"".join(flowtable.pack_new_action(out, self._cpus) for _, _, out in rest)
            try:
                done, err = privileged.write_flows(pin_dir, keys, values, len(rest))
            except OSError as exc:  # the channel or the map, not one entry
                failed.update((match, f"flow table write failed: {exc}") for match, _, _ in rest)
                break
            for match, key, out in rest[:done]:
                self._table[key] = out
                self._matches[key] = match
                written.append(match)
            if err == 0:
                break
            reason = (
                f"offload table full (capacity {self.opts.capacity})"
                if err == errno.E2BIG
                else f"kernel refused the entry: {os.strerror(err)} (errno {err})"
            )
            if err not in PER_ENTRY_ERRORS:
                failed.update((match, reason) for match, _, _ in rest[done:])
                break
            failed[rest[done][0]] = reason
            start += done + 1
        return written

    @_serialized
    def remove(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        self._ready()
        keys: list[bytes] = []
        for match in matches:
            in_ifindex = self._ports.get(match.in_port)
            if in_ifindex is not None:
                keys.append(flowtable.pack_key(match, in_ifindex))
        removed = self._remove_keys(keys)
        return {self._match_of(key): counters for key, counters in removed.items()}

    def _remove_keys(self, keys: list[bytes]) -> dict[bytes, FlowCounters]:
        value_size = flowtable.percpu_value_size(self._cpus)
        try:
            values = privileged.take_flows(self.opts.bpffs_dir, keys, value_size)
        except OSError as exc:
            raise OffloadError(provider=self.NAME, action="remove flows", reason=str(exc)) from exc
        removed = {
            key: flowtable.sum_counters(value, self._cpus)
            for key, value in zip(keys, values, strict=True)
            if value is not None
        }
        for key in removed:
            self._table.pop(key, None)
        return removed

    def _match_of(self, key: bytes) -> FlowMatch:
        match = self._matches.pop(key, None)
        if match is None:
            match = flowtable.unpack_key(key, {v: k for k, v in self._ports.items()})
        assert match is not None
        return match

    @_serialized
    def stats(self) -> dict[FlowMatch, FlowCounters]:
        self._ready()
        try:
            keys_blob, values_blob, count = self._read_table()
        except OSError as exc:
            raise OffloadError(
                provider=self.NAME, action="read statistics", reason=str(exc)
            ) from exc
        keys = flowtable.split_keys(keys_blob, count)
        matches = list(map(self._matches.get, keys))
        if None in matches:  # entries this process did not install (e.g. after a restart)
            names = {v: k for k, v in self._ports.items()}
            for i, (key, match) in enumerate(zip(keys, matches, strict=True)):
                if match is None:
                    matches[i] = flowtable.unpack_key(key, names)
                    if matches[i] is not None:
                        self._matches[key] = matches[i]
        counters = flowtable.sum_all_counters(values_blob, count, self._cpus)
        result = dict(zip(matches, counters, strict=True))
        result.pop(None, None)  # type: ignore[call-overload]  # ingress port detached under us
        return result


def attach_rx_pass(ifname: str, netns: str | None = None) -> None:
    """Give a veth the receive ring XDP redirects need (see ``rx_pass.bpf.c``).

    Uses iproute2 so it can run in any namespace without a provider there.
    """
    # -force replaces a program already there: attaching is idempotent.
    prefix = ["ip", "-force", "-n", netns] if netns else ["ip", "-force"]
    processutil.run(
        [*prefix, "link", "set", "dev", ifname, "xdpdrv", "obj", str(RX_PASS_OBJECT), "sec", "xdp"]
    )


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator (``flexmig.offload_xdp``): ours and the privsep daemon's."""
    from oslo_privsep import priv_context

    return [("offload_xdp", CONFIG_OPTS), (privileged.eswitch.cfg_section, priv_context.OPTS)]
