"""Endpoint naming and addressing (pure)."""

import pytest

from flexmig import exceptions
from flexmig_lab import endpoints, topology


def test_endpoint_addresses_never_collide_with_vms_or_the_probe():
    vm_ips = {topology.tenant_ip(i) for i in range(200)}
    ep_ips = {endpoints.endpoint_ip(i) for i in range(endpoints.MAX_ENDPOINTS)}
    assert len(ep_ips) == endpoints.MAX_ENDPOINTS
    assert not ep_ips & vm_ips
    assert str(topology.TENANT_PROBE_IP) not in ep_ips
    assert all(ip in {str(a) for a in topology.TENANT_NET.hosts()} for ip in ep_ips)


def test_names_fit_interfaces_and_lab_down_finds_the_namespace():
    longest = "a" * 12
    assert len(endpoints.endpoint_port(longest)) <= 15  # IFNAMSIZ - 1
    assert endpoints.endpoint_netns(longest).startswith(topology.NETNS_PREFIX)
    # Never a host's namespace name (those are <prefix><letter>).
    assert endpoints.endpoint_netns("a") not in {s.netns for s in topology.host_specs(8)}


@pytest.mark.parametrize("name", ["", "1ab", "a" * 13, "a-b", "A"])
def test_bad_names_are_rejected(name):
    with pytest.raises(exceptions.InvalidInput, match="endpoint name"):
        endpoints.check_name(name)


@pytest.mark.parametrize("ip", ["10.251.0.209", "10.251.0.254", "10.250.0.220", "nonsense"])
def test_addresses_outside_the_endpoint_range_are_rejected(ip):
    with pytest.raises(exceptions.InvalidInput, match="endpoint address"):
        endpoints.check_ip(ip)


def test_next_free_address_skips_used_ones_and_says_when_none_is_left():
    used = {endpoints.endpoint_ip(0), endpoints.endpoint_ip(1)}
    assert endpoints.next_free_ip(used) == endpoints.endpoint_ip(2)
    everything = {endpoints.endpoint_ip(i) for i in range(endpoints.MAX_ENDPOINTS)}
    with pytest.raises(exceptions.InvalidInput, match="in use"):
        endpoints.next_free_ip(everything)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["endpoint", "add", "--host", "A", "Bad"], "Invalid endpoint name"),
        (["endpoint", "add", "--host", "A", "ok", "--ip", "10.251.0.5"], "endpoint address"),
    ],
)
def test_cli_rejects_bad_input_before_touching_the_lab(
    argv, message, capsys, tmp_path, monkeypatch
):
    from flexmig_lab import cli

    monkeypatch.setenv("FLEXMIG_LAB_DIR", str(tmp_path / "no-lab"))
    assert cli.main(argv) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "no-lab").exists()
