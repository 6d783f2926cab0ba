"""``noop``: the reference provider.  It offloads nothing, so every flow
stays on the vSwitch — useful where no fast path exists, and the smallest
example of the provider interface (like os-vif's ``vif_plug_noop``)."""

from __future__ import annotations

from collections.abc import Iterable

from oslo_config import cfg

from ovs_ext.providers import base
from ovs_ext.providers.base import FlowCounters, FlowMatch, InstallResult, OffloadEntry

REASON = "noop provider offloads nothing"


class NoopProvider(base.OffloadProvider):
    CONFIG_OPTS: list[cfg.Opt] = []

    def describe(self) -> base.ProviderDescription:
        return base.ProviderDescription(
            name="noop", capacity=0, summary="offloads nothing; every flow stays onloaded"
        )

    def attach_port(self, ifname: str) -> None:
        """Nothing to attach: no port carries offloaded flows."""

    def detach_port(self, ifname: str) -> None:
        """Nothing to detach."""

    def install(self, entries: Iterable[OffloadEntry]) -> InstallResult:
        return InstallResult(installed=(), failed={e.match: REASON for e in entries})

    def remove(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        return {}

    def stats(self) -> dict[FlowMatch, FlowCounters]:
        return {}
