"""The rtnetlink messages of the tc-flower provider, built with pyroute2.

pyroute2 (0.9) ships no flower classifier, so :class:`FlowerTcmsg` is its
``tcmsg`` taught the flower options (numbers from linux/pkt_cls.h) and the
action statistics attributes newer kernels add (hardware counters, 64-bit
packet counts, from linux/gen_stats.h).  Pure message building and parsing;
sending them is the provider's job.

Scheme: every filter sits on the ingress hook of a representor's clsact
qdisc (parent ffff:fff2), protocol ip, one configured priority for all of
FlexMig's filters, and a handle unique per representor, so (ifindex, handle)
names a filter.
"""

from __future__ import annotations

import dataclasses
import socket

from pyroute2.netlink import NLA_F_NESTED, nla
from pyroute2.netlink.rtnl.tcmsg import tcmsg
from pyroute2.netlink.rtnl.tcmsg.common_act import nla_plus_tca_act_opt

from ovs_ext.providers.base import IPPROTO_TCP, FlowCounters, FlowMatch

ETH_P_IP = 0x0800
TC_H_CLSACT = 0xFFFFFFF1  # clsact qdisc parent
CLSACT_HANDLE = 0xFFFF0000
INGRESS_PARENT = 0xFFFFFFF2  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)
TCA_CLS_FLAGS_SKIP_SW = 1 << 1
TCA_CLS_FLAGS_IN_HW = 1 << 2
TCA_EGRESS_REDIR = 1  # linux/tc_act/tc_mirred.h
TC_ACT_STOLEN = 4  # what tc(8) sets for "mirred egress redirect"


class FlowerTcmsg(tcmsg):
    """pyroute2's tcmsg, with flower options for TCA_KIND "flower"."""

    def get_plugin(self, plug: str, *argv, **kwarg):
        if plug == "options" and self.get_attr("TCA_KIND") == "flower":
            return FlowerOptions
        return super().get_plugin(plug, *argv, **kwarg)


class FlowerAction(nla, nla_plus_tca_act_opt):
    """One action (tca_act) with the kernel's full statistics attributes."""

    nla_flags = NLA_F_NESTED
    nla_map = (
        ("TCA_ACT_UNSPEC", "none"),
        ("TCA_ACT_KIND", "asciiz"),
        ("TCA_ACT_OPTIONS", "get_act_options"),
        ("TCA_ACT_INDEX", "uint32"),
        ("TCA_ACT_STATS", "stats2"),
        ("TCA_ACT_PAD", "hex"),
        ("TCA_ACT_COOKIE", "hex"),
        ("TCA_ACT_FLAGS", "hex"),
        ("TCA_ACT_HW_STATS", "hex"),
        ("TCA_ACT_USED_HW_STATS", "hex"),
        ("TCA_ACT_IN_HW_COUNT", "uint32"),
    )

    class stats2(nla):
        nla_flags = NLA_F_NESTED
        nla_map = (
            ("TCA_STATS_UNSPEC", "none"),
            ("TCA_STATS_BASIC", "basic"),
            ("TCA_STATS_RATE_EST", "hex"),
            ("TCA_STATS_QUEUE", "hex"),
            ("TCA_STATS_APP", "hex"),
            ("TCA_STATS_RATE_EST64", "hex"),
            ("TCA_STATS_PAD", "hex"),
            ("TCA_STATS_BASIC_HW", "basic"),
            ("TCA_STATS_PKT64", "uint64"),
        )

        class basic(nla):
            fields = (("bytes", "Q"), ("packets", "I"))


class FlowerOptions(nla):
    nla_flags = NLA_F_NESTED
    nla_map = (
        (0, "TCA_FLOWER_UNSPEC", "none"),
        (1, "TCA_FLOWER_CLASSID", "uint32"),
        (2, "TCA_FLOWER_INDEV", "asciiz"),
        (3, "TCA_FLOWER_ACT", "actions"),
        (8, "TCA_FLOWER_KEY_ETH_TYPE", "be16"),
        (9, "TCA_FLOWER_KEY_IP_PROTO", "uint8"),
        (10, "TCA_FLOWER_KEY_IPV4_SRC", "ip4addr"),
        (11, "TCA_FLOWER_KEY_IPV4_SRC_MASK", "ip4addr"),
        (12, "TCA_FLOWER_KEY_IPV4_DST", "ip4addr"),
        (13, "TCA_FLOWER_KEY_IPV4_DST_MASK", "ip4addr"),
        (18, "TCA_FLOWER_KEY_TCP_SRC", "be16"),
        (19, "TCA_FLOWER_KEY_TCP_DST", "be16"),
        (20, "TCA_FLOWER_KEY_UDP_SRC", "be16"),
        (21, "TCA_FLOWER_KEY_UDP_DST", "be16"),
        (22, "TCA_FLOWER_FLAGS", "uint32"),
        (86, "TCA_FLOWER_IN_HW_COUNT", "uint32"),
    )

    class actions(nla):
        nla_flags = NLA_F_NESTED
        # Action slots 1..32 (TCA_ACT_MAX_PRIO); only slot 1 is used.
        nla_map = tuple((i, f"TCA_ACT_PRIO_{i}", "FlowerAction") for i in range(1, 33))
        FlowerAction = FlowerAction


