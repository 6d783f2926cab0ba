"""tc-flower provider: the netlink messages it builds and parses, no kernel.

Messages are encoded to bytes by pyroute2 and read back with an independent
NLA walker (struct), so a test fails if pyroute2's encoding and the kernel's
layout (linux/pkt_cls.h, linux/tc_act/tc_mirred.h) disagree.
"""

from __future__ import annotations

import errno
import socket
import struct

import pytest
from oslo_config import cfg
from pyroute2.netlink import NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST
from pyroute2.netlink.rtnl import RTM_DELTFILTER, RTM_GETTFILTER, RTM_NEWQDISC, RTM_NEWTFILTER

from ovs_ext.providers.base import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    FlowCounters,
    FlowMatch,
    OffloadEntry,
    OffloadError,
)
from ovs_ext.providers.noop import NoopProvider
from ovs_ext.providers.tc_flower import TcFlowerProvider, messages, probe
from ovs_ext.providers.tc_flower.provider import NetlinkFailure

NLMSGHDR = struct.Struct("=IHHII")
TCMSG = struct.Struct("=BxxxiIII")
NLA = struct.Struct("=HH")
MIRRED_PARMS = struct.Struct("=IIiiiiI")  # struct tc_mirred
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER

# Attribute numbers, from the kernel headers.
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_FLOWER_ACT, TCA_FLOWER_FLAGS = 3, 22
KEY_ETH_TYPE, KEY_IP_PROTO, KEY_IPV4_SRC, KEY_IPV4_DST = 8, 9, 10, 12
KEY_TCP_SRC, KEY_TCP_DST, KEY_UDP_SRC, KEY_UDP_DST = 18, 19, 20, 21
TCA_ACT_KIND, TCA_ACT_OPTIONS, TCA_ACT_STATS = 1, 2, 4
TCA_MIRRED_PARMS = 2
TCA_STATS_BASIC, TCA_STATS_PKT64 = 1, 8

TCP_FLOW = FlowMatch("rep1", IPPROTO_TCP, "10.0.0.1", "10.0.0.2", 40000, 5201)
UDP_FLOW = FlowMatch("rep1", IPPROTO_UDP, "10.0.0.1", "10.0.0.3", 5000, 53)


def attrs(data: bytes) -> dict[int, bytes]:
    """NLAs of a buffer: type -> payload (each type appears once here)."""
    found, offset = {}, 0
    while offset + NLA.size <= len(data):
        length, nla_type = NLA.unpack_from(data, offset)
        found[nla_type & NLA_TYPE_MASK] = data[offset + NLA.size : offset + length]
        offset += (length + 3) & ~3
    return found


def encoded(msg) -> tuple[tuple, dict[int, bytes]]:
    msg.encode()
    data = bytes(msg.data)
    assert NLMSGHDR.unpack_from(data)[0] == len(data)
    header = TCMSG.unpack_from(data, NLMSGHDR.size)
    return header, attrs(data[NLMSGHDR.size + TCMSG.size :])


def nla(nla_type: int, payload: bytes) -> bytes:
    return NLA.pack(NLA.size + len(payload), nla_type) + payload + bytes(-len(payload) % 4)


def kernel_filter_reply(ifindex, prio, handle, packets, byte_count, pkt64=None, kind=b"flower"):
    """An RTM_NEWTFILTER as the kernel sends it in a dump, built by hand."""
    stats = nla(TCA_STATS_BASIC, struct.pack("=QI4x", byte_count, packets))
    if pkt64 is not None:
        stats += nla(TCA_STATS_PKT64, struct.pack("=Q", pkt64))
    action = nla(TCA_ACT_KIND, b"mirred\0") + nla(TCA_ACT_STATS | 0x8000, stats)
    options = nla(TCA_FLOWER_FLAGS, struct.pack("=I", 0b110))  # skip_sw | in_hw
    options += nla(TCA_FLOWER_ACT | 0x8000, nla(1 | 0x8000, action))
    body = TCMSG.pack(0, ifindex, handle, messages.INGRESS_PARENT, messages.filter_info(prio))
    body += nla(TCA_KIND, kind + b"\0") + nla(TCA_OPTIONS | 0x8000, options)
    data = NLMSGHDR.pack(NLMSGHDR.size + len(body), RTM_NEWTFILTER, 2, 1, 0) + body
    msg = messages.FlowerTcmsg(data)
    msg.decode()
    return msg


