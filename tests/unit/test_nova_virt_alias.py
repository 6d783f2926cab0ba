"""Nova 34 loads ``compute_driver = nova_driver.driver.X`` as ``nova.virt.nova_driver.driver.X``."""

import pytest

pytest.importorskip("nova", reason="Nova is not installed (tools/setup.sh installs it)")


def test_the_alias_is_the_driver_itself():
    from nova_driver import driver
    from nova_driver.nova_virt import driver as alias

    assert alias.FlexMigLibvirtDriver is driver.FlexMigLibvirtDriver
