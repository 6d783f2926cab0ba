import dataclasses
import math

import pytest

from flexmig import exceptions
from flexmig.policy import dirty_model, precopy
from flexmig.policy.decision import MigrationInputs, decide
from flexmig.policy.dirty_model import DirtyModel

MIB = 2**20


def test_fit_recovers_a_random_writer():
    # W pages written uniformly at random at R pages/s: M = W, tau = W ln2 / R.
    w, r = 32768, 20000
    samples = [(t, w * (1 - (1 - 1 / w) ** (r * t))) for t in (1, 2, 3)]
    model = dirty_model.fit(samples)
    assert model.m_pages == pytest.approx(w, rel=0.01)
    assert model.tau_s == pytest.approx(w * math.log(2) / r, rel=0.01)


def test_fit_with_noise_stays_close():
    truth = DirtyModel(m_pages=1.0e5, tau_s=1.32)
    noise = [1.03, 0.97, 1.02, 0.99]
    samples = [(t, truth.pages(t) * n) for t, n in zip((0.5, 1, 2, 4), noise, strict=True)]
    model = dirty_model.fit(samples)
    assert model.m_pages == pytest.approx(1.0e5, rel=0.05)
    assert model.tau_s == pytest.approx(1.32, rel=0.15)


def test_fit_idle_and_bad_samples():
    assert dirty_model.fit([(1, 0), (2, 0)]).m_pages == 0
    with pytest.raises(exceptions.InvalidInput, match="two distinct interval"):
        dirty_model.fit([(1, 10), (1, 12)])


def test_beta_slows_dirtying():
    model = DirtyModel(m_pages=1000, tau_s=1.0)
    assert model.with_beta(0.5).pages(2.0) == pytest.approx(model.pages(1.0))


def test_paper_db_workload_rounds_match_table_14():
    """Seed 000, DB server, TCP/IP column: M=1.00e5, tau=1.32 s, beta=0.806 (the
    sender's CPU share, table 11), 2 GB VM sent in 9.63 s, 2.5 ms per round
    (table 13's intercept).  Paper: 62,680 / 11,424 / 2,136 dirty pages after
    rounds 1-3, 7 transfers in all, 11.07 s, 600,963 pages sent."""
    pages = 2 * 1024 * 256
    xfer = precopy.Transfer(
        ram_pages=pages,
        resident_pages=pages,
        page_size=4096,
        bandwidth_bps=2048 * MIB / 9.63,
        switchover_s=0.0,
        round_overhead_s=2.5e-3,
    )
    pred = precopy.simulate_precopy(DirtyModel(1.0e5, 1.32, beta=0.806), xfer, max_downtime_s=0.0)
    resent = [r.pages for r in pred.rounds[1:4]]
    for ours, paper in zip(resent, (62_680, 11_424, 2_136), strict=True):
        assert ours == pytest.approx(paper, rel=0.05)
    assert pred.converged
    assert len(pred.rounds) + 1 == 7  # rounds plus the final stop-and-copy
    assert pred.total_time_s == pytest.approx(11.07, rel=0.03)
    assert pred.total_bytes / 4096 == pytest.approx(600_963, rel=0.01)


def test_precopy_hits_the_byte_cap_when_dirtying_outruns_the_link():
    xfer = precopy.Transfer(
        ram_pages=10_000,
        resident_pages=10_000,
        page_size=4096,
        bandwidth_bps=1000 * 4096,
        switchover_s=0.0,
    )
    pred = precopy.simulate_precopy(DirtyModel(8000, 0.1), xfer, max_downtime_s=0.1)
    assert not pred.converged
    assert "cap" in pred.stop_reason
    assert pred.total_bytes <= 3 * 10_000 * 4096 + 8000 * 4096


def _inputs(**kw):
    base = dict(
        vm="vm",
        ram_bytes=512 * MIB,
        resident_bytes=200 * MIB,
        dirty=DirtyModel(32768, 32768 * math.log(2) / 5000),
        bandwidth_bps=300 * MIB,
        dest_free_bytes=4096 * MIB,
        dest_store_free_bytes=8192 * MIB,
        file_backed=True,
    )
    base.update(kw)
    return MigrationInputs(**base)


HOT = DirtyModel(32768, 32768 * math.log(2) / 200_000)


def test_idle_and_moderate_choose_precopy():
    assert decide(_inputs(dirty=dirty_model.IDLE)).mode == "precopy"
    d = decide(_inputs())
    assert (d.mode, d.transfer, d.auto_converge) == ("precopy", "precopy", False)
    assert d.prediction.converged


def test_hot_chooses_hybrid_postcopy_with_a_switch_point():
    d = decide(_inputs(dirty=HOT))
    assert (d.mode, d.transfer) == ("postcopy", "postcopy")
    assert d.postcopy_after_round >= 1
    assert d.prediction.downtime_s < decide(_inputs(dirty=HOT), "precopy").prediction.downtime_s
    assert "does not converge" in d.explain()


