"""In-flight correction of a precopy whose stream is slower than planned."""

from __future__ import annotations

import dataclasses

from flexmig.policy import inflight

MIB = 2**20
SLOW = inflight.Progress(
    iteration=8,
    processed_bytes=600 * MIB,
    remaining_bytes=4 * MIB,
    ram_bytes=512 * MIB,
    bandwidth_bps=13 * MIB,
)


def _adjust(progress: inflight.Progress, limit_ms: int = 20, postcopy: bool = False):
    return inflight.adjust(
        progress, planned_rounds=4, limit_ms=limit_ms, budget_ms=300, postcopy_enabled=postcopy
    )


def test_a_remainder_that_fits_the_limit_needs_nothing() -> None:
    fast = dataclasses.replace(SLOW, bandwidth_bps=1000 * MIB)  # 4 ms
    assert _adjust(fast).action == "none"


def test_nothing_changes_while_the_plan_has_rounds_left() -> None:
    assert _adjust(dataclasses.replace(SLOW, iteration=6)).action == "none"  # 4 + 2 slack


def test_past_the_plan_the_limit_rises_to_the_budget() -> None:
    change = _adjust(SLOW)
    assert (change.action, change.downtime_ms) == ("raise_downtime", 300)
    assert "13.0 MiB/s" in change.reason


def test_postcopy_is_preferred_where_the_plan_enabled_it() -> None:
    assert _adjust(SLOW, postcopy=True).action == "switch_postcopy"


def test_at_the_byte_cap_with_the_budget_in_force_it_stops_and_copies() -> None:
    capped = dataclasses.replace(SLOW, processed_bytes=3 * 512 * MIB + 1)
    assert _adjust(capped, limit_ms=300).action == "stop_and_copy"


def test_with_the_budget_in_force_and_no_cap_yet_it_keeps_iterating() -> None:
    assert _adjust(SLOW, limit_ms=300).action == "none"


def test_no_observed_bandwidth_is_no_reason_to_act_early() -> None:
    unknown = dataclasses.replace(SLOW, iteration=2, bandwidth_bps=0)
    assert _adjust(unknown).action == "none"


def test_behind_past_converge_timeout_stops_and_copies_without_a_cap() -> None:
    # A stream trickling at about the dirty rate: rounds grow longer, not more
    # numerous, so neither the round nor the byte cap comes for minutes.
    def behind_for(seconds: float, limit_ms: int = 300) -> inflight.Adjustment:
        return inflight.adjust(
            SLOW, 4, limit_ms, 300, False, correcting_s=seconds, converge_timeout_s=30
        )

    assert behind_for(29.0).action == "none"
    change = behind_for(31.0)
    assert change.action == "stop_and_copy"
    assert "31 s after the correction engaged" in change.reason
    # the raised limit never took effect (libvirt did not answer): stop anyway
    assert behind_for(31.0, limit_ms=20).action == "stop_and_copy"
    assert behind_for(29.0, limit_ms=20).action == "raise_downtime"


def test_postcopy_is_still_preferred_past_converge_timeout() -> None:
    change = inflight.adjust(SLOW, 4, 300, 300, True, correcting_s=99, converge_timeout_s=30)
    assert change.action == "switch_postcopy"


def test_behind_needs_both_the_plans_rounds_past_and_a_remainder_over_the_limit() -> None:
    assert inflight.behind(SLOW, planned_rounds=4, limit_ms=20)
    assert not inflight.behind(SLOW, planned_rounds=6, limit_ms=20)  # 8 <= 6 + 2 slack
    assert not inflight.behind(SLOW, planned_rounds=4, limit_ms=400)  # ~308 ms fits
    capped = dataclasses.replace(SLOW, iteration=31)
    assert inflight.behind(capped, planned_rounds=40, limit_ms=20)
