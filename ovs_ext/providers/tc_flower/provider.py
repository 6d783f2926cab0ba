"""``tc-flower``: offload flows into a switchdev SR-IOV NIC's eswitch.

Each offloaded flow is one flower filter with ``skip_sw`` on the ingress
(clsact) hook of the representor its packets enter by, matching the IPv4
5-tuple, with ``mirred egress redirect`` to the out port's representor: the
NIC forwards the flow between VFs/uplink without the host.  Counters are the
NIC's, read back per filter.  Everything goes through pyroute2.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from oslo_config import cfg
from pyroute2 import IPRoute
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl import RTM_DELTFILTER, RTM_GETTFILTER, RTM_NEWQDISC, RTM_NEWTFILTER

from ovs_ext.providers import base
from ovs_ext.providers.base import (
    FlowCounters,
    FlowMatch,
    InstallResult,
    OffloadEntry,
    OffloadError,
    ProviderDescription,
)
from ovs_ext.providers.tc_flower import messages, probe

LOG = logging.getLogger("flexmig.ovs_ext.providers.tc_flower")

NAME = "tc-flower"
GROUP = "offload_tc_flower"
CREATE = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
MAX_HANDLE = 0xFFFFFFFF

CONFIG_OPTS = [
    cfg.ListOpt(
        "representors",
        default=[],
        help="Representor netdevs flows may be offloaded between. Empty: any "
        "netdev sysfs shows as a switchdev representor (phys_switch_id and a "
        "pf<N>vf<M> or p<N> phys_port_name).",
    ),
    cfg.IntOpt(
        "filter_priority",
        default=10,
        min=1,
        max=0xFFFF,
        help="tc priority of FlexMig's flower filters on the representors' "
        "ingress hook. Keep it apart from priorities OVS's own hw-offload uses "
        "on the same devices.",
    ),
    cfg.IntOpt(
        "capacity",
        default=65536,
        min=1,
        max=16 * 1024 * 1024,
        help="Flows this provider offloads at most: the share of the NIC's flow "
        "table FlexMig may use.",
    ),
]


def list_opts() -> list[tuple[str, list[cfg.Opt]]]:
    """For oslo-config-generator."""
    return [(GROUP, CONFIG_OPTS)]


class TcNetlink(Protocol):
    """The few rtnetlink calls the provider makes (pyroute2 in production)."""

    def ifindex(self, ifname: str) -> int | None: ...

    def request(self, msg: object, msg_type: int, flags: int) -> list: ...


class NetlinkFailure(Exception):
    """A netlink request the kernel refused (errno and its message)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (errno {code})")
        self.code = code


class PyRoute2Netlink:
    """rtnetlink through one pyroute2 IPRoute socket, flower replies decoded."""

    def __init__(self, netns: str | None = None) -> None:
        self._netns = netns
        self._ipr: IPRoute | None = None

    def _socket(self) -> IPRoute:
        if self._ipr is None:
            self._ipr = IPRoute(ext_ack=True, netns=self._netns)
            # Per-socket decoder map: filter replies parse as flower.
            self._ipr.asyncore.marshal.msg_map[RTM_NEWTFILTER] = messages.FlowerTcmsg
            # pyroute2 0.9.7's sync IPRoute never sets the key its own
            # nlm_request() reads (KeyError 'nlm_generator'): ask for lists.
            self._ipr.asyncore.status.setdefault("nlm_generator", False)
        return self._ipr

    def ifindex(self, ifname: str) -> int | None:
        try:
            found = self._socket().link_lookup(ifname=ifname)
        except (NetlinkError, OSError) as exc:
            raise _failure(exc) from exc
        return found[0] if found else None

    def request(self, msg: object, msg_type: int, flags: int) -> list:
        try:
            return list(self._socket().nlm_request(msg, msg_type=msg_type, msg_flags=flags))
        except (NetlinkError, OSError) as exc:
            raise _failure(exc) from exc

    def close(self) -> None:
        if self._ipr is not None:
            self._ipr.close()
            self._ipr = None