def test_hot_without_postcopy_uses_auto_converge_and_says_why():
    d = decide(_inputs(dirty=HOT, postcopy_blocker="memory is in a file on ext4"))
    assert (d.mode, d.auto_converge) == ("precopy", True)
    assert "memory is in a file on ext4" in d.explain()


def test_short_destination_chooses_split_with_a_budget():
    d = decide(_inputs(dest_free_bytes=400 * MIB))
    assert d.mode == "split"
    assert 0 < d.memory_budget_bytes < 400 * MIB
    assert "unavailable" in d.alternatives["precopy"]


def test_short_destination_without_file_backing_is_refused_with_reasons():
    with pytest.raises(exceptions.PolicyRefused, match="not file-backed") as refused:
        decide(_inputs(dest_free_bytes=400 * MIB, file_backed=False))
    precopy_reason, split_reason = refused.value.reasons
    assert precopy_reason.startswith("precopy and postcopy are unavailable")
    assert split_reason.startswith("split is unavailable")


def test_forcing_an_unavailable_mode_is_refused():
    with pytest.raises(exceptions.PolicyRefused, match="vm: postcopy is unavailable"):
        decide(_inputs(postcopy_blocker="a passthrough device"), "postcopy")
    with pytest.raises(exceptions.PolicyRefused, match="split is unavailable"):
        decide(_inputs(file_backed=False), "split")


def test_forced_precopy_on_a_hot_vm_stays_precopy():
    d = decide(_inputs(dirty=HOT), "precopy")
    assert (d.mode, d.transfer, d.postcopy_after_round) == ("precopy", "precopy", None)


@pytest.mark.parametrize(
    "kw",
    [
        dict(bandwidth_bps=0),
        dict(max_downtime_ms=0),
        dict(resident_bytes=10**12),
        dict(ram_bytes=0),
    ],
)
def test_bad_inputs_are_rejected(kw):
    with pytest.raises(exceptions.InvalidInput, match="migration inputs"):
        decide(_inputs(**kw))


def test_unknown_mode_is_rejected():
    with pytest.raises(exceptions.InvalidInput, match="mode 'fast'"):
        decide(_inputs(), "fast")


def test_fit_never_exceeds_the_vms_pages():
    # Short samples of a slow writer look linear; unbounded, M would run off.
    samples = [(1, 4800), (2, 9600), (3, 14400)]
    model = dirty_model.fit(samples, max_pages=131072)
    assert model.m_pages <= 131072
    assert model.pages(1) == pytest.approx(4800, rel=0.05)


def test_split_prediction_pays_for_a_slow_store_and_a_small_budget():
    fast = decide(_inputs(dest_free_bytes=500 * MIB, dest_store_write_bps=2000 * MIB))
    slow = decide(_inputs(dest_free_bytes=500 * MIB, dest_store_write_bps=20 * MIB))
    small = decide(_inputs(dest_free_bytes=260 * MIB, dest_store_write_bps=20 * MIB))
    precopy_only = decide(_inputs(), "precopy").prediction
    assert fast.mode == slow.mode == small.mode == "split"
    assert fast.prediction.total_time_s == pytest.approx(precopy_only.total_time_s, rel=0.05)
    # 500 MiB free holds all that moves: nothing waits on the store, slow or fast
    assert slow.prediction.total_time_s == pytest.approx(fast.prediction.total_time_s)
    assert small.prediction.total_time_s > slow.prediction.total_time_s  # more spills
    # the switchover msync is the destination QEMU's, counted by the planner (test_knobs)
    assert slow.prediction.downtime_s == pytest.approx(fast.prediction.downtime_s)
    assert 0 < small.headroom_bytes <= small.memory_budget_bytes // 2


def test_split_explain_names_the_store_and_the_cgroup():
    d = decide(
        _inputs(
            dest_free_bytes=400 * MIB,
            dest_store_write_bps=300 * MIB,
            dest_memory_cgroup="cgroup v2 (unified hierarchy at /sys/fs/cgroup, memory.max)",
        )
    )
    text = d.explain()
    assert "300 MiB/s (measured)" in text and "cgroup v2" in text
    assert f"{d.headroom_bytes // MIB} MiB of it free for the final round" in text
    fits = decide(_inputs(dest_memory_cgroup="cgroup v1 (memory controller at /m)")).explain()
    assert "would cap a split VM with cgroup v1" in fits
    unmeasured = decide(_inputs(dest_free_bytes=400 * MIB)).explain()
    assert "assumed, not measured" in unmeasured


def test_a_final_round_larger_than_the_headroom_waits_on_reclaim():
    from flexmig.policy import split

    xfer = precopy.Transfer(
        ram_pages=131072, resident_pages=131072, page_size=4096,
        bandwidth_bps=100 * MIB, switchover_s=0.05,
    )  # fmt: skip
    small_final = precopy.Prediction("precopy", (), True, "", 6.0, 600 * MIB, 0.06, 0)
    big_final = dataclasses.replace(small_final, downtime_s=1.05)  # 100 MiB final round
    store = split.StoreFacts(budget_bytes=100 * MIB, write_bps=200 * MIB, qemu_own_bytes=0)
    within = split.predict(small_final, xfer, store)
    beyond = split.predict(big_final, xfer, store)
    headroom = split.headroom_bytes(100 * MIB, 100 * MIB, 100 * MIB)
    reclaim_s = (100 * MIB - headroom) * split.PAGE_WRITE_SLOWDOWN / (200 * MIB)
    extra = beyond.downtime_s - big_final.downtime_s - (within.downtime_s - small_final.downtime_s)
    assert extra == pytest.approx(reclaim_s)  # the overflow waits on reclaim


