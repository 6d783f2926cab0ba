"""The poll-cost benchmark builds the reply OVS would send: two rules per flow."""

from tests.bench import offload_poll_cost


def test_a_poll_of_n_flows_parses_2n_rules():
    measured = offload_poll_cost.measure(50)
    assert (measured["flows"], measured["entries"]) == (50, 100)
    assert measured["osken_parse_s"] > 0  # rounded to ms: the poll of 50 may show 0
