"""Every QEMU/libvirt knob chosen per VM, the feature matrix, and the downtime forecast."""

from __future__ import annotations

import dataclasses

import libvirt
import pytest

from flexmig.migration import downtime, knobs, planner
from flexmig.migration.knobs import HostSoftware
from flexmig.migration.libvirt_job import JobConfig, MigrationJob
from flexmig.migration.options import EngineOptions
from flexmig.migration.request import MigrationRequest
from tests.unit.engine_fakes import MIB, vm_facts

BOOKWORM = HostSoftware(9_000_000, 10_000_002)  # the lab's system libvirt, QEMU 10 backport
BACKPORTS = HostSoftware(11_003_000, 10_000_002)  # FLEXMIG_LAB_LIBVIRT=backports


def plan_for(
    source=BACKPORTS,
    dest=BACKPORTS,
    hot=True,
    file_backed=False,
    fabric_mib=300,
    idle_cpus=1.5,
    **request,
) -> planner.Plan:
    return planner.plan(
        MigrationRequest(vm="vm", **request),
        vm_facts(hot=hot, file_backed=file_backed),
        planner.DestinationFacts(4096 * MIB, 8192 * MIB, software=dest),
        planner.LinkFacts(fabric_bps=fabric_mib * MIB),
        EngineOptions(),
        source=planner.SourceFacts(source, idle_cpus),
    )


def test_the_feature_matrix_names_the_host_and_the_version_it_lacks():
    matrix = knobs.feature_matrix(BACKPORTS, BOOKWORM)
    # libvirt 10.0 turns preempt on by itself; Debian 12's 9.0 does not.
    assert matrix["postcopy-preempt"] == "no: destination needs libvirt 10.0.0"
    assert knobs.feature_matrix(BACKPORTS, BACKPORTS)["postcopy-preempt"] == "yes"
    noble = HostSoftware(10_000_000, 8_002_002)  # Ubuntu 24.04's libvirt and QEMU
    assert knobs.feature_matrix(noble, noble)["postcopy-preempt"] == "yes"
    old_qemu = HostSoftware(10_000_000, 7_002_000)
    assert knobs.feature_matrix(noble, old_qemu)["postcopy-preempt"] == (
        "no: destination needs QEMU 8.0.0"
    )
    assert matrix["switchover-bandwidth"] == "no: destination needs libvirt 11.1.0"
    assert matrix["multifd-zstd"] == "no: destination needs libvirt 9.4.0"
    assert matrix["parallel"] == matrix["zerocopy"] == "yes"
    assert matrix["parallel-postcopy"].startswith("no: source needs libvirt 11.6.0 and QEMU")
    assert matrix["dirty-limit"] == "no: libvirt has no migration knob for it"
    assert knobs.feature_matrix(BACKPORTS, BACKPORTS)["switchover-bandwidth"] == "yes"


def test_preempt_is_on_for_postcopy_where_libvirt_turns_it_on_and_never_a_flag():
    # libvirt >= 10.0 enables QEMU's postcopy-preempt by itself for every postcopy
    # both ends support; the proposed flag (1<<21) is in no release and 11.3
    # refuses it: the plan forecasts preempt, it never asks for it.
    plan = plan_for()
    assert plan.mode == "postcopy" and plan.knobs.postcopy_preempt
    assert not plan.mode_flags(libvirt) & knobs.VIR_MIGRATE_POSTCOPY_PREEMPT
    assert "postcopy-preempt: on, libvirt turns it on by itself" in plan.explain()
    assert "    postcopy-preempt: yes" in plan.explain()
    # A host without it: off, and explain names the host and what it lacks.
    old = plan_for(dest=BOOKWORM)
    assert old.mode == "postcopy" and not old.knobs.postcopy_preempt
    assert "postcopy-preempt: off (destination needs libvirt 10.0.0)" in old.explain()
    unknown = plan_for(dest=HostSoftware())
    assert not unknown.knobs.postcopy_preempt
    assert "postcopy-preempt: unknown (destination did not report" in unknown.explain()
    assert not plan_for(hot=False).knobs.postcopy_preempt  # precopy
    assert knobs.Knobs(postcopy_preempt=True).flags() == 0
    # A caller's flags (Nova's) never carry the refused bit through the plan.
    assert not plan.merged_flags(knobs.VIR_MIGRATE_POSTCOPY_PREEMPT | 1, libvirt) & (1 << 21)