def filter_info(priority: int) -> int:
    """tcmsg.info of a filter: priority in the high half, protocol (network
    byte order) in the low half, as tc(8) packs "prio N protocol ip"."""
    return priority << 16 | socket.htons(ETH_P_IP)


def clsact_request(ifindex: int) -> tcmsg:
    """The clsact qdisc that gives a representor its ingress filter hook."""
    msg = tcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = ifindex
    msg["handle"] = CLSACT_HANDLE
    msg["parent"] = TC_H_CLSACT
    msg["attrs"] = [["TCA_KIND", "clsact"]]
    return msg


def _filter_header(ifindex: int, priority: int, handle: int) -> FlowerTcmsg:
    msg = FlowerTcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = ifindex
    msg["handle"] = handle
    msg["parent"] = INGRESS_PARENT
    msg["info"] = filter_info(priority)
    return msg


def add_filter_request(
    match: FlowMatch, in_ifindex: int, out_ifindex: int, priority: int, handle: int
) -> FlowerTcmsg:
    """Flower filter: the 5-tuple, in hardware only, redirected to the out port."""
    proto = "TCP" if match.ip_proto == IPPROTO_TCP else "UDP"
    keys = [
        ["TCA_FLOWER_KEY_ETH_TYPE", ETH_P_IP],
        ["TCA_FLOWER_KEY_IP_PROTO", match.ip_proto],
        ["TCA_FLOWER_KEY_IPV4_SRC", match.ipv4_src],
        ["TCA_FLOWER_KEY_IPV4_DST", match.ipv4_dst],
        [f"TCA_FLOWER_KEY_{proto}_SRC", match.tp_src],
        [f"TCA_FLOWER_KEY_{proto}_DST", match.tp_dst],
    ]
    mirred = {
        "attrs": [
            ["TCA_ACT_KIND", "mirred"],
            [
                "TCA_ACT_OPTIONS",
                {
                    "attrs": [
                        [
                            "TCA_MIRRED_PARMS",
                            {
                                "eaction": TCA_EGRESS_REDIR,
                                "ifindex": out_ifindex,
                                "action": TC_ACT_STOLEN,
                            },
                        ]
                    ]
                },
            ],
        ]
    }
    msg = _filter_header(in_ifindex, priority, handle)
    msg["attrs"] = [
        ["TCA_KIND", "flower"],
        [
            "TCA_OPTIONS",
            {
                "attrs": [
                    *keys,
                    # skip_sw: the NIC carries the flow or the install fails;
                    # a software copy would just be a slower vSwitch.
                    ["TCA_FLOWER_FLAGS", TCA_CLS_FLAGS_SKIP_SW],
                    ["TCA_FLOWER_ACT", {"attrs": [["TCA_ACT_PRIO_1", mirred]]}],
                ]
            },
        ],
    ]
    return msg


def filter_request(ifindex: int, priority: int, handle: int) -> FlowerTcmsg:
    """Names one filter: for RTM_DELTFILTER and RTM_GETTFILTER."""
    msg = _filter_header(ifindex, priority, handle)
    msg["attrs"] = [["TCA_KIND", "flower"]]
    return msg


def dump_request(ifindex: int) -> FlowerTcmsg:
    """Every filter on a representor's ingress hook (RTM_GETTFILTER, dump)."""
    msg = FlowerTcmsg()
    msg["family"] = socket.AF_UNSPEC
    msg["index"] = ifindex
    msg["parent"] = INGRESS_PARENT
    return msg


@dataclasses.dataclass(frozen=True)
class FilterState:
    """What a filter reply says: which filter, its counters, whether in hardware."""

    ifindex: int
    priority: int
    handle: int
    counters: FlowCounters
    in_hw: bool


def parse_filter(msg: FlowerTcmsg) -> FilterState | None:
    """A flower filter reply's counters; None for anything else (the
    classifier-instance message a dump also returns has no handle)."""
    if msg.get_attr("TCA_KIND") != "flower" or not msg["handle"]:
        return None
    options = msg.get_attr("TCA_OPTIONS")
    packets = byte_count = 0
    flags = 0
    if options is not None:
        flags = options.get_attr("TCA_FLOWER_FLAGS") or 0
        actions = options.get_attr("TCA_FLOWER_ACT")
        action = actions.get_attr("TCA_ACT_PRIO_1") if actions is not None else None
        stats = action.get_attr("TCA_ACT_STATS") if action is not None else None
        if stats is not None:
            # With skip_sw every packet counted is the NIC's (the kernel
            # pulls the hardware counters into these when dumping).  The
            # 64-bit packet count, where the kernel sends it, over the basic
            # block's 32-bit one, which wraps at 4G packets.
            basic = stats.get_attr("TCA_STATS_BASIC")
            if basic is not None:
                packets, byte_count = basic["packets"], basic["bytes"]
            packets64 = stats.get_attr("TCA_STATS_PKT64")
            if packets64 is not None:
                packets = packets64
    return FilterState(
        ifindex=msg["index"],
        priority=msg["info"] >> 16,
        handle=msg["handle"],
        counters=FlowCounters(packets=packets, bytes=byte_count),
        in_hw=bool(flags & TCA_CLS_FLAGS_IN_HW),
    )
