"""The agents' half of moving a VM's offloaded flows with it (issue 15).

Each host's agent talks to its own offload extension over the extension's
local control interface (``ovs_ext/control_api.py``, a signed UNIX socket) and
to the peer agent over the agents' API; records travel agent to agent.  The
same steps serve the agent's own migrations and the Nova driver (which calls
its local agent's ``/v1/offload/*`` routes), so there is one path:

source  ``depart``  demote + hold here, records to the destination's ``arrive``;
dest    ``arrive``  pre-register there, then watch libvirt: once the incoming
                    domain runs (switchover, or the postcopy switch), ``resume``
                    re-offloads at once;
source  ``finish``  final counters to the destination's ``settle``; forgotten here;
source  ``restore`` the migration failed: re-offloaded here, the destination abandons.

A VM with SR-IOV failover pairs (a VF primary, a virtio standby: see
``sriov_failover.py``) takes the same steps with a few more: at ``depart`` the
VF representor's flows are re-keyed to the standby; the destination, once the
VM runs, plugs a VF (the agent path; Nova plugs the VF it claimed itself) and
re-keys the flows to its representor before re-offloading them; ``restore``
plugs the VF back on the source if QEMU has not and re-keys the flows back.

A host without the extension (no socket) migrates its VMs as before: every step
says so in the events and nothing else changes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import libvirt

from agents.agent import api, sriov_failover
from agents.agent.client import AgentClient
from agents.agent.sriov_failover import FailoverNic, FailoverPair
from flexmig import exceptions, hypervisor

LOG = logging.getLogger("flexmig.agent.offload")
# The incoming domain is polled this often for the moment it runs here: the
# re-offload target is 1 s after resume, so this is a small part of it, and
# 10 light RPCs a second leave libvirtd free for the incoming migration itself.
RESUME_POLL_S = 0.1
RESUME_WATCH_MAX_S = 3600.0
LOCAL_TIMEOUT_S = 10.0
# Records travel in parts that fit one request (api.MAX_BODY) with room for the
# other fields (a VM's port names, ids): a VM may have thousands of flows.
PART_BYTES = api.MAX_BODY * 3 // 4
Event = Callable[[str], None]


def vm_ports(domain_xml: str) -> list[str]:
    """The VM's ports on the bridge: its interfaces' target devices (a VF's
    flows are its representor's: see ``failover_pairs``).

    >>> vm_ports("<domain><devices><interface type='bridge'><target dev='tap3'/>"
    ...          "</interface><interface type='hostdev'><target dev='vf0'/></interface>"
    ...          "</devices></domain>")
    ['tap3']
    """
    root = ET.fromstring(domain_xml)
    ports = []
    for iface in root.findall("./devices/interface"):
        if iface.get("type") == "hostdev":
            continue
        target = iface.find("target")
        if target is not None and target.get("dev"):
            ports.append(target.get("dev"))
    return ports


def parts(records: list[dict[str, Any]], budget: int = PART_BYTES) -> list[list[dict[str, Any]]]:
    """The records in order, split so each part's JSON stays within ``budget``
    bytes; always at least one part (an empty one for no records).

    >>> [len(p) for p in parts([{"a": "x" * 10}] * 5, budget=45)]
    [2, 2, 1]
    >>> parts([])
    [[]]
    """
    out: list[list[dict[str, Any]]] = [[]]
    size = 2  # the list's brackets
    for record in records:
        length = len(json.dumps(record, separators=(",", ":"))) + 2  # ", " between
        if length + 2 > budget:
            raise exceptions.InvalidInput(what="flow record", reason=f"{length} bytes alone")
        if out[-1] and size + length > budget:
            out.append([])
            size = 2
        out[-1].append(record)
        size += length
    return out


def count_offloaded(flows: list[dict[str, Any]]) -> int:
    return sum(1 for f in flows if f.get("was_offloaded"))


FAILOVER_FIELDS = {"mac": str, "standby": str, "alias": str, "vf": str, "plug": bool}


def check_failover(entries: Any) -> list[dict[str, Any]]:
    """The failover pairs an arrival names, refused whole if any is malformed.

    >>> check_failover([{"mac": "52:54:00:aa:bb:01", "standby": "tap4", "alias": "ua-sb0",
    ...                  "vf": "", "plug": True}])[0]["standby"]
    'tap4'
    >>> check_failover([{"mac": "52:54:00:aa:bb:01", "standby": "tap4';", "alias": "",
    ...                  "vf": "", "plug": False}])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    flexmig.exceptions.InvalidInput: Invalid failover pair: ...
    """
    if not isinstance(entries, list) or len(entries) > sriov_failover.MAX_PAIRS:
        raise exceptions.InvalidInput(what="failover pairs", reason="not a list of up to 8")
    for entry in entries:
        try:
            api.check_fields(entry, FAILOVER_FIELDS)
        except (api.BadRequest, TypeError, AttributeError) as exc:
            raise exceptions.InvalidInput(what="failover pair", reason=str(exc)) from exc
        bad = (
            not sriov_failover.MAC.match(entry["mac"])
            or not sriov_failover.PORT.match(entry["standby"])
            or (entry["alias"] and not sriov_failover.ALIAS.match(entry["alias"]))
            or (entry["vf"] and not sriov_failover.PCI_ADDRESS.match(entry["vf"]))
            or (entry["plug"] and not entry["alias"])
        )
        if bad:
            raise exceptions.InvalidInput(what="failover pair", reason=repr(entry)[:200])
    return entries


class Departure:
    """A VM leaving with failover pairs: what ``restore`` needs to put them back."""

    def __init__(self, vm: str, pairs: list[tuple[FailoverNic, str]], nova: bool) -> None:
        self.vm, self.pairs, self.nova = vm, pairs, nova


class OffloadHook:
    def __init__(
        self,
        socket_path: str,
        key: bytes,
        host: str,
        libvirt_uri: str,
        failover_vfs: list[str] | None = None,
        sysfs: Path = Path("/sys"),
    ) -> None:
        self.socket_path = socket_path
        self.key = key
        self.host = host
        self.libvirt_uri = libvirt_uri
        self.failover_vfs = [sriov_failover.check_pci(v) for v in failover_vfs or []]
        self.sysfs = sysfs
        self.watchers: dict[str, threading.Event] = {}
        self.departures: dict[str, Departure] = {}  # source: failover pairs leaving
        self.arrivals: dict[str, list[dict[str, Any]]] = {}  # destination: pairs to plug
        self.failover_notes: dict[str, list[str]] = {}  # destination: what plugging did
        self.lock = threading.Lock()

    # -- the local extension ------------------------------------------------------
    def available(self) -> str:
        """Empty when the extension's control interface is here, else why not."""
        if not self.socket_path:
            return "no offload control socket configured ([agent] offload_control_socket)"
        if not os.path.exists(self.socket_path):
            return f"the offload extension is not running here ({self.socket_path} absent)"
        return ""

    def local(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        client = AgentClient(self.socket_path, 0, self.key, timeout=LOCAL_TIMEOUT_S)
        return client.request(method, path, body)

    def domain_xml(self, vm: str) -> str:
        with hypervisor.connect(self.libvirt_uri, self.host) as conn:
            dom = hypervisor.find_domain(conn, vm)
            if dom is None:
                raise exceptions.InvalidInput(what="VM", reason=f"{vm!r} is not here")
            with hypervisor.wrap_errors(self.host, f"read {vm}'s XML"):
                return dom.XMLDesc(0)

    def ports_of(self, vm: str) -> list[str]:
        return vm_ports(self.domain_xml(vm))

    def failover_pairs(self, domain_xml: str, event: Event) -> list[tuple[FailoverNic, str]]:
        """The VM's failover pairs with a VF plugged now, each with its representor;
        a pair whose representor is not found is named and left out (its VF's
        flows stay where they are, as any VM's without the extension)."""
        found = []
        for nic in sriov_failover.failover_nics(domain_xml):
            if nic.vf_pci is None:
                continue
            try:
                found.append((nic, sriov_failover.representor_of(nic.vf_pci, self.sysfs)))
            except exceptions.FlexMigError as exc:
                event(f"offload: SR-IOV failover {nic.mac}: VF flows not handled: {exc}")
        return found

    def explain(self, vm: str) -> str:
        """What a migration would do to the VM's flows (for ``flexmig explain``)."""
        why_not = self.available()
        if why_not:
            return f"offloaded flows: none handled ({why_not})"
        xml = self.domain_xml(vm)
        notes: list[str] = []
        pairs = self.failover_pairs(xml, notes.append)
        ports = vm_ports(xml) + [rep for _, rep in pairs]
        if not ports:
            return "offloaded flows: the VM has no bridge port"
        reply = self.local("POST", "/v1/flows", {"ports": ports})
        flows = reply["flows"]
        text = (
            f"offloaded flows: {count_offloaded(flows)} of {len(flows)} flows on "
            f"{', '.join(ports)} are offloaded (provider {reply['provider']}); a migration "
            "demotes them to the vSwitch before switchover (counters carried), sends their "
            "records to the destination ahead of it, and offloads them again there once the "
            "VM resumes (the destination's policy and capacity permitting)"
        )
        for nic, rep in pairs:
            text += (
                f"; SR-IOV failover {nic.mac}: the flows of VF {nic.vf_pci} (representor "
                f"{rep}) are re-keyed to the standby {nic.standby_port} before QEMU unplugs "
                "the VF, the destination plugs one of its VFs once the VM runs there and "
                "re-offloads them on its representor; a failed migration plugs this VF back"
            )
        return "; ".join([text, *notes])

    # -- source ---------------------------------------------------------------------
    def depart(
        self,
        migration_id: str,
        vm: str,
        dest: AgentClient,
        event: Event,
        nova_vfs: dict[str, str] | None = None,
    ) -> bool:
        """Demote and hold here, hand the records to the destination; True if handled.

        ``nova_vfs`` (Nova's path): {MAC: the destination VF Nova claimed}; Nova
        detaches and attaches the VFs, the agents only move their flows.
        """
        why_not = self.available()
        if why_not:
            event(f"offload: flows not handled: {why_not}")
            return False
        xml = self.domain_xml(vm)
        pairs = self.failover_pairs(xml, event)
        ports = vm_ports(xml)
        body = {"migration_id": migration_id, "ports": ports + [rep for _, rep in pairs]}
        body |= {"peer": dest.address}
        if pairs:
            body["rekey"] = {rep: nic.standby_port for nic, rep in pairs}
        flows = self.local("POST", "/v1/migrations/depart", body)["flows"]
        event(
            f"offload: {count_offloaded(flows)} offloaded flows of {len(flows)} demoted "
            f"to the vSwitch on {self.host} (counters carried)"
        )
        arrive = {"migration_id": migration_id, "vm": vm, "ports": ports, "peer": self.host}
        if pairs:
            arrive["failover"] = self._leaving(migration_id, vm, pairs, nova_vfs, event)
        first, *rest = parts(flows)
        try:
            reply = dest.post("/v1/offload/arrive", arrive | {"flows": first})
            for part in rest:
                dest.post("/v1/offload/records", {"migration_id": migration_id, "flows": part})
        except exceptions.FlexMigError as exc:
            event(f"offload: destination cannot take the flow records: {exc}")
            return True
        event(
            f"offload: {len(flows)} flow records transferred in {1 + len(rest)} request(s); "
            f"{reply.get('note', '')}".strip()
        )
        return True

    def _leaving(
        self,
        migration_id: str,
        vm: str,
        pairs: list[tuple[FailoverNic, str]],
        nova_vfs: dict[str, str] | None,
        event: Event,
    ) -> list[dict[str, Any]]:
        """Note the pairs for ``restore``; what the destination must plug."""
        with self.lock:
            self.departures[migration_id] = Departure(vm, pairs, nova_vfs is not None)
        who = "Nova detaches the VF before the job" if nova_vfs is not None else (
            "QEMU unplugs the primary as the migration starts"
        )  # fmt: skip
        for nic, rep in pairs:
            event(
                f"offload: SR-IOV failover {nic.mac}: flows of VF {nic.vf_pci} (representor "
                f"{rep}) re-keyed to the standby {nic.standby_port}; {who}"
            )
        return [
            {"mac": nic.mac, "standby": nic.standby_port, "alias": nic.standby_alias,
             "vf": (nova_vfs or {}).get(nic.mac, ""), "plug": nova_vfs is None}
            for nic, _ in pairs
        ]  # fmt: skip

    def finish(self, migration_id: str, dest: AgentClient, event: Event) -> dict[str, Any]:
        """Final counters to the destination, forgotten here; the destination's view."""
        with self.lock:
            self.departures.pop(migration_id, None)
        final = self.local("POST", f"/v1/migrations/{migration_id}/finish", {})["flows"]
        event(f"offload: {len(final)} flows forgotten on {self.host}; final counters sent")
        try:
            for part in parts(final):
                reply = dest.post("/v1/offload/settle", {"migration_id": migration_id} | {
                    "flows": part})  # fmt: skip
                view = reply["migration"]
        except exceptions.FlexMigError as exc:
            event(f"offload: destination did not take the final counters: {exc}")
            return {"flows": len(final), "error": str(exc)}
        for note in reply.get("failover", []):
            event(f"offload: SR-IOV failover on the destination: {note}")
        resumed = view.get("events", {}).get("resumed")
        times = sorted(view.get("reoffloaded", {}).values())
        if resumed and times:
            delays = ", ".join(f"{t - resumed:.3f}" for t in times)
            event(f"offload: {len(times)} flows re-offloaded there {delays} s after resume")
        return {
            "flows": len(final),
            "were_offloaded": count_offloaded(final),
            "reoffloaded": len(times),
            "resumed_at": resumed,
            "reoffload_delays_s": [round(t - resumed, 4) for t in times] if resumed else [],
            "failover": reply.get("failover", []),
            "destination": view,
        }

    def restore(self, migration_id: str, reason: str, dest: AgentClient, event: Event) -> None:
        """The migration failed: the flows are offloaded here again; the destination forgets."""
        with self.lock:
            departure = self.departures.pop(migration_id, None)
        if departure is not None:
            self._failover_back(migration_id, departure, event)
        try:
            reply = self.local(
                "POST", f"/v1/migrations/{migration_id}/restore", {"reason": reason[:500]}
            )
            event(f"offload: {reply['reoffloaded']} flows re-offloaded on {self.host}")
        except exceptions.FlexMigError as exc:
            event(f"offload: could not restore the flows here: {exc}")
        try:
            dest.post("/v1/offload/abandon", {"migration_id": migration_id, "reason": reason[:500]})
        except exceptions.FlexMigError as exc:
            event(f"offload: destination did not drop the arrived records: {exc}")

    def _failover_back(self, migration_id: str, departure: Departure, event: Event) -> None:
        """Each pair's VF plugged back here (QEMU re-plugs a primary when a
        migration fails; if it has not, the agent does; on Nova's path Nova
        re-attaches it), its flows re-keyed back to its representor."""
        for nic, rep in departure.pairs:
            try:
                if departure.nova:
                    event(f"offload: SR-IOV failover {nic.mac}: Nova re-attaches VF {nic.vf_pci}")
                else:
                    done = self._replug(departure.vm, nic, rep)
                    event(f"offload: SR-IOV failover {nic.mac}: {done}")
                self.local(
                    "POST", f"/v1/migrations/{migration_id}/rekey",
                    {"from": nic.standby_port, "to": rep},
                )  # fmt: skip
                event(f"offload: flows of {nic.standby_port} re-keyed back to {rep} on {self.host}")
            except exceptions.FlexMigError as exc:
                event(f"offload: SR-IOV failover {nic.mac}: could not put the VF back: {exc}")

    def _replug(self, vm: str, nic: FailoverNic, rep: str) -> str:
        assert nic.vf_pci is not None  # only pairs with a plugged VF depart
        with hypervisor.connect(self.libvirt_uri, self.host) as conn:
            dom = hypervisor.find_domain(conn, vm)
            if dom is None:
                raise exceptions.InvalidInput(what="VM", reason=f"{vm!r} is not here")
            with hypervisor.wrap_errors(self.host, f"read {vm}'s XML"):
                now = sriov_failover.failover_nics(dom.XMLDesc(0))
            if any(n.mac == nic.mac and n.vf_pci == nic.vf_pci for n in now):
                return f"QEMU plugged VF {nic.vf_pci} back as primary"
            pair = FailoverPair(nic.vf_pci, rep, nic.standby_port, nic.mac,
                                standby_alias=nic.standby_alias)  # fmt: skip
            sriov_failover.plug(dom, pair, self.host)
            return f"VF {nic.vf_pci} plugged back as primary on {self.host}"

    # -- destination ------------------------------------------------------------------
    def arrive(
        self,
        migration_id: str,
        vm: str,
        ports: list[str],
        peer: str,
        flows: list,
        failover: list[dict[str, Any]] | None = None,
    ) -> str:
        why_not = self.available()
        if why_not:
            return f"the destination does not handle flows: {why_not}"
        pairs = check_failover(failover or [])
        body = {"migration_id": migration_id, "ports": ports, "peer": peer, "flows": flows}
        self.local("POST", "/v1/migrations/arrive", body)
        if pairs:
            with self.lock:
                self.arrivals[migration_id] = pairs
        self._watch_resume(migration_id, vm)
        note = "the destination re-offloads them when the VM resumes there"
        if pairs:
            note += f", after plugging {len(pairs)} VF(s) as primary and re-keying their flows"
        return note

    def _watch_resume(self, migration_id: str, vm: str) -> None:
        stop = threading.Event()
        with self.lock:
            self.watchers[migration_id] = stop
        threading.Thread(
            target=self._resume_when_running,
            args=(migration_id, vm, stop),
            name=f"offload-resume-{migration_id}",
            daemon=True,
        ).start()

    def _resume_when_running(self, migration_id: str, vm: str, stop: threading.Event) -> None:
        deadline = time.monotonic() + RESUME_WATCH_MAX_S
        try:
            with hypervisor.connect(self.libvirt_uri, self.host) as conn:
                dom = None
                while not stop.is_set() and time.monotonic() < deadline:
                    dom = dom or _lookup(conn, vm)
                    if dom is not None and _running(dom):
                        self._failover_arrived(conn, dom, migration_id)
                        self.local("POST", f"/v1/migrations/{migration_id}/resume", {})
                        return
                    stop.wait(RESUME_POLL_S)
        except exceptions.FlexMigError as exc:
            LOG.error("migration %s: re-offload after resume failed: %s", migration_id, exc)
        finally:
            with self.lock:
                self.watchers.pop(migration_id, None)

    def _failover_arrived(
        self, conn: libvirt.virConnect, dom: libvirt.virDomain, migration_id: str
    ) -> None:
        """Before re-offloading: each pair gets a VF of this host as primary (the
        agent plugs one from its pool; Nova attaches the one it claimed) and its
        flows are re-keyed from the standby to that VF's representor."""
        with self.lock:
            pairs = self.arrivals.pop(migration_id, [])
        notes = []
        for entry in pairs:
            try:
                notes.append(self._plug_arrived(conn, dom, migration_id, entry))
            except exceptions.FlexMigError as exc:
                notes.append(
                    f"{entry['mac']}: {exc}; its flows stay on the standby {entry['standby']}"
                )
        if notes:
            with self.lock:
                self.failover_notes[migration_id] = notes

    def _plug_arrived(
        self, conn: libvirt.virConnect, dom: libvirt.virDomain, migration_id: str, entry: dict
    ) -> str:
        vf = entry["vf"] or sriov_failover.pick_free_vf(self.failover_vfs, _vfs_in_use(conn))
        rep = sriov_failover.representor_of(vf, self.sysfs)
        if entry["plug"]:
            pair = FailoverPair(vf, rep, entry["standby"], entry["mac"],
                                standby_alias=entry["alias"])  # fmt: skip
            sriov_failover.plug(dom, pair, self.host)
        self.local(
            "POST", f"/v1/migrations/{migration_id}/rekey", {"from": entry["standby"], "to": rep}
        )
        how = "plugged" if entry["plug"] else "attached by Nova"
        return (
            f"{entry['mac']}: VF {vf} {how} as primary; flows re-keyed from "
            f"{entry['standby']} to {rep}"
        )

    def records(self, migration_id: str, flows: list) -> dict[str, Any]:
        """More records of an arrived migration (a VM with many flows)."""
        return self.local("POST", f"/v1/migrations/{migration_id}/records", {"flows": flows})

    def settle(self, migration_id: str, flows: list) -> dict[str, Any]:
        self._stop_watch(migration_id)
        # The source saw the job complete, so the VM runs here: resume is idempotent.
        self.local("POST", f"/v1/migrations/{migration_id}/resume", {})
        reply = self.local("POST", f"/v1/migrations/{migration_id}/settle", {"flows": flows})
        with self.lock:
            notes = self.failover_notes.pop(migration_id, [])
        return reply | ({"failover": notes} if notes else {})

    def abandon(self, migration_id: str, reason: str) -> dict[str, Any]:
        self._stop_watch(migration_id)
        with self.lock:
            self.arrivals.pop(migration_id, None)
        return self.local("POST", f"/v1/migrations/{migration_id}/abandon", {"reason": reason})

    def _stop_watch(self, migration_id: str) -> None:
        with self.lock:
            stop = self.watchers.pop(migration_id, None)
        if stop is not None:
            stop.set()


def _vfs_in_use(conn: libvirt.virConnect) -> set[str]:
    with hypervisor.wrap_errors("this host", "list the domains' VFs"):
        return sriov_failover.vfs_in_use([d.XMLDesc(0) for d in conn.listAllDomains()])


def _lookup(conn: libvirt.virConnect, vm: str) -> libvirt.virDomain | None:
    try:
        return hypervisor.find_domain(conn, vm)
    except libvirt.libvirtError:
        return None  # the incoming domain is being defined


def _running(dom: libvirt.virDomain) -> bool:
    try:
        return dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
    except libvirt.libvirtError:
        return False  # being torn down (a failed migration): abandon stops the watch