def test_a_postcopy_plan_leaves_the_mover_where_libvirt_turns_preempt_on():
    # The mover serves one connection per socket; preempt's second one, opened
    # at the switch, failed there ("Failed to establish preempt channel").
    plan = plan_for(transport="mover")
    assert plan.mode == "postcopy" and plan.transport.transport == "qemu-tcp"
    assert plan.knobs.postcopy_preempt
    assert "instead of the mover (mover was requested)" in plan.explain()
    # Without preempt (libvirt 9.0 on one end) the mover carries postcopy as before.
    old = plan_for(dest=BOOKWORM, transport="mover")
    assert old.transport.transport == "mover" and not old.knobs.postcopy_preempt
    # A host that did not report its versions may still turn it on: not the mover.
    assert plan_for(dest=HostSoftware(), transport="mover").transport.transport == "qemu-tcp"
    # Precopy opens no preempt channel: the mover stays.
    assert plan_for(hot=False, transport="mover").transport.transport == "mover"


def test_parallel_connections_fill_a_fast_path_where_cpus_are_idle():
    assert plan_for(hot=False).parallel == 1  # 300 MiB/s: one channel fills it
    fast = plan_for(hot=False, fabric_mib=3000, idle_cpus=6)
    assert fast.parallel == 3 and fast.params()[knobs.PARAM_PARALLEL_CONNECTIONS] == 3
    assert plan_for(hot=False, fabric_mib=3000, idle_cpus=1.2).parallel == 1
    # The plan's choice needs both hosts known; a caller's explicit ask is tried.
    unknown = plan_for(hot=False, fabric_mib=3000, idle_cpus=6, dest=HostSoftware())
    assert unknown.parallel == 1 and "did not report" in unknown.explain()
    assert plan_for(hot=False, dest=HostSoftware(), parallel=4).parallel == 4


def test_a_file_backed_vm_precopies_over_two_channels_where_qemu_skips_zero_pages():
    # One stream faults every zero page into the destination's memory file.
    plan = plan_for(hot=False, file_backed=True)
    assert plan.mode == "precopy" and plan.parallel == 2
    assert plan.params()[knobs.PARAM_PARALLEL_CONNECTIONS] == 2
    assert "2 channels for a file-backed VM" in plan.explain()
    # Even on a busy source: the destination's page writes are what they spread.
    assert plan_for(hot=False, file_backed=True, idle_cpus=0.2).parallel == 2
    # A faster path still gets its own count of channels.
    assert plan_for(hot=False, file_backed=True, fabric_mib=3000, idle_cpus=6).parallel == 3
    # QEMU before 9.0 writes every zero page a channel carries: one stream.
    old = plan_for(hot=False, file_backed=True, dest=HostSoftware(11_003_000, 8_002_002))
    assert old.parallel == 1 and "multifd-zero-page (destination needs QEMU 9.0.0)" in old.explain()
    # Anonymous memory and an explicit single stream keep one stream.
    assert plan_for(hot=False).parallel == 1
    assert plan_for(hot=False, file_backed=True, parallel=1).parallel == 1
    # So does postcopy (on tmpfs): with postcopy on, QEMU writes every zero page.
    features = knobs.feature_matrix(BACKPORTS, BACKPORTS)
    postcopy = knobs.KnobInputs(
        "postcopy", 0, 100 * MIB, 100 * MIB, False, "qemu-tcp", 4.0, features, True
    )
    assert knobs.choose_parallel(postcopy)[0] == 1
    # A split VM gets two channels where the source can map what its guest
    # writes for the destination, and keeps one stream where it cannot.
    split = dataclasses.replace(postcopy, transfer="precopy", split=True)
    assert knobs.choose_parallel(split)[0] == 2
    blind = dataclasses.replace(split, hot_hint=False)
    assert knobs.choose_parallel(blind) == (
        1,
        "parallel: a single stream for a split VM whose memory file has no writeback (no "
        "map of what its guest writes for the destination): over two channels its "
        "switchover took up to 329 ms longer under the budget",
    )


