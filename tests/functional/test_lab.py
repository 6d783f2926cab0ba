"""Lab lifecycle: up, hosts reach each other, down leaves nothing."""

import re

import pytest

from flexmig_lab import errors
from flexmig_lab import host as lab_host
from flexmig_lab.lab import Lab
from tests.functional.conftest import lab_missing_reason, leftovers

pytestmark = pytest.mark.lab


@pytest.fixture
def fresh_lab():
    reason = lab_missing_reason()
    if reason:
        pytest.skip(reason)
    the_lab = Lab()
    the_lab.down()
    yield the_lab
    the_lab.down()


def test_up_connects_hosts_and_down_leaves_nothing(fresh_lab):
    a, b = fresh_lab.up(2)
    ping = a.ns.run(["ping", "-c", "2", "-W", "2", b.spec.mgmt_ip], check=False)
    assert ping.returncode == 0, ping.stdout + ping.stderr
    # libvirt on A reaches B's libvirtd over the fabric, as migration will.
    peer = a.ns.run(["virsh", "-c", b.spec.libvirt_uri, "hostname"])
    assert peer.stdout.strip() == b.spec.hostname
    assert a.ns.run(["hostname"]).stdout.strip() == a.spec.hostname
    uuids = set()
    for h in (a, b):
        caps = h.ns.run(["virsh", "-c", "qemu:///system", "capabilities"]).stdout
        uuids.add(re.search(r"<uuid>([0-9a-f-]+)</uuid>", caps).group(1))
    assert len(uuids) == 2  # each host has its own host_uuid
    status = fresh_lab.status()
    assert all(all(h["daemons"].values()) for h in status["hosts"])
    fresh_lab.down()
    assert leftovers(fresh_lab) == []


def test_up_is_idempotent_and_refuses_a_different_size(fresh_lab):
    fresh_lab.up(2)
    fresh_lab.up(2)
    assert all(all(h["daemons"].values()) for h in fresh_lab.status()["hosts"])
    with pytest.raises(errors.LabError, match="already up"):
        fresh_lab.up(3)


def test_nothing_listens_outside_the_lab(fresh_lab):
    a, _ = fresh_lab.up(2)
    listening = a.ns.run(["ss", "-Hltn"]).stdout.split("\n")
    addrs = {line.split()[3].rsplit(":", 1)[0] for line in listening if line.strip()}
    assert addrs <= {a.spec.mgmt_ip, "127.0.0.1", "[::1]"}, addrs


def test_down_after_a_failed_up_leaves_nothing(fresh_lab, monkeypatch):
    def broken_libvirt(self):
        raise errors.LabError(reason="injected failure starting libvirtd")

    monkeypatch.setattr(lab_host.LabHost, "_start_libvirt", broken_libvirt)
    with pytest.raises(errors.LabError, match="injected"):
        fresh_lab.up(2)
    fresh_lab.down()
    assert leftovers(fresh_lab) == []
