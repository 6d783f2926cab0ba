"""The XDP provider's pure parts: key layout, counter folding, batch planning, config.

No root, no kernel: the batch logic runs against a fake of the two libbpf
calls it makes, which refuses entries the way the kernel does (it stops at
the refused entry and reports how many it wrote before it).
"""

from __future__ import annotations

import doctest
import errno
import re
import shutil
import subprocess

import pytest
from oslo_config import cfg

from ovs_ext.providers.base import FlowCounters, FlowMatch, OffloadEntry, OffloadError
from ovs_ext.providers.xdp import bpffs, flowtable, libbpf, privileged
from ovs_ext.providers.xdp import provider as xdp


@pytest.mark.parametrize("module", [flowtable, bpffs])
def test_doctests(module):
    assert doctest.testmod(module).failed == 0


def _btf_struct_sizes(obj) -> dict[str, int]:
    out = subprocess.run(
        ["bpftool", "btf", "dump", "file", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    return {m[0]: int(m[1]) for m in re.findall(r"STRUCT '(\w+)' size=(\d+)", out)}


def test_packed_layout_matches_the_compiled_program():
    if not xdp.ESWITCH_OBJECT.is_file() or shutil.which("bpftool") is None:
        pytest.skip("eswitch.bpf.o or bpftool missing (tools/setup.sh builds and installs them)")
    sizes = _btf_struct_sizes(xdp.ESWITCH_OBJECT)
    assert sizes["eswitch_flow_key"] == flowtable.KEY.size
    assert sizes["eswitch_flow_action"] == flowtable.ACTION.size


def test_key_round_trips_and_keeps_network_byte_order():
    match = FlowMatch("tap3", 6, "192.168.1.2", "10.0.0.9", 40000, 5201)
    key = flowtable.pack_key(match, 12)
    assert key[4:8] == bytes([192, 168, 1, 2])
    assert key[12:14] == (40000).to_bytes(2, "big")
    assert flowtable.unpack_key(key, {12: "tap3"}) == match
    assert flowtable.unpack_key(key, {}) is None  # its port is gone


def test_per_cpu_values_fold_into_totals():
    cpus = 4
    value = b"".join(flowtable.ACTION.pack(5, 0, n, n * 60) for n in (1, 2, 3, 4))
    assert len(value) == flowtable.percpu_value_size(cpus)
    assert flowtable.sum_counters(value, cpus) == FlowCounters(10, 600)
    fresh = flowtable.pack_new_action(9, cpus)
    assert flowtable.out_ifindex(fresh) == 9
    assert flowtable.sum_counters(fresh, cpus) == FlowCounters(0, 0)


class FakeKernel:
    """The flow map as the batch syscalls see it: refuses ``refuse`` keys, has a size."""

    def __init__(self, capacity: int, refuse: dict[bytes, int] | None = None) -> None:
        self.capacity = capacity
        self.refuse = refuse or {}
        self.entries: dict[bytes, bytes] = {}
        self.calls = 0

    def write_flows(self, pin_dir, keys_blob, values_blob, count):
        self.calls += 1
        size = flowtable.KEY.size
        value_size = len(values_blob) // count
        for i in range(count):
            key = keys_blob[i * size : (i + 1) * size]
            if key in self.refuse:
                return i, self.refuse[key]
            if len(self.entries) >= self.capacity:
                return i, errno.E2BIG
            self.entries[key] = values_blob[i * value_size : (i + 1) * value_size]
        return count, 0


@pytest.fixture
def provider(monkeypatch):
    conf = cfg.ConfigOpts()
    p = xdp.XdpProvider(conf)
    conf([])
    p._cpus = 2  # as if loaded: 2 possible CPUs
    p._ports = {"tap1": 11, "tap2": 12, "phy0": 2}
    return p


def _entry(sport: int, out: str = "tap2", in_port: str = "tap1") -> OffloadEntry:
    return OffloadEntry(FlowMatch(in_port, 17, "10.0.0.1", "10.0.0.2", sport, 53), out)


def test_install_is_one_batch_and_names_every_refusal(provider, monkeypatch):
    kernel = FakeKernel(capacity=1000)
    monkeypatch.setattr(privileged, "write_flows", kernel.write_flows)
    entries = [_entry(p) for p in range(1, 101)]
    bad = [
        _entry(200, out="tap9"),  # not attached
        _entry(201, in_port="tap2"),  # hairpin
        _entry(1, out="phy0"),  # the same match again: the first entry wins
    ]
    result = provider.install(entries + bad)
    assert kernel.calls == 1
    assert len(result.installed) == 100 and len(kernel.entries) == 100
    reasons = {m.tp_src: r for m, r in result.failed.items()}
    assert "out_port tap9 is not attached" in reasons[200]
    assert "same port" in reasons[201]
    assert set(reasons) == {200, 201}  # a repeated match is answered once, by its first entry


def test_refused_entry_fails_alone_and_the_batch_goes_on(provider, monkeypatch):
    refused = _entry(50)
    key = flowtable.pack_key(refused.match, 11)
    kernel = FakeKernel(capacity=1000, refuse={key: errno.ENOMEM})
    monkeypatch.setattr(privileged, "write_flows", kernel.write_flows)
    result = provider.install([_entry(p) for p in range(1, 101)])
    assert len(result.installed) == 99
    assert list(result.failed) == [refused.match]
    assert "kernel refused the entry" in result.failed[refused.match]
    assert kernel.calls == 2  # one syscall before the refusal, one after


def test_full_table_fails_the_overflow_with_the_capacity(provider, monkeypatch):
    kernel = FakeKernel(capacity=10_000)
    monkeypatch.setattr(privileged, "write_flows", kernel.write_flows)
    provider.conf.set_override("capacity", 60, group="offload_xdp")
    result = provider.install([_entry(p) for p in range(1, 101)])
    assert len(result.installed) == 60
    assert len(result.failed) == 40
    assert all("offload table full (capacity 60)" in r for r in result.failed.values())


def test_reinstall_is_idempotent_but_a_new_egress_is_refused(provider, monkeypatch):
    kernel = FakeKernel(capacity=100)
    monkeypatch.setattr(privileged, "write_flows", kernel.write_flows)
    assert provider.install([_entry(7)]).failed == {}
    again = provider.install([_entry(7)])
    assert again.installed == (_entry(7).match,) and kernel.calls == 1
    moved = provider.install([_entry(7, out="phy0")])
    assert "remove it first" in moved.failed[_entry(7).match]


def test_a_call_level_kernel_error_fails_the_rest_of_the_batch(provider, monkeypatch):
    monkeypatch.setattr(privileged, "write_flows", lambda *a: (3, errno.EFAULT))
    result = provider.install([_entry(p) for p in range(1, 11)])
    assert len(result.installed) == 3 and len(result.failed) == 7


@pytest.mark.parametrize(
    ("option", "value"),
    [("capacity", 0), ("capacity", 2**30), ("attach_mode", "offload")],
)
def test_config_out_of_bounds_is_rejected(option, value):
    conf = cfg.ConfigOpts()
    xdp.XdpProvider(conf)
    conf([])
    with pytest.raises(ValueError):
        conf.set_override(option, value, group="offload_xdp")


def test_unavailable_reason_names_what_is_missing(monkeypatch, tmp_path):
    conf = cfg.ConfigOpts()
    p = xdp.XdpProvider(conf)
    conf([])
    monkeypatch.setattr(xdp.os, "geteuid", lambda: 0)
    conf.set_override("bpf_object", str(tmp_path / "none.o"), group="offload_xdp")
    description = p.describe()
    assert not description.available
    assert "none.o is not built" in description.unavailable_reason
    monkeypatch.setattr(xdp.os, "geteuid", lambda: 1000)
    assert "needs root" in p.describe().unavailable_reason


def test_load_failure_is_an_offload_error_naming_the_step(monkeypatch, tmp_path):
    conf = cfg.ConfigOpts()
    p = xdp.XdpProvider(conf)
    conf([])
    conf.set_override("bpffs_dir", str(tmp_path / "pins"), group="offload_xdp")
    conf.set_override("privsep", "inline", group="offload_xdp")
    monkeypatch.setattr(privileged.eswitch, "client_mode", True)  # restored after the test

    def no_bpffs(_dir):
        raise libbpf.BpfError(call="mount", reason="Operation not permitted")

    monkeypatch.setattr(bpffs, "ensure", no_bpffs)
    with pytest.raises(OffloadError, match="could not load the eSwitch: .*not permitted"):
        p.stats()


def test_privileged_side_keeps_only_what_xdp_needs():
    from oslo_privsep import capabilities as caps

    wanted = {caps.CAP_SYS_ADMIN, caps.CAP_NET_ADMIN, caps.CAP_BPF}
    assert set(cfg.CONF.offload_xdp_privsep.capabilities) == wanted
    for name in ("load_eswitch", "attach_port", "detach_port", "write_flows", "read_flows"):
        assert privileged.eswitch.is_entrypoint(getattr(privileged, name))


def test_a_broken_privileged_channel_fails_the_batch_with_the_reason(provider, monkeypatch):
    def broken(*_args):
        raise OSError(32, "Broken pipe")

    monkeypatch.setattr(privileged, "write_flows", broken)
    result = provider.install([_entry(p) for p in range(1, 4)])
    assert result.installed == ()
    assert all("flow table write failed" in r for r in result.failed.values())