@pytest.mark.parametrize(("backing_fs", "channels"), [("ext4", 2), ("xfs", 2), ("tmpfs", 1)])
def test_a_split_plan_takes_two_channels_where_its_memory_file_has_writeback(backing_fs, channels):
    def to(free_mib):
        return planner.plan(
            MigrationRequest(vm="vm", bandwidth_mib=100),
            vm_facts(hot=False, file_backed=True, backing_fs=backing_fs),
            planner.DestinationFacts(free_mib * MIB, 8192 * MIB, software=BACKPORTS),
            planner.LinkFacts(fabric_bps=300 * MIB),
            EngineOptions(),
            source=planner.SourceFacts(BACKPORTS, 1.5),
        )

    split, room = to(300), to(4096)
    assert split.mode == "split" and split.parallel == channels
    assert ("a single stream for a split VM" in split.explain()) == (channels == 1)
    assert room.mode == "precopy" and room.parallel == 2


def test_parallel_postcopy_needs_qemu_10_1_on_both_ends():
    hot = plan_for(fabric_mib=3000, idle_cpus=6)
    assert hot.mode == "postcopy" and hot.parallel == 1
    assert "parallel-postcopy" in hot.explain()
    future = HostSoftware(11_006_000, 10_001_000)
    both = plan_for(source=future, dest=future, fabric_mib=3000, idle_cpus=6)
    assert both.parallel == 3


def test_compression_where_the_link_is_the_bottleneck_and_cpus_are_idle():
    slow = plan_for(hot=False, bandwidth_mib=100, parallel=4, idle_cpus=6)
    assert slow.knobs.compression == "zstd"
    assert slow.params()[knobs.PARAM_COMPRESSION] == "zstd"
    assert slow.mode_flags(libvirt) & knobs.VIR_MIGRATE_COMPRESSED
    busy = plan_for(hot=False, bandwidth_mib=100, parallel=4, idle_cpus=1.0)
    assert busy.knobs.compression is None and "CPUs are idle" in busy.explain()
    # A fast link carries raw pages faster than four cores compress them.
    fast = plan_for(hot=False, fabric_mib=3000, parallel=4, idle_cpus=6)
    assert fast.knobs.compression is None
    assert plan_for(hot=False, bandwidth_mib=100, idle_cpus=6).knobs.compression is None


def test_zero_copy_only_on_a_fast_uncapped_tcp_path_for_anonymous_memory():
    fast = plan_for(hot=False, fabric_mib=3000, idle_cpus=6)
    assert fast.knobs.zerocopy and fast.mode_flags(libvirt) & knobs.VIR_MIGRATE_ZEROCOPY
    assert not plan_for(hot=False, fabric_mib=3000, idle_cpus=6, file_backed=True).knobs.zerocopy
    assert not plan_for(hot=False, fabric_mib=300, parallel=4, idle_cpus=6).knobs.zerocopy
    assert not plan_for(hot=False, fabric_mib=3000, idle_cpus=6, transport="mover").knobs.zerocopy


def test_the_switchover_hint_is_the_probed_path_where_libvirt_takes_it():
    plan = plan_for(hot=False, fabric_mib=300)
    assert plan.knobs.avail_switchover_mib == 300
    assert plan.params()[knobs.PARAM_AVAIL_SWITCHOVER] == 300
    capped = plan_for(hot=False, fabric_mib=300, bandwidth_mib=100)
    assert capped.knobs.avail_switchover_mib == 100
    old = plan_for(hot=False, source=BOOKWORM)
    assert old.knobs.avail_switchover_mib is None
    assert knobs.PARAM_AVAIL_SWITCHOVER not in old.params()
    assert "source needs libvirt 11.1.0" in old.explain()


