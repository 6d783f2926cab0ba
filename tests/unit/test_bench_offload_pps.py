"""Part (a)'s table and the benchmark's --parts (pure: no lab)."""

import argparse

import pytest

from tests.bench import bench_offload_datapath, offload_pps


def _cell(received: float, cpu: float) -> dict:
    return {
        "sent_pps": 2 * received, "port_pps": 1.5 * received, "received_pps": received,
        "datapath_cpu_pct": cpu, "generator_cpu_pct": 90.0, "guest_napi_pct": 10.0,
        "pps_per_core": received / (cpu / 100), "loadavg": 1.0, "napi_threads": 2,
        "rounds_received_pps": [received, received],
    }  # fmt: skip


def test_table_has_every_generator_sink_and_path_against_its_own_plain_row():
    pps = {}
    for generator, sink in offload_pps.CELLS:
        base = 100_000 if generator == "xdpgen" else 150_000
        pps[f"{generator}/{sink}/plain"] = _cell(base, 100)
        pps[f"{generator}/{sink}/miss"] = _cell(base * 0.8, 100)
        pps[f"{generator}/{sink}/offloaded"] = _cell(base * 6, 50)
    args = argparse.Namespace(duration=4.0, rounds=2, senders=2)
    rows = [line for line in offload_pps.render_table(pps, args) if line.startswith("| ")]
    assert len(rows) == 1 + 3 * 3  # header + (generator, sink) x paths
    offloaded = [r for r in rows if "offloaded (XDP" in r]
    assert [r.split(" | ")[0:2] for r in offloaded] == [
        ["| xdpgen", "xdp"], ["| udpgen", "xdp"], ["| udpgen", "socket"]
    ]  # fmt: skip
    assert all(" 6.00x " in r and " 12.00x " in r for r in offloaded)
    assert all(" 0.80x " in r for r in rows if "miss -> OVS" in r)


def test_parts_accepts_letters_and_refuses_anything_else():
    assert bench_offload_datapath._parts("ca") == "ac"
    for bad in ("", "d", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_offload_datapath._parts(bad)
