"""The offload service under load (issue 18, part 3): 10,000 active flows and
1,000 new flows a second, while 20 clients dump the OpenFlow endpoint.

Real OVS, the real flexmig-offload with the XDP provider, real datagrams from
the lab's generators (what runs: tests/bench/offload_load.py, which also
renders docs/benchmarks/offload-load.md).  Held to: about 10,000 flows
active, an operator's ``ovs-ofctl dump-flows`` answered within its timeout with
the flows it must show, no other client's dump failed, every flow's counter
<= sent and == sent on a loss-free run, and every elephant offloaded within
the promotion latency target (200 ms, docs/benchmarks/offload-control.md).
Not met on the 2-core development machine (measured in docs/benchmarks/offload-load.md,
last for issue 18 part 3): the active flows and exact counters, and the promotion latency,
are strict xfails naming why, so they fail the run the day they are met and their marks
must go; the operator's dump showing every flow it must is met on a quiet machine and not
under the benchmark's load, so its xfail is not strict.  Every dump answered within its
timeout, with no other client's dump failing, is met and asserted plainly.
"""

from __future__ import annotations

import pytest

from flexmig import processutil
from flexmig_lab import endpoints, offload, traffic
from ovs_ext.providers.xdp import provider as xdp_provider
from tests.bench import offload_load

pytestmark = pytest.mark.lab
TRIALS = 6


@pytest.fixture(scope="module")
def eps(lab):
    for built in (xdp_provider.ESWITCH_OBJECT, xdp_provider.RX_PASS_OBJECT, traffic.UDPGEN):
        if not built.is_file():
            pytest.skip(f"{built} is not built (tools/setup.sh)")
    if not offload.provider_installed("xdp"):
        pytest.skip("the xdp offload provider is not installed (tools/setup.sh)")
    made = {name: endpoints.add(lab, "A", name) for name in ("s1", "s2", "r1")}
    for sender in ("s1", "s2"):  # ARP through OVS: the app learns where each MAC is
        ping = processutil.run(
            [*endpoints.exec_prefix(made[sender]), "ping", "-c", "1", "-W", "2", made["r1"].ip],
            check=False,
        )
        assert ping.returncode == 0, ping.stdout
    yield made
    for name in made:
        endpoints.delete(lab, name)


@pytest.fixture(scope="module")
def loaded(lab, eps):
    """One run of the load (about a minute): the tests below read its result."""
    result = offload_load.run(lab, eps, TRIALS)
    print(offload_load.render(result, TRIALS))
    return result


@pytest.mark.xfail(
    strict=True,
    reason="not met (docs/benchmarks/offload-load.md, issue 18 part 3): the app tracks what "
    "arrives (median 5-8k mice in the operator's dumps, was 0-19), but 22-31 % of the mice "
    "are lost: ovs-vswitchd's userspace datapath thread waits on the run queue half the "
    "time on 2 cores, so the run is never loss-free and every mouse expires before the end",
)
def test_10k_flows_are_active_and_every_counter_exact_under_load(loaded):
    # ~10,000 mice active (1,000/s x the 10 s idle timeout) whenever the operator looked.
    assert loaded.active_flows and min(loaded.active_flows) >= 9000, loaded.active_flows
    assert loaded.mice["shown_at_end"] >= 9000, loaded.mice
    assert not loaded.mice_bad, loaded.mice_bad[:5]
    assert not loaded.elephants_bad, loaded.elephants_bad


def test_ovs_ofctl_is_answered_while_20_other_clients_dump_the_table(loaded):
    assert len(loaded.operator_s) == TRIALS, loaded.operator_failures[:3]
    assert max(loaded.operator_s) < offload_load.OPERATOR_TIMEOUT_S
    assert loaded.dumper_dumps > 0 and not loaded.dumper_failures, loaded.dumper_failures[:3]


@pytest.mark.xfail(
    strict=False,
    reason="met in some runs, not in others (docs/benchmarks/offload-load.md, issue 18 part "
    "3): 1-2 of 6 operator dumps lacked the elephant they must show in the benchmark's runs "
    "(its one first datagram lost in the starved datapath or judged late, so the app never "
    "tracked it), while a CI run on a quiet machine (2026-11-28) showed it in all 6; strict, "
    "it failed that run for meeting the target once",
)
def test_every_operator_dump_shows_the_flows_it_must(loaded):
    assert not loaded.operator_failures, loaded.operator_failures[:3]


@pytest.mark.xfail(
    strict=True,
    reason="not met (docs/benchmarks/offload-load.md, issue 18 part 3): 4-5 of 6 elephants "
    "were not offloaded within 10 s (not tracked in time: first packet lost, or polls "
    "stalled behind a starved ovs-vswitchd); those offloaded took 107-1,466 ms",
)
def test_every_elephant_is_offloaded_within_the_target_under_load(loaded):
    assert loaded.never_offloaded == 0 and len(loaded.latencies_ms) == TRIALS
    assert max(loaded.latencies_ms) <= offload_load.TARGET_MS, loaded.latencies_ms
