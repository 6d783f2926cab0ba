"""The OpenFlow statistics endpoint read by the real Debian ``ovs-ofctl``.

No lab: the endpoint listens on a UNIX socket (or loopback TCP) in a temporary
directory and ``/usr/bin/ovs-ofctl`` (openvswitch-common) connects to it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import threading
import time

import pytest

from ovs_ext.flow_record import FlowRecord
from ovs_ext.openflow_stats import EndpointError, OpenFlowStatsServer, codec, ofp13
from ovs_ext.openflow_stats.codec import FlowStatsRequest

OVS_OFCTL = "/usr/bin/ovs-ofctl"
pytestmark = pytest.mark.skipif(
    not os.access(OVS_OFCTL, os.X_OK),
    reason="/usr/bin/ovs-ofctl is missing: install openvswitch-common (tools/setup.sh does)",
)

TCP = {"eth_type": 0x0800, "ip_proto": 6}
UDP = {"eth_type": 0x0800, "ip_proto": 17}
RECORDS = [
    FlowRecord(
        0, 100, 0x5,
        {"in_port": 1, **TCP, "ipv4_src": "10.0.0.1", "ipv4_dst": "10.0.0.2",
         "tcp_src": 40000, "tcp_dst": 5201},
        packets=1234, bytes=1_851_000, duration_s=12.345, out_port=2, offloaded=True,
    ),
    FlowRecord(
        1, 200, 0x15, {"in_port": 2, **UDP, "ipv4_dst": "10.0.0.1", "udp_dst": 53},
        packets=77, bytes=6160, duration_s=0.5, out_port=1,
    ),
    FlowRecord(0, 0, 0x0, {}, packets=5, bytes=500, duration_s=3.0),
]  # fmt: skip


def expected_line(record: FlowRecord) -> str:
    """How ovs-ofctl prints a record: the oracle the dumps are compared with."""
    match = record.match
    fields = []
    if match.get("ip_proto") == 6:
        fields.append("tcp")
    elif match.get("ip_proto") == 17:
        fields.append("udp")
    elif match.get("eth_type") == 0x0800:
        fields.append("ip")
    names = {
        "in_port": "in_port", "ipv4_src": "nw_src", "ipv4_dst": "nw_dst", "tcp_src": "tp_src",
        "udp_src": "tp_src", "tcp_dst": "tp_dst", "udp_dst": "tp_dst",
    }  # fmt: skip
    fields += [f"{names[k]}={v}" for k, v in match.items() if k in names]
    duration = record.duration_s
    duration_text = f"{duration:.0f}" if duration == int(duration) else f"{duration:.3f}"
    action = "NORMAL" if record.out_port is None else f"output:{record.out_port}"
    return (
        f"cookie={record.cookie:#x}, duration={duration_text}s, table={record.table_id}, "
        f"n_packets={record.packets}, n_bytes={record.bytes}, "
        f"{','.join([f'priority={record.priority}', *fields])} actions={action}"
    )


def flows(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.startswith(" cookie=")]


def ofctl(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [OVS_OFCTL, "--timeout=10", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"ovs-ofctl {args} failed: {result.stderr}")
    return result


@pytest.fixture
def records():
    return list(RECORDS)


@pytest.fixture
def endpoint(tmp_path, records):
    path = str(tmp_path / "flexmig-test.mgmt")
    server = OpenFlowStatsServer(
        lambda: list(records), unix_socket=path, port_names=lambda: {1: "vm1-tap", 2: "phy0"}
    )
    server.start()
    yield server, path
    server.stop()
    assert not os.path.exists(path)


VERSIONS = [(), ("-O", "OpenFlow13")]


@pytest.mark.parametrize("version", VERSIONS, ids=["default-OF1.0", "OF1.3"])
def test_dump_flows_prints_every_record(endpoint, version):
    _, path = endpoint
    out = ofctl(*version, "dump-flows", f"unix:{path}").stdout
    assert flows(out) == [expected_line(r) for r in RECORDS]
    assert ("(OF1.3)" in out) == bool(version)


def test_bare_name_resolves_to_the_mgmt_socket_in_ovs_rundir(endpoint, tmp_path):
    out = ofctl("dump-flows", "flexmig-test", env={"OVS_RUNDIR": str(tmp_path)}).stdout
    assert flows(out) == [expected_line(r) for r in RECORDS]
    elsewhere = ofctl("dump-flows", "flexmig-test", env={"OVS_RUNDIR": "/nonexistent"}, check=False)
    assert elsewhere.returncode != 0 and "is not a bridge or a socket" in elsewhere.stderr


@pytest.mark.parametrize("version", VERSIONS, ids=["default-OF1.0", "OF1.3"])
@pytest.mark.parametrize(
    ("selection", "indexes"),
    [
        ("tcp,tp_dst=5201", [0]),
        ("udp", [1]),
        ("ip,nw_dst=10.0.0.0/24", [0, 1]),
        ("table=1", [1]),
        ("out_port=2", [0]),
        ("in_port=2", [1]),
        ("tcp,tp_dst=80", []),
    ],
)
def test_dump_flows_honours_the_selection(endpoint, version, selection, indexes):
    _, path = endpoint
    out = ofctl(*version, "dump-flows", f"unix:{path}", selection).stdout
    assert flows(out) == [expected_line(RECORDS[i]) for i in indexes]


def test_cookie_selection_needs_openflow_13(endpoint):
    _, path = endpoint
    out = ofctl("-O", "OpenFlow13", "dump-flows", f"unix:{path}", "cookie=0x10/0xf0").stdout
    assert flows(out) == [expected_line(RECORDS[1])]
    # OpenFlow 1.0 cannot carry a cookie in a flow-stats request; ovs-ofctl
    # asks for Nicira's extended match, which this endpoint does not serve.
    result = ofctl("dump-flows", f"unix:{path}", "cookie=0x10/0xf0", check=False)
    assert result.returncode != 0 and "usable flow formats" in result.stderr


@pytest.mark.parametrize("version", VERSIONS, ids=["default-OF1.0", "OF1.3"])
def test_dump_aggregate_sums_the_selected_flows(endpoint, version):
    _, path = endpoint
    out = ofctl(*version, "dump-aggregate", f"unix:{path}").stdout
    total = (sum(r.packets for r in RECORDS), sum(r.bytes for r in RECORDS), len(RECORDS))
    assert "packet_count=%d byte_count=%d flow_count=%d" % total in out
    out = ofctl(*version, "dump-aggregate", f"unix:{path}", "tcp").stdout
    assert "packet_count=1234 byte_count=1851000 flow_count=1" in out


def test_names_show_the_ports_given(endpoint):
    _, path = endpoint
    for version in VERSIONS:
        out = ofctl(*version, "--names", "dump-flows", f"unix:{path}", "tcp").stdout
        # ovs-ofctl quotes names holding a "-"
        assert 'in_port="vm1-tap"' in out and "actions=output:phy0" in out


def test_counters_are_read_at_each_request(endpoint, records):
    _, path = endpoint
    records[0] = FlowRecord(**{**records[0].__dict__, "packets": 5000, "bytes": 7_500_000})
    out = ofctl("dump-flows", f"unix:{path}", "tcp").stdout
    assert "n_packets=5000, n_bytes=7500000" in out


@pytest.mark.parametrize("version", VERSIONS, ids=["default-OF1.0", "OF1.3"])
def test_ten_thousand_flows_arrive_in_multipart_replies(tmp_path, version):
    many = [
        FlowRecord(0, 10, i, {**UDP, "ipv4_src": str(ipaddress.IPv4Address(0x0A000000 + i)),
                              "udp_dst": 5000 + i % 1000},
                   packets=i, bytes=64 * i, duration_s=i / 1000, out_port=3)
        for i in range(12_000)
    ]  # fmt: skip
    path = str(tmp_path / "big.mgmt")
    with OpenFlowStatsServer(lambda: many, unix_socket=path):
        out = ofctl(*version, "dump-flows", f"unix:{path}").stdout
        aggregate = ofctl(*version, "dump-aggregate", f"unix:{path}").stdout
    replies = out.count("OFPST_FLOW reply")
    assert replies > 10  # 64 KiB messages: ~680 (1.0) or ~500 (1.3) flows each
    lines = flows(out)
    assert len(lines) == len(many)
    assert lines == [expected_line(r) for r in many]
    total = sum(r.packets for r in many), sum(r.bytes for r in many)
    assert "packet_count=%d byte_count=%d flow_count=12000" % total in aggregate


def test_socket_is_private_to_its_owner(endpoint):
    _, path = endpoint
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_tcp_listener_only_when_configured(tmp_path):
    with OpenFlowStatsServer(lambda: RECORDS, tcp_address=("127.0.0.1", 0)) as server:
        (target,) = server.targets()
        assert target.startswith("tcp:127.0.0.1:") and not any(tmp_path.iterdir())
        out = ofctl("-O", "OpenFlow13", "dump-flows", target).stdout
        assert flows(out) == [expected_line(r) for r in RECORDS]


def test_flow_mod_from_ovs_ofctl_is_refused_and_nothing_changes(endpoint, records):
    _, path = endpoint
    for version in VERSIONS:
        result = ofctl(*version, "add-flow", f"unix:{path}", "priority=5,actions=drop", check=False)
        assert result.returncode != 0 and "OFPFMFC_EPERM" in result.stderr
        result = ofctl(*version, "del-flows", f"unix:{path}", check=False)
        assert result.returncode != 0 and "OFPFMFC_EPERM" in result.stderr
    assert records == RECORDS
    assert flows(ofctl("dump-flows", f"unix:{path}").stdout) == [expected_line(r) for r in RECORDS]


# ---------------------------------------------------------------- raw sockets


def raw_client(path: str, versions=(4,)) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(codec.encode_hello(versions))
        hello = receive(sock)
        assert hello and codec.parse_header(hello).msg_type == ofp13.MsgType.HELLO
    except BaseException:
        sock.close()
        raise
    return sock


def receive(sock: socket.socket) -> bytes:
    """One OpenFlow message, or b"" at EOF."""
    data = b""
    while len(data) < 8 or len(data) < codec.parse_header(data).length:
        wanted = 8 if len(data) < 8 else codec.parse_header(data).length
        chunk = sock.recv(wanted - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def test_bad_length_header_gets_an_error_then_the_connection_closes(endpoint):
    _, path = endpoint
    sock = raw_client(path)
    bad = struct.pack("!BBHI", 4, ofp13.MsgType.ECHO_REQUEST, 3, 0xABCD)
    sock.sendall(bad)
    error = receive(sock)
    assert codec.parse_header(error).xid == 0xABCD
    assert codec.decode_error(error) == (1, ofp13.BadRequestCode.BAD_LEN, bad)
    assert receive(sock) == b""
    sock.close()


def test_malformed_requests_get_errors_and_the_connection_stays(endpoint):
    _, path = endpoint
    sock = raw_client(path)
    bad_match = bytearray(codec.encode_flow_stats_request(FlowStatsRequest(), xid=3))
    struct.pack_into("!H", bad_match, 16 + 32, 0)  # match type 0: OFPMT_STANDARD
    cases = [
        (codec.encode_message(99, 1), (1, 1)),  # unknown type
        (codec.encode_multipart_request(ofp13.MultipartType.GROUP, 2), (1, 2)),  # bad multipart
        (bytes(bad_match), (4, 0)),  # bad match type
        (codec.encode_message(ofp13.MsgType.FLOW_MOD, 4, bytes(48)), (5, 4)),  # read-only
    ]
    for message, expected in cases:
        sock.sendall(message)
        err_type, code, data = codec.decode_error(receive(sock))
        assert ((err_type, code), data) == (expected, message)
    sock.sendall(codec.encode_message(ofp13.MsgType.BARRIER_REQUEST, 9))
    assert codec.parse_header(receive(sock)).msg_type == ofp13.MsgType.BARRIER_REPLY
    sock.close()


def test_garbage_instead_of_hello_is_refused(endpoint):
    _, path = endpoint
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert codec.parse_header(receive(sock)).msg_type == ofp13.MsgType.HELLO
    assert codec.decode_error(receive(sock))[:2] == (0, 0)  # HELLO_FAILED/INCOMPATIBLE
    assert receive(sock) == b""
    sock.close()


def test_a_misbehaving_client_does_not_disturb_others(endpoint):
    _, path = endpoint
    stuck = raw_client(path)
    stuck.sendall(codec.encode_message(ofp13.MsgType.ECHO_REQUEST, 1, b"x" * 100)[:20])  # half
    slow = raw_client(path)
    slow.sendall(codec.encode_flow_stats_request(FlowStatsRequest(), xid=2))  # never read
    out = ofctl("dump-flows", f"unix:{path}").stdout
    assert flows(out) == [expected_line(r) for r in RECORDS]
    stuck.close()
    slow.close()


def test_connections_beyond_the_limit_are_closed(tmp_path):
    path = str(tmp_path / "limit.mgmt")
    with OpenFlowStatsServer(lambda: RECORDS, unix_socket=path, max_connections=2):
        held = [raw_client(path), raw_client(path)]
        extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        extra.settimeout(10)
        extra.connect(path)
        assert extra.recv(64) == b""
        held[0].close()
        deadline = time.monotonic() + 10
        while True:  # the server notices the close on its next loop
            try:
                raw_client(path).close()
                break
            except (AssertionError, OSError):
                assert time.monotonic() < deadline, "a freed slot was never reused"
                time.sleep(0.1)
        for sock in [extra, *held[1:]]:
            sock.close()


def test_silent_connections_are_closed_after_the_idle_timeout(tmp_path):
    path = str(tmp_path / "idle.mgmt")
    with OpenFlowStatsServer(lambda: RECORDS, unix_socket=path, idle_timeout=1.0):
        sock = raw_client(path)
        started = time.monotonic()
        assert receive(sock) == b""
        assert 0.5 < time.monotonic() - started < 8
        sock.close()


def test_existing_files_are_never_replaced(tmp_path):
    path = tmp_path / "taken.mgmt"
    path.write_text("not a socket")
    with pytest.raises(EndpointError, match="not a socket"):
        OpenFlowStatsServer(lambda: RECORDS, unix_socket=str(path)).start()
    assert path.read_text() == "not a socket"


def test_a_live_endpoint_is_not_taken_over_but_a_stale_socket_is(tmp_path):
    path = str(tmp_path / "x.mgmt")
    with OpenFlowStatsServer(lambda: RECORDS, unix_socket=path):
        with pytest.raises(EndpointError, match="another process is listening"):
            OpenFlowStatsServer(lambda: RECORDS, unix_socket=path).start()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # leaves the file behind, as a killed process does
    with OpenFlowStatsServer(lambda: RECORDS, unix_socket=path):
        assert flows(ofctl("dump-flows", f"unix:{path}").stdout)


def test_concurrent_dumps_all_complete(endpoint):
    _, path = endpoint
    outputs: list[str] = []

    def dump() -> None:
        outputs.append(ofctl("-O", "OpenFlow13", "dump-flows", f"unix:{path}").stdout)

    threads = [threading.Thread(target=dump) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(outputs) == 6
    assert all(flows(o) == [expected_line(r) for r in RECORDS] for o in outputs)


def test_ovs_ofctl_is_the_real_one():
    version = subprocess.run([OVS_OFCTL, "--version"], capture_output=True, text=True, check=True)
    assert re.search(r"ovs-ofctl \(Open vSwitch\) 3\.", version.stdout)
    assert shutil.which("ovs-ofctl") == OVS_OFCTL


def test_versions_other_than_10_and_13_fail_negotiation_naming_both(endpoint):
    _, path = endpoint
    result = ofctl("-O", "OpenFlow14", "dump-flows", f"unix:{path}", check=False)
    assert result.returncode != 0
    assert "peer supports versions 0x01, 0x04" in result.stderr


def test_port_mod_and_packet_out_are_refused(endpoint):
    _, path = endpoint
    for args in (
        ("mod-port", f"unix:{path}", "1", "down"),
        ("-O", "OpenFlow13", "mod-port", f"unix:{path}", "1", "down"),
        ("-O", "OpenFlow13", "packet-out", f"unix:{path}", "CONTROLLER", "output:1",
         "ffffffffffff000000000001080045000014000100004006f9e50a0000010a000002"),
    ):  # fmt: skip
        result = ofctl(*args, check=False)
        assert result.returncode != 0 and "OFPBRC_EPERM" in result.stderr


def test_a_failing_record_source_closes_only_that_request(tmp_path):
    path = str(tmp_path / "failing.mgmt")
    calls = []

    def records():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("flow manager not ready")
        return RECORDS

    with OpenFlowStatsServer(records, unix_socket=path):
        first = ofctl("dump-flows", f"unix:{path}", check=False)
        assert first.returncode != 0
        second = ofctl("dump-flows", f"unix:{path}")
        assert flows(second.stdout) == [expected_line(r) for r in RECORDS]


def test_show_and_dump_desc_describe_the_endpoint(endpoint):
    _, path = endpoint
    desc = ofctl("dump-desc", f"unix:{path}").stdout
    assert "Manufacturer: FlexMig" in desc
    for version in VERSIONS:
        show = ofctl(*version, "show", f"unix:{path}").stdout
        assert "capabilities: FLOW_STATS" in show
        assert "1(vm1-tap)" in show and "2(phy0)" in show


@pytest.mark.parametrize("version", ["", "-O OpenFlow13"], ids=["default-OF1.0", "OF1.3"])
def test_an_operator_at_a_terminal_sees_port_names(endpoint, version):
    # On a terminal ovs-ofctl also asks for the port and table maps, even
    # without a match; script(1) gives it one.
    _, path = endpoint
    command = f"{OVS_OFCTL} --timeout=10 {version} dump-flows unix:{path}"
    result = subprocess.run(
        ["script", "-qec", command, "/dev/null"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert 'in_port="vm1-tap"' in result.stdout and "actions=output:phy0" in result.stdout
    assert "n_packets=1234, n_bytes=1851000" in result.stdout
