"""The offload provider interface: the one contract every fast path implements.

A provider is an eSwitch that can carry a flow instead of the vSwitch — a
NIC's (``tc-flower`` with ``skip_sw`` on switchdev representors) or the
kernel's (``xdp``).  Like os-vif's plugins it is tiny: ``describe``, port
attach/detach, ``install``/``remove`` in batches, ``stats``.  Providers are
found through the ``flexmig.offload_providers`` entry points and carry their
own ``CONFIG_OPTS`` (registered under ``[offload_<name>]``).

Everything here is data: no I/O, so the Flow Manager and the tests can use it
without a kernel.
"""

from __future__ import annotations

import abc
import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping

from oslo_config import cfg

from flexmig import exceptions

IPPROTO_TCP = 6
IPPROTO_UDP = 17


class OffloadError(exceptions.FlexMigError):
    msg_fmt = "offload provider %(provider)s could not %(action)s: %(reason)s"


@dataclasses.dataclass(frozen=True, order=True)
class FlowMatch:
    """An IPv4 5-tuple seen on a port: the unit that is offloaded or onloaded."""

    in_port: str  # interface name of the port the packets enter br-int by
    ip_proto: int  # IPPROTO_TCP or IPPROTO_UDP
    ipv4_src: str
    ipv4_dst: str
    tp_src: int
    tp_dst: int

    def __post_init__(self) -> None:
        if self.ip_proto not in (IPPROTO_TCP, IPPROTO_UDP):
            raise exceptions.InvalidInput(what="ip_proto", reason=f"{self.ip_proto} not TCP/UDP")
        for field in ("ipv4_src", "ipv4_dst"):
            try:
                ipaddress.IPv4Address(getattr(self, field))
            except ValueError as exc:
                raise exceptions.InvalidInput(what=field, reason=str(exc)) from exc
        for field in ("tp_src", "tp_dst"):
            if not 0 <= getattr(self, field) <= 0xFFFF:
                raise exceptions.InvalidInput(what=field, reason="not a port number")
        if not self.in_port or len(self.in_port) > 15:
            raise exceptions.InvalidInput(what="in_port", reason=f"{self.in_port!r}")


@dataclasses.dataclass(frozen=True)
class OffloadEntry:
    """Install request: packets matching ``match`` leave by ``out_port``, untouched."""

    match: FlowMatch
    out_port: str


@dataclasses.dataclass(frozen=True)
class FlowCounters:
    packets: int = 0
    bytes: int = 0

    def __add__(self, other: FlowCounters) -> FlowCounters:
        return FlowCounters(self.packets + other.packets, self.bytes + other.bytes)


@dataclasses.dataclass(frozen=True)
class ProviderDescription:
    name: str
    capacity: int  # offload-table size, as a NIC's flow table has one
    summary: str
    available: bool = True
    unavailable_reason: str = ""


@dataclasses.dataclass(frozen=True)
class InstallResult:
    """Which entries of a batch are now offloaded, and why the others are not."""

    installed: tuple[FlowMatch, ...]
    failed: Mapping[FlowMatch, str]


class OffloadProvider(abc.ABC):
    """One fast path.  Methods raise :class:`OffloadError` for whole-call failures."""

    CONFIG_OPTS: list[cfg.Opt] = []  # overridden per plugin

    def __init__(self, conf: cfg.ConfigOpts) -> None:
        self.conf = conf

    @abc.abstractmethod
    def describe(self) -> ProviderDescription:
        """What this provider is, its capacity, and whether it can run here."""

    @abc.abstractmethod
    def attach_port(self, ifname: str) -> None:
        """Make the port a member of the fast path (idempotent)."""

    @abc.abstractmethod
    def detach_port(self, ifname: str) -> None:
        """Remove the port and every entry using it (idempotent)."""

    @abc.abstractmethod
    def install(self, entries: Iterable[OffloadEntry]) -> InstallResult:
        """Install a batch; a refused entry stays onloaded and is named in ``failed``."""

    @abc.abstractmethod
    def remove(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        """Remove entries; returns each one's final counters so none are lost."""

    @abc.abstractmethod
    def stats(self) -> dict[FlowMatch, FlowCounters]:
        """Counters of every installed entry since it was installed."""