def _failure(exc: Exception) -> NetlinkFailure:
    """pyroute2's and the socket layer's errors as one type the provider handles."""
    if isinstance(exc, NetlinkError):
        return NetlinkFailure(exc.code, str(exc.args[-1]))
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    return NetlinkFailure(code, str(exc))


@dataclasses.dataclass(frozen=True)
class _Filter:
    ifindex: int
    handle: int
    out_port: str


class TcFlowerProvider(base.OffloadProvider):
    CONFIG_OPTS = CONFIG_OPTS

    def __init__(
        self,
        conf: cfg.ConfigOpts,
        netlink: TcNetlink | None = None,
        facts: Callable[[], probe.SystemFacts] = probe.gather,
        is_representor: Callable[[str], bool] = probe.is_representor,
    ) -> None:
        super().__init__(conf)
        conf.register_opts(CONFIG_OPTS, group=GROUP)
        self._opts = conf[GROUP]
        self._netlink = netlink or PyRoute2Netlink()
        self._facts = facts
        self._is_representor = is_representor
        self._ports: dict[str, int] = {}  # attached representor -> ifindex
        self._installed: dict[FlowMatch, _Filter] = {}
        self._next_handle: dict[int, int] = {}
        # Counters each filter last showed: what remove() returns if the
        # kernel cannot be read at that moment, so a total is never lost.
        self._last_counters: dict[FlowMatch, FlowCounters] = {}

    def describe(self) -> ProviderDescription:
        facts = self._facts()
        reasons = probe.missing(facts)
        absent = [r for r in self._opts.representors if r not in facts.representors]
        if absent and facts.representors:
            reasons.append(f"configured representors not found: {', '.join(absent)}")
        return ProviderDescription(
            name=NAME,
            capacity=self._opts.capacity,
            summary="flower filters with skip_sw on switchdev VF representors, "
            "mirred redirect between them; per-filter NIC counters",
            available=not reasons,
            unavailable_reason="; ".join(reasons),
        )

    # ------------------------------------------------------------ ports

    def attach_port(self, ifname: str) -> None:
        if ifname in self._ports:
            return
        allowed = self._opts.representors
        if (allowed and ifname not in allowed) or not (allowed or self._is_representor(ifname)):
            raise OffloadError(provider=NAME, action=f"attach {ifname}",
                               reason="not a switchdev representor")  # fmt: skip
        try:
            ifindex = self._netlink.ifindex(ifname)
        except NetlinkFailure as exc:
            raise OffloadError(provider=NAME, action=f"attach {ifname}", reason=str(exc)) from exc
        if ifindex is None:
            raise OffloadError(provider=NAME, action=f"attach {ifname}", reason="no such netdev")
        try:
            self._netlink.request(messages.clsact_request(ifindex), RTM_NEWQDISC, CREATE)
        except NetlinkFailure as exc:
            if exc.code != errno.EEXIST:  # a clsact qdisc is already there: fine
                raise OffloadError(provider=NAME, action=f"add clsact to {ifname}",
                                   reason=str(exc)) from exc  # fmt: skip
        self._ports[ifname] = ifindex

    def detach_port(self, ifname: str) -> None:
        """Remove the port's filters (their final counters are dropped: call
        :meth:`remove` first to keep them) and forget it; its clsact qdisc
        stays, as other users may have filters there."""
        using = [m for m, f in self._installed.items() if ifname in (m.in_port, f.out_port)]
        self.remove(using)
        self._ports.pop(ifname, None)

    # ------------------------------------------------------------ flows

    def install(self, entries: Iterable[OffloadEntry]) -> InstallResult:
        installed: list[FlowMatch] = []
        failed: dict[FlowMatch, str] = {}
        for entry in entries:
            reason = self._install_one(entry)
            if reason:
                failed[entry.match] = reason
            else:
                installed.append(entry.match)
        return InstallResult(installed=tuple(installed), failed=failed)

    def _install_one(self, entry: OffloadEntry) -> str:
        """Install one filter; the reason it was not, or ""."""
        match = entry.match
        existing = self._installed.get(match)
        if existing is not None:
            if existing.out_port == entry.out_port:
                return ""
            return f"already offloaded to {existing.out_port}; remove it first"
        if len(self._installed) >= self._opts.capacity:
            return f"offload table full ({self._opts.capacity} flows)"
        for port in (match.in_port, entry.out_port):
            if port not in self._ports:
                return f"port {port} is not attached to {NAME}"
        ifindex = self._ports[match.in_port]
        handle = self._allocate_handle(ifindex)
        request = messages.add_filter_request(
            match, ifindex, self._ports[entry.out_port], self._opts.filter_priority, handle
        )
        try:
            self._netlink.request(request, RTM_NEWTFILTER, CREATE)
        except NetlinkFailure as exc:
            return f"the kernel refused the flower filter on {match.in_port}: {exc}"
        self._installed[match] = _Filter(ifindex, handle, entry.out_port)
        return ""

    def _allocate_handle(self, ifindex: int) -> int:
        used = {f.handle for f in self._installed.values() if f.ifindex == ifindex}
        handle = self._next_handle.get(ifindex, 1)
        while handle in used:
            handle = handle % MAX_HANDLE + 1
        self._next_handle[ifindex] = handle % MAX_HANDLE + 1
        return handle

    def remove(self, matches: Iterable[FlowMatch]) -> dict[FlowMatch, FlowCounters]:
        """Delete filters, returning each one's counters read just before.

        A filter the kernel refuses to delete stays installed (and in
        :meth:`stats`); it is logged and left out of the result."""
        final: dict[FlowMatch, FlowCounters] = {}
        for match in matches:
            installed = self._installed.get(match)
            if installed is None:
                continue
            counters = self._read_one(installed) or self._last_counters.get(match, FlowCounters())
            request = messages.filter_request(
                installed.ifindex, self._opts.filter_priority, installed.handle
            )
            try:
                self._netlink.request(request, RTM_DELTFILTER, NLM_F_REQUEST | NLM_F_ACK)
            except NetlinkFailure as exc:
                if exc.code != errno.ENOENT:
                    LOG.error("tc-flower: could not remove %s: %s", match, exc)
                    continue
            del self._installed[match]
            self._last_counters.pop(match, None)
            final[match] = counters
        return final

    def _read_one(self, installed: _Filter) -> FlowCounters | None:
        request = messages.filter_request(
            installed.ifindex, self._opts.filter_priority, installed.handle
        )
        try:
            replies = self._netlink.request(request, RTM_GETTFILTER, NLM_F_REQUEST)
        except NetlinkFailure as exc:
            LOG.warning("tc-flower: no final counters for handle %#x: %s", installed.handle, exc)
            return None
        for reply in replies:
            state = messages.parse_filter(reply)
            if state is not None and state.handle == installed.handle:
                return state.counters
        return None

    def stats(self) -> dict[FlowMatch, FlowCounters]:
        by_filter = {(f.ifindex, f.handle): m for m, f in self._installed.items()}
        found: dict[FlowMatch, FlowCounters] = {}
        for ifindex in sorted({f.ifindex for f in self._installed.values()}):
            try:
                replies = self._netlink.request(
                    messages.dump_request(ifindex), RTM_GETTFILTER, NLM_F_REQUEST | NLM_F_DUMP
                )
            except NetlinkFailure as exc:
                raise OffloadError(provider=NAME, action=f"dump filters of ifindex {ifindex}",
                                   reason=str(exc)) from exc  # fmt: skip
            for reply in replies:
                state = messages.parse_filter(reply)
                if state is None or state.priority != self._opts.filter_priority:
                    continue
                match = by_filter.get((ifindex, state.handle))
                if match is not None:
                    found[match] = state.counters
        self._last_counters.update(found)
        lost = set(self._installed) - set(found)
        if lost:
            LOG.warning("tc-flower: %d installed filters missing from the dump", len(lost))
        return found
