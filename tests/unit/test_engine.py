"""The engine's pure parts: the request, the options, the planner, the controller."""

from __future__ import annotations

import dataclasses

import pytest
from oslo_config import cfg

from flexmig import exceptions
from flexmig.migration import controller, knobs, options, planner
from flexmig.migration.controller import Controller
from flexmig.migration.facts import declared_backing, filesystem_of
from flexmig.migration.options import EngineOptions
from flexmig.migration.request import MigrationRequest
from flexmig.policy import inflight
from tests.unit.engine_fakes import MIB, make_plan, vm_facts

# -- request ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"mode": "fast"}, "mode 'fast'"),
        ({"max_downtime_ms": 0}, "max downtime 0 ms"),
        ({"bandwidth_mib": -1}, "bandwidth -1"),
        ({"transport": "carrier-pigeon"}, "transport 'carrier-pigeon'"),
        ({"parallel": 9}, "parallel 9"),
        ({"parallel": -1}, "parallel -1"),
        ({"vm": "../etc"}, "not a plain name"),
    ],
)
def test_a_bad_request_is_invalid_input_naming_the_problem(fields, problem):
    with pytest.raises(exceptions.InvalidInput, match=problem):
        MigrationRequest(**({"vm": "vm"} | fields))


def test_a_request_travels_as_json_and_back():
    asked = MigrationRequest(vm="vm", mode="precopy", parallel=4, transport="mover")
    body = asked.to_body()
    assert body == {"vm": "vm", "mode": "precopy", "parallel": 4, "transport": "mover"}
    assert MigrationRequest.from_body(body) == asked
    with pytest.raises(exceptions.InvalidInput, match="'parallel' has the wrong type"):
        MigrationRequest.from_body({"vm": "vm", "parallel": True})


def test_the_downtime_default_is_applied_once_where_it_is_configured():
    assert MigrationRequest(vm="vm").downtime_budget_ms(300) == 300
    assert MigrationRequest(vm="vm", max_downtime_ms=50).downtime_budget_ms(300) == 50


# -- options ------------------------------------------------------------------


def _conf(tmp_path, text: str) -> cfg.ConfigOpts:
    path = tmp_path / "x.conf"
    path.write_text(text)
    conf = cfg.ConfigOpts()
    options.register_opts(conf)
    conf(["--config-file", str(path)], project="flexmig-test", default_config_files=[])
    return conf


def test_old_agent_and_nova_option_names_still_work(tmp_path):
    conf = _conf(tmp_path, "[agent]\nstall_timeout = 8\ninitial_stream_bandwidth_mib = 99\n")
    opts = options.read(conf)
    assert (opts.stall_timeout_s, opts.stream_bandwidth_mib) == (8.0, 99)
    conf = _conf(tmp_path, "[flexmig]\nstall_timeout = 42\nallowed_modes = precopy\n")
    opts = options.read(conf)
    assert (opts.stall_timeout_s, opts.allowed_modes) == (42.0, ("precopy",))


def test_defaults_are_one_set(tmp_path):
    assert options.read(_conf(tmp_path, "")) == EngineOptions()


@pytest.mark.parametrize(
    ("text", "option"),
    [
        ("dirty_sample_seconds = 2,2", "dirty_sample_seconds"),
        ("allowed_modes =", "allowed_modes"),
        ("stall_timeout = 0", "stall_timeout"),
        ("converge_timeout = 0.5", "converge_timeout"),
        ("converge_timeout = nan", "converge_timeout"),
        ("transport = fast", "transport"),
        ("postcopy_without_recovery = maybe", "postcopy_without_recovery"),
    ],
)
def test_a_bad_option_names_itself(tmp_path, text, option):
    with pytest.raises(options.InvalidConfig, match=rf"\[migration\] {option}"):
        options.read(_conf(tmp_path, "[migration]\n" + text + "\n"))


# -- facts (the pure parts) ---------------------------------------------------


def test_backing_kinds_from_the_domain_definition():
    def xml(backing: str) -> str:
        return f"<domain><memoryBacking>{backing}</memoryBacking><devices/></domain>"

    assert declared_backing(xml("<source type='file'/>"))[0] == "file"
    assert declared_backing(xml("<source type='memfd'/>"))[0] == "shmem"
    assert declared_backing(xml("<hugepages/>"))[0] == "hugepages"
    assert declared_backing("<domain><devices/></domain>") == ("anonymous", False)


