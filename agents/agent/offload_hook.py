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
from typing import Any

import libvirt

from agents.agent import api
from agents.agent.client import AgentClient
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
    """The VM's ports on the bridge: its interfaces' target devices.

    >>> vm_ports("<domain><devices><interface type='bridge'><target dev='tap3'/>"
    ...          "</interface><interface type='hostdev'/></devices></domain>")
    ['tap3']
    """
    root = ET.fromstring(domain_xml)
    ports = []
    for iface in root.findall("./devices/interface"):
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


class OffloadHook:
    def __init__(self, socket_path: str, key: bytes, host: str, libvirt_uri: str) -> None:
        self.socket_path = socket_path
        self.key = key
        self.host = host
        self.libvirt_uri = libvirt_uri
        self.watchers: dict[str, threading.Event] = {}
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

    def ports_of(self, vm: str) -> list[str]:
        with hypervisor.connect(self.libvirt_uri, self.host) as conn:
            dom = hypervisor.find_domain(conn, vm)
            if dom is None:
                raise exceptions.InvalidInput(what="VM", reason=f"{vm!r} is not here")
            with hypervisor.wrap_errors(self.host, f"read {vm}'s XML"):
                return vm_ports(dom.XMLDesc(0))

    def explain(self, vm: str) -> str:
        """What a migration would do to the VM's flows (for ``flexmig explain``)."""
        why_not = self.available()
        if why_not:
            return f"offloaded flows: none handled ({why_not})"
        ports = self.ports_of(vm)
        if not ports:
            return "offloaded flows: the VM has no bridge port"
        reply = self.local("POST", "/v1/flows", {"ports": ports})
        flows = reply["flows"]
        return (
            f"offloaded flows: {count_offloaded(flows)} of {len(flows)} flows on "
            f"{', '.join(ports)} are offloaded (provider {reply['provider']}); a migration "
            "demotes them to the vSwitch before switchover (counters carried), sends their "
            "records to the destination ahead of it, and offloads them again there once the "
            "VM resumes (the destination's policy and capacity permitting)"
        )

    # -- source ---------------------------------------------------------------------
    def depart(self, migration_id: str, vm: str, dest: AgentClient, event: Event) -> bool:
        """Demote and hold here, hand the records to the destination; True if handled."""
        why_not = self.available()
        if why_not:
            event(f"offload: flows not handled: {why_not}")
            return False
        ports = self.ports_of(vm)
        body = {"migration_id": migration_id, "ports": ports, "peer": dest.address}
        flows = self.local("POST", "/v1/migrations/depart", body)["flows"]
        event(
            f"offload: {count_offloaded(flows)} offloaded flows of {len(flows)} demoted "
            f"to the vSwitch on {self.host} (counters carried)"
        )
        first, *rest = parts(flows)
        try:
            reply = dest.post(
                "/v1/offload/arrive",
                {"migration_id": migration_id, "vm": vm, "ports": ports, "peer": self.host}
                | {"flows": first},
            )
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

    def finish(self, migration_id: str, dest: AgentClient, event: Event) -> dict[str, Any]:
        """Final counters to the destination, forgotten here; the destination's view."""
        final = self.local("POST", f"/v1/migrations/{migration_id}/finish", {})["flows"]
        event(f"offload: {len(final)} flows forgotten on {self.host}; final counters sent")
        try:
            for part in parts(final):
                view = dest.post(
                    "/v1/offload/settle", {"migration_id": migration_id, "flows": part}
                )["migration"]
        except exceptions.FlexMigError as exc:
            event(f"offload: destination did not take the final counters: {exc}")
            return {"flows": len(final), "error": str(exc)}
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
            "destination": view,
        }

    def restore(self, migration_id: str, reason: str, dest: AgentClient, event: Event) -> None:
        """The migration failed: the flows are offloaded here again; the destination forgets."""
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

    # -- destination ------------------------------------------------------------------
    def arrive(self, migration_id: str, vm: str, ports: list[str], peer: str, flows: list) -> str:
        why_not = self.available()
        if why_not:
            return f"the destination does not handle flows: {why_not}"
        body = {"migration_id": migration_id, "ports": ports, "peer": peer, "flows": flows}
        self.local("POST", "/v1/migrations/arrive", body)
        self._watch_resume(migration_id, vm)
        return "the destination re-offloads them when the VM resumes there"

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
                        self.local("POST", f"/v1/migrations/{migration_id}/resume", {})
                        return
                    stop.wait(RESUME_POLL_S)
        except exceptions.FlexMigError as exc:
            LOG.error("migration %s: re-offload after resume failed: %s", migration_id, exc)
        finally:
            with self.lock:
                self.watchers.pop(migration_id, None)

    def records(self, migration_id: str, flows: list) -> dict[str, Any]:
        """More records of an arrived migration (a VM with many flows)."""
        return self.local("POST", f"/v1/migrations/{migration_id}/records", {"flows": flows})

    def settle(self, migration_id: str, flows: list) -> dict[str, Any]:
        self._stop_watch(migration_id)
        # The source saw the job complete, so the VM runs here: resume is idempotent.
        self.local("POST", f"/v1/migrations/{migration_id}/resume", {})
        return self.local("POST", f"/v1/migrations/{migration_id}/settle", {"flows": flows})

    def abandon(self, migration_id: str, reason: str) -> dict[str, Any]:
        self._stop_watch(migration_id)
        return self.local("POST", f"/v1/migrations/{migration_id}/abandon", {"reason": reason})

    def _stop_watch(self, migration_id: str) -> None:
        with self.lock:
            stop = self.watchers.pop(migration_id, None)
        if stop is not None:
            stop.set()


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