def _split_inputs(free_mib: int, fault_s: float) -> MigrationInputs:
    # 512 MiB guest rewriting 128 MiB at 100 MiB/s, into a host with too little RAM.
    return _inputs(
        resident_bytes=512 * MIB,
        bandwidth_bps=100 * MIB,
        dest_free_bytes=free_mib * MIB,
        dest_store_write_bps=400 * MIB,
        dest_store_fault_s=fault_s,
    )


def test_split_forecast_adds_faults_on_the_rewritten_set_beyond_the_budget():
    from flexmig.policy import split

    roomy = decide(_split_inputs(400, 0.02))  # 240 MiB budget: 156 MiB of room
    assert roomy.mode == "split"
    assert dataclasses.replace(roomy.store_faults, stored_share=0.0) == split.NO_FAULTS
    # no faults, yet 512 MiB resident in 156 MiB of room: the rest is stored
    assert roomy.store_faults.stored_share == pytest.approx(1 - 156 / 512, abs=0.01)
    tight = decide(_split_inputs(300, 0.02))  # 140 MiB budget: 56 MiB of room
    assert tight.memory_budget_bytes == 140 * MIB
    # 128 - 56 = 72 MiB off budget: 19 windows of 4 MiB, all reached by the final round.
    assert tight.store_faults.off_budget_bytes == pytest.approx(72.5 * MIB, rel=0.01)
    assert (tight.store_faults.final_round, tight.store_faults.first_heartbeat) == (19, 0)
    assumed = decide(_split_inputs(300, 0.0))  # 4 MiB at 400 MiB/s: 10 ms a fault
    extra_ms = (tight.prediction.downtime_s - assumed.prediction.downtime_s) * 1000
    assert extra_ms == pytest.approx(19 * 10, abs=0.5)
    assert tight.prediction.total_time_s - assumed.prediction.total_time_s == pytest.approx(0.19)


def test_split_explain_names_the_fault_time():
    tight = decide(_split_inputs(300, 0.02)).explain()
    assert "a fault on the store reads a 4 MiB window in 20 ms (measured)" in tight
    assert "19 faults in the final round (+380 ms of downtime)" in tight
    assumed = decide(_split_inputs(300, 0.0)).explain()
    assert "in 10 ms (assumed: a read at the write rate)" in assumed
    assert "fits the budget: no faults expected" in decide(_split_inputs(400, 0.02)).explain()


def test_the_rewritten_set_is_capped_at_the_vms_pages():
    from flexmig.policy import split

    xfer = precopy.Transfer(131072, 131072, 4096, bandwidth_bps=100 * MIB, switchover_s=0.05)
    pre = precopy.Prediction("precopy", (), True, "", 6.0, 600 * MIB, 0.1, 0)
    store = split.StoreFacts(140 * MIB, 400 * MIB, 64 * MIB, fault_s=0.02)
    whole = split.faults(pre, xfer, store, DirtyModel(131072, 1.0))
    runaway = split.faults(pre, xfer, store, DirtyModel(1e9, 1.0 * 1e9 / 131072))
    assert runaway.off_budget_bytes == whole.off_budget_bytes == (512 - 51) * MIB
    assert runaway == whole


def test_destination_facts_carry_the_store_fault_time():
    from flexmig.migration.planner import DestinationFacts

    facts = {"free_for_vms_bytes": 1, "store_free_bytes": 2, "store_fault_s": 0.025}
    assert DestinationFacts.from_agent(facts).store_fault_s == 0.025
    assert DestinationFacts.from_agent(facts | {"store_fault_s": None}).store_fault_s == 0.0


def test_split_explain_names_a_store_held_in_large_folios():
    large = dataclasses.replace(_split_inputs(300, 0.02), dest_store_folio_bytes=2 * MIB)
    assert "holds its page cache in 2 MiB folios" in decide(large).explain()
    small = dataclasses.replace(large, dest_store_folio_bytes=4096)
    assert "folios" not in decide(small).explain()
    assert "folios" not in decide(_split_inputs(300, 0.02)).explain()  # not measured


def test_destination_facts_carry_the_store_folio_size():
    from flexmig.migration.planner import DestinationFacts

    facts = {"free_for_vms_bytes": 1, "store_free_bytes": 2, "store_folio_bytes": 2 * MIB}
    assert DestinationFacts.from_agent(facts).store_folio_bytes == 2 * MIB
    assert DestinationFacts.from_agent(facts | {"store_folio_bytes": None}).store_folio_bytes == 0
