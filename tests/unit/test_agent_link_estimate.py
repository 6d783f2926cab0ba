"""What an agent learns about a destination from its completed precopy jobs."""

import concurrent.futures
import dataclasses
import json
import threading
import time
import types

import pytest

from agents.agent import link_estimate, migrations
from agents.agent.link_estimate import LinkEstimate
from flexmig.migration import downtime

MIB = 2**20


_NO_PLAN = types.SimpleNamespace(guest_downtime=downtime.Forecast({}))


def job(bps_mib, processed_mib, elapsed_ms, downtime_ms):
    return {
        "memory_bps": bps_mib * MIB,
        "memory_processed": processed_mib * MIB,
        "time_elapsed": elapsed_ms,
        "downtime": downtime_ms,
    }


def test_an_uncapped_job_teaches_the_stream_rate_setup_and_switchover():
    link = LinkEstimate()
    link.learn(job(200, 400, 4100, 100))  # 2 s of transfer, 0.1 s switchover, 2 s setup
    assert link.stream_bps == 200 * MIB
    assert link.setup_s == pytest.approx(2.0) and link.switchover_s == pytest.approx(0.1)


def test_a_capped_job_teaches_setup_and_switchover_but_not_the_rate():
    """A job under a bandwidth cap moves at the cap, not at what the link carries;
    its setup (the destination's QEMU starting) is the link's all the same."""
    link = LinkEstimate()
    link.learn(job(100, 300, 5060, 60), cap_bps=100 * MIB)
    assert link.stream_bps is None
    assert link.setup_s == pytest.approx(2.0) and link.switchover_s == pytest.approx(0.06)
    link.learn(job(100, 300, 6000, 100), cap_bps=100 * MIB)  # averaged, not replaced
    assert link.setup_s == pytest.approx(2.45) and link.switchover_s == pytest.approx(0.08)
    link.learn(job(250, 500, 4030, 30))  # the first uncapped job: its rate as it is
    assert link.stream_bps == 250 * MIB
    assert link.setup_s == pytest.approx(2.225) and link.timings_learned == 3


def test_a_capped_job_that_stayed_under_its_cap_teaches_the_streams_rate():
    """The lab's TCG guest streamed 59 MiB/s under a 100 MiB/s cap: the stream,
    not the cap, set that rate, and a forecast at the cap was 30-40 % short."""
    link = LinkEstimate()
    link.learn(job(59, 330, 6600, 145), cap_bps=100 * MIB)
    assert link.stream_bps == 59 * MIB
    link.learn(job(99, 330, 4600, 100), cap_bps=100 * MIB)  # held by the cap: a floor
    assert link.stream_bps == 99 * MIB
    link.learn(job(64, 330, 4600, 100), cap_bps=64 * MIB)  # held, below what is known
    assert link.stream_bps == 99 * MIB


def test_the_learnt_switchover_leaves_out_what_the_forecast_counts_per_vm():
    """libvirt's downtime holds the VM's last pages and its destination's msync:
    the forecast counts those per VM, so the link's switchover is the rest."""
    forecast = downtime.Forecast({"device state": 50.0, "destination msync": 100.0}, copy_ms=10.0)
    link = LinkEstimate()
    link.learn(job(59, 330, 6600, 190), cap_bps=100 * MIB, forecast=forecast)
    assert link.switchover_s == pytest.approx(0.080)
    link.learn(job(59, 330, 6600, 60), cap_bps=100 * MIB, forecast=forecast)
    assert link.switchover_recent[-1] == downtime.LEARNT_SWITCHOVER_MIN_S


def test_an_estimate_saved_before_timings_were_counted_keeps_averaging_them():
    link = LinkEstimate(stream_bps=100 * MIB, setup_s=1.0, switchover_s=0.05)
    link.learn(job(100, 100, 4050, 50), cap_bps=100 * MIB)
    assert link.setup_s == pytest.approx(2.0) and link.stream_bps == 100 * MIB


def test_one_slow_switchover_does_not_move_the_learnt_one():
    """libvirt's downtime of a job that met a loaded host is an outlier: the median
    of the last five keeps the forecast where the other jobs put it."""
    link = LinkEstimate()
    for downtime_ms in (40, 45, 300, 42):
        link.learn(job(100, 300, 5060, downtime_ms), cap_bps=100 * MIB)
    assert link.switchover_s == pytest.approx(0.0435)
    for _ in range(5):  # the host stays slow: the estimate follows
        link.learn(job(100, 300, 5300, 300), cap_bps=100 * MIB)
    assert link.switchover_s == pytest.approx(0.3) and len(link.switchover_recent) == 5
    saved = json.loads(json.dumps({"switchover_s": 0.05, "stream_bps": 100 * MIB}))
    old = LinkEstimate(**saved)  # saved before the samples were kept
    old.learn(job(100, 100, 2000, 70), cap_bps=100 * MIB)
    assert old.switchover_s == pytest.approx(0.06) and old.switchover_recent == [0.05, 0.07]


def test_a_job_without_a_rate_teaches_nothing():
    link = LinkEstimate()
    link.learn({"memory_bps": 0, "time_elapsed": 1000, "downtime": 30})
    assert link == LinkEstimate()


