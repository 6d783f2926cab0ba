import pytest

from flexmig import exceptions
from flexmig_lab import daemon_config, topology


def test_host_specs_name_and_address_hosts_distinctly():
    specs = topology.host_specs(3)
    assert [s.name for s in specs] == ["A", "B", "C"]
    assert [s.mgmt_ip for s in specs] == ["10.250.0.1", "10.250.0.2", "10.250.0.3"]
    assert len({s.netns for s in specs}) == 3
    assert all(s.netns.startswith(topology.NETNS_PREFIX) for s in specs)
    assert specs[1].libvirt_uri == "qemu+tcp://10.250.0.2/system"


@pytest.mark.parametrize("count", [0, 1, 9, -2])
def test_host_count_out_of_range_is_rejected(count):
    with pytest.raises(exceptions.InvalidInput, match="host count"):
        topology.host_specs(count)


def test_host_by_name_is_case_insensitive_and_names_known_hosts():
    specs = topology.host_specs(2)
    assert topology.host_by_name(specs, "b").name == "B"
    with pytest.raises(exceptions.InvalidInput, match=r"'Z' is not a lab host \(A, B\)"):
        topology.host_by_name(specs, "Z")


def test_tenant_addresses_stay_in_the_tenant_network():
    assert topology.tenant_ip(0) == "10.251.0.10"
    with pytest.raises(exceptions.InvalidInput):
        topology.tenant_ip(200)


def test_etc_hosts_resolves_every_lab_hostname():
    text = topology.etc_hosts(3)
    assert "10.250.0.3 lab-c" in text


def test_libvirtd_listens_only_on_the_management_address():
    spec = topology.host_specs(2)[1]
    conf = daemon_config.libvirtd_conf(spec, "0d7a6c2e-9a43-4c3e-8f39-1b7cf2c6a7f1")
    assert 'listen_addr = "10.250.0.2"' in conf
    assert 'host_uuid = "0d7a6c2e-9a43-4c3e-8f39-1b7cf2c6a7f1"' in conf
    assert "listen_tls = 0" in conf


def test_qemu_conf_points_memory_backing_at_the_host_store():
    spec = topology.host_specs(2)[0]
    conf = daemon_config.qemu_conf(spec, "/lab/hosts/A/store")
    assert 'memory_backing_dir = "/lab/hosts/A/store"' in conf
    assert 'migration_address = "10.250.0.1"' in conf


def test_agent_conf_sets_the_dirty_samples_only_when_asked():
    spec = topology.host_specs(2)[0]
    args = dict(
        key_file="/k",
        store_dir="/s",
        unix_socket="/u",
        memory_budget_mb=4096,
        cgroup_parent="p",
    )
    conf = daemon_config.agent_conf(spec, dirty_sample_seconds="1,5,15", **args)
    migration = conf.split("[migration]")[1]
    assert "dirty_sample_seconds = 1,5,15" in migration
    assert "dirty_sample_seconds" not in daemon_config.agent_conf(spec, **args)
    refresh = daemon_config.agent_conf(spec, dirty_sample_refresh="30", **args)
    assert "dirty_sample_refresh = 30" in refresh.split("[migration]")[0]
    assert "dirty_sample_refresh" not in daemon_config.agent_conf(spec, **args)


def test_lab_name_rejects_names_unfit_for_namespaces(monkeypatch):
    monkeypatch.setenv("FLEXMIG_LAB_NAME", "Bad-Name")
    with pytest.raises(exceptions.InvalidInput, match="FLEXMIG_LAB_NAME"):
        topology.lab_name()


def test_second_lab_gets_its_own_state_and_cgroups(monkeypatch):
    monkeypatch.setenv("FLEXMIG_LAB_NAME", "t2")
    assert topology.cgroup_parent() == "flexmig-t2"
    assert topology.default_state_dir() == "/var/lib/flexmig-lab-t2"
    monkeypatch.delenv("FLEXMIG_LAB_NAME")
    assert topology.cgroup_parent() == "flexmig"
