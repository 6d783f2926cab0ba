"""The data mover across lab hosts, alone and as the migration transport."""

import json
import os
import subprocess
import time

import pytest

from agents.agent import movers
from agents.mover import BINARY
from flexmig import migrate_cli
from flexmig_lab import vm

pytestmark = pytest.mark.lab
TOKEN = "functional-test-credential-0123456789"


def _mover_cmd(host, role, *args):
    return [*host.ns.exec_prefix(), str(BINARY), role, "--local", host.spec.mgmt_ip, *args]


def test_byte_exact_across_the_fabric_and_a_vanished_peer_is_seen(lab, tmp_path):
    a, b = lab.host("A"), lab.host("B")
    src, dst = tmp_path / "in", tmp_path / "out"
    src.write_bytes(os.urandom(128 * 2**20))
    env = dict(os.environ, FM_MOVER_TOKEN=TOKEN)
    recv = subprocess.Popen(
        _mover_cmd(b, "recv", "--output", str(dst), "--port", "7460"),
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    send = subprocess.run(
        _mover_cmd(a, "send", "--peer", b.spec.mgmt_ip, "--port", "7460", "--input", str(src)),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    _, recv_err = recv.communicate(timeout=60)
    assert send.returncode == 0 and recv.returncode == 0, send.stderr + recv_err
    assert dst.read_bytes() == src.read_bytes()
    stats = json.loads(send.stderr.strip().splitlines()[-1])
    assert stats["bytes"] == 128 * 2**20 and stats["mib_per_s"] > 0

    # A receiver killed mid-stream: the sender says so within its timeout.
    recv = subprocess.Popen(
        _mover_cmd(b, "recv", "--output", "/dev/null", "--port", "7461"),
        env=env,
        stderr=subprocess.DEVNULL,
    )
    feeder = subprocess.Popen(["sh", "-c", f"cat {src}; sleep 60"], stdout=subprocess.PIPE)
    send = subprocess.Popen(
        _mover_cmd(
            a, "send", "--peer", b.spec.mgmt_ip, "--port", "7461", "--input", "-", "--timeout", "5"
        ),
        env=env,
        stdin=feeder.stdout,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)
    b.ns.run(["pkill", "-9", "-f", "flexmig-mover recv"], check=False)
    killed = time.monotonic()
    _, err = send.communicate(timeout=30)
    feeder.kill()
    recv.wait(5)
    assert send.returncode != 0
    assert "peer vanished" in err or "silent" in err or "completion error" in err
    assert time.monotonic() - killed < 10


def test_verbs_provider_path():
    if not movers.rdma_provider_present():
        pytest.skip("no RDMA device: libfabric's verbs provider (rdma-core) finds none here")
    out = subprocess.run([str(BINARY), "--help"], capture_output=True, text=True, check=True)
    assert "verbs;ofi_rxm" in out.stdout


def _through_mover(lab, name, **kw):
    result = migrate_cli.migrate(lab, name, "B", show=False, transport="mover", **kw)
    assert result["state"] == "completed", result.get("error")
    assert result["transport"] == "mover"
    assert (result["verify"]["bad"], result["verify"]["lost"]) == (0, 0)
    movers_stats = result["movers"]
    assert movers_stats["send"]["bytes"] == movers_stats["recv"]["bytes"] > 64 * 2**20
    return result


def test_precopy_migration_through_the_mover(lab):
    vm.create(lab, "A", ram="384M", workload="dirtier:wss=128M,rate=3000", name="mv1")
    try:
        result = _through_mover(lab, "mv1")
        assert result["mode"] == "precopy"
    finally:
        vm.destroy(lab, "mv1")


def test_parallel_precopy_carries_each_connection_on_its_own_mover_stream(lab):
    vm.create(
        lab,
        "A",
        ram="384M",
        workload="dirtier:wss=128M,rate=3000",
        memory_backing="anonymous",
        name="mv4",
    )
    try:
        result = _through_mover(lab, "mv4", mode="precopy", parallel=2)
        assert result["parallel"] == 2
        send, recv = result["movers"]["send"], result["movers"]["recv"]
        # QEMU's main connection and its 2 multifd channels: three mover pairs.
        assert send["streams"] == recv["streams"] == 3
        assert sorted(send["stream_bytes"]) == sorted(recv["stream_bytes"])
        # The pages went over the channels, not the main stream alone.
        assert sorted(recv["stream_bytes"])[1] > 32 * 2**20
    finally:
        vm.destroy(lab, "mv4")


def test_hybrid_postcopy_through_the_mover_uses_the_return_path(lab):
    vm.create(
        lab,
        "A",
        ram="512M",
        workload="dirtier:wss=256M,rate=150000",
        memory_backing="anonymous",
        name="mv2",
    )
    try:
        if os.environ.get("FLEXMIG_LAB_LIBVIRT") == "backports":
            # libvirt 11.3 turns postcopy-preempt on by itself, whose second
            # connection the mover cannot take: the plan leaves the mover.
            result = migrate_cli.migrate(
                lab, "mv2", "B", show=False, transport="mover", mode="postcopy", bandwidth_mib=64
            )
            assert result["state"] == "completed", result.get("error")
            assert result["transport"] == "qemu-tcp" and result["switched_to_postcopy"]
            assert (result["verify"]["bad"], result["verify"]["lost"]) == (0, 0)
            return
        result = _through_mover(lab, "mv2", mode="postcopy", bandwidth_mib=64)
        assert result["switched_to_postcopy"]
        # Page requests (and QEMU's acks) came back from the destination.
        assert result["movers"]["send"]["reverse_bytes"] > 0
    finally:
        vm.destroy(lab, "mv2")


def test_split_migration_through_the_mover(lab):
    lab.set_budget("B", 400)
    try:
        vm.create(lab, "A", ram="512M", workload="dirtier:wss=256M,rate=2000", name="mv3")
        result = _through_mover(lab, "mv3")
        assert result["mode"] == "split"
    finally:
        vm.destroy(lab, "mv3")
        lab.set_budget("B", 4096)
