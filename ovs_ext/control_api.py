"""The extension's local control interface: a VM's flows across a live migration.

JSON over HTTP on a UNIX socket (mode 0600), every request signed like the
agents' API (HMAC over the request with the deployment key, nonce and
timestamp; ``agents.agent.auth``).  Only this host's agent calls it; the
agents carry the records between hosts.  Each handler takes the runtime's lock
for the state change and does the OpenFlow I/O (deleting forgotten flows'
rules) after it.  Bad input is refused with 400 and changes nothing.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from agents.agent import api, auth, listener
from ovs_ext import migration, openflow
from ovs_ext.app import Runtime, write_status
from ovs_ext.flows import TrackedFlow

LOG = logging.getLogger("flexmig.ovs_ext.control_api")
ID = r"(?P<id>[0-9A-Za-z-]{1,64})"
PORT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
# Final counters come after this many statistics polls, so the last packets the
# source's rules counted (OVS pushes them every revalidator pass) are in.
FINISH_POLLS = 2
FINISH_WAIT_S = 3.0


class ControlAPI:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.migrations = migration.FlowMigrations(runtime.control)
        self.router = api.Router()
        r = self.router
        r.add("POST", "/v1/migrations/depart", self.depart)
        r.add("POST", "/v1/migrations/arrive", self.arrive)
        r.add("POST", f"/v1/migrations/{ID}/records", self.records)
        r.add("POST", f"/v1/migrations/{ID}/resume", self.resume)
        r.add("POST", f"/v1/migrations/{ID}/finish", self.finish)
        r.add("POST", f"/v1/migrations/{ID}/settle", self.settle)
        r.add("POST", f"/v1/migrations/{ID}/restore", self.restore)
        r.add("POST", f"/v1/migrations/{ID}/abandon", self.abandon)
        r.add("POST", f"/v1/migrations/{ID}/rekey", self.rekey)
        r.add("GET", f"/v1/migrations/{ID}", self.show)
        r.add("POST", "/v1/flows", self.flows_of_ports)

    # -- source -------------------------------------------------------------------
    def depart(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """Demote and hold; ``rekey`` ({VF representor: standby}) then moves an SR-IOV
        failover pair's flows to the standby, the records leave keyed by it."""
        api.check_fields(body, {"migration_id": str, "ports": list, "peer": str}, {"rekey": dict})
        ports = _ports(body["ports"])
        _check_id(body["migration_id"])
        pairs = _rekey_pairs(body.get("rekey", {}), ports)
        gone: list[TrackedFlow] = []
        with self.rt.lock:
            mid = body["migration_id"]
            records = self.migrations.depart(mid, ports, body["peer"][:100])
            for old, new in pairs:
                gone += self.migrations.rekey(mid, old, new)
            if pairs:
                records = self.migrations.records(mid)
        self._delete_rules(gone)
        self._write_status()
        return 200, {"flows": [r.to_wire() for r in records]}

    def rekey(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """An SR-IOV failover pair's flows change NIC (either role; see migration.py)."""
        api.check_fields(body, {"from": str, "to": str})
        (old, new), *_ = _rekey_pairs({body["from"]: body["to"]}, [])
        with self.rt.lock:
            gone = self.migrations.rekey(m["id"], old, new)
            shown = self.migrations.by_id[m["id"]].as_dict()
        self._delete_rules(gone)
        self._write_status()
        return 200, {"rekeyed": len(gone), "migration": shown}

    def finish(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        with self.rt.lock:
            self.migrations.get(m["id"], migration.Role.SOURCE)
            polls = self.rt.control.polls
        self._wait_polls(polls + FINISH_POLLS)
        with self.rt.lock:
            final, gone = self.migrations.finish(m["id"])
        self._delete_rules(gone)
        self._write_status()
        return 200, {"flows": [r.to_wire() for r in final]}

    def restore(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"reason": str})
        with self.rt.lock:
            done = self.migrations.restore(m["id"], body["reason"])
            mig = self.migrations.get(m["id"], migration.Role.SOURCE).as_dict()
        self._write_status()
        return 200, {"reoffloaded": len(done), "migration": mig}

    # -- destination --------------------------------------------------------------
    def arrive(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"migration_id": str, "ports": list, "peer": str, "flows": list})
        _check_id(body["migration_id"])
        ports = _ports(body["ports"])
        records = [migration.FlowTransfer.from_wire(_obj(r)) for r in body["flows"]]
        with self.rt.lock:
            mig = self.migrations.arrive(body["migration_id"], ports, body["peer"][:100], records)
            shown = mig.as_dict()
        self._write_status()
        return 200, {"migration": shown}

    def records(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"flows": list})
        records = [migration.FlowTransfer.from_wire(_obj(r)) for r in body["flows"]]
        with self.rt.lock:
            shown = self.migrations.add_records(m["id"], records).as_dict()
        self._write_status()
        return 200, {"migration": shown}

    def resume(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        with self.rt.lock:
            done = self.migrations.resume(m["id"])
            shown = self.migrations.get(m["id"], migration.Role.DESTINATION).as_dict()
        self._write_status()
        return 200, {"reoffloaded_now": len(done), "migration": shown}

    def settle(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"flows": list})
        records = [migration.FlowTransfer.from_wire(_obj(r)) for r in body["flows"]]
        with self.rt.lock:
            shown = self.migrations.settle(m["id"], records).as_dict()
        self._write_status()
        return 200, {"migration": shown}

    def abandon(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {"reason": str})
        with self.rt.lock:
            gone = self.migrations.abandon(m["id"], body["reason"])
        self._delete_rules(gone)
        self._write_status()
        return 200, {"forgotten": len(gone)}

    # -- reads --------------------------------------------------------------------
    def show(self, body: dict[str, Any], m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        api.check_fields(body, {})
        with self.rt.lock:
            mig = self.migrations.by_id.get(m["id"])
            if mig is None:
                raise api.BadRequest(reason=f"no migration {m['id']!r} here")
            return 200, mig.as_dict()

    def flows_of_ports(self, body: dict[str, Any], _m: re.Match[str]) -> tuple[int, dict[str, Any]]:
        """The flows of these ports, as a migration would carry them (for explain)."""
        api.check_fields(body, {"ports": list})
        ports = _ports(body["ports"])
        with self.rt.lock:
            flows = {f.match: f for p in ports for f in self.rt.control.flows.flows_of_port(p)}
            records = [
                migration.transfer_of(f, f.state.value == "offloaded") for f in flows.values()
            ]
            return 200, {
                "provider": self.rt.control.provider_name,
                "flows": [r.to_wire() for r in records],
            }

    # -- I/O ------------------------------------------------------------------------
    def _wait_polls(self, target: int) -> None:
        deadline = time.monotonic() + FINISH_WAIT_S
        while time.monotonic() < deadline:
            with self.rt.lock:
                if self.rt.control.polls >= target:
                    return
            time.sleep(0.02)
        LOG.warning("no fresh statistics in %.1f s: final counters as last polled", FINISH_WAIT_S)

    def _delete_rules(self, gone: list[TrackedFlow]) -> None:
        app = self.rt.app
        if app is None or app.datapath is None:
            return
        dp = app.datapath
        for flow in gone:
            app.send(openflow.delete_owned(dp.ofproto_parser, dp.ofproto, flow.cookie, 2**64 - 1))

    def _write_status(self) -> None:
        if self.rt.status_file:
            with self.rt.lock:
                write_status(self.rt.status_file, self.rt.control.status())


def _ports(value: list[Any]) -> list[str]:
    names_ok = all(isinstance(p, str) and PORT_RE.match(p) for p in value)
    if not value or len(value) > 64 or not names_ok:
        raise api.BadRequest(reason="ports must be 1..64 interface names")
    return value


def _rekey_pairs(value: dict[str, Any], ports: list[str]) -> list[tuple[str, str]]:
    """(old, new) port pairs, both interface names; with ``ports`` given (depart),
    each old port must be one of the VM's ports there."""
    pairs = list(value.items())
    if len(pairs) > 8 or not all(
        isinstance(v, str) and PORT_RE.match(k) and PORT_RE.match(v) and k != v for k, v in pairs
    ):
        raise api.BadRequest(reason="rekey must map up to 8 interface names to other names")
    if ports and not all(k in ports for k, _ in pairs):
        raise api.BadRequest(reason="rekey names a port that is not the VM's")
    return pairs


def _check_id(value: str) -> None:
    if not re.fullmatch(r"[0-9A-Za-z-]{1,64}", value):
        raise api.BadRequest(reason="migration_id must be 1..64 letters, digits or '-'")


def _obj(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise api.BadRequest(reason="each flow record must be an object")
    return value


def serve(runtime: Runtime, socket_path: str, key: bytes) -> ControlAPI:
    """Start the control interface in a thread; the returned object keeps its state."""
    control_api = ControlAPI(runtime)
    handler = api.make_handler(auth.Verifier(key), control_api.router)
    server = listener.unix_listener(socket_path, handler, listener.Limits())
    threading.Thread(target=server.serve_forever, name="offload-control", daemon=True).start()
    control_api.server = server  # type: ignore[attr-defined]
    return control_api
