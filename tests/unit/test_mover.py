"""The C data mover: its unit tests, and two movers over loopback (tcp;ofi_rxm).

Loopback needs no root and no lab; the lab tests run the movers across hosts.
"""

import os
import shutil
import socket
import subprocess
import threading

import pytest

from agents.agent import movers
from agents.mover import BINARY, MOVER_DIR
from flexmig import exceptions

TOKEN = "unit-test-credential-0123"


@pytest.fixture(scope="module")
def mover():
    if (
        shutil.which("pkg-config") is None
        or subprocess.run(["pkg-config", "--exists", "libfabric"], check=False).returncode
    ):
        pytest.skip("libfabric-dev is not installed (tools/setup.sh installs it)")
    subprocess.run(["make", "-s", "-C", str(MOVER_DIR)], check=True)
    return BINARY


def test_c_unit_tests(mover):
    out = subprocess.run(
        [MOVER_DIR / "build" / "test_mover"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(", 0 failed")


def _pair(mover, tmp_path, port, send_args=(), recv_args=(), send_token=TOKEN, data=None):
    data = data if data is not None else os.urandom(9 * 2**20 + 12345)
    src, dst = tmp_path / "in", tmp_path / "out"
    src.write_bytes(data)
    env = dict(os.environ, FM_MOVER_TOKEN=TOKEN)
    recv = subprocess.Popen(
        [
            mover,
            "recv",
            "--local",
            "127.0.0.1",
            "--port",
            str(port),
            "--output",
            dst,
            "--batch-kib",
            "256",
            *recv_args,
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    result = {}
    t = threading.Thread(target=lambda: result.update(err=recv.communicate(timeout=60)[1]))
    t.start()
    send = subprocess.run(
        [
            mover,
            "send",
            "--local",
            "127.0.0.1",
            "--peer",
            "127.0.0.1",
            "--port",
            str(port),
            "--input",
            src,
            *send_args,
        ],
        env=dict(env, FM_MOVER_TOKEN=send_token),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    t.join()
    return data, dst, send, recv.returncode, result["err"]


def test_byte_exact_transfer_with_odd_tail(mover, tmp_path):
    data, dst, send, rc, err = _pair(mover, tmp_path, 7491)
    assert send.returncode == 0 and rc == 0, send.stderr + err
    assert dst.read_bytes() == data
    assert '"bytes": %d' % len(data) in err


@pytest.mark.parametrize("depth", ["1", "8"])
def test_any_depth_delivers_the_same_bytes(mover, tmp_path, depth):
    data, dst, send, rc, err = _pair(mover, tmp_path, 7492, send_args=("--depth", depth))
    assert send.returncode == 0 and rc == 0, send.stderr + err
    assert dst.read_bytes() == data


def test_corruption_on_the_wire_is_caught(mover, tmp_path):
    _, dst, send, rc, err = _pair(mover, tmp_path, 7493, send_args=("--inject-corruption", "3"))
    assert rc != 0 and send.returncode != 0
    assert "batch 3 failed its CRC32C check" in err
    assert dst.stat().st_size == 3 * 256 * 1024  # nothing at or after the bad batch


def test_wrong_credential_moves_nothing(mover, tmp_path):
    _, dst, send, rc, err = _pair(mover, tmp_path, 7494, send_token="not-the-right-one-xx")
    assert rc != 0 and send.returncode != 0
    assert "wrong or no credential" in err and "refused our credential" in send.stderr
    assert not dst.exists() or dst.stat().st_size == 0


@pytest.mark.parametrize(
    "args", [["--depth", "0"], ["--batch-kib", "1"], ["--port", "x"], ["--provider"], []]
)
def test_bad_options_are_refused_clearly(mover, args):
    env = dict(os.environ, FM_MOVER_TOKEN=TOKEN)
    base = [mover, "send", "--local", "127.0.0.1", "--peer", "127.0.0.1"]
    if args:
        base += ["--input", "/dev/null"]
    out = subprocess.run(
        base + args, env=env, capture_output=True, text=True, timeout=10, check=False
    )
    assert out.returncode == 2
    assert "mover:" in out.stderr or "usage" in out.stderr


def test_help_lists_every_tunable(mover):
    out = subprocess.run([mover, "--help"], capture_output=True, text=True, check=False)
    for opt in ("--provider", "--batch-kib", "--depth", "--slots", "--timeout"):
        assert opt in out.stdout
    assert "FM_MOVER_DEPTH" in out.stdout


def _serve_destination(path, conns, received):
    """Stand in for the destination QEMU: accept ``conns`` connections, read each to EOF."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(conns)
        listener.settimeout(30)
        for _ in range(conns):
            conn, _addr = listener.accept()
            with conn:
                conn.settimeout(30)
                chunks = []
                while chunk := conn.recv(1 << 20):
                    chunks.append(chunk)
                received.append(b"".join(chunks))


def test_parallel_connections_each_ride_their_own_mover_pair(mover, tmp_path):
    streams, mid = 3, "abc123"
    payloads = [bytes([k]) * 16 + os.urandom(3 * 2**20 + k) for k in range(streams)]
    received = []
    path = movers.socket_path(str(tmp_path), mid)
    # Both "hosts" share this one: the destination keeps its state in a directory of its own.
    dest_dir = tmp_path / "dest"
    dest_dir.mkdir()
    receivers, ports = movers.start_receivers(str(dest_dir), "127.0.0.1", mid, TOKEN, streams)
    assert len(set(ports)) == streams
    server = threading.Thread(
        target=_serve_destination,
        args=(movers.socket_path(str(dest_dir), mid), streams, received),
    )
    server.start()
    senders = movers.start_senders(str(tmp_path), "127.0.0.1", "127.0.0.1", ports, mid, TOKEN)
    try:
        for payload in payloads:  # like QEMU: main stream first, then each channel
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(path)
                conn.sendall(payload)
        sent = senders.wait(60)
        got = receivers.wait(60)
    finally:
        senders.kill()
        receivers.kill()
        server.join(60)
    assert sorted(received) == sorted(payloads)  # each connection intact, none merged
    # Movers that ended well leave nothing: tokens, ready, stats and logs gone on both ends
    # (the sockets are their callers', removed with the pair: test_mover_pairs).
    left = sorted(p.name for d in (tmp_path, dest_dir) for p in d.glob("mover-*"))
    assert left == [], left
    assert sent["streams"] == got["streams"] == streams
    assert got["bytes"] == sum(len(p) for p in payloads)
    assert sorted(got["stream_bytes"]) == sorted(len(p) for p in payloads)


def test_killed_movers_keep_only_their_log_marked_failed(mover, tmp_path):
    receivers, ports = movers.start_receivers(str(tmp_path), "127.0.0.1", "abc124", TOKEN, 2)
    receivers.kill()  # a migration aborted while they waited for their senders
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["mover-abc124-recv.failed.log", "mover-abc124-recv1.failed.log"], left


def test_a_sender_that_cannot_reach_its_receiver_leaves_only_its_log(mover, tmp_path):
    port = movers.PORT_RANGE[-1]  # nothing listens there in this test
    with pytest.raises(exceptions.BackendError, match="did not get ready"):
        movers.start_senders(str(tmp_path), "127.0.0.1", "127.0.0.1", [port], "abc125", TOKEN)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["mover-abc125-send.failed.log"], left


class _Member:
    def __init__(self, argv):
        self.proc = subprocess.Popen(argv)
        self.killed = False

    def kill(self):
        self.killed = self.proc.poll() is None
        self.proc.kill()
        self.proc.wait()


def test_movers_nobody_comes_back_for_are_reaped_after_a_grace(tmp_path):
    ended, running = _Member(["true"]), _Member(["sleep", "60"])
    ended.proc.wait()
    sets = {"aaa111": movers.MoverSet([ended]), "bbb222": movers.MoverSet([running])}
    (tmp_path / "mig-aaa111.sock").write_text("")
    now = sets["aaa111"].started
    assert movers.reap_unclaimed(sets, str(tmp_path), now, grace_s=60, max_run_s=600) == []
    # Ended 61 s ago and never finished: its migration's agent is gone.
    assert movers.reap_unclaimed(sets, str(tmp_path), now + 61, 60, 600) == ["aaa111"]
    assert list(sets) == ["bbb222"] and not (tmp_path / "mig-aaa111.sock").exists()
    assert not running.killed
    assert movers.reap_unclaimed(sets, str(tmp_path), now + 601, 60, 600) == ["bbb222"]
    assert running.killed and sets == {}


def test_combined_statistics_sum_counters_and_take_the_slowest_stream():
    total = movers.combine_stats(
        [
            {"bytes": 3 * 2**20, "seconds": 1.0, "cpu_user_s": 0.25, "cpu_sys_s": 0.5},
            {"bytes": 2**20, "seconds": 2.0, "cpu_user_s": 0.25, "cpu_sys_s": 0.0},
        ]
    )
    assert total["bytes"] == 4 * 2**20 and total["seconds"] == 2.0
    assert total["mib_per_s"] == 2.0 and total["cpu_user_s"] == 0.5
    assert total["streams"] == 2 and total["stream_bytes"] == [3 * 2**20, 2**20]


def test_too_many_streams_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(exceptions.InvalidInput):
        movers.start_receivers(str(tmp_path), "127.0.0.1", "abc123", TOKEN, 10)
    assert not list(tmp_path.iterdir())


class _NoMigrations:
    def start(self, *args, **kwargs):
        raise AssertionError("a refused request must start nothing")


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"parallel": 9, "mode": "precopy"}, "not in 0..8"),
        ({"parallel": -1, "mode": "precopy"}, "not in 0..8"),
        ({"parallel": "4", "mode": "precopy"}, "parallel"),
    ],
)
def test_the_agent_refuses_bad_parallel_requests(extra, reason):
    from types import SimpleNamespace

    from agents.agent import service

    agent = SimpleNamespace(migrations=_NoMigrations(), _destination=lambda dest: dest)
    body = {"vm": "vm0", "dest": {}, **extra}
    agent._request = lambda body: service.Agent._request(agent, body)
    with pytest.raises(exceptions.InvalidInput, match=reason):
        service.Agent.migrate(agent, body, None)
