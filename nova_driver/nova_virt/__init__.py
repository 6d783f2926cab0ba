"""``nova.virt.flexmig``: where Nova finds ``compute_driver = flexmig.FlexMigLibvirtDriver``.

Nova 34 imports its compute driver as ``nova.virt.<compute_driver>`` (as it
does ``libvirt.LibvirtDriver``), so FlexMig installs this package under that
name (setup.py maps it onto ``nova_driver/nova_virt``).  It only re-exports
the driver, which lives in ``nova_driver.driver``.
"""

from nova_driver.driver import FlexMigLibvirtDriver

__all__ = ["FlexMigLibvirtDriver"]
