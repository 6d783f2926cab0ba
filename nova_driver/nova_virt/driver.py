"""Re-export of the FlexMig driver under ``nova.virt.nova_driver.driver``."""

from nova_driver.driver import FlexMigLibvirtDriver

__all__ = ["FlexMigLibvirtDriver"]