def test_the_agents_job_hands_libvirt_every_knob(started_migrations):
    started = started_migrations
    plan = plan_for(bandwidth_mib=100)
    job = MigrationJob(None, "A", plan, JobConfig("qemu+tcp://b/system", "tcp://b"))  # type: ignore[arg-type]
    job._start(job.flags())
    params, flags = started[0]
    assert flags & libvirt.VIR_MIGRATE_POSTCOPY and not flags & knobs.VIR_MIGRATE_POSTCOPY_PREEMPT
    assert params["bandwidth.avail.switchover"] == 100
    assert params[libvirt.VIR_MIGRATE_PARAM_BANDWIDTH] == 100


def test_novas_guest_migrates_with_the_plans_extra_parameters():
    from nova_driver.driver import PlannedGuest

    class Domain:
        def migrateToURI3(self, uri, params, flags):
            self.call = (uri, params, flags)

    class Guest:  # Nova's Guest.migrate, reduced to what it passes on
        def __init__(self, domain):
            self._domain = domain

        def migrate(self, destination, flags=0, parallel=0, **kwargs):
            params = {"bandwidth": 0, "migrate_uri": kwargs.get("migrate_uri")}
            self._domain.migrateToURI3(destination, params=params, flags=flags)

    domain = Domain()
    plan = plan_for(hot=False, bandwidth_mib=100, parallel=4, idle_cpus=6)
    PlannedGuest(Guest(domain), plan, None).migrate("qemu+tcp://b/system", flags=1)
    _uri, params, flags = domain.call
    assert params["compression"] == "zstd" and params["bandwidth.avail.switchover"] == 100
    assert flags & knobs.VIR_MIGRATE_COMPRESSED and flags & libvirt.VIR_MIGRATE_PARALLEL


def test_a_budget_no_plan_meets_is_said_before_anything_moves():
    # The case: a hot file-backed VM (no postcopy) with a 300 ms budget.
    plan = plan_for(file_backed=True, max_downtime_ms=300)
    assert plan.mode == "precopy" and plan.decision.auto_converge
    assert plan.over_budget is not None
    assert "over its 300 ms budget" in plan.explain()
    assert plan_for(hot=False).over_budget is None


def test_the_guest_downtime_forecast_counts_post_switch_faults():
    # Without preempt (libvirt 9.0 at one end) faults wait behind the queue.
    hot = plan_for(bandwidth_mib=100, dest=BOOKWORM)
    assert hot.guest_downtime.parts_ms["postcopy faults"] == pytest.approx(240, abs=1)
    slower = plan_for(bandwidth_mib=50, dest=BOOKWORM)
    assert slower.guest_downtime.parts_ms["postcopy faults"] == pytest.approx(480, abs=1)
    preempted = plan_for(bandwidth_mib=100)
    assert preempted.guest_downtime.parts_ms["postcopy faults"] == pytest.approx(200, abs=1)
    pred = hot.decision.prediction
    with_preempt = downtime.predict(pred, "postcopy", 0.05, 100 * MIB, preempt=True)
    # Measured, not derived: hot hybrid runs where libvirt 11.3 had turned preempt
    # on (208 and 320 ms guest gaps at 100 MiB/s, 405 and 375 at 64, less 85 ms of
    # device state and resume): shorter than without, but still the stream's rate.
    assert with_preempt.parts_ms["postcopy faults"] == pytest.approx(200)
    assert with_preempt.total_ms == pytest.approx(285)
    at_64 = downtime.predict(pred, "postcopy", 0.05, 64 * MIB, preempt=True)
    assert at_64.total_ms == pytest.approx(397.5)  # 405 and 375 ms measured
    without = downtime.predict(pred, "postcopy", 0.05, 64 * MIB, preempt=False)
    assert without.total_ms == pytest.approx(460)  # 466, 230 ms measured (libvirt 9.0)
    precopy = plan_for(hot=False)
    assert precopy.guest_downtime.parts_ms["postcopy faults"] == 0
    assert "finish and resume 35" in precopy.explain()


def _enough_ram_forecast(vm, link: planner.LinkFacts) -> downtime.Forecast:
    """The guest-observed forecast of ``vm``'s move to a host with room for it."""
    dest = planner.DestinationFacts(4096 * MIB, 8192 * MIB, software=BACKPORTS)
    plan = planner.plan(MigrationRequest(vm="vm"), vm, dest, link, EngineOptions())
    return plan.guest_downtime


