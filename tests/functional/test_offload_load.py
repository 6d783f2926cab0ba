"""The offload service under load (issue 18, part 3): 10,000 active flows and
1,000 new flows a second, while 20 clients dump the OpenFlow endpoint.

Real OVS, the real flexmig-offload with the XDP provider, real datagrams from
the lab's generators (what runs: tests/bench/offload_load.py, which also
renders docs/benchmarks/offload-load.md).  Held to: every elephant offloaded
within the promotion latency target (200 ms, docs/benchmarks/offload-control.md),
about 10,000 flows active, an operator's ``ovs-ofctl dump-flows`` answered
within its timeout with the flows it must show, no other client's dump
failed, and every flow's counter <= sent, == sent on a loss-free run.
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


def test_promotion_latency_and_counters_hold_under_10k_flows_and_20_dumpers(lab, eps):
    result = offload_load.run(lab, eps, TRIALS)
    print(offload_load.render(result, TRIALS))
    assert len(result.latencies_ms) == TRIALS
    assert max(result.latencies_ms) <= offload_load.TARGET_MS, result.latencies_ms
    # ~10,000 mice active (1,000/s x the 10 s idle timeout) whenever the operator looked.
    assert min(result.active_flows) >= 9000, result.active_flows
    assert not result.operator_failures, result.operator_failures[:3]
    assert max(result.operator_s) < offload_load.OPERATOR_TIMEOUT_S
    assert result.dumper_dumps > 0 and not result.dumper_failures, result.dumper_failures[:3]
    assert result.mice["shown_at_end"] >= 9000, result.mice
    assert not result.mice_bad, result.mice_bad[:5]
    assert not result.elephants_bad, result.elephants_bad
