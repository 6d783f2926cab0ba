"""Which transport carries a migration: one rule for the agent and Nova paths."""

import pytest

from flexmig import exceptions
from flexmig.policy.transport import TRANSPORTS, choose_transport


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