def test_a_learnt_switchover_holds_the_resume_and_a_tcg_guest_pays_its_first_run():
    # libvirt's downtime (what the agent learns the switchover from) ends with the
    # destination's QEMU running: equal to the traced source stop -> destination
    # running within 2 ms (docs/benchmarks/switchover.md), so adding the 35 ms
    # "finish and resume" to it counted that part twice.
    def forecast(accelerator: str, learned: bool) -> downtime.Forecast:
        vm = dataclasses.replace(vm_facts(hot=False, file_backed=False), accelerator=accelerator)
        link = planner.LinkFacts(
            fabric_bps=300 * MIB, switchover_s=0.04, switchover_learned=learned
        )
        return _enough_ram_forecast(vm, link)

    guessed, learnt = forecast("kvm", learned=False), forecast("kvm", learned=True)
    assert guessed.parts_ms["device state"] == 40 and guessed.parts_ms["finish and resume"] == 35
    assert learnt.parts_ms[downtime.LEARNT_SWITCHOVER] == 40
    assert "device state" not in learnt.parts_ms
    assert learnt.total_ms == pytest.approx(guessed.total_ms - 35)
    # A new QEMU process retranslates a TCG guest's code before it runs again
    # (5-185 ms measured; 0-6 ms after a pause and resume in one process).
    tcg = forecast("tcg", learned=True)
    assert tcg.parts_ms["first run"] == pytest.approx(downtime.FIRST_RUN_TCG_S * 1000)
    assert tcg.total_ms == pytest.approx(learnt.total_ms + downtime.FIRST_RUN_TCG_S * 1000)
    assert learnt.parts_ms["first run"] == 0
    assert "first run" not in learnt.describe()


def test_the_measured_breakdown_and_the_excess_are_reported():
    parts = downtime.measured({"downtime": 80}, guest_gap_ms=420.0)
    assert parts["beyond_qemu_ms"] == 340.0
    assert downtime.excess(300, 420.0) == 120.0
    assert downtime.excess(300, 299.0) is None
    assert downtime.measured({}) == {
        "qemu_downtime_ms": None,
        "libvirt_downtime_net_ms": None,
        "guest_ms": None,
        "beyond_qemu_ms": None,
    }


def test_the_request_leaves_the_connections_to_the_plan_by_default():
    assert MigrationRequest(vm="vm").parallel == 0
    assert "parallel" not in MigrationRequest(vm="vm").to_body()
    assert dataclasses.replace(MigrationRequest(vm="vm"), parallel=1).to_body()["parallel"] == 1


def test_novas_path_ends_with_the_budgets_verdict():
    from nova_driver.monitor import completion_summary

    plan = plan_for(hot=False)
    text, exceeded = completion_summary(plan, 420)
    assert exceeded and "EXCEEDED by 120 ms" in text and "budget 300 ms" in text
    text, exceeded = completion_summary(plan, 40)
    assert not exceeded and "EXCEEDED" not in text
    assert not completion_summary(plan, None)[1]


