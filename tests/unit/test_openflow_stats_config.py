"""[openflow_stats] options and the server built from them."""

from __future__ import annotations

import os
import socket
import stat
import threading

import pytest
from oslo_config import cfg

from ovs_ext.openflow_stats import EndpointError, OpenFlowStatsServer, codec, config


def conf_with(**opts) -> cfg.ConfigOpts:
    conf = cfg.ConfigOpts()
    config.register_opts(conf)
    conf([])
    for name, value in opts.items():
        conf.set_override(name, value, group="openflow_stats")
    return conf


def test_defaults_listen_on_a_private_socket_only():
    conf = conf_with()
    opts = conf.openflow_stats
    assert opts.unix_socket == "/var/run/openvswitch/br-int-offload.mgmt"
    assert opts.unix_socket_mode == "0600" and opts.tcp_address is None


@pytest.mark.parametrize(
    ("name", "value"),
    [("unix_socket_mode", "0999"), ("unix_socket_mode", "rw"), ("max_connections", 0),
     ("idle_timeout", 0.1), ("tcp_port", 70000), ("tcp_address", "not-an-ip")],
)  # fmt: skip
def test_out_of_range_options_are_rejected(name, value):
    with pytest.raises(ValueError):
        conf_with(**{name: value})


def test_server_from_config_uses_the_socket_and_mode(tmp_path):
    path = str(tmp_path / "cfg.mgmt")
    conf = conf_with(unix_socket=path, unix_socket_mode="0640", datapath_id=0xABC)
    with OpenFlowStatsServer.from_config(conf, lambda: []) as server:
        assert server.targets() == [f"unix:{path}"]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(path)
            client.sendall(codec.encode_hello({4}))
            client.sendall(codec.encode_message(5, 7))  # FEATURES_REQUEST
            data = b""
            while len(data) < 16 + 32:
                chunk = client.recv(4096)
                assert chunk
                data += chunk
            assert int.from_bytes(data[16 + 8 : 16 + 16], "big") == 0xABC
    assert not os.path.exists(path)


def test_nowhere_to_listen_is_an_error():
    with pytest.raises(EndpointError, match="neither a UNIX socket nor TCP"):
        OpenFlowStatsServer.from_config(conf_with(unix_socket=""), lambda: [])


def test_a_missing_directory_is_a_clear_error(tmp_path):
    server = OpenFlowStatsServer(lambda: [], unix_socket=str(tmp_path / "no" / "x.mgmt"))
    with pytest.raises(EndpointError, match="No such file or directory"):
        server.start()


def test_clients_connecting_while_a_dump_is_encoded_wait_instead_of_failing(tmp_path):
    """Every connection the endpoint would serve can queue while its one thread
    is busy with a dump (a full backlog fails a client's connect: ovs-ofctl's
    "Protocol error" beside 20 dumping clients)."""
    path = str(tmp_path / "busy.mgmt")
    busy, release = threading.Event(), threading.Event()

    def slow_records():
        busy.set()
        release.wait(10)
        return []

    clients = []
    with OpenFlowStatsServer(slow_records, unix_socket=path, max_connections=40):
        try:
            first = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(first)
            first.connect(path)
            first.sendall(codec.encode_hello({4}))
            first.sendall(codec.encode_flow_stats_request(codec.FlowStatsRequest(), 1))
            assert busy.wait(10), "the dump never asked for records"
            for _ in range(39):  # the thread is held in the dump: nobody accepts
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                clients.append(client)
                client.setblocking(False)
                client.connect(path)  # BlockingIOError once the backlog is full
        finally:
            release.set()
            for client in clients:
                client.close()