# ---------------------------------------------------------------- messages


def test_filter_is_flower_skip_sw_on_ingress_with_the_handle_and_priority():
    header, top = encoded(messages.add_filter_request(TCP_FLOW, 7, 9, priority=10, handle=3))
    family, ifindex, handle, parent, info = header
    assert (family, ifindex, handle, parent) == (socket.AF_UNSPEC, 7, 3, 0xFFFFFFF2)
    assert info >> 16 == 10 and info & 0xFFFF == socket.htons(0x0800)
    assert top[TCA_KIND] == b"flower\0"
    options = attrs(top[TCA_OPTIONS])
    assert struct.unpack("=I", options[TCA_FLOWER_FLAGS]) == (messages.TCA_CLS_FLAGS_SKIP_SW,)


def test_filter_matches_the_tcp_five_tuple_in_network_byte_order():
    _, top = encoded(messages.add_filter_request(TCP_FLOW, 7, 9, priority=10, handle=3))
    options = attrs(top[TCA_OPTIONS])
    assert options[KEY_ETH_TYPE] == b"\x08\x00"
    assert options[KEY_IP_PROTO] == b"\x06"
    assert options[KEY_IPV4_SRC] == socket.inet_aton("10.0.0.1")
    assert options[KEY_IPV4_DST] == socket.inet_aton("10.0.0.2")
    assert options[KEY_TCP_SRC] == struct.pack("!H", 40000)
    assert options[KEY_TCP_DST] == struct.pack("!H", 5201)
    assert KEY_UDP_SRC not in options and KEY_UDP_DST not in options


def test_udp_flows_use_the_udp_port_keys():
    _, top = encoded(messages.add_filter_request(UDP_FLOW, 7, 9, priority=10, handle=4))
    options = attrs(top[TCA_OPTIONS])
    assert options[KEY_IP_PROTO] == b"\x11"
    assert options[KEY_UDP_DST] == struct.pack("!H", 53)
    assert KEY_TCP_SRC not in options and KEY_TCP_DST not in options


def test_action_is_mirred_egress_redirect_to_the_out_port():
    _, top = encoded(messages.add_filter_request(TCP_FLOW, 7, 9, priority=10, handle=3))
    actions = attrs(attrs(top[TCA_OPTIONS])[TCA_FLOWER_ACT])
    assert list(actions) == [1]  # one action, in slot 1
    action = attrs(actions[1])
    assert action[TCA_ACT_KIND] == b"mirred\0"
    parms = MIRRED_PARMS.unpack(attrs(action[TCA_ACT_OPTIONS])[TCA_MIRRED_PARMS])
    _index, _capab, verdict, _refcnt, _bindcnt, eaction, ifindex = parms
    assert (eaction, ifindex, verdict) == (messages.TCA_EGRESS_REDIR, 9, messages.TC_ACT_STOLEN)


def test_filter_round_trips_through_pyroute2():
    msg = messages.add_filter_request(TCP_FLOW, 7, 9, priority=10, handle=3)
    msg.encode()
    back = messages.FlowerTcmsg(bytes(msg.data))
    back.decode()
    options = back.get_attr("TCA_OPTIONS")
    assert options.get_attr("TCA_FLOWER_KEY_IPV4_DST") == "10.0.0.2"
    assert options.get_attr("TCA_FLOWER_KEY_TCP_DST") == 5201


def test_clsact_qdisc_request():
    header, top = encoded(messages.clsact_request(5))
    assert header[1:4] == (5, 0xFFFF0000, 0xFFFFFFF1)
    assert top[TCA_KIND] == b"clsact\0"


def test_stats_reply_parses_counters_handle_and_hardware_flag():
    state = messages.parse_filter(kernel_filter_reply(7, 10, 3, packets=12, byte_count=18000))
    assert (state.ifindex, state.priority, state.handle) == (7, 10, 3)
    assert state.counters == FlowCounters(packets=12, bytes=18000)
    assert state.in_hw


def test_stats_reply_prefers_the_64_bit_packet_count():
    reply = kernel_filter_reply(7, 10, 3, packets=705_032_704, byte_count=2**40, pkt64=5 * 10**9)
    assert messages.parse_filter(reply).counters == FlowCounters(5 * 10**9, 2**40)


def test_classifier_instance_and_other_kinds_are_not_filters():
    assert messages.parse_filter(kernel_filter_reply(7, 10, 0, 1, 1)) is None
    assert messages.parse_filter(kernel_filter_reply(7, 10, 3, 1, 1, kind=b"u32")) is None


