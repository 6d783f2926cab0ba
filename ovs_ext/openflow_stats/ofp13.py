"""OpenFlow 1.3 numbers the statistics endpoint speaks (OpenFlow 1.3.5 spec).

Only what a read-only statistics endpoint needs; names follow the spec so they
can be looked up there.
"""

from __future__ import annotations

import enum

OFP_VERSION = 0x04
HEADER_LEN = 8
MAX_MESSAGE_LEN = 0xFFFF  # ofp_header.length is 16 bits
MULTIPART_HEADER_LEN = 16  # ofp_header + type, flags, pad[4]
OFPHET_VERSIONBITMAP = 1

OFPMPF_REQ_MORE = 1
OFPMPF_REPLY_MORE = 1

OFPTT_ALL = 0xFF
OFPP_NORMAL = 0xFFFFFFFA
OFPP_ANY = 0xFFFFFFFF
OFPP_MAX = 0xFFFFFF00  # ports at or above are reserved
OFPG_ANY = 0xFFFFFFFF
OFPCML_NO_BUFFER = 0xFFFF
OFPC_FLOW_STATS = 1 << 0

OFPMT_OXM = 1
OFPXMC_OPENFLOW_BASIC = 0x8000
OFPIT_APPLY_ACTIONS = 4
OFPAT_OUTPUT = 0


class MsgType(enum.IntEnum):
    HELLO = 0
    ERROR = 1
    ECHO_REQUEST = 2
    ECHO_REPLY = 3
    EXPERIMENTER = 4
    FEATURES_REQUEST = 5
    FEATURES_REPLY = 6
    GET_CONFIG_REQUEST = 7
    GET_CONFIG_REPLY = 8
    SET_CONFIG = 9
    PACKET_IN = 10
    FLOW_REMOVED = 11
    PORT_STATUS = 12
    PACKET_OUT = 13
    FLOW_MOD = 14
    GROUP_MOD = 15
    PORT_MOD = 16
    TABLE_MOD = 17
    MULTIPART_REQUEST = 18
    MULTIPART_REPLY = 19
    BARRIER_REQUEST = 20
    BARRIER_REPLY = 21
    QUEUE_GET_CONFIG_REQUEST = 22
    QUEUE_GET_CONFIG_REPLY = 23
    ROLE_REQUEST = 24
    ROLE_REPLY = 25
    GET_ASYNC_REQUEST = 26
    GET_ASYNC_REPLY = 27
    SET_ASYNC = 28
    METER_MOD = 29


# Controller-to-switch messages that change a switch: this endpoint only
# reports, so each is refused and nothing else happens.
STATE_CHANGING = frozenset(
    {
        MsgType.SET_CONFIG,
        MsgType.PACKET_OUT,
        MsgType.FLOW_MOD,
        MsgType.GROUP_MOD,
        MsgType.PORT_MOD,
        MsgType.TABLE_MOD,
        MsgType.ROLE_REQUEST,
        MsgType.SET_ASYNC,
        MsgType.METER_MOD,
    }
)


class MultipartType(enum.IntEnum):
    DESC = 0
    FLOW = 1
    AGGREGATE = 2
    TABLE = 3
    PORT_STATS = 4
    QUEUE = 5
    GROUP = 6
    GROUP_DESC = 7
    GROUP_FEATURES = 8
    METER = 9
    METER_CONFIG = 10
    METER_FEATURES = 11
    TABLE_FEATURES = 12
    PORT_DESC = 13
    EXPERIMENTER = 0xFFFF


class ErrorType(enum.IntEnum):
    HELLO_FAILED = 0
    BAD_REQUEST = 1
    BAD_ACTION = 2
    BAD_INSTRUCTION = 3
    BAD_MATCH = 4
    FLOW_MOD_FAILED = 5


class HelloFailedCode(enum.IntEnum):
    INCOMPATIBLE = 0
    EPERM = 1


class BadRequestCode(enum.IntEnum):
    BAD_VERSION = 0
    BAD_TYPE = 1
    BAD_MULTIPART = 2
    BAD_EXPERIMENTER = 3
    BAD_EXP_TYPE = 4
    EPERM = 5
    BAD_LEN = 6
    BAD_TABLE_ID = 9
    BAD_PORT = 11


class BadMatchCode(enum.IntEnum):
    BAD_TYPE = 0
    BAD_LEN = 1
    BAD_WILDCARDS = 5
    BAD_FIELD = 6
    BAD_VALUE = 7
    BAD_MASK = 8
    BAD_PREREQ = 9
    DUP_FIELD = 10


class FlowModFailedCode(enum.IntEnum):
    EPERM = 4


class OxmField(enum.IntEnum):
    """OXM_OF_* field numbers of class OFPXMC_OPENFLOW_BASIC."""

    IN_PORT = 0
    ETH_TYPE = 5
    IP_PROTO = 10
    IPV4_SRC = 11
    IPV4_DST = 12
    TCP_SRC = 13
    TCP_DST = 14
    UDP_SRC = 15
    UDP_DST = 16


# Payload length of each OpenFlow-basic field (spec table 11), so a filter on
# a field FlowRecords never carry is still validated before it selects nothing.
OXM_BASIC_LENGTHS = {
    0: 4, 1: 4, 2: 8, 3: 6, 4: 6, 5: 2, 6: 2, 7: 1, 8: 1, 9: 1, 10: 1,
    11: 4, 12: 4, 13: 2, 14: 2, 15: 2, 16: 2, 17: 2, 18: 2, 19: 1, 20: 1,
    21: 2, 22: 4, 23: 4, 24: 6, 25: 6, 26: 16, 27: 16, 28: 4, 29: 1, 30: 1,
    31: 16, 32: 6, 33: 6, 34: 4, 35: 1, 36: 1, 37: 3, 38: 8, 39: 2,
}  # fmt: skip
