"""An SR-IOV VM (VF primary + virtio standby) migrates with its flows (issue 15).

Needs a switchdev SR-IOV NIC on two hosts: set FLEXMIG_SRIOV_GATE=1 on a gate
that has one (docs/sriov-failover-gate.md says what it checks).  Here it skips,
naming what the tc-flower probe found missing.
"""

from __future__ import annotations

import os

import pytest

from ovs_ext.providers.tc_flower import probe

pytestmark = pytest.mark.lab


def test_vf_flows_follow_an_sriov_vm_through_its_standby():
    missing = probe.missing(probe.gather())
    if missing:
        pytest.skip(f"no switchdev SR-IOV NIC here: {missing}")
    if not os.environ.get("FLEXMIG_SRIOV_GATE"):
        pytest.skip("a switchdev NIC is present but FLEXMIG_SRIOV_GATE is not set")
    pytest.fail("the SR-IOV gate steps (docs/sriov-failover-gate.md) are not automated yet")