class _ProbedAgent:
    def __init__(self):
        self.address, self.probes = "10.250.0.2", 0

    def probe_bandwidth(self, mib):
        self.probes += 1
        time.sleep(0.05)  # a probe takes a while: plans asked meanwhile pile up
        return 100 * MIB


def _service(tmp_path):
    service = object.__new__(migrations.MigrationService)
    service.links_file = tmp_path / "links.json"
    service.links = {}
    service.links_lock = threading.Lock()
    service._probe_lock = threading.Lock()
    service.options = types.SimpleNamespace(bandwidth_probe_mib=1)
    return service


def test_plans_asked_together_share_one_probe_and_never_race_on_the_file(tmp_path):
    service = _service(tmp_path)
    dest = migrations.Destination(agent=_ProbedAgent(), libvirt_uri="", migration_uri="")
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        links = list(pool.map(lambda _: service.link(dest), range(64)))
        learnt = [
            pool.submit(service._learn, dest, job(100, 100, 2000, 50), None, _NO_PLAN)
            for _ in range(64)
        ]
        for future in learnt:
            future.result()  # a racing save raised FileNotFoundError here
    assert dest.agent.probes == 1 and all(link is links[0] for link in links)
    saved = json.loads(service.links_file.read_text())
    assert saved["10.250.0.2"]["timings_learned"] == 64
    assert service.links_snapshot() == saved


def test_the_learnt_qemu_side_holds_the_copy_and_leaves_out_the_writeback():
    """QEMU's side learnt whole: each job's downtime less its destination's msync
    (forecast per VM), beside the copy that job's plan forecast."""
    link = LinkEstimate()
    assert link.learnt_side == downtime.NOTHING_LEARNT
    msync = {"destination msync": 100.0}
    for downtime_ms, copy_ms in ((130, 2.0), (125, 18.0), (170, 9.0), (105, 1.0)):
        forecast = downtime.Forecast(msync, copy_ms=copy_ms)
        link.learn(job(59, 330, 6600, downtime_ms), cap_bps=100 * MIB, forecast=forecast)
    assert link.qemu_side_recent[0] == pytest.approx([0.030, 0.002])
    assert link.qemu_side_recent[-1] == pytest.approx([0.010, 0.001])  # floored at 10 ms
    side = link.learnt_side
    assert side.qemu_s == pytest.approx(0.0275) and side.copy_s == pytest.approx(0.0055)
    assert side.first_run_s is None
    for n in range(10):
        link.learn(job(59, 330, 6600, 140 + n), cap_bps=100 * MIB, forecast=forecast)
    assert len(link.qemu_side_recent) == link_estimate.SWITCHOVER_SAMPLES
    assert link.learnt_side.qemu_s == pytest.approx(0.047)  # 145-149 less the msync


def test_the_first_run_is_the_median_of_the_last_reports():
    link = LinkEstimate()
    for gap_ms in (80, 70, 400, 60, 75, 65):
        link.learn_first_run(gap_ms / 1000, 0.030)
    assert link.first_run_recent == pytest.approx([0.040, 0.370, 0.030, 0.045, 0.035])
    assert link.learnt_side.first_run_s == pytest.approx(0.040)
    link.learn_first_run(0.010, 0.030)  # a gap inside QEMU's downtime: nothing
    assert link.first_run_recent[-1] == 0.0


def test_an_estimate_saved_before_these_were_learnt_loads_without_them():
    saved = {"fabric_bps": 1.0, "stream_bps": 2.0, "switchover_s": 0.04, "timings_learned": 3}
    assert LinkEstimate(**saved).learnt_side == downtime.NOTHING_LEARNT


def test_split_jobs_teach_their_own_qemu_side_apart_from_the_precopy_one():
    """A split plan forecasts a longer final round than a precopy's (19-21 ms of
    copy beyond the precopy jobs' own, docs/benchmarks/README.md) that its QEMU
    downtime never showed: split jobs' downtimes, less their writeback and the
    final round's store faults, are split plans' learnt QEMU side."""
    link = LinkEstimate()
    link.learn(job(59, 330, 6600, 20), forecast=downtime.Forecast({}, copy_ms=2.9))
    msync = {"destination msync": 30.0}
    for downtime_ms, copy_ms in ((53, 23.0), (48, 21.0), (95, 20.0)):
        link.learn_split_side(
            {"downtime": downtime_ms}, downtime.Forecast(msync, copy_ms=copy_ms), 0.01
        )
    link.learn_split_side({}, downtime.Forecast(msync), 0.0)  # no downtime reported: nothing
    assert link.split_qemu_side_recent == [
        pytest.approx([0.013, 0.023]), pytest.approx([0.010, 0.021]), pytest.approx([0.055, 0.020])
    ]  # fmt: skip
    side = link.learnt_side
    assert (side.qemu_s, side.copy_s) == pytest.approx((0.020, 0.0029))
    split = side.for_mode("split")
    assert (split.qemu_s, split.copy_s) == pytest.approx((0.013, 0.021))
    # a split plan whose copy is the split jobs' adds none beyond them
    parts = downtime._qemu_side(0.021, 0.02, None, split)
    assert parts[downtime.COPY_BEYOND_LEARNT] == 0.0
    assert downtime._qemu_side(0.021, 0.02, None, side)[downtime.COPY_BEYOND_LEARNT] > 0.018
    saved = json.loads(json.dumps(dataclasses.asdict(link)))
    assert LinkEstimate(**saved).learnt_side == side