# ---------------------------------------------------------------- provider


class FakeKernel:
    """Records what the provider sends; answers like rtnetlink would."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple, dict[int, bytes], int, int]] = []
        self.filters: dict[tuple[int, int], tuple[int, int]] = {}  # (ifindex, handle) -> counters
        self.refuse: NetlinkFailure | None = None
        self.refuse_single_get = False
        self.ifindexes = {"rep1": 11, "rep2": 12, "uplink": 13}

    def ifindex(self, ifname):
        return self.ifindexes.get(ifname)

    def request(self, msg, msg_type, flags):
        header, top = encoded(msg)
        self.sent.append((header, top, msg_type, flags))
        ifindex, handle, prio = header[1], header[2], header[4] >> 16
        if self.refuse is not None and msg_type in (RTM_NEWTFILTER, RTM_NEWQDISC):
            raise self.refuse
        if msg_type == RTM_NEWTFILTER:
            self.filters[ifindex, handle] = (0, 0)
        elif msg_type == RTM_DELTFILTER:
            if self.filters.pop((ifindex, handle), None) is None:
                raise NetlinkFailure(
                    errno.ENOENT, "Filter with specified priority/protocol not found"
                )
        elif msg_type == RTM_GETTFILTER:
            if self.refuse_single_get and not flags & NLM_F_DUMP:
                raise NetlinkFailure(errno.EBUSY, "Device or resource busy")
            return [
                kernel_filter_reply(i, 10 if flags & NLM_F_DUMP else prio, h, *counters)
                for (i, h), counters in self.filters.items()
                if i == ifindex and (flags & NLM_F_DUMP or h == handle)
            ]
        return []


def make_provider(kernel: FakeKernel, **opts) -> TcFlowerProvider:
    conf = cfg.ConfigOpts()
    conf([])
    provider = TcFlowerProvider(conf, netlink=kernel, is_representor=lambda n: n != "eth0")
    for name, value in opts.items():
        conf.set_override(name, value, group="offload_tc_flower")
    return provider


def attached(**opts) -> tuple[TcFlowerProvider, FakeKernel]:
    kernel = FakeKernel()
    provider = make_provider(kernel, **opts)
    for port in ("rep1", "rep2"):
        provider.attach_port(port)
    return provider, kernel


def test_attach_adds_a_clsact_qdisc_once_and_tolerates_an_existing_one():
    provider, kernel = attached()
    assert [(s[2], s[3]) for s in kernel.sent] == [
        (RTM_NEWQDISC, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
    ] * 2
    provider.attach_port("rep1")
    assert len(kernel.sent) == 2
    kernel.refuse = NetlinkFailure(errno.EEXIST, "Exclusivity flag on, cannot modify")
    provider.attach_port("uplink")


def test_attach_refuses_non_representors_and_kernel_errors():
    kernel = FakeKernel()
    provider = make_provider(kernel)
    with pytest.raises(OffloadError, match="eth0: not a switchdev representor"):
        provider.attach_port("eth0")
    with pytest.raises(OffloadError, match="missing: no such netdev"):
        provider.attach_port("missing")
    kernel.refuse = NetlinkFailure(errno.EPERM, "Operation not permitted")
    with pytest.raises(OffloadError, match="add clsact to rep1: Operation not permitted"):
        provider.attach_port("rep1")
    assert kernel.sent[-1][2] == RTM_NEWQDISC
    configured = make_provider(FakeKernel(), representors=["rep2"])
    with pytest.raises(OffloadError, match="not a switchdev representor"):
        configured.attach_port("rep1")


def test_install_gives_each_filter_its_own_handle_at_the_configured_priority():
    provider, kernel = attached(filter_priority=77)
    result = provider.install([OffloadEntry(TCP_FLOW, "rep2"), OffloadEntry(UDP_FLOW, "rep2")])
    assert result.installed == (TCP_FLOW, UDP_FLOW) and not result.failed
    filters = [s for s in kernel.sent if s[2] == RTM_NEWTFILTER]
    assert [(h[1], h[2], h[4] >> 16) for h, *_ in filters] == [(11, 1, 77), (11, 2, 77)]
    assert all(s[3] & NLM_F_EXCL for s in filters)


def test_install_failures_leave_the_flow_onloaded_with_the_reason():
    provider, kernel = attached(capacity=1)
    elsewhere = FlowMatch("rep9", IPPROTO_TCP, "10.0.0.1", "10.0.0.2", 1, 2)
    result = provider.install(
        [OffloadEntry(elsewhere, "rep2"), OffloadEntry(TCP_FLOW, "rep2"),
         OffloadEntry(UDP_FLOW, "rep2")]
    )  # fmt: skip
    assert result.installed == (TCP_FLOW,)
    assert result.failed == {
        elsewhere: "port rep9 is not attached to tc-flower",
        UDP_FLOW: "offload table full (1 flows)",
    }
    provider, kernel = attached()
    kernel.refuse = NetlinkFailure(errno.EOPNOTSUPP, "TC offload is disabled on net device")
    result = provider.install([OffloadEntry(TCP_FLOW, "rep2")])
    assert "TC offload is disabled on net device" in result.failed[TCP_FLOW]
    assert provider.stats() == {}


def test_reinstall_is_idempotent_but_a_new_out_port_is_refused():
    provider, kernel = attached()
    provider.install([OffloadEntry(TCP_FLOW, "rep2")])
    assert provider.install([OffloadEntry(TCP_FLOW, "rep2")]).installed == (TCP_FLOW,)
    assert sum(s[2] == RTM_NEWTFILTER for s in kernel.sent) == 1
    provider.attach_port("uplink")
    failed = provider.install([OffloadEntry(TCP_FLOW, "uplink")]).failed
    assert failed == {TCP_FLOW: "already offloaded to rep2; remove it first"}


def test_stats_dump_maps_filters_back_to_flows():
    provider, kernel = attached()
    provider.install([OffloadEntry(TCP_FLOW, "rep2"), OffloadEntry(UDP_FLOW, "rep2")])
    kernel.filters[11, 1] = (100, 150_000)
    kernel.filters[11, 2] = (7, 700)
    kernel.filters[11, 99] = (5, 5)  # someone else's filter: not ours
    assert provider.stats() == {
        TCP_FLOW: FlowCounters(100, 150_000),
        UDP_FLOW: FlowCounters(7, 700),
    }
    dump = kernel.sent[-1]
    assert (dump[0][1], dump[0][3], dump[2]) == (11, 0xFFFFFFF2, RTM_GETTFILTER)
    assert dump[3] == NLM_F_REQUEST | NLM_F_DUMP


def test_remove_returns_final_counters_and_deletes_the_filter():
    provider, kernel = attached()
    provider.install([OffloadEntry(TCP_FLOW, "rep2")])
    kernel.filters[11, 1] = (42, 4200)
    assert provider.remove([TCP_FLOW, UDP_FLOW]) == {TCP_FLOW: FlowCounters(42, 4200)}
    deletes = [s for s in kernel.sent if s[2] == RTM_DELTFILTER]
    assert [(h[1], h[2], h[4] >> 16) for h, *_ in deletes] == [(11, 1, 10)]
    assert deletes[0][1][TCA_KIND] == b"flower\0"
    assert kernel.filters == {} and provider.stats() == {}


def test_remove_falls_back_to_the_last_counters_seen_if_the_kernel_cannot_say():
    provider, kernel = attached()
    provider.install([OffloadEntry(TCP_FLOW, "rep2")])
    kernel.filters[11, 1] = (42, 4200)
    provider.stats()
    kernel.refuse_single_get = True
    assert provider.remove([TCP_FLOW]) == {TCP_FLOW: FlowCounters(42, 4200)}


def test_a_filter_already_gone_counts_as_removed():
    provider, kernel = attached()
    provider.install([OffloadEntry(TCP_FLOW, "rep2")])
    kernel.filters.clear()
    assert provider.remove([TCP_FLOW]) == {TCP_FLOW: FlowCounters()}


def test_detach_removes_every_filter_using_the_port():
    provider, kernel = attached()
    provider.attach_port("uplink")
    other = FlowMatch("uplink", IPPROTO_UDP, "10.0.0.9", "10.0.0.1", 1, 2)
    provider.install([OffloadEntry(TCP_FLOW, "rep2"), OffloadEntry(other, "rep1")])
    provider.detach_port("rep2")
    assert set(kernel.filters) == {(13, 1)}
    assert provider.install([OffloadEntry(TCP_FLOW, "rep2")]).failed


# ---------------------------------------------------------------- describe


FULL = probe.SystemFacts(
    netdevs=("enp1s0f0", "eth0", "pf0vf0", "pf0vf1"),
    representors=("pf0vf0", "pf0vf1"),
    eswitch_modes={"pci/0000:01:00.0": "switchdev"},
    devlink_error="",
    flower_source="/sys/module/cls_flower",
    mirred_source="/sys/module/act_mirred",
    kernel_release="6.1.0",
)


def test_describe_names_everything_missing():
    bare = probe.SystemFacts(("eth0", "lo"), (), {"pci/0000:01:00.0": "legacy"}, "", "", "", "6.1")
    conf = cfg.ConfigOpts()
    conf([])
    description = TcFlowerProvider(conf, netlink=FakeKernel(), facts=lambda: bare).describe()
    assert not description.available
    reason = description.unavailable_reason
    assert "no eswitch in switchdev mode (pci/0000:01:00.0: legacy)" in reason
    assert "no VF representors" in reason and "among eth0, lo" in reason
    assert "no tc flower classifier" in reason and "no tc mirred action" in reason


def test_describe_available_with_a_switchdev_nic():
    conf = cfg.ConfigOpts()
    conf([])
    description = TcFlowerProvider(conf, netlink=FakeKernel(), facts=lambda: FULL).describe()
    assert description.available and description.unavailable_reason == ""
    assert description.capacity == 65536
    conf.set_override("representors", ["pf0vf7"], group="offload_tc_flower")
    description = TcFlowerProvider(conf, netlink=FakeKernel(), facts=lambda: FULL).describe()
    assert "configured representors not found: pf0vf7" in description.unavailable_reason


def test_representors_are_recognised_by_sysfs(tmp_path):
    for name, switch_id, port_name in [
        ("pf0vf1", "1e2f", "pf0vf1"), ("p0", "1e2f", "p0"), ("eth0", "", ""),
        ("vfnet", "", "pf0vf2"), ("weird", "1e2f", "x0"),
    ]:  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / "phys_switch_id").write_text(switch_id + "\n")
        (tmp_path / name / "phys_port_name").write_text(port_name + "\n")
    found = {n for n in ("pf0vf1", "p0", "eth0", "vfnet", "weird", "absent")
             if probe.is_representor(n, str(tmp_path))}  # fmt: skip
    assert found == {"pf0vf1", "p0"}


def test_the_filter_priority_option_is_bounded():
    conf = cfg.ConfigOpts()
    conf([])
    TcFlowerProvider(conf, netlink=FakeKernel())
    with pytest.raises(ValueError):
        conf.set_override("filter_priority", 0x10000, group="offload_tc_flower")


# ---------------------------------------------------------------- noop


def test_noop_offloads_nothing_and_says_why():
    conf = cfg.ConfigOpts()
    provider = NoopProvider(conf)
    description = provider.describe()
    assert (description.name, description.available, description.capacity) == ("noop", True, 0)
    provider.attach_port("tap0")
    result = provider.install([OffloadEntry(TCP_FLOW, "rep2"), OffloadEntry(UDP_FLOW, "rep2")])
    assert result.installed == ()
    assert result.failed == {m: "noop provider offloads nothing" for m in (TCP_FLOW, UDP_FLOW)}
    assert provider.stats() == {} and provider.remove([TCP_FLOW]) == {}
    provider.detach_port("tap0")


def test_providers_are_found_through_entry_points():
    from stevedore import driver

    conf = cfg.ConfigOpts()
    conf([])
    for name, cls in (("noop", NoopProvider), ("tc-flower", TcFlowerProvider)):
        manager = driver.DriverManager(
            "flexmig.offload_providers", name, invoke_on_load=True, invoke_args=(conf,)
        )
        assert type(manager.driver) is cls


def test_built_in_tc_code_is_found_in_kallsyms(tmp_path):
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_text(
        "ffffffff81eee0c0 T tcf_mirred_act\nffffffff8124097e t tcf_mirred_act.cold\n"
        "ffffffffc0a01000 t fl_classify\t[cls_flower]\n"
    )
    wanted = {"fl_classify", "tcf_mirred_act", "mall_classify"}
    symbols = probe.kernel_symbols(wanted, str(kallsyms))
    assert symbols == {"fl_classify", "tcf_mirred_act"}
    assert probe.module_source("act_mirred", "tcf_mirred_act", "x", symbols).startswith("/proc")
    assert probe.module_source("cls_matchall", "mall_classify", "no-such-release", symbols) == ""