def test_filesystem_of_takes_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\ntmpfs /run tmpfs rw 0 0\n")
    assert filesystem_of("/run/flexmig/x", str(mounts)) == "tmpfs"
    assert filesystem_of("/runner", str(mounts)) == "ext4"
    assert filesystem_of("/x", str(tmp_path / "missing")) is None


# -- planner ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backing", "fs", "blocked"),
    [
        ("anonymous", None, False),
        ("shmem", None, False),
        ("hugepages", None, False),
        ("file", "tmpfs", False),
        ("file", "hugetlbfs", False),
        ("file", "ext4", True),
        ("file", None, True),  # a file on a filesystem nobody could name: not servable
    ],
)
def test_one_rule_for_postcopy(backing, fs, blocked):
    memory = dataclasses.replace(vm_facts().memory, backing=backing, backing_fs=fs)
    assert (planner.postcopy_blocker(memory) is not None) == blocked


def test_a_hot_file_backed_vm_on_tmpfs_gets_postcopy_on_ext4_precopy():
    def mode(fs: str) -> tuple[str, str]:
        vm = vm_facts(hot=True, backing_fs=fs)
        plan = planner.plan(
            MigrationRequest(vm="vm"),
            vm,
            planner.DestinationFacts(4096 * MIB, 8192 * MIB),
            planner.LinkFacts(fabric_bps=300 * MIB),
            EngineOptions(),
        )
        return plan.mode, plan.decision.alternatives.get("postcopy", "")

    assert mode("tmpfs")[0] == "postcopy"
    chosen, postcopy = mode("ext4")
    assert chosen == "precopy" and "a file on ext4" in postcopy


def test_allowed_modes_and_a_paused_vm_block_postcopy():
    vm = vm_facts(hot=True, file_backed=False)
    dest = planner.DestinationFacts(4096 * MIB, 8192 * MIB)
    no_postcopy = EngineOptions(allowed_modes=("precopy", "split"))
    assert "allowed_modes" in planner.blockers(vm, dest, no_postcopy)[0]
    paused = dataclasses.replace(vm, paused=True)
    assert "paused" in planner.blockers(paused, dest, EngineOptions())[0]


def _hot_plan_between(libvirt: int, qemu: int, opts: EngineOptions) -> planner.Plan:
    software = knobs.HostSoftware(libvirt, qemu)
    return planner.plan(
        MigrationRequest(vm="vm"),
        vm_facts(hot=True, file_backed=False),
        planner.DestinationFacts(4096 * MIB, 8192 * MIB, software=software),
        planner.LinkFacts(fabric_bps=300 * MIB),
        opts,
        source=planner.SourceFacts(software=software),
    )


def test_postcopy_between_hosts_that_cannot_resume_it_is_warned_of_or_refused():
    """libvirt 9.0 with QEMU 10 cannot resume a broken postcopy (the fault
    campaign's lost VMs): the plan says so, and with refuse goes by precopy."""
    warned = _hot_plan_between(9_000_000, 10_000_002, EngineOptions())
    assert warned.decision.transfer == "postcopy"
    assert warned.features["postcopy-recovery"].startswith("no: source needs libvirt 11.0.0")
    assert "note: a postcopy whose connection breaks cannot be resumed" in warned.explain()
    refuse = EngineOptions(postcopy_without_recovery="refuse")
    refused = _hot_plan_between(9_000_000, 10_000_002, refuse)
    assert refused.decision.transfer == "precopy"
    assert "postcopy_without_recovery is refuse" in refused.decision.alternatives["postcopy"]
    current = _hot_plan_between(11_003_000, 10_000_002, refuse)
    assert current.decision.transfer == "postcopy"
    assert "cannot be resumed" not in current.explain()
    # Hosts that did not report their versions: nothing refused on a guess.
    assert _hot_plan_between(0, 0, refuse).decision.transfer == "postcopy"


