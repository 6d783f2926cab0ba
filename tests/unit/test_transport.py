"""Which transport carries a migration: one rule for the agent and Nova paths."""

import pytest

from flexmig import exceptions
from flexmig.policy.transport import (
    TRANSPORTS,
    TransportChoice,
    choose_transport,
    preempt_conflict,
)


@pytest.mark.parametrize("tcp_default", ["qemu-tcp", "mover"])
def test_auto_takes_the_mover_with_rdma_at_both_ends_else_the_tcp_default(tcp_default):
    assert choose_transport("auto", True, tcp_default).transport == "mover"
    assert choose_transport("auto", False, tcp_default).transport == tcp_default


def test_a_named_transport_is_taken_as_asked():
    for name in TRANSPORTS[1:]:
        assert choose_transport(name, False, "qemu-tcp").reason == f"{name} was requested"


def test_an_unknown_transport_is_bad_input():
    with pytest.raises(exceptions.InvalidInput, match="'pigeon' not one of auto"):
        choose_transport("pigeon", False, "qemu-tcp")


MOVER = TransportChoice("mover", "both ends have an RDMA provider")


@pytest.mark.parametrize(
    ("transfer", "preempt", "carried_by"),
    [
        ("postcopy", "yes", "qemu-tcp"),  # libvirt >= 10.0 turns preempt on: not the mover
        ("postcopy", "unknown: destination did not report its versions", "qemu-tcp"),
        ("postcopy", "no: destination needs libvirt 10.0.0", "mover"),
        ("precopy", "yes", "mover"),  # no switch, no preempt channel
    ],
)
def test_a_postcopy_plan_leaves_the_mover_where_libvirt_may_turn_preempt_on(
    transfer, preempt, carried_by
):
    chosen = preempt_conflict(MOVER, transfer, preempt) or MOVER
    assert chosen.transport == carried_by


def test_the_reason_says_why_the_mover_was_left_and_what_it_was_chosen_for():
    reason = preempt_conflict(MOVER, "postcopy", "yes").reason
    assert reason.startswith("instead of the mover (both ends have an RDMA provider)")
    assert "turns QEMU's postcopy-preempt on by itself" in reason
    maybe = preempt_conflict(MOVER, "postcopy", "unknown: source did not report its versions")
    assert "may turn QEMU's postcopy-preempt on (source did not report" in maybe.reason
    # QEMU's own TCP takes the extra connection: nothing to change there.
    assert preempt_conflict(TransportChoice("qemu-tcp", "x"), "postcopy", "yes") is None