def test_a_learnt_qemu_side_counts_the_copy_once_and_a_learnt_first_run_replaces_the_constant():
    """Where earlier precopy jobs to the destination were measured, QEMU's side is
    their downtime (which held their own final round) plus only the copy this
    plan forecasts beyond theirs; the first run is what the guest probe saw."""

    def forecast(hot: bool, learnt: downtime.LearntSide) -> downtime.Forecast:
        vm = dataclasses.replace(vm_facts(hot=hot, file_backed=False), accelerator="tcg")
        link = planner.LinkFacts(
            fabric_bps=300 * MIB, switchover_s=0.04, switchover_learned=True, learnt=learnt
        )
        return _enough_ram_forecast(vm, link)

    unlearnt = forecast(False, downtime.NOTHING_LEARNT)
    assert downtime.LEARNT_QEMU_SIDE not in unlearnt.parts_ms
    side = downtime.LearntSide(qemu_s=0.027, copy_s=0.0, first_run_s=0.042)
    learnt = forecast(False, side)
    assert learnt.parts_ms[downtime.LEARNT_QEMU_SIDE] == 27
    assert learnt.parts_ms["first run"] == 42
    for apart in ("stop-and-copy", downtime.LEARNT_SWITCHOVER, "device state"):
        assert apart not in learnt.parts_ms
    copy = learnt.copy_ms
    assert copy > 0
    assert learnt.parts_ms[downtime.COPY_BEYOND_LEARNT] == pytest.approx(copy)
    # the learnt jobs' own copy is inside their downtime: not counted again
    same_copy = forecast(False, dataclasses.replace(side, copy_s=copy / 1000))
    assert same_copy.parts_ms[downtime.COPY_BEYOND_LEARNT] == 0
    assert same_copy.total_ms == pytest.approx(27 + 42)
    # a plan whose final round is longer than the learnt jobs' adds what exceeds theirs
    shorter = forecast(False, dataclasses.replace(side, copy_s=copy / 4000))
    assert shorter.parts_ms[downtime.COPY_BEYOND_LEARNT] == pytest.approx(copy * 0.75, abs=0.1)
    # without a guest probe's reports the first run stays the accelerator's
    no_probe = forecast(False, dataclasses.replace(side, first_run_s=None))
    assert no_probe.parts_ms["first run"] == pytest.approx(downtime.FIRST_RUN_TCG_S * 1000)


def test_a_split_plan_counts_splits_own_learnt_first_run():
    vm = dataclasses.replace(vm_facts(hot=False, file_backed=True), accelerator="tcg")
    line = downtime.SplitFirstRun(base_s=0.02, per_share_s=0.1)
    side = downtime.LearntSide(qemu_s=0.03, first_run_s=0.055, split_first_run=line)
    link = planner.LinkFacts(fabric_bps=300 * MIB, switchover_learned=True, learnt=side)
    dest = planner.DestinationFacts(4096 * MIB, 8192 * MIB, software=BACKPORTS)
    enough = planner.plan(MigrationRequest(vm="vm"), vm, dest, link, EngineOptions())
    assert enough.mode == "precopy" and enough.guest_downtime.parts_ms["first run"] == 55
    tight = dataclasses.replace(dest, free_for_vms_bytes=300 * MIB)  # 200 MiB resident
    split = planner.plan(MigrationRequest(vm="vm", mode="split"), vm, tight, link, EngineOptions())
    share = split.decision.store_faults.stored_share
    assert split.mode == "split" and 0 < share < 1
    # the line at the share this plan leaves stored, not the precopy's 55 ms
    assert split.guest_downtime.parts_ms["first run"] == pytest.approx(
        (0.02 + 0.1 * share) * 1000, abs=0.1
    )


@pytest.mark.parametrize(("qemu", "syncs"), [(10_000_002, True), (10_000_013, False)])
def test_a_split_plan_counts_the_switchover_msync_once_and_only_where_qemu_does_it(qemu, syncs):
    """The destination's msync of a split VM's memory file is the "destination
    msync" part where its QEMU syncs file RAM (< 10.0.3), and nowhere else: its
    stop-and-copy is the same VM's precopy one, not 20-30 ms more."""
    vm = dataclasses.replace(vm_facts(hot=False, file_backed=True), accelerator="tcg")
    link = planner.LinkFacts(fabric_bps=300 * MIB)
    roomy = planner.DestinationFacts(
        4096 * MIB, 8192 * MIB, software=HostSoftware(11_003_000, qemu)
    )
    tight = dataclasses.replace(roomy, free_for_vms_bytes=300 * MIB, store_write_bps=200 * MIB)
    enough = planner.plan(MigrationRequest(vm="vm"), vm, roomy, link, EngineOptions())
    split = planner.plan(MigrationRequest(vm="vm", mode="split"), vm, tight, link, EngineOptions())
    assert (enough.mode, split.mode) == ("precopy", "split")
    parts = split.guest_downtime.parts_ms
    assert parts["stop-and-copy"] == pytest.approx(enough.guest_downtime.parts_ms["stop-and-copy"])
    assert (parts["destination msync"] > 0) is syncs, parts