def test_a_mode_the_operator_excludes_is_a_refusal_with_reasons():
    with pytest.raises(exceptions.PolicyRefused) as refused:
        planner.plan(
            MigrationRequest(vm="vm"),
            vm_facts(),
            planner.DestinationFacts(400 * MIB, 8192 * MIB),
            planner.LinkFacts(fabric_bps=300 * MIB),
            EngineOptions(allowed_modes=("precopy", "postcopy")),
        )
    assert any("split is not in [migration] allowed_modes" in r for r in refused.value.reasons)


def test_split_needs_a_reservation_where_the_caller_reserves_first():
    with pytest.raises(exceptions.PolicyRefused, match="reserved no split budget"):
        planner.plan(
            MigrationRequest(vm="vm"),
            vm_facts(),
            planner.DestinationFacts(400 * MIB, 8192 * MIB, split_reserved=False),
            planner.LinkFacts(fabric_bps=300 * MIB),
            EngineOptions(),
        )
    assert make_plan(free_mib=400).mode == "split"


def test_parallel_connections_are_dropped_for_a_postcopy_plan_and_said_so():
    hot = make_plan(hot=True, file_backed=False, parallel=4)
    assert (hot.mode, hot.parallel) == ("postcopy", 1)
    assert "parallel: 4 asked for, but this plan switches to postcopy" in hot.explain()
    assert make_plan(parallel=4).parallel == 4


def test_the_stream_is_planned_at_the_learned_rate_else_the_probe_capped_by_the_request():
    req, opts = MigrationRequest(vm="vm", bandwidth_mib=64), EngineOptions()
    assert planner.stream_bandwidth(req, planner.LinkFacts(stream_bps=500 * MIB), opts) == 64 * MIB
    free = MigrationRequest(vm="vm")
    assert planner.stream_bandwidth(free, planner.LinkFacts(), opts) == 256 * MIB
    learned = planner.LinkFacts(fabric_bps=10 * MIB, stream_bps=500 * MIB)
    assert planner.stream_bandwidth(free, learned, opts) == 500 * MIB


def test_flags_are_the_plans_and_nova_keeps_its_own():
    import libvirt

    hot = make_plan(hot=True, file_backed=False)
    assert hot.mode_flags(libvirt) == libvirt.VIR_MIGRATE_POSTCOPY
    nova = libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_AUTO_CONVERGE
    merged = hot.merged_flags(nova, libvirt)
    assert merged == libvirt.VIR_MIGRATE_LIVE | libvirt.VIR_MIGRATE_POSTCOPY
    parallel = make_plan(parallel=2)
    assert parallel.mode_flags(libvirt) == libvirt.VIR_MIGRATE_PARALLEL


# -- controller ---------------------------------------------------------------


def _stats(iteration, processed_mib, remaining_mib=1, bps_mib=300):
    return {
        "memory_iteration": iteration,
        "memory_processed": processed_mib * MIB,
        "memory_remaining": remaining_mib * MIB,
        "memory_bps": bps_mib * MIB,
    }


def test_the_controller_switches_once_at_the_plans_round():
    plan = make_plan(hot=True, file_backed=False)
    control = Controller(plan, stall_timeout_s=15, recovers_postcopy=False)
    after = plan.decision.postcopy_after_round
    assert control.on_stats(_stats(after, 100), 0) == []
    (switch,) = control.on_stats(_stats(after + 1, 200), 1)
    assert switch.kind == controller.SWITCH
    assert control.on_stats(_stats(after + 1, 210), 2) == [switch]  # not done: asked again
    control.done(switch)
    assert control.on_stats(_stats(after + 2, 300), 3) == []


def test_no_switch_into_a_stream_that_stopped_moving_and_the_hold_is_said_once():
    """Campaign postcopy/qemu-tcp/cut-30s/switchover: the link was cut 2.9 s
    before the plan's switch; the switch sent the device state into the dead
    link, the destination's libvirt killed its QEMU at the keepalive timeout,
    and the VM stayed paused on the source."""
    plan = make_plan(hot=True, file_backed=False)
    control = Controller(plan, stall_timeout_s=15, recovers_postcopy=True)
    after = plan.decision.postcopy_after_round
    control.on_stats(_stats(after, 100), 0)
    # The round the switch waits for ends as the link goes: the counter stops.
    assert control.on_stats(_stats(after + 1, 180), 0.2)[0].kind == controller.SWITCH
    (hold,) = control.on_stats(_stats(after + 1, 180), 1.5)
    assert hold.kind == controller.HOLD_SWITCH and "not moved for 1.3 s" in hold.reason
    assert control.on_stats(_stats(after + 1, 180), 3.0) == []  # said once per standstill
    # Bytes move again: the switch goes ahead.
    assert [a.kind for a in control.on_stats(_stats(after + 1, 190), 3.2)] == [controller.SWITCH]
    # Never moving again: the watchdog ends the precopy, the VM whole on the source.
    kinds = [a.kind for a in control.on_stats(_stats(after + 1, 190), 18.5)]
    assert kinds == [controller.HOLD_SWITCH, controller.INTERRUPT]


