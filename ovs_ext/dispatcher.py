"""Per-VM dispatchers: one per VM port, holding that VM's filter table.

Seed 002 gives every VM a Dispatcher whose filter table says, flow by flow,
whether the VM's packets go to the NIC (offload) or through the vSwitch
(onload).  Here a dispatcher owns the flows *from* its port (egress) and the
flows *to* it (ingress, from the uplink or another port) and applies the
Policy Manager's decisions to them through the offload provider, in batches.
The provider is the only thing it talks to, so it is unit-tested with a fake.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Sequence

from ovs_ext.policy import Direction
from ovs_ext.providers.base import (
    FlowCounters,
    FlowMatch,
    InstallResult,
    OffloadEntry,
    OffloadError,
    OffloadProvider,
)

LOG = logging.getLogger(__name__)


@dataclasses.dataclass
class FilterEntry:
    out_port: str
    offloaded: bool = False


class PortDispatcher:
    """The filter table of one VM port and the provider calls that realise it."""

    def __init__(self, port: str, provider: OffloadProvider, provider_name: str) -> None:
        self.port = port
        self.provider = provider
        self.provider_name = provider_name
        self.filter_table: dict[FlowMatch, FilterEntry] = {}

    def direction_of(self, match: FlowMatch, out_port: str | None) -> Direction | None:
        """Egress when the flow enters br-int from this VM, ingress when it leaves to it."""
        if match.in_port == self.port:
            return Direction.EGRESS
        if out_port == self.port:
            return Direction.INGRESS
        return None

    def offload(self, entries: Sequence[OffloadEntry]) -> InstallResult:
        """Install a batch; every entry the provider refuses keeps its reason."""
        if not entries:
            return InstallResult(installed=(), failed={})
        try:
            result = self.provider.install(entries)
        except OffloadError as exc:
            LOG.warning("%s: provider %s refused a batch: %s", self.port, self.provider_name, exc)
            return InstallResult(installed=(), failed={e.match: str(exc) for e in entries})
        for entry in entries:
            if entry.match in result.installed:
                self.filter_table[entry.match] = FilterEntry(entry.out_port, offloaded=True)
        return result

    def onload(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        """Remove offload entries; return each one's final counters (none are lost)."""
        matches = [m for m in matches if m in self.filter_table]
        if not matches:
            return {}
        try:
            finals = self.provider.remove(matches)
        except OffloadError as exc:
            # The entries may still be in the fast path: keep them in the
            # table so the next poll's stats keep counting them.
            LOG.error("%s: provider %s failed to remove: %s", self.port, self.provider_name, exc)
            return {}
        for match in matches:
            self.filter_table.pop(match, None)
        return finals

    def forget(self, match: FlowMatch) -> None:
        self.filter_table.pop(match, None)


class Dispatchers:
    """The dispatcher of every VM port on the bridge, created as ports come and go."""

    def __init__(
        self,
        provider: OffloadProvider,
        provider_name: str,
        vm_port_patterns: Sequence[str],
        uplinks: Sequence[str],
    ) -> None:
        self.provider = provider
        self.provider_name = provider_name
        self.vm_port_res = [re.compile(p) for p in vm_port_patterns]
        self.uplinks = set(uplinks)
        self.by_port: dict[str, PortDispatcher] = {}
        self.fast_path_ports: set[str] = set()

    def is_vm_port(self, name: str) -> bool:
        return name not in self.uplinks and any(r.fullmatch(name) for r in self.vm_port_res)

    def watches(self, name: str) -> bool:
        """Ports whose new flows the app discovers: VM ports and uplinks."""
        return name in self.uplinks or self.is_vm_port(name)

    def port_added(self, name: str) -> PortDispatcher | None:
        """Attach a VM port or uplink to the fast path; VM ports get a dispatcher."""
        if not self.watches(name):
            return None
        if name not in self.fast_path_ports:
            try:
                self.provider.attach_port(name)
                self.fast_path_ports.add(name)
            except OffloadError as exc:
                LOG.warning("port %s stays onload-only: %s", name, exc)
        if not self.is_vm_port(name):
            return None
        dispatcher = self.by_port.get(name)
        if dispatcher is None:
            dispatcher = PortDispatcher(name, self.provider, self.provider_name)
            self.by_port[name] = dispatcher
        return dispatcher

    def port_removed(self, name: str) -> None:
        self.by_port.pop(name, None)
        if name in self.fast_path_ports:
            self.fast_path_ports.discard(name)
            try:
                self.provider.detach_port(name)
            except OffloadError as exc:
                LOG.warning("detaching %s: %s", name, exc)

    def owners(self, match: FlowMatch, out_port: str | None) -> list[tuple[str, Direction]]:
        """The dispatchers that see a flow: its sending VM's (egress), then its
        receiving VM's (ingress).  Between two VMs of one host, both."""
        seen = []
        if match.in_port in self.by_port:
            seen.append((match.in_port, Direction.EGRESS))
        if out_port in self.by_port and out_port != match.in_port:
            seen.append((out_port, Direction.INGRESS))
        return seen

    def can_offload(self, match: FlowMatch, out_port: str | None) -> str:
        """Empty when the fast path can carry the flow, else why not."""
        if out_port is None:
            return "destination port not learned yet"
        missing = [p for p in (match.in_port, out_port) if p not in self.fast_path_ports]
        if missing:
            return f"port {', '.join(missing)} is not attached to provider {self.provider_name}"
        return ""
