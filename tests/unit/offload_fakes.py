"""An in-memory offload provider for unit tests of the control plane only."""

from __future__ import annotations

from collections.abc import Iterable

from ovs_ext.providers.base import (
    FlowCounters,
    FlowMatch,
    InstallResult,
    OffloadEntry,
    OffloadError,
    OffloadProvider,
    ProviderDescription,
)


class FakeProvider(OffloadProvider):
    """Entries in a dict; tests add traffic with :meth:`carry` and refusals with ``refuse``."""

    def __init__(self, capacity: int = 16) -> None:
        super().__init__(conf=None)  # type: ignore[arg-type]
        self.capacity = capacity
        self.ports: set[str] = set()
        self.entries: dict[FlowMatch, FlowCounters] = {}
        self.refuse: dict[FlowMatch, str] = {}
        self.fail_attach: set[str] = set()
        self.install_calls = 0

    def describe(self) -> ProviderDescription:
        return ProviderDescription("fake", self.capacity, "in-memory test provider")

    def attach_port(self, ifname: str) -> None:
        if ifname in self.fail_attach:
            raise OffloadError(provider="fake", action=f"attach {ifname}", reason="refused")
        self.ports.add(ifname)

    def detach_port(self, ifname: str) -> None:
        self.ports.discard(ifname)
        for match in [m for m in self.entries if m.in_port == ifname]:
            del self.entries[match]

    def install(self, entries: Iterable[OffloadEntry]) -> InstallResult:
        self.install_calls += 1
        installed, failed = [], {}
        for entry in entries:
            if entry.match in self.refuse:
                failed[entry.match] = self.refuse[entry.match]
            elif len(self.entries) >= self.capacity:
                failed[entry.match] = "table full"
            else:
                self.entries[entry.match] = FlowCounters()
                installed.append(entry.match)
        return InstallResult(tuple(installed), failed)

    def remove(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        return {m: self.entries.pop(m) for m in matches if m in self.entries}

    def stats(self) -> dict[FlowMatch, FlowCounters]:
        return dict(self.entries)

    def carry(self, match: FlowMatch, packets: int, size: int = 100) -> None:
        """Traffic through the fast path (only where an entry exists)."""
        self.entries[match] = self.entries[match] + FlowCounters(packets, packets * size)
