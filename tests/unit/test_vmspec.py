import xml.etree.ElementTree as ET

import pytest

from flexmig import exceptions
from flexmig_lab import vmspec


@pytest.mark.parametrize(
    ("text", "mib"), [("512M", 512), ("1G", 1024), ("2GiB", 2048), ("300", 300), (" 64MB ", 64)]
)
def test_sizes(text, mib):
    assert vmspec.parse_size_mib(text, "RAM") == mib


@pytest.mark.parametrize("text", ["", "1T", "abc", "-5M", "1.5G"])
def test_bad_sizes_name_the_value(text):
    with pytest.raises(exceptions.InvalidInput, match="RAM"):
        vmspec.parse_size_mib(text, "RAM")


def test_workload_parsing():
    wl = vmspec.parse_workload("dirtier:wss=128M,rate=20000,pattern=seq")
    assert (wl.kind, wl.wss_mib, wl.rate, wl.pattern) == ("dirtier", 128, 20000, "seq")
    assert vmspec.parse_workload(wl.cmdline()) == wl
    assert vmspec.parse_workload("idle").kind == "idle"


def test_a_hot_set_is_part_of_the_working_set():
    wl = vmspec.parse_workload("dirtier:wss=400M,rate=2000,hot=64M")
    assert (wl.wss_mib, wl.hot_mib) == (400, 64)
    assert wl.cmdline().endswith(",hot=64M")
    assert vmspec.parse_workload(wl.cmdline()) == wl
    # A hot set as large as the working set is the plain dirtier.
    whole = vmspec.parse_workload("dirtier:wss=64M,hot=64M")
    assert whole.hot_mib == 0 and "hot=" not in whole.cmdline()


@pytest.mark.parametrize(
    "text",
    [
        "stress:wss=1M",
        "dirtier:wss=1M,speed=5",
        "dirtier:rate=-1",
        "dirtier:rate=1e9",
        "dirtier:pattern=zigzag",
        "dirtier:wss=0M",
        "dirtier:wss",
        "dirtier:wss=64M,hot=65M",
        "dirtier:wss=64M,hot=0M",
        "dirtier:hot=lots",
    ],
)
def test_bad_workloads_are_rejected(text):
    with pytest.raises(exceptions.InvalidInput, match="workload|working set|hot set"):
        vmspec.parse_workload(text)


def test_make_spec_checks_bounds():
    with pytest.raises(exceptions.InvalidInput, match="VM name"):
        vmspec.make_spec("Bad_Name", "256M", 1, "idle", "file", 0)
    with pytest.raises(exceptions.InvalidInput, match="RAM"):
        vmspec.make_spec("vm", "64M", 1, "idle", "file", 0)
    with pytest.raises(exceptions.InvalidInput, match="vCPUs"):
        vmspec.make_spec("vm", "256M", 9, "idle", "file", 0)
    with pytest.raises(exceptions.InvalidInput, match="memory backing"):
        vmspec.make_spec("vm", "256M", 1, "idle", "hugepages", 0)
    with pytest.raises(exceptions.InvalidInput, match="exceeds the VM's 256 MiB"):
        vmspec.make_spec("vm", "256M", 1, "dirtier:wss=200M", "file", 0)


def _domain(backing):
    spec = vmspec.make_spec("vm7", "512M", 2, "dirtier:wss=128M,rate=20000", backing, 7)
    return spec, ET.fromstring(vmspec.domain_xml(spec, "/k/vmlinuz", "/k/initrd"))


def test_domain_xml_is_file_backed_and_shared_for_split_mode():
    spec, root = _domain("file")
    assert root.find("memoryBacking/source").get("type") == "file"
    assert root.find("memoryBacking/access").get("mode") == "shared"
    assert root.find("memory").text == "512"
    assert root.find("vcpu").text == "2"
    cmdline = root.find("os/cmdline").text
    assert "fm.workload=dirtier:wss=128M,rate=20000,pattern=random" in cmdline
    assert f"fm.ip={spec.tenant_ip}/24" in cmdline


def test_domain_xml_anonymous_has_no_memory_backing():
    _, root = _domain("anonymous")
    assert root.find("memoryBacking") is None


def test_domain_xml_wires_control_port_and_ovs_port():
    spec, root = _domain("file")
    serials = root.findall("devices/serial")
    assert serials[1].get("type") == "unix"
    assert serials[1].find("source").get("path") == spec.ctl_socket
    iface = root.find("devices/interface")
    assert iface.find("source").get("bridge") == "br-int"
    assert iface.find("virtualport").get("type") == "openvswitch"
    assert iface.find("mac").get("address") == "52:54:00:fe:00:07"