def test_a_slow_poll_that_sees_bytes_moved_does_not_hold_the_switch():
    plan = make_plan(hot=True, file_backed=False)
    control = Controller(plan, stall_timeout_s=15, recovers_postcopy=True)
    after = plan.decision.postcopy_after_round
    control.on_stats(_stats(after, 100), 0)
    (switch,) = control.on_stats(_stats(after + 1, 200), 5.0)  # 5 s between polls, bytes moved
    assert switch.kind == controller.SWITCH


def test_a_stall_in_postcopy_is_left_to_libvirt_where_the_executor_cannot_recover():
    plan = make_plan(hot=True, file_backed=False)
    for recovers, expected in ((False, []), (True, [controller.INTERRUPT])):
        control = Controller(plan, stall_timeout_s=15, recovers_postcopy=recovers)
        control.on_stats(_stats(1, 100), 0)
        control.done(controller.Action(controller.SWITCH, "test"))
        assert [a.kind for a in control.on_stats(_stats(1, 100), 20)] == expected


def test_progress_re_arms_the_stall_watchdog():
    control = Controller(make_plan(), stall_timeout_s=15, recovers_postcopy=True)
    control.on_stats(_stats(1, 100), 0)
    assert control.on_stats(_stats(1, 150), 14) == []
    assert control.on_stats(_stats(1, 150), 28) == []  # 14 s since the last move
    assert [a.kind for a in control.on_stats(_stats(1, 150), 30)] == [controller.INTERRUPT]


def test_a_precopy_that_never_fits_the_budget_is_stopped_after_converge_timeout():
    plan = make_plan()
    control = Controller(plan, stall_timeout_s=15, recovers_postcopy=False, converge_timeout_s=30)
    rounds = len(plan.decision.prediction.rounds)
    late = rounds + inflight.ROUNDS_OF_SLACK + 1

    def poll(iteration, processed_mib, t):
        # 40 MiB left at 4 MiB/s: ~10 s of downtime, over any budget
        return control.on_stats(_stats(iteration, processed_mib, remaining_mib=40, bps_mib=4), t)

    assert poll(late - 1, 400, 0) == []  # the plan's rounds (and slack) not past yet
    (first,) = poll(late, 500, 5)  # the correction engages here
    assert first.kind == controller.SET_DOWNTIME
    control.done(first)
    assert poll(late, 520, 10) == []
    assert poll(late + 1, 600, 35) == []
    (stop,) = poll(late + 1, 610, 36)
    assert stop.kind == controller.PAUSE_GUEST
    assert "31 s after the correction engaged" in stop.reason
    control.done(stop)
    assert poll(late + 1, 620, 42) == []


def test_converge_timeout_runs_even_when_the_raised_limit_never_took_effect():
    # The CI's libvirt never returned from raising the limit: the executor never
    # reports it done, the controller asks again, and then stops and copies.
    plan = make_plan()
    control = Controller(plan, stall_timeout_s=15, recovers_postcopy=False, converge_timeout_s=30)
    late = len(plan.decision.prediction.rounds) + inflight.ROUNDS_OF_SLACK + 1
    stats = _stats(late, 500, remaining_mib=40, bps_mib=4)
    assert [a.kind for a in control.on_stats(stats, 0)] == [controller.SET_DOWNTIME]
    assert [a.kind for a in control.on_stats(stats | {"memory_processed": 510 * MIB}, 30)] == [
        controller.SET_DOWNTIME
    ]
    assert [a.kind for a in control.on_stats(stats | {"memory_processed": 520 * MIB}, 31)] == [
        controller.PAUSE_GUEST
    ]
